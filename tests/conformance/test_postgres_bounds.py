"""PostgreSQL: an operation is bounded when its connection goes silent.

A server host that vanishes, or a firewall that drops a connection's state,
sends no reset: without a bound, a statement waits for its answer until TCP
gives up (many minutes), and every caller queued for the pool waits behind it.
Each test puts a relay between the store and the server that can freeze the
connections open at that moment (they stay open, nothing more crosses them),
while new connections pass as usual. `test_without_the_bounds_the_same_silence_hangs`
is the protection switched off: the same silence, no bound, and the call is
still waiting (the fence's test shows it too, when its bound is taken out).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit, urlunsplit

import pytest

import leases.postgres as leases_postgres
from gateway.policy.decision import KeyState
from gateway.store.postgres import PostgresStore
from leases.errors import StoreUnavailable
from leases.fence import Fence, StaleToken
from leases.fence.database import FenceDatabase
from tests.conformance.test_store_conformance import COMPLETED, CONTEXT, write
from tests.harness import eventually
from tests.pg import FreezingRelay, fresh_database

pytestmark = pytest.mark.postgres

BOUND_S = 0.5  # the store's bounds in these tests
HANG_CHECK_S = 10.0  # a call still waiting this long counts as hung


@pytest.fixture
async def relayed() -> AsyncIterator[tuple[str, FreezingRelay]]:
    async with fresh_database() as url:
        parts = urlsplit(url)
        relay = FreezingRelay(parts.hostname or "127.0.0.1", parts.port or 5432)
        await relay.start()
        netloc = parts.netloc.rsplit("@", 1)
        auth = f"{netloc[0]}@" if len(netloc) == 2 else ""
        try:
            yield urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{relay.port}")), relay
        finally:
            await relay.stop()


@asynccontextmanager
async def _store(
    url: str, relay: FreezingRelay, **bounds: float | None
) -> AsyncIterator[PostgresStore]:
    """A store of one pooled connection through `relay`, bounded by `BOUND_S` unless
    told otherwise; at the end the relay resets what is left silent (a silent
    connection would hold up `close()`)."""
    options: dict[str, float | None] = {"acquire_timeout": BOUND_S, "statement_timeout": BOUND_S}
    options.update(bounds)
    store = await PostgresStore.open(url, min_size=1, max_size=1, **options)  # type: ignore[arg-type]
    try:
        yield store
    finally:
        await relay.stop()
        await store.close()


async def test_a_silent_connection_fails_the_call_and_is_not_used_again(
    relayed: tuple[str, FreezingRelay],
) -> None:
    url, relay = relayed
    async with _store(url, relay) as store:
        await store.claim("job-a", owner="w", ttl=30)  # the pool's one connection is open
        relay.freeze()
        with pytest.raises(StoreUnavailable, match="did not answer in time"):
            await asyncio.wait_for(store.claim("job-b", owner="w", ttl=30), HANG_CHECK_S)
        # Closed, not put back in the pool (asyncpg would close it too, but only
        # after a ROLLBACK on it had timed out in turn: a second wait).
        await eventually(lambda: relay.frozen_closed_by_client == 1, what="the connection closed")
        # The next calls get a new connection: the store works on.
        lease = await asyncio.wait_for(store.claim("job-b", owner="w", ttl=30), HANG_CHECK_S)
        assert lease.generation == 1
        verdict = await asyncio.wait_for(store.decide_write(write(), CONTEXT), HANG_CHECK_S)
        assert verdict.attempt is not None


async def test_a_write_decision_and_its_outcome_go_again_on_a_fresh_connection(
    relayed: tuple[str, FreezingRelay],
) -> None:
    """Each waits `BOUND_S` for its silent connection, closes it and is sent again
    on a new one: the outcome until its reservation's deadline, the decision
    because nothing was committed (its COMMIT was never sent)."""
    url, relay = relayed
    async with _store(url, relay) as store:
        verdict = await store.decide_write(write(key="key-1"), CONTEXT)
        assert verdict.attempt is not None
        relay.freeze()
        outcome_call = store.record_outcome(write(key="key-1"), verdict.attempt, COMPLETED)
        assert await asyncio.wait_for(outcome_call, HANG_CHECK_S) is True
        assert store.outcome_retries == 1
        record = await store.key_record("pay", "key-1")
        assert record is not None and record.state is KeyState.COMPLETED
        relay.freeze()
        verdict = await asyncio.wait_for(
            store.decide_write(write(key="key-2"), CONTEXT), HANG_CHECK_S
        )
        assert verdict.attempt is not None and store.decision_retries == 1
        await eventually(lambda: relay.frozen_closed_by_client == 2, what="both closed")


async def test_a_wait_for_a_pooled_connection_is_bounded(
    relayed: tuple[str, FreezingRelay],
) -> None:
    """The pool's one connection is stuck in a silent statement (for up to its
    bound, long here): a second call waits for a connection only `BOUND_S`."""
    url, relay = relayed
    async with _store(url, relay, statement_timeout=HANG_CHECK_S) as store:
        await store.claim("job-a", owner="w", ttl=30)
        relay.freeze()
        stuck = asyncio.create_task(store.claim("job-b", owner="w", ttl=30))
        await asyncio.sleep(0)  # it takes the connection first
        with pytest.raises(StoreUnavailable, match="did not answer in time"):
            await asyncio.wait_for(store.get("job-a"), HANG_CHECK_S)
        assert not stuck.done()  # the second call gave up while the first still waits
        await relay.stop()  # end the first: its connection is reset
        with pytest.raises(StoreUnavailable):
            await stuck


async def test_a_call_cancelled_on_a_silent_connection_ends_at_once(
    relayed: tuple[str, FreezingRelay],
) -> None:
    """`hold` cancels a renewal at the lease's local deadline: it must end then,
    not after a ROLLBACK on the silent connection has waited out its own bound."""
    url, relay = relayed
    async with _store(url, relay, statement_timeout=HANG_CHECK_S) as store:
        await store.claim("job-a", owner="w", ttl=30)
        relay.freeze()
        call = asyncio.create_task(store.claim("job-b", owner="w", ttl=30))
        await asyncio.sleep(4 * BOUND_S)  # on its way, waiting for an answer
        call.cancel()
        done, _ = await asyncio.wait({call}, timeout=HANG_CHECK_S / 2)
        assert done and call.cancelled()
        await eventually(lambda: relay.frozen_closed_by_client == 1, what="the connection closed")
        lease = await asyncio.wait_for(store.claim("job-c", owner="w", ttl=30), HANG_CHECK_S)
        assert lease.generation == 1


async def test_without_the_bounds_the_same_silence_hangs(
    relayed: tuple[str, FreezingRelay],
) -> None:
    """The protection switched off: the call above would wait on and on."""
    url, relay = relayed
    async with _store(url, relay, acquire_timeout=None, statement_timeout=None) as store:
        await store.claim("job-a", owner="w", ttl=30)
        relay.freeze()
        call = asyncio.create_task(store.claim("job-b", owner="w", ttl=30))
        done, _ = await asyncio.wait({call}, timeout=4 * BOUND_S)
        assert not done  # still waiting, where the bounded store had given up
        await relay.stop()  # reset the connection: only then does the call end
        with pytest.raises(StoreUnavailable):
            await call


async def test_the_fence_of_the_middlewares_is_bounded_too(
    relayed: tuple[str, FreezingRelay], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`leases.fence.aiohttp_middleware`'s database: a silent connection fails the
    check as an unreachable database (the middleware's 503), and the next check
    runs on a new connection."""
    monkeypatch.setattr(leases_postgres, "STATEMENT_TIMEOUT_S", BOUND_S)
    url, relay = relayed
    database = FenceDatabase(Fence(), url)
    try:
        await database.check("job-1", 2)
        relay.freeze()
        call = asyncio.create_task(database.check("job-1", 3))
        done, _ = await asyncio.wait({call}, timeout=HANG_CHECK_S)
        assert done, "the check still waits on the silent connection"
        assert isinstance(call.exception(), TimeoutError)  # the middleware's 503
        await database.check("job-1", 3)  # a new connection: the fence works on
        with pytest.raises(StaleToken):
            await database.check("job-1", 2)
    finally:
        await relay.stop()
        await database.close()
