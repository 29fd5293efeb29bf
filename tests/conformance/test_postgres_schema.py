"""What only the PostgreSQL lease store has to get right: its schema under concurrent
start-up, first claims racing across pools, the server's clock plus `clock_offset`,
durable commits, and errors. The shared lease semantics are the conformance suite's."""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg  # type: ignore[import-untyped]
import pytest

from leases.errors import JobCompleted, LeaseHeld, LeaseLost, SchemaTooNew, StoreUnavailable
from leases.model import Lease
from leases.postgres import (
    PostgresLeaseStore,
    db_now,
    driver_errors,
    ensure_schema,
    read_lease_for_update,
    require_durable_commit,
)
from leases.store import open_store
from tests.pg import fresh_database

pytestmark = pytest.mark.postgres


@pytest.fixture
async def pg_url() -> AsyncIterator[str]:
    async with fresh_database() as url:
        yield url


async def _fetch(url: str, sql: str, *args: object) -> list[tuple[object, ...]]:
    conn = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await conn.fetch(sql, *args)]
    finally:
        await conn.close()


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"postgresql://postgres@127.0.0.1:{port}/test"


# --- schema --------------------------------------------------------------------------


async def test_schema_is_created_once_with_its_version_recorded(pg_url: str) -> None:
    async with await open_store(pg_url) as store:
        assert isinstance(store, PostgresLeaseStore)
    async with await PostgresLeaseStore.open(pg_url):
        pass
    assert await _fetch(pg_url, "SELECT component, version FROM sinkgate_schema") == [("leases", 1)]
    columns = await _fetch(
        pg_url,
        "SELECT column_name, data_type FROM information_schema.columns "
        "WHERE table_name = 'leases' ORDER BY ordinal_position",
    )
    assert columns == [
        ("job_id", "text"),
        ("owner", "text"),
        ("generation", "bigint"),
        ("state", "text"),
        ("lease_until", "double precision"),
        ("ttl", "double precision"),
    ]
    with pytest.raises(asyncpg.CheckViolationError):
        await _fetch(pg_url, "INSERT INTO leases VALUES ('j', 'o', 1, 'lost', 0, 1)")


async def test_a_database_from_a_newer_release_is_refused(pg_url: str) -> None:
    async with await PostgresLeaseStore.open(pg_url):
        pass
    await _fetch(pg_url, "UPDATE sinkgate_schema SET version = 2 WHERE component = 'leases'")
    with pytest.raises(SchemaTooNew, match="newer"):
        await PostgresLeaseStore.open(pg_url)


async def test_stores_opening_at_once_on_an_empty_database_all_succeed(pg_url: str) -> None:
    """Concurrent CREATE TABLE IF NOT EXISTS can collide in the catalog; the advisory
    lock serializes the DDL, so every opener succeeds and the version is recorded once."""
    for _ in range(5):
        await _fetch(pg_url, "DROP TABLE IF EXISTS leases, sinkgate_schema")
        stores = await asyncio.gather(*(PostgresLeaseStore.open(pg_url) for _ in range(4)))
        try:
            leases = await asyncio.gather(
                *(s.claim(f"job-{i}", owner="w", ttl=5) for i, s in enumerate(stores))
            )
            assert [lease.generation for lease in leases] == [1, 1, 1, 1]
        finally:
            await asyncio.gather(*(s.close() for s in stores))
        assert await _fetch(pg_url, "SELECT component, version FROM sinkgate_schema") == [
            ("leases", 1)
        ]


async def test_ensure_schema_runs_inside_a_callers_transaction(pg_url: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        async with conn.transaction():
            await ensure_schema(conn)
            assert await read_lease_for_update(conn, "nobody") is None
            await ensure_schema(conn)
        assert await conn.fetchval("SELECT count(*) FROM sinkgate_schema") == 1
    finally:
        await conn.close()


# --- competing claims ----------------------------------------------------------------


async def test_first_claims_racing_across_two_pools_have_exactly_one_winner(pg_url: str) -> None:
    a = await PostgresLeaseStore.open(pg_url, max_size=10)
    b = await PostgresLeaseStore.open(pg_url, max_size=10)
    try:
        for round_ in range(20):
            job = f"race-{round_}"
            results = await asyncio.gather(
                *((a, b)[i % 2].claim(job, owner=f"w{i}", ttl=30) for i in range(50)),
                return_exceptions=True,
            )
            winners = [r for r in results if isinstance(r, Lease)]
            held = [r for r in results if isinstance(r, LeaseHeld)]
            assert len(winners) == 1, results
            assert len(held) == 49, [r for r in results if not isinstance(r, Lease | LeaseHeld)]
            winner = winners[0]
            assert winner.generation == 1
            assert {h.owner for h in held} == {winner.owner}
            assert all(0 < h.expires_in <= 30 for h in held)
            current = await b.get(job)
            assert current is not None
            assert (current.owner, current.generation) == (winner.owner, 1)
    finally:
        await a.close()
        await b.close()


async def test_claims_racing_for_an_expired_lease_have_exactly_one_winner(pg_url: str) -> None:
    a = await PostgresLeaseStore.open(pg_url)
    b = await PostgresLeaseStore.open(pg_url)
    try:
        await a.claim("job", owner="old", ttl=1)
        a.clock_offset = b.clock_offset = 2.0
        results = await asyncio.gather(
            *((a, b)[i % 2].claim("job", owner=f"w{i}", ttl=30) for i in range(20)),
            return_exceptions=True,
        )
        winners = [r for r in results if isinstance(r, Lease)]
        assert len(winners) == 1
        assert winners[0].generation == 2
        assert sum(isinstance(r, LeaseHeld) for r in results) == 19
    finally:
        await a.close()
        await b.close()


# --- the clock -----------------------------------------------------------------------


async def test_the_clock_is_the_servers_plus_clock_offset(pg_url: str) -> None:
    async with await PostgresLeaseStore.open(pg_url, clock_offset=100.0) as store:
        lease = await store.claim("job", owner="a", ttl=10)
        (server_now,) = (await _fetch(pg_url, "SELECT extract(epoch FROM clock_timestamp())"))[0]
        until = lease.lease_until.timestamp()
        # lease_until = (server clock at the claim) + 100 + 10, the claim just before.
        assert float(server_now) + 109 < until <= float(server_now) + 110
        assert lease.lease_until.tzinfo is UTC
        assert abs(lease.lease_until - datetime.now(UTC)).total_seconds() < 115


async def test_moving_clock_offset_expires_the_lease(pg_url: str) -> None:
    async with await PostgresLeaseStore.open(pg_url) as store:
        lease = await store.claim("job", owner="a", ttl=10)
        assert 9 < lease.expires_in <= 10

        store.clock_offset = 6.0
        current = await store.get("job")
        assert current is not None
        assert 3 < current.expires_in <= 4
        with pytest.raises(LeaseHeld):
            await store.claim("job", owner="b", ttl=10)

        store.clock_offset = 10.0
        current = await store.get("job")
        assert current is not None
        assert current.expires_in == 0
        with pytest.raises(LeaseLost) as lost:
            await store.renew(lease)
        assert (lost.value.reason, lost.value.current_generation) == ("lease_expired", 1)

        taken = await store.claim("job", owner="b", ttl=10)
        assert taken.generation == 2
        with pytest.raises(LeaseLost) as lost:
            await store.complete(lease)
        assert (lost.value.reason, lost.value.current_generation) == ("stale_generation", 2)
        done = await store.complete(taken)
        assert done.state == "done"
        with pytest.raises(JobCompleted):
            await store.claim("job", owner="c", ttl=10)


async def test_db_now_adds_the_offset_as_a_parameter(pg_url: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        base = await db_now(conn, 0.0)
        later = await db_now(conn, 3600.0)
        assert 3600 <= later - base < 3660
    finally:
        await conn.close()


# --- durability ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("configured", "inside"), [("off", "on"), ("local", "local"), ("remote_apply", "remote_apply")]
)
async def test_write_transactions_commit_durably_and_leave_no_session_state(
    pg_url: str, configured: str, inside: str
) -> None:
    conn = await asyncpg.connect(pg_url, server_settings={"synchronous_commit": configured})
    try:
        async with conn.transaction():
            await require_durable_commit(conn)
            assert await conn.fetchval("SHOW synchronous_commit") == inside
        assert await conn.fetchval("SHOW synchronous_commit") == configured
    finally:
        await conn.close()


# --- errors --------------------------------------------------------------------------


async def test_an_unreachable_server_is_store_unavailable() -> None:
    with pytest.raises(StoreUnavailable) as caught:
        await PostgresLeaseStore.open(_closed_port_url(), connect_timeout=5)
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.reason == "store_unavailable"


def test_a_connection_in_a_bad_state_is_store_unavailable() -> None:
    """asyncpg raises InternalClientError ("another operation is in progress") on a
    pooled connection left mid-operation by a terminated backend or a cut
    connection: an outage like any other, never a 500."""
    with pytest.raises(StoreUnavailable) as caught, driver_errors("write"):
        raise asyncpg.InternalClientError("cannot switch to state 12")
    assert isinstance(caught.value.__cause__, asyncpg.InternalClientError)


async def test_driver_errors_and_a_closed_store_are_store_unavailable(pg_url: str) -> None:
    store = await PostgresLeaseStore.open(pg_url)
    lease = await store.claim("job", owner="a", ttl=10)
    await _fetch(pg_url, "DROP TABLE leases")
    with pytest.raises(StoreUnavailable) as caught:
        await store.renew(lease)
    assert isinstance(caught.value.__cause__, asyncpg.UndefinedTableError)
    with pytest.raises(StoreUnavailable):
        await store.get("job")
    await store.close()
    await store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        await store.claim("job", owner="a", ttl=10)


@pytest.mark.parametrize(
    "options",
    [
        {"min_size": -1},
        {"max_size": 0},
        {"min_size": 5, "max_size": 2},
        {"max_size": True},
        {"clock_offset": math.nan},
        {"clock_offset": "1"},
        {"statement_cache_size": -1},
        {"connect_timeout": 0},
    ],
)
async def test_bad_open_arguments_are_value_errors_before_any_connection(
    options: dict[str, object],
) -> None:
    # The URL points at a closed port: touching the network would be StoreUnavailable.
    with pytest.raises(ValueError):
        await PostgresLeaseStore.open(_closed_port_url(), **options)  # type: ignore[arg-type]


async def test_a_non_postgres_url_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="PostgreSQL URL"):
        await PostgresLeaseStore.open("mysql://127.0.0.1/test")


async def test_bad_arguments_are_value_errors_and_change_nothing(pg_url: str) -> None:
    async with await PostgresLeaseStore.open(pg_url) as store:
        lease = await store.claim("job", owner="a", ttl=10)
        for job, owner, ttl in [
            ("bad job", "a", 10),
            ("", "a", 10),
            ("x" * 257, "a", 10),
            ("new", "bad owner", 10),
            ("new", "a", 0.01),
            ("new", "a", 86401),
            ("new", "a", True),
            ("new", "a", math.inf),
        ]:
            with pytest.raises(ValueError):
                await store.claim(job, owner=owner, ttl=ttl)
        with pytest.raises(ValueError):
            await store.renew(lease, ttl=-1)
        with pytest.raises(ValueError):
            await store.complete("job")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await store.get("bad job")
        store.clock_offset = math.inf
        with pytest.raises(ValueError):
            await store.release(lease)
        store.clock_offset = 0.0
        rows = await _fetch(pg_url, "SELECT job_id, generation, state, ttl FROM leases")
        assert rows == [("job", 1, "active", 10.0)]
