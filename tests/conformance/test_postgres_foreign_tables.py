"""A database holding tables of sinkgate's names that sinkgate did not make (an
app's own `leases`, say): `CREATE TABLE IF NOT EXISTS` took them as they were,
`serve` started and reported ready, and every call then failed on a missing
column; `check-config --connect` said "schema missing: serve creates it". Both
now refuse, and the database is left as it was (the lease tables too, which were
created before the gateway's were looked at)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg  # type: ignore[import-untyped]
import pytest

from gateway.store.postgres import PostgresStore
from gateway.store.probe import ProbeFailed, store_status
from leases.errors import ForeignTables
from leases.postgres import PostgresLeaseStore
from tests.pg import fresh_database

pytestmark = pytest.mark.postgres


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with fresh_database() as url:
        yield url


async def _tables(url: str) -> list[str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT relname FROM pg_class WHERE relkind = 'r' AND "
            "relnamespace = 'public'::regnamespace ORDER BY 1"
        )
        return [r[0] for r in rows]
    finally:
        await conn.close()


async def _create(url: str, ddl: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(ddl)
    finally:
        await conn.close()


@pytest.mark.parametrize("table", ["leases", "idempotency", "audit"])
async def test_a_table_sinkgate_did_not_make_is_refused_and_left_alone(
    url: str, table: str
) -> None:
    await _create(url, f"CREATE TABLE {table} (id serial PRIMARY KEY, foo text)")
    with pytest.raises(ForeignTables, match=f"table {table} already in this database"):
        await PostgresStore.open(url)
    with pytest.raises(ProbeFailed, match="not made by sinkgate"):
        await store_status(url)
    assert await _tables(url) == [table]  # nothing of sinkgate's was created beside it


async def test_the_lease_store_alone_refuses_a_foreign_leases_table(url: str) -> None:
    await _create(url, "CREATE TABLE leases (id serial PRIMARY KEY)")
    with pytest.raises(ForeignTables):
        await PostgresLeaseStore.open(url)


async def test_sinkgates_own_tables_open_again_and_probe_current(url: str) -> None:
    """The check looks only where no version is recorded: a database sinkgate made
    opens as before (the lease store's alone, then the gateway's beside it)."""
    leases = await PostgresLeaseStore.open(url)
    await leases.close()
    for _ in range(2):
        store = await PostgresStore.open(url)
        await store.close()
    assert (await store_status(url)).startswith("schema current")
