"""PostgreSQL: backends terminated in a loop during a burst of writes (and a database
emptied under the gateway, at the end).

A connection reset between a forward and its outcome must not turn an applied
write into `unknown`: the outcome is sent again on a fresh connection until the
reservation's deadline. Another task terminates one of the store's backends
(`pg_terminate_backend`) every few milliseconds while writes are decided and
their outcomes recorded; at the end every key whose outcome the store accepted
is `completed`, and the outcomes the store gave up on stay under 1 % of the
forwarded writes (in practice none: the deadline is seconds away).

The protection switched off, checked by hand: with the outcome sent once
(`RECORD_RETRY_FIRST_S` above the reservation's deadline), the same burst left
about 21 % of the forwarded keys in flight, bound for `unknown`; with the
connection handling of before (a lost connection asked `is_closed()` after
asyncpg had taken it back), callers saw "connection has been released back to
the pool".
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from gateway.policy.decision import Forward, KeyState, Reject
from gateway.store import postgres as postgres_store
from gateway.store import postgres_schema
from gateway.store.postgres import PostgresStore
from leases.errors import StoreUnavailable
from tests.conformance.test_store_conformance import COMPLETED, CONTEXT, write
from tests.harness import eventually
from tests.pg import PG_ADMIN_URL, first_answer_lost, fresh_database

pytestmark = pytest.mark.postgres

KILLS = 40  # backends terminated before the burst may end
KILL_EVERY_S = 0.05
WAVE = 64  # writes at once
MIN_WRITES = 600
MAX_WRITES = 60 * WAVE


@dataclass
class Burst:
    forwarded: list[tuple[str, bool]] = field(default_factory=list)  # (key, recorded)
    errors: Counter[str] = field(default_factory=Counter)
    killed: int = 0


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with fresh_database() as url:
        yield url


async def _terminate_in_a_loop(database: str, burst: Burst, stop: asyncio.Event) -> None:
    """Terminate one backend of `database` at a time until `stop`."""
    conn = await asyncpg.connect(PG_ADMIN_URL)
    try:
        while not stop.is_set():
            burst.killed += await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM (SELECT pid FROM "
                "pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid() "
                "ORDER BY random() LIMIT 1) AS one",
                database,
            )
            await asyncio.sleep(KILL_EVERY_S)
    finally:
        await conn.close()


async def _one(store: PostgresStore, n: int, burst: Burst) -> None:
    facts = write(job_id=f"job-{n % 40}", key=f"key-{n}")
    try:
        verdict = await store.decide_write(facts, CONTEXT)
    except StoreUnavailable as exc:  # a 503 to the worker: nothing forwarded
        burst.errors[str(exc.__cause__ or exc)] += 1
        return
    assert isinstance(verdict.decision, Forward) and verdict.attempt is not None
    try:
        recorded = await store.record_outcome(facts, verdict.attempt, COMPLETED)
    except StoreUnavailable as exc:
        burst.errors[str(exc.__cause__ or exc)] += 1
        recorded = False
    burst.forwarded.append((facts.key or "", recorded))


async def _burst(store: PostgresStore, database: str) -> Burst:
    """Waves of writes until MIN_WRITES are done, half of them forwarded, and KILLS
    backends are gone (on a loaded machine more decisions fail: it goes on longer)."""
    burst = Burst()
    stop = asyncio.Event()
    killer = asyncio.create_task(_terminate_in_a_loop(database, burst, stop))
    n = 0
    try:
        while not killer.done() and (
            burst.killed < KILLS
            or (n < MAX_WRITES and (n < MIN_WRITES or len(burst.forwarded) < MIN_WRITES // 2))
        ):
            await asyncio.gather(*(_one(store, n + i, burst) for i in range(WAVE)))
            n += WAVE
    finally:
        stop.set()
        await killer
    return burst


async def test_outcomes_survive_backends_terminated_during_a_burst(url: str) -> None:
    database = url.rsplit("/", 1)[1]
    store = await PostgresStore.open(url, min_size=2, max_size=10)
    try:
        burst = await _burst(store, database)
        states = {key: await store.key_record("pay", key) for key, _ in burst.forwarded}
        retries = store.outcome_retries
    finally:
        await store.close()
    forwarded = len(burst.forwarded)
    lost = [key for key, recorded in burst.forwarded if not recorded]
    assert burst.killed >= KILLS
    assert forwarded >= MIN_WRITES // 2, burst.errors
    # Every outcome the store accepted is the key's; the ones it gave up on are few.
    for key, recorded in burst.forwarded:
        record = states[key]
        assert record is not None
        if recorded:
            assert record.state is KeyState.COMPLETED, (key, record.state)
    assert len(lost) / forwarded < 0.01, (len(lost), forwarded, burst.errors, retries)
    # The pooled connection is never used after asyncpg took it back.
    assert not [e for e in burst.errors if "released back to the pool" in e], burst.errors


async def test_a_commit_without_its_answer_releases_the_reservations_it_made(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every try of the decision call commits, then its connection is lost before
    the answer arrives: its callers are told the store failed, so nobody forwards
    those writes, and their reservations are released rather than left in flight
    to turn `unknown`. (Switched off by hand, `_release_in_background` doing
    nothing: the key is found in flight, and the retry answers
    `request_in_progress`.)"""
    real = postgres_store.decide_batch

    async def answer_lost(conn: Any, *args: Any) -> Any:
        await real(conn, *args)  # committed
        raise asyncpg.ConnectionDoesNotExistError("connection was closed")

    store = await PostgresStore.open(url)
    try:
        monkeypatch.setattr(postgres_store, "decide_batch", answer_lost)
        with pytest.raises(StoreUnavailable):
            await store.decide_write(write(key="lost"), CONTEXT)
        assert store.decision_retries == postgres_store.DECISION_TRIES - 1
        monkeypatch.setattr(postgres_store, "decide_batch", real)
        await eventually(lambda: store.uncertain_released == 1, what="the release")
        assert await store.key_record("pay", "lost") is None
        verdict = await store.decide_write(write(key="lost"), CONTEXT)
        assert isinstance(verdict.decision, Forward)
    finally:
        await store.close()


@pytest.mark.parametrize("keyed", [True, False])
async def test_a_call_run_again_after_its_commit_answers_forward_and_reserves_once(
    url: str, monkeypatch: pytest.MonkeyPatch, keyed: bool
) -> None:
    """The first call commits and loses its answer; the call run again finds the
    write reserved under its own attempt id: the caller is told to forward, and the
    key (or the keyless attempt) is reserved once, by that attempt."""
    calls = first_answer_lost(monkeypatch)
    store = await PostgresStore.open(url)
    try:
        facts = write(key="again" if keyed else None)
        verdict = await store.decide_write(facts, CONTEXT)
        assert isinstance(verdict.decision, Forward) and verdict.attempt is not None
        assert (calls[0], store.decision_retries) == (2, 1)
        async with store._pool.acquire() as conn:
            if keyed:
                row = await conn.fetchrow("SELECT attempt, attempts FROM idempotency")
                assert (row["attempt"], row["attempts"]) == (verdict.attempt, 1)
            else:
                assert await conn.fetchval("SELECT array_agg(attempt) FROM attempts") == [
                    verdict.attempt
                ]
        assert await store.record_outcome(facts, verdict.attempt, COMPLETED)
    finally:
        await store.close()


async def test_without_its_attempt_found_the_call_run_again_refuses_its_own_write(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recognition switched off (the function no longer looks for the write's
    own attempt): the call run again finds the key in flight and refuses the write
    its first run reserved. Shows the test above can fail."""
    mine = "ELSE k.attempt IS NOT DISTINCT FROM p_attempt[i] END"
    assert mine in postgres_schema.DECIDE_FUNCTION_DDL
    monkeypatch.setattr(
        postgres_schema,
        "DECIDE_FUNCTION_DDL",
        postgres_schema.DECIDE_FUNCTION_DDL.replace(mine, "ELSE false END"),
    )
    first_answer_lost(monkeypatch)
    store = await PostgresStore.open(url)
    try:
        verdict = await store.decide_write(write(key="again"), CONTEXT)
        assert isinstance(verdict.decision, Reject)
        assert verdict.decision.reason == "request_in_progress"
    finally:
        await store.close()


async def test_an_outcome_outlives_a_database_that_refuses_connections(url: str) -> None:
    """`ALLOW_CONNECTIONS false` and every backend terminated while a forward is out:
    each new connection is refused with SQLSTATE 55000, which is no connection
    class. The outcome was not sent again (a write the upstream applied was left
    `unknown`); a refused connection is an outage whatever its SQLSTATE."""
    database = url.rsplit("/", 1)[1]
    store = await PostgresStore.open(url, min_size=1, max_size=4)
    admin = await asyncpg.connect(PG_ADMIN_URL)
    try:
        facts = write(job_id="job-refused", key="key-refused")
        verdict = await store.decide_write(facts, CONTEXT)
        assert verdict.attempt is not None
        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
        await admin.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = $1 AND pid <> pg_backend_pid()",
            database,
        )
        recording = asyncio.create_task(store.record_outcome(facts, verdict.attempt, COMPLETED))
        await eventually(lambda: store.outcome_retries >= 2, within=10)
        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        assert await asyncio.wait_for(recording, 10) is True
        record = await store.key_record("pay", "key-refused")
        assert record is not None and record.state is KeyState.COMPLETED
    finally:
        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        await admin.close()
        await store.close()


async def test_a_database_emptied_under_the_gateway_is_not_ready(url: str) -> None:
    """A database dropped and created again answered `SELECT 1`, so `/readyz` said
    ready while every write failed on a missing table."""
    store = await PostgresStore.open(url)
    try:
        await store.ping()
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("DELETE FROM sinkgate_schema WHERE component = 'gateway'")
            with pytest.raises(StoreUnavailable, match="holds gateway schema None, not"):
                await store.ping()
            await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
        finally:
            await conn.close()
        with pytest.raises(StoreUnavailable, match="sinkgate_schema"):
            await store.ping()  # the driver's words: the table is gone
    finally:
        await store.close()
