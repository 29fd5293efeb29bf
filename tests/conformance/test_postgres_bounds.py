"""PostgreSQL: an operation is bounded when its connection goes silent.

A server host that vanishes, or a firewall that drops a connection's state,
sends no reset: without a bound, a statement waits for its answer until TCP
gives up (many minutes), and every caller queued for the pool waits behind it.
Each test puts a relay between the store and the server that can freeze the
connections open at that moment (they stay open, nothing more crosses them),
while new connections pass as usual. The last test is the protection switched
off: the same silence, no bound, and the call is still waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import pytest

from gateway.store.postgres import PostgresStore
from leases.errors import StoreUnavailable
from tests.conformance.test_store_conformance import COMPLETED, CONTEXT, write
from tests.harness import eventually
from tests.pg import fresh_database

pytestmark = pytest.mark.postgres

BOUND_S = 0.5  # the store's bounds in these tests
HANG_CHECK_S = 10.0  # a call still waiting this long counts as hung


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter  # towards the store
    server: asyncio.StreamWriter  # towards PostgreSQL
    frozen: bool = False
    closed_by_client: bool = False


class FreezingRelay:
    """A TCP relay to the PostgreSQL server whose open connections can be frozen."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._server: asyncio.Server | None = None
        self._links: list[_Link] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def freeze(self) -> None:
        """Nothing more crosses the connections open now; they stay open."""
        for link in self._links:
            link.frozen = link.frozen or not link.closed_by_client

    @property
    def frozen_closed_by_client(self) -> int:
        """Frozen connections whose client (the store) has closed its end."""
        return sum(1 for link in self._links if link.frozen and link.closed_by_client)

    async def stop(self) -> None:
        """Reset every connection and stop listening."""
        if self._server is not None:
            self._server.close()
        for link in self._links:
            link.client.transport.abort()
            link.server.transport.abort()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        link = _Link(writer, up_writer)
        self._links.append(link)
        for source, sink, from_client in ((reader, up_writer, True), (up_reader, writer, False)):
            task = asyncio.create_task(self._pump(link, source, sink, from_client))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        link: _Link,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        from_client: bool,
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await source.read(65536):
                if link.frozen:
                    continue  # swallowed: never passed on
                sink.write(chunk)
                await sink.drain()
        if from_client:
            link.closed_by_client = True
        if not link.frozen:
            link.client.close()
            link.server.close()


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


async def _open(url: str, **bounds: float | None) -> PostgresStore:
    options: dict[str, float | None] = {"acquire_timeout": BOUND_S, "statement_timeout": BOUND_S}
    options.update(bounds)
    return await PostgresStore.open(url, min_size=1, max_size=1, **options)  # type: ignore[arg-type]


async def test_a_silent_connection_fails_the_call_and_is_not_used_again(
    relayed: tuple[str, FreezingRelay],
) -> None:
    url, relay = relayed
    store = await _open(url)
    try:
        await store.claim("job-a", owner="w", ttl=30)  # the pool's one connection is open
        relay.freeze()
        with pytest.raises(StoreUnavailable, match="did not answer in time"):
            await asyncio.wait_for(store.claim("job-b", owner="w", ttl=30), HANG_CHECK_S)
        # closed, not put back in the pool
        await eventually(lambda: relay.frozen_closed_by_client == 1, what="the connection closed")
        # The next calls get a new connection: the store works on.
        lease = await asyncio.wait_for(store.claim("job-b", owner="w", ttl=30), HANG_CHECK_S)
        assert lease.generation == 1
        verdict = await asyncio.wait_for(store.decide_write(write(), CONTEXT), HANG_CHECK_S)
        assert verdict.attempt is not None
    finally:
        await store.close()


async def test_a_write_decision_and_its_outcome_are_bounded_too(
    relayed: tuple[str, FreezingRelay],
) -> None:
    url, relay = relayed
    store = await _open(url)
    try:
        verdict = await store.decide_write(write(key="key-1"), CONTEXT)
        assert verdict.attempt is not None
        relay.freeze()
        outcome_call = store.record_outcome(write(key="key-1"), verdict.attempt, COMPLETED)
        with pytest.raises(StoreUnavailable, match="did not answer in time"):
            await asyncio.wait_for(outcome_call, HANG_CHECK_S)
        # A new connection for the next decision; then it goes silent as well.
        verdict = await asyncio.wait_for(
            store.decide_write(write(key="key-2"), CONTEXT), HANG_CHECK_S
        )
        assert verdict.attempt is not None
        relay.freeze()
        with pytest.raises(StoreUnavailable, match="did not answer in time"):
            await asyncio.wait_for(store.decide_write(write(key="key-3"), CONTEXT), HANG_CHECK_S)
        await eventually(lambda: relay.frozen_closed_by_client == 2, what="both closed")
    finally:
        await store.close()


async def test_a_wait_for_a_pooled_connection_is_bounded(
    relayed: tuple[str, FreezingRelay],
) -> None:
    """The pool's one connection is stuck in a silent statement (for up to its
    bound, long here): a second call waits for a connection only `BOUND_S`."""
    url, relay = relayed
    store = await _open(url, statement_timeout=HANG_CHECK_S)
    try:
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
    finally:
        await store.close()


async def test_without_the_bounds_the_same_silence_hangs(
    relayed: tuple[str, FreezingRelay],
) -> None:
    """The protection switched off: the call above would wait on and on."""
    url, relay = relayed
    store = await _open(url, acquire_timeout=None, statement_timeout=None)
    try:
        await store.claim("job-a", owner="w", ttl=30)
        relay.freeze()
        call = asyncio.create_task(store.claim("job-b", owner="w", ttl=30))
        done, _ = await asyncio.wait({call}, timeout=4 * BOUND_S)
        assert not done  # still waiting, where the bounded store had given up
        await relay.stop()  # reset the connection: only then does the call end
        with pytest.raises(StoreUnavailable):
            await call
    finally:
        await store.close()

