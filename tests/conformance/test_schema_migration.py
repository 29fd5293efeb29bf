"""Older gateway schemas upgraded on both backends: from v1, the key's row gains
`barrier_until` and an attempt a v1 gateway left in flight still bars newer
generations; from v3, the audit log gains `operator` and keeps every row. On
PostgreSQL, a v4 or v5 database in use (keys completed and in flight) gains v6's
functions (v5's state read is left for v5 replicas still running): the attempts
an older gateway left in flight record their outcomes through one, and the
decisions after the upgrade read what it wrote in the other."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import pytest
from structlog.testing import capture_logs

from gateway.policy.decision import Forward, KeyState, Reject, Replay
from gateway.store import postgres_schema
from gateway.store.admin_records import AuditQuery
from gateway.store.postgres import PostgresStore
from gateway.store.postgres_batch import DECIDE_FUNCTION
from gateway.store.postgres_outcomes import OUTCOMES_FUNCTION
from gateway.store.sqlite import GATEWAY_SCHEMA_VERSION, SQLiteStore
from tests.conformance.test_store_conformance import COMPLETED, CONTEXT, write
from tests.pg import fresh_database

# What a v1 gateway stored for a keyed write still on the wire: the key in flight
# and its attempt row (v1 had no `barrier_until`).
_V1_KEY = (
    "INSERT INTO idempotency (destination, key, state, fingerprint, attempt, attempts, "
    "job_id, generation, owner, created_at, updated_at, deadline) "
    "VALUES ('pay', 'old', 'in_flight', 'fp-old', 'a1', 1, 'job-1', 1, NULL, {now}, {now}, "
    "{far})"
)
_V1_ATTEMPT = (
    "INSERT INTO attempts (attempt, job_id, generation, destination, key, started_at, deadline) "
    "VALUES ('a1', 'job-1', 1, 'pay', 'old', {now}, {far})"
)
_TO_V1 = (
    "DROP INDEX idempotency_in_flight",
    "ALTER TABLE idempotency DROP COLUMN barrier_until",
    "UPDATE sinkgate_schema SET version = 1 WHERE component = 'gateway'",
)


async def _check_after_upgrade(store: SQLiteStore | PostgresStore) -> None:
    newer = await store.decide_write(write(generation=2, key="new"), CONTEXT)
    assert isinstance(newer.decision, Reject)
    assert newer.decision.reason == "older_generation_in_flight"
    # and a write after the upgrade carries its barrier in its key's row
    other = await store.decide_write(write(job_id="job-2", key="k2"), CONTEXT)
    assert isinstance(other.decision, Forward)
    later = await store.decide_write(write(job_id="job-2", generation=2, key="k3"), CONTEXT)
    assert isinstance(later.decision, Reject)
    assert later.decision.reason == "older_generation_in_flight"


def _schema_lines(logs: list[dict[str, object]]) -> list[tuple[object, ...]]:
    return [
        (e["event"], e["store"], e["from_version"], e["version"])
        for e in logs
        if str(e["event"]).startswith("schema_")
    ]


async def test_sqlite_v1_database_is_upgraded(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'g.db'}"
    with capture_logs() as created:
        await (await SQLiteStore.open(url)).close()
    conn = sqlite3.connect(tmp_path / "g.db")
    now, far = time.time(), time.time() + 3600
    for statement in (*_TO_V1, _V1_KEY, _V1_ATTEMPT):
        conn.execute(statement.format(now=now, far=far))
    conn.commit()
    conn.close()
    with capture_logs() as migrated:
        store = await SQLiteStore.open(url)
    with capture_logs() as current:
        await (await SQLiteStore.open(url)).close()
    v = GATEWAY_SCHEMA_VERSION
    assert _schema_lines(created) == [("schema_created", "sqlite", None, v)]
    assert _schema_lines(migrated) == [("schema_migrated", "sqlite", 1, v)]  # what it was
    assert _schema_lines(current) == []
    try:
        await _check_after_upgrade(store)
    finally:
        await store.close()
    conn = sqlite3.connect(tmp_path / "g.db")
    version = conn.execute("SELECT version FROM sinkgate_schema WHERE component = 'gateway'")
    assert version.fetchone() == (GATEWAY_SCHEMA_VERSION,)
    conn.close()


@pytest.mark.postgres
async def test_postgres_v1_database_is_upgraded() -> None:
    async with fresh_database() as url:
        await (await PostgresStore.open(url)).close()
        conn = await asyncpg.connect(url)
        try:
            now, far = time.time(), time.time() + 3600
            for statement in (*_TO_V1, _V1_KEY, _V1_ATTEMPT):
                await conn.execute(statement.format(now=now, far=far))
        finally:
            await conn.close()
        with capture_logs() as migrated:
            store = await PostgresStore.open(url)
        v = postgres_schema.GATEWAY_SCHEMA_VERSION
        assert _schema_lines(migrated) == [("schema_migrated", "postgresql", 1, v)]
        try:
            await _check_after_upgrade(store)
        finally:
            await store.close()
        conn = await asyncpg.connect(url)
        try:
            version = await conn.fetchval(
                "SELECT version FROM sinkgate_schema WHERE component = 'gateway'"
            )
        finally:
            await conn.close()
        assert version == postgres_schema.GATEWAY_SCHEMA_VERSION


# A v3 audit log: no `operator` column, and rows written before there was one.
_TO_V3_AUDIT = (
    "ALTER TABLE audit DROP COLUMN operator",
    "UPDATE sinkgate_schema SET version = 3 WHERE component = 'gateway'",
    "INSERT INTO audit (at, action, destination, key, attempt, note, remote) "
    "VALUES ({now}, 'resolve_applied', 'pay', 'k1', 'a1', 'checked at the PSP', '10.0.0.7')",
    "INSERT INTO audit (at, action, note) VALUES ({now}, 'reload', 'sighup: no change')",
)


async def _check_audit_kept(store: SQLiteStore | PostgresStore) -> None:
    """Every v3 row is there, with no operator; a new row names its operator."""
    old = await store.list_audit(AuditQuery())
    assert [(e.action, e.note, e.operator) for e in old] == [
        ("reload", "sighup: no change", None),
        ("resolve_applied", "checked at the PSP", None),
    ]
    assert old[1].remote == "10.0.0.7"
    await store.record_audit(action="reload", note="admin: no change", operator="alice")
    assert (await store.list_audit(AuditQuery()))[0].operator == "alice"


async def test_sqlite_v3_audit_log_keeps_its_rows(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'g.db'}"
    await (await SQLiteStore.open(url)).close()
    conn = sqlite3.connect(tmp_path / "g.db")
    for statement in _TO_V3_AUDIT:
        conn.execute(statement.format(now=time.time()))
    conn.commit()
    conn.close()
    store = await SQLiteStore.open(url)
    try:
        await _check_audit_kept(store)
    finally:
        await store.close()


@pytest.mark.postgres
async def test_postgres_v3_audit_log_keeps_its_rows() -> None:
    async with fresh_database() as url:
        await (await PostgresStore.open(url)).close()
        conn = await asyncpg.connect(url)
        try:
            for statement in _TO_V3_AUDIT:
                await conn.execute(statement.format(now=time.time()))
        finally:
            await conn.close()
        store = await PostgresStore.open(url)
        try:
            await _check_audit_kept(store)
        finally:
            await store.close()


# v5's decision state read, as the v5 release created it (its body does not matter).
_V5_STATE_FUNCTION = (
    "CREATE FUNCTION sinkgate_decision_state_v1(float8, text[], text[], text[], int8[], "
    "text[], boolean) RETURNS SETOF record LANGUAGE sql AS 'SELECT NULL::record WHERE false'"
)


@pytest.mark.postgres
@pytest.mark.parametrize("old", [4, 5])
async def test_postgres_database_in_use_is_upgraded_to_v6(old: int) -> None:
    async with fresh_database() as url:
        store = await PostgresStore.open(url)
        try:
            done = write(key="done")
            verdict = await store.decide_write(done, CONTEXT)
            assert verdict.attempt is not None
            assert await store.record_outcome(done, verdict.attempt, COMPLETED)
            keyed = await store.decide_write(write(job_id="job-2", key="open"), CONTEXT)
            keyless = await store.decide_write(write(job_id="job-3", key=None), CONTEXT)
        finally:
            await store.close()
        conn = await asyncpg.connect(url)
        try:  # the database as the older release leaves it
            await conn.execute(f"DROP FUNCTION {DECIDE_FUNCTION}")
            if old == 4:
                await conn.execute(f"DROP FUNCTION {OUTCOMES_FUNCTION}")
            else:
                await conn.execute(_V5_STATE_FUNCTION)
            await conn.execute(
                "UPDATE sinkgate_schema SET version = $1 WHERE component = 'gateway'", old
            )
        finally:
            await conn.close()
        store = await PostgresStore.open(url)
        try:
            assert isinstance((await store.decide_write(done, CONTEXT)).decision, Replay)
            for facts, left in (
                (write(job_id="job-2", key="open"), keyed),
                (write(job_id="job-3", key=None), keyless),
            ):
                assert left.attempt is not None
                assert await store.record_outcome(facts, left.attempt, COMPLETED)
            record = await store.key_record("pay", "open")
            assert record is not None and record.state is KeyState.COMPLETED
            assert (await store.job_state("job-3")).in_flight == ()  # type: ignore[union-attr]
        finally:
            await store.close()
        conn = await asyncpg.connect(url)
        try:
            version = await conn.fetchval(
                "SELECT version FROM sinkgate_schema WHERE component = 'gateway'"
            )
            functions = await conn.fetchval(
                "SELECT array_agg(proname::text ORDER BY proname) FROM pg_proc "
                "WHERE proname LIKE 'sinkgate_%'"
            )
        finally:
            await conn.close()
        assert version == postgres_schema.GATEWAY_SCHEMA_VERSION == 6
        assert DECIDE_FUNCTION in functions and OUTCOMES_FUNCTION in functions
        # v5's, left for v5 replicas still running
        assert ("sinkgate_decision_state_v1" in functions) is (old == 5)


# The decision function of the releases before runs of one key were read once
# (its body does not matter): `sinkgate_decide_v2` returns a column more.
_V1_DECIDE_FUNCTION = (
    "CREATE FUNCTION sinkgate_decide_v1(float8) RETURNS SETOF record LANGUAGE sql "
    "AS 'SELECT NULL::record WHERE false'"
)


@pytest.mark.postgres
async def test_postgres_a_start_leaves_the_previous_decision_function_to_its_replicas() -> None:
    """Replicas of the release before still call `sinkgate_decide_v1` while the
    others are replaced: a start adds v2 beside it and drops nothing."""
    async with fresh_database() as url:
        await (await PostgresStore.open(url)).close()
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(f"DROP FUNCTION {DECIDE_FUNCTION}")
            await conn.execute(_V1_DECIDE_FUNCTION)
            store = await PostgresStore.open(url)
            try:
                verdict = await store.decide_write(write(key="after"), CONTEXT)
                assert verdict.attempt is not None
            finally:
                await store.close()
            functions = await conn.fetchval(
                "SELECT array_agg(proname::text) FROM pg_proc WHERE proname LIKE 'sinkgate_decide%'"
            )
        finally:
            await conn.close()
        assert DECIDE_FUNCTION == "sinkgate_decide_v2"
        assert sorted(functions) == ["sinkgate_decide_v1", "sinkgate_decide_v2"]


@pytest.mark.postgres
async def test_postgres_a_start_beside_running_replicas_locks_none_of_their_tables() -> None:
    """A replica's open transaction writing every table (as a batch does) does not
    hold up a gateway starting on a database at its version: no DDL of the tables
    runs. Before, `CREATE INDEX IF NOT EXISTS` waited for that transaction, and
    every write queued behind the start."""
    async with fresh_database() as url:
        await (await PostgresStore.open(url)).close()
        replica = await asyncpg.connect(url)
        try:
            async with replica.transaction():
                for table in ("idempotency", "attempts", "rejections", "fences", "audit", "leases"):
                    await replica.execute(f"LOCK TABLE {table} IN ROW EXCLUSIVE MODE")
                # Bounded only so that a start that waits fails instead of hanging.
                store = await asyncio.wait_for(PostgresStore.open(url), 30)
                await store.close()
        finally:
            await replica.close()
