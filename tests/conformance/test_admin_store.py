"""The operator's store verbs (SPEC 4: keys, resolve, audit, summary), on every backend.

Resolve is checked against the three things that can happen to an unknown key
at the same moment: a second operator resolving it, the janitor purging, and a
worker's retry decided by another replica (a second store on the same database).
Each guard is also switched off once to show its test can fail.
"""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import replace
from typing import Any

import pytest

from gateway.config.keys import RETENTION
from gateway.policy.decision import RESERVATION_GRACE_S, Forward, KeyState, Replay
from gateway.policy.records import Outcome, RejectionRecord
from gateway.store import postgres_admin, postgres_schema, sqlite_admin
from gateway.store.admin_records import (
    AuditQuery,
    KeyQuery,
    Resolution,
    ResolveRefused,
    bucket_width,
)
from gateway.store.janitor import purge_once
from gateway.store.postgres import PostgresStore
from gateway.store.records import RejectionQuery
from gateway.store.sqlite import GATEWAY_SCHEMA_VERSION, SQLiteStore
from gateway.telemetry.metrics import Metrics
from tests.backends import Backend
from tests.conformance.test_store_conformance import CONTEXT, TIMEOUT, reason, write
from tests.conftest import FakeClock

PAST_DEADLINE = TIMEOUT + RESERVATION_GRACE_S + 1
DAY = 86400.0
AUDIT_TTL = RETENTION.defaults["audit_ttl"]  # [retention] audit_ttl's default: a year


async def unknown_key(store: Any, key: str = "key-1", **facts: Any) -> str:
    """A key whose forward ended `unknown`; returns its attempt."""
    verdict = await store.decide_write(write(key=key, **facts), CONTEXT)
    assert await store.record_outcome(write(key=key, **facts), verdict.attempt, Outcome("unknown"))
    return str(verdict.attempt)


def resolution(attempt: str, applied: bool, **overrides: Any) -> Resolution:
    base: dict[str, Any] = {
        "destination": "pay",
        "key": "key-1",
        "attempt": attempt,
        "applied": applied,
        "note": "checked the ledger",
        "remote": "10.0.0.9",
    }
    if applied:
        base.update(status=201, body=b'{"id":"ch_1"}', content_type="application/json")
    return Resolution(**{**base, **overrides})


def guard_off(store_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace the resolve guard by one that matches any row of the key."""
    if store_backend.name == "sqlite":
        monkeypatch.setattr(sqlite_admin, "RESOLVE_GUARD", "1 = 1")
    else:
        monkeypatch.setattr(
            postgres_admin, "RESOLVE_GUARD", "$3::text IS NOT NULL AND $4::float8 IS NOT NULL"
        )


async def audit(store: Any) -> list[Any]:
    return await store.list_audit(AuditQuery())


# --- listing -------------------------------------------------------------------------------


async def test_keys_are_listed_newest_first_by_effective_state(store_backend: Backend) -> None:
    store = store_backend.store
    done = await store.decide_write(write(key="done", job_id="j-done"), CONTEXT)
    completed = Outcome("completed", status=200, body=b"ok")
    await store.record_outcome(write(key="done"), done.attempt, completed)
    store_backend.advance(1)
    await unknown_key(store, "lost", job_id="j-lost")
    store_backend.advance(1)
    await store.decide_write(write(key="dead", job_id="j-dead"), CONTEXT)  # its gateway dies
    store_backend.advance(1)
    assert [r.key for r in await store.list_keys(KeyQuery())] == ["dead", "lost", "done"]
    unknown = await store.list_keys(KeyQuery(state=KeyState.UNKNOWN))
    assert [r.key for r in unknown] == ["lost"]  # "dead" is still within its deadline
    store_backend.advance(PAST_DEADLINE)
    unknown = await store.list_keys(KeyQuery(state=KeyState.UNKNOWN))
    assert [r.key for r in unknown] == ["dead", "lost"]  # past it: read as unknown
    assert await store.unknown_counts() == {"pay": 2}
    assert await store.list_keys(KeyQuery(state=KeyState.IN_FLIGHT)) == []
    assert [r.key for r in await store.list_keys(KeyQuery(job_id="j-done"))] == ["done"]
    assert await store.list_keys(KeyQuery(destination="mail")) == []
    first = await store.list_keys(KeyQuery(limit=2))
    last = first[-1]
    rest = await store.list_keys(KeyQuery(limit=2, after=(last.updated_at, "pay", last.key)))
    assert [r.key for r in first + rest] == ["dead", "lost", "done"]
    since = await store.list_keys(KeyQuery(since=last.updated_at))
    assert [r.key for r in since] == ["dead", "lost"]


# --- resolve ---------------------------------------------------------------------------------


async def test_resolved_applied_is_replayed_and_audited(store_backend: Backend) -> None:
    store = store_backend.store
    attempt = await unknown_key(store)
    assert reason(await store.decide_write(write(), CONTEXT)) == "outcome_unknown"
    record = await store.resolve_key(resolution(attempt, True))
    assert record.state is KeyState.COMPLETED and record.status == 201
    assert record.attempt != attempt  # the operator now holds the key
    replay = await store.decide_write(write(), CONTEXT)
    assert isinstance(replay.decision, Replay)
    assert (replay.decision.record.status, replay.decision.record.body) == (201, b'{"id":"ch_1"}')
    assert replay.decision.record.headers == (("Content-Type", "application/json"),)
    # The dead attempt, recording late, no longer holds the key.
    assert await store.record_outcome(write(), attempt, Outcome("unknown")) is False
    assert (await store.key_record("pay", "key-1")).state is KeyState.COMPLETED
    [entry] = await audit(store)
    assert (entry.action, entry.destination, entry.key, entry.attempt) == (
        "resolve_applied",
        "pay",
        "key-1",
        attempt,
    )
    assert (entry.note, entry.remote) == ("checked the ledger", "10.0.0.9")
    assert entry.at == pytest.approx(store.clock(), abs=5)


async def test_resolved_not_applied_is_released_and_forwarded_again(store_backend: Backend) -> None:
    store = store_backend.store
    attempt = await unknown_key(store)
    released = await store.resolve_key(resolution(attempt, False))
    assert (released.attempt, released.state) == (attempt, KeyState.UNKNOWN)  # as it was
    assert await store.key_record("pay", "key-1") is None
    again = await store.decide_write(write(), CONTEXT)
    assert again.decision == Forward()
    assert (await store.key_record("pay", "key-1")).attempts == 1
    assert [e.action for e in await audit(store)] == ["resolve_not_applied"]


async def test_only_an_unknown_key_held_by_the_named_attempt_is_resolved(
    store_backend: Backend,
) -> None:
    store = store_backend.store
    with pytest.raises(ResolveRefused) as refused:
        await store.resolve_key(resolution("nope", True))
    assert refused.value.reason == "not_found"
    flying = await store.decide_write(write(), CONTEXT)
    with pytest.raises(ResolveRefused) as refused:
        await store.resolve_key(resolution(flying.attempt, True))
    assert refused.value.reason == "key_not_unknown"  # within its deadline: alive
    store_backend.advance(PAST_DEADLINE)  # now its gateway is presumed dead: unknown
    with pytest.raises(ResolveRefused) as refused:
        await store.resolve_key(resolution("another-attempt", False))
    assert refused.value.reason == "attempt_mismatch"
    assert refused.value.record.attempt == flying.attempt
    assert (await store.key_record("pay", "key-1")).state is KeyState.IN_FLIGHT  # unchanged
    assert await audit(store) == []
    assert (await store.resolve_key(resolution(flying.attempt, True))).status == 201
    with pytest.raises(ResolveRefused) as refused:
        await store.resolve_key(resolution(flying.attempt, True))
    assert refused.value.reason == "key_not_unknown"  # completed now


async def race_two_operators(store: Any) -> list[str]:
    attempt = await unknown_key(store)
    results = await asyncio.gather(
        store.resolve_key(resolution(attempt, True)),
        store.resolve_key(resolution(attempt, True, status=202, note="second operator")),
        return_exceptions=True,
    )
    return sorted("ok" if not isinstance(r, Exception) else r.reason for r in results)


async def test_a_second_operator_is_refused(store_backend: Backend) -> None:
    assert await race_two_operators(store_backend.store) == ["key_not_unknown", "ok"]
    assert len(await audit(store_backend.store)) == 1


async def test_without_the_guard_a_second_operator_resolves_it_again(
    store_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The protection switched off: both operators' verdicts land, two audit rows."""
    guard_off(store_backend, monkeypatch)
    assert await race_two_operators(store_backend.store) == ["ok", "ok"]
    assert len(await audit(store_backend.store)) == 2


async def retry_then_resolve(retrying: Any, resolving: Any) -> str:
    """A worker's retry on a destination with upstream_idempotent = true is forwarded
    again by one replica; then an operator on another replica resolves the attempt
    they looked at."""
    idem = {"upstream_idempotent": True}
    attempt = await unknown_key(retrying, **idem)
    retry = await retrying.decide_write(write(**idem), CONTEXT)
    assert retry.decision == Forward(retry_of_unknown=True)
    try:
        await resolving.resolve_key(resolution(attempt, True))
    except ResolveRefused as refused:
        return refused.reason
    return "ok"


async def second_replica(store_backend: Backend, fake_clock: FakeClock | None = None) -> Any:
    if store_backend.name == "sqlite":
        return await SQLiteStore.open(store_backend.url, clock=store_backend.store.clock)
    other = await PostgresStore.open(store_backend.url)
    other.clock_offset = store_backend.store.clock_offset
    return other


async def test_a_retry_forwarded_by_another_replica_wins_over_a_stale_resolve(
    store_backend: Backend,
) -> None:
    other = await second_replica(store_backend)
    try:
        assert await retry_then_resolve(store_backend.store, other) == "key_not_unknown"
    finally:
        await other.close()
    record = await store_backend.store.key_record("pay", "key-1")
    assert record.state is KeyState.IN_FLIGHT and record.attempts == 2
    assert await audit(store_backend.store) == []


async def test_without_the_guard_a_stale_resolve_overwrites_a_live_retry(
    store_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The protection switched off: the operator's verdict lands on the key while the
    retry is on the wire, whose answer is then no longer recorded."""
    guard_off(store_backend, monkeypatch)
    assert await retry_then_resolve(store_backend.store, store_backend.store) == "ok"
    assert (await store_backend.store.key_record("pay", "key-1")).state is KeyState.COMPLETED


async def test_resolve_and_a_retry_racing_on_two_replicas_never_both_win(
    store_backend: Backend,
) -> None:
    other = await second_replica(store_backend)
    try:
        for n in range(10):
            key = f"race-{n}"
            attempt = await unknown_key(store_backend.store, key, upstream_idempotent=True)
            retry, resolved = await asyncio.gather(
                other.decide_write(write(key=key, upstream_idempotent=True), CONTEXT),
                store_backend.store.resolve_key(resolution(attempt, False, key=key)),
                return_exceptions=True,
            )
            if isinstance(resolved, ResolveRefused):
                # The retry came first: it holds the key, the operator was refused.
                assert resolved.reason == "key_not_unknown"
                assert retry.decision == Forward(retry_of_unknown=True)
            else:
                # The operator came first: the retry is a fresh forward of a free key.
                assert resolved.attempt == attempt and retry.decision == Forward()
            record = await store_backend.store.key_record("pay", key)
            assert record.attempt == retry.attempt and record.state is KeyState.IN_FLIGHT
    finally:
        await other.close()


async def test_the_janitor_never_purges_an_unknown_key_nor_a_young_resolution(
    store_backend: Backend,
) -> None:
    store = store_backend.store
    attempt = await unknown_key(store)
    store_backend.advance(30 * DAY)
    # A purge as old as anything: the unknown key waits for its operator.
    await asyncio.gather(
        purge_once(store, Metrics(), idempotency_ttl=1, rejections_ttl=1, audit_ttl=AUDIT_TTL),
        store.resolve_key(resolution(attempt, True)),
    )
    # Whichever came first, the key was unknown to the purge and resolved after it,
    # or resolved just now and younger than any retention: it is there.
    assert (await store.key_record("pay", "key-1")).state is KeyState.COMPLETED
    await purge_once(store, Metrics(), idempotency_ttl=DAY, rejections_ttl=DAY, audit_ttl=AUDIT_TTL)
    assert (await store.key_record("pay", "key-1")).state is KeyState.COMPLETED
    assert len(await audit(store)) == 1
    store_backend.advance(DAY + 60)
    await purge_once(store, Metrics(), idempotency_ttl=DAY, rejections_ttl=DAY, audit_ttl=AUDIT_TTL)
    assert len(await audit(store)) == 1  # audit rows have their own retention
    await purge_once(store, Metrics(), idempotency_ttl=DAY, rejections_ttl=DAY, audit_ttl=DAY)
    assert await audit(store) == []
    assert await store.key_record("pay", "key-1") is None


async def test_audit_rows_outlive_a_short_rejections_ttl(store_backend: Backend) -> None:
    """The record of what operators decided is kept for audit_ttl (default a year),
    whatever rejections_ttl says: with the janitor purging the audit log by the
    rejections' cut-off (as it once did), a one-minute rejections_ttl deleted a
    resolve's row two minutes after it was written and this test fails."""
    store = store_backend.store
    await store.record_rejection(RejectionRecord(reason="stale_generation", detail="t"))
    attempt = await unknown_key(store)
    await store.resolve_key(resolution(attempt, False))
    await store.record_audit(action="reload", note="admin: no change", operator="alice")
    store_backend.advance(120)
    await purge_once(store, Metrics(), idempotency_ttl=60, rejections_ttl=60, audit_ttl=AUDIT_TTL)
    assert await store.list_rejections(RejectionQuery()) == []  # the noise is gone
    assert len(await audit(store)) == 2  # the decisions are not
    store_backend.advance(364 * DAY)
    await purge_once(store, Metrics(), idempotency_ttl=60, rejections_ttl=60, audit_ttl=AUDIT_TTL)
    assert len(await audit(store)) == 2  # younger than the default audit_ttl (365d)
    store_backend.advance(DAY)
    await purge_once(store, Metrics(), idempotency_ttl=60, rejections_ttl=60, audit_ttl=AUDIT_TTL)
    assert await audit(store) == []


async def test_the_audit_log_names_the_operator(store_backend: Backend) -> None:
    store = store_backend.store
    attempt = await unknown_key(store)
    await store.resolve_key(replace(resolution(attempt, True), operator="alice"))
    await store.record_audit(action="reload", note="sighup: no change")
    resolved_by, reload_by = (await audit(store))[::-1]
    assert (resolved_by.action, resolved_by.operator) == ("resolve_applied", "alice")
    assert (reload_by.action, reload_by.operator) == ("reload", None)


# --- audit and summary -------------------------------------------------------------------


async def test_record_audit_and_its_pages(store_backend: Backend) -> None:
    store = store_backend.store
    first = await store.record_audit(action="reload", note="destinations: pay")
    store_backend.advance(10)
    second = await store.record_audit(
        action="resolve_applied", destination="pay", key="k", attempt="a", remote="::1"
    )
    entries = await audit(store)
    assert [e.id for e in entries] == [second, first]
    assert (entries[1].action, entries[1].note, entries[1].destination) == (
        "reload",
        "destinations: pay",
        None,
    )
    assert [e.id for e in await store.list_audit(AuditQuery(before_id=second))] == [first]
    assert [e.id for e in await store.list_audit(AuditQuery(since=entries[0].at))] == [second]
    assert [e.id for e in await store.list_audit(AuditQuery(until=entries[1].at))] == [first]
    assert [e.id for e in await store.list_audit(AuditQuery(limit=1))] == [second]


async def test_summary_counts_the_window_in_buckets(store_backend: Backend) -> None:
    store = store_backend.store
    # Start just past a 600 s boundary, so two rejections 60 s apart share a bucket
    # whatever the wall clock says (on PostgreSQL the store's clock is the server's).
    store_backend.advance(600 - store.clock() % 600 + 1)
    start = store.clock()
    for reason_, destination, later in (
        ("stale_generation", "pay", 0),
        ("stale_generation", "mail", 60),
        ("duplicate", "pay", 3600),
    ):
        store_backend.advance(later)
        await store.record_rejection(
            RejectionRecord(reason=reason_, detail="", destination=destination)
        )
    await unknown_key(store, "lost")
    await store.decide_write(write(key="flying", job_id="j2"), CONTEXT)
    now = store.clock()
    summary = await store.summary(now - DAY, now + 1)
    assert summary.by_reason == {"stale_generation": 2, "duplicate": 1}
    assert summary.by_destination == {"pay": 2, "mail": 1}
    assert summary.keys_by_state == {"pay": {"unknown": 1, "in_flight": 1}}
    assert summary.bucket_seconds == 600 and summary.bucket_count <= 200
    assert sum(sum(c.values()) for c in summary.series.values()) == 3
    first = int((start - summary.first_bucket) // 600)
    assert summary.series[first] == {"stale_generation": 2}  # 60 s apart: one bucket
    assert summary.series[first + 6] == {"duplicate": 1}  # an hour later
    narrow = await store.summary(now - 10, now + 1)
    assert narrow.by_reason == {"duplicate": 1} and narrow.bucket_seconds == 1


def test_bucket_widths_keep_every_window_within_200_buckets() -> None:
    for window in (1, 59, 900, 3600, 86400, 7 * 86400, 30 * 86400, 400 * 86400):
        width, start = bucket_width(1_700_000_123.4 - window, 1_700_000_123.4)
        assert start <= 1_700_000_123.4 - window
        assert (1_700_000_123.4 - start) / width <= 200


# --- the schema ------------------------------------------------------------------------------


async def test_a_version_1_sqlite_database_is_migrated(tmp_path) -> None:
    path = tmp_path / "v1.db"
    store = await SQLiteStore.open(f"sqlite:///{path}", clock=FakeClock())
    await store.close()
    conn = sqlite3.connect(path)
    conn.executescript(
        "DROP TABLE audit; DROP INDEX rejections_window;"
        "UPDATE sinkgate_schema SET version = 1 WHERE component = 'gateway';"
    )
    conn.close()
    store = await SQLiteStore.open(f"sqlite:///{path}", clock=FakeClock())
    try:
        assert await store.record_audit(action="reload") == 1
    finally:
        await store.close()
    conn = sqlite3.connect(path)
    version = conn.execute("SELECT version FROM sinkgate_schema WHERE component = 'gateway'")
    assert version.fetchone() == (GATEWAY_SCHEMA_VERSION,)
    plan = conn.execute("EXPLAIN QUERY PLAN " + sqlite_admin.SUMMARY_SQL, (0, 1, 0, 1)).fetchall()
    assert "COVERING INDEX rejections_window" in str(plan)
    conn.close()


@pytest.mark.postgres
async def test_a_version_1_postgres_database_is_migrated() -> None:
    import asyncpg  # type: ignore[import-untyped]

    from tests.pg import fresh_database

    async with fresh_database() as url:
        await (await PostgresStore.open(url)).close()
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(
                "DROP TABLE audit; DROP INDEX rejections_window;"
                "UPDATE sinkgate_schema SET version = 1 WHERE component = 'gateway'"
            )
        finally:
            await conn.close()
        store = await PostgresStore.open(url)
        try:
            assert await store.record_audit(action="reload") >= 1
        finally:
            await store.close()
        conn = await asyncpg.connect(url)
        try:
            version = await conn.fetchval(
                "SELECT version FROM sinkgate_schema WHERE component = 'gateway'"
            )
            index = await conn.fetchval("SELECT to_regclass('rejections_window')::text")
        finally:
            await conn.close()
        assert (version, index) == (postgres_schema.GATEWAY_SCHEMA_VERSION, "rejections_window")
