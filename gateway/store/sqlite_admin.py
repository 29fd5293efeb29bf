"""The operator's verbs on SQLite: key listing, resolve, audit log, summary.

A mixin of `SQLiteStore` (it uses the store's executor and clock), kept apart
from the write path. Resolve is one function handed to the group-commit
executor, so it is serialised with every decision and outcome: its guard (the
`WHERE` of `RESOLVE_GUARD`) is evaluated against the key as it is at commit
order, never as an earlier read saw it.

Schema v2 (`ADMIN_SCHEMA`, applied by `migrate`): the audit table, and a
covering index of rejections by time, reason and destination that the summary
reads without touching the table.
"""

from __future__ import annotations

import json
import sqlite3
from typing import TYPE_CHECKING, Any

from gateway.policy.decision import KeyRecord, KeyState
from gateway.store.admin_records import (
    AuditEntry,
    AuditQuery,
    KeyQuery,
    Resolution,
    ResolveRefused,
    Summary,
    audit_filters,
    bucket_width,
)
from gateway.store.records import KEY_COLUMNS_SQL, key_record, new_attempt_id, where_set
from leases.reasons import Reason

if TYPE_CHECKING:
    from gateway.store.records import Clock
    from leases.sqlite import SQLiteExecutor

ADMIN_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    action TEXT NOT NULL,
    destination TEXT,
    key TEXT,
    attempt TEXT,
    note TEXT,
    remote TEXT,
    operator TEXT
);
CREATE INDEX IF NOT EXISTS audit_at ON audit (at);
CREATE INDEX IF NOT EXISTS rejections_window ON rejections (at, reason, destination);
"""

# Only a key that is unknown now, held by the named attempt, is resolved. Named
# parameters :attempt and :now. Tests switch it off to show the races it closes.
RESOLVE_GUARD = (
    "attempt = :attempt AND (state = 'unknown' OR (state = 'in_flight' AND deadline <= :now))"
)

# The effective state of SPEC 4 as a predicate on a row (:now bound); each starts
# with a `state` test the (state, completed_at) index can answer.
_STATE_SQL = {
    KeyState.UNKNOWN: (
        "state IN ('unknown', 'in_flight') AND (state = 'unknown' OR deadline <= :now)"
    ),
    KeyState.IN_FLIGHT: "state = 'in_flight' AND deadline > :now",
    KeyState.COMPLETED: "state = 'completed'",
}
# ?1 first bucket's start, ?2 bucket width, ?3 since, ?4 until.
SUMMARY_SQL = (
    "SELECT CAST((at - ?) / ? AS INTEGER), reason, destination, count(*) "
    "FROM rejections INDEXED BY rejections_window WHERE at >= ? AND at <= ? GROUP BY 1, 2, 3"
)
# With statistics (ANALYZE), SQLite would rather walk the primary key in
# destination order for a GROUP BY destination, reading every key: named, the
# (state, completed_at) index reads only the in-flight and unknown rows.
_BY_STATE = "INDEXED BY idempotency_completed"
_AUDIT_COLUMNS = "id, at, action, destination, key, attempt, note, remote, operator"


def migrate(conn: sqlite3.Connection) -> None:
    """The audit log and the summary index (schema v2), and the audit log's
    `operator` (v4: rows from before it keep theirs, with no operator); idempotent,
    in the caller's transaction."""
    for statement in ADMIN_SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(audit)")}
    if "operator" not in columns:
        conn.execute("ALTER TABLE audit ADD COLUMN operator TEXT")


class SQLiteAdmin:
    """`OperatorStore` on SQLite; mixed into `SQLiteStore`."""

    _executor: SQLiteExecutor
    clock: Clock

    async def list_keys(self, query: KeyQuery) -> list[KeyRecord]:
        now = self.clock()
        return await self._executor.read(lambda c: _list_keys(c, query, now))

    async def resolve_key(self, resolution: Resolution) -> KeyRecord:
        clock = self.clock
        return await self._executor.run(lambda c: _resolve_tx(c, resolution, clock()))

    async def record_audit(
        self,
        *,
        action: str,
        destination: str | None = None,
        key: str | None = None,
        attempt: str | None = None,
        note: str | None = None,
        remote: str | None = None,
        operator: str | None = None,
    ) -> int:
        row = (action, destination, key, attempt, note, remote, operator)
        clock = self.clock
        return await self._executor.run(lambda c: _insert_audit(c, clock(), *row))

    async def list_audit(self, query: AuditQuery) -> list[AuditEntry]:
        return await self._executor.read(lambda c: _list_audit(c, query))

    async def summary(self, since: float, until: float) -> Summary:
        now = self.clock()
        return await self._executor.read(lambda c: _summary(c, since, until, now))

    async def unknown_counts(self) -> dict[str, int]:
        now = self.clock()
        rows = await self._executor.read(
            lambda c: c.execute(
                "SELECT destination, count(*) FROM idempotency "
                f"{_BY_STATE} WHERE {_STATE_SQL[KeyState.UNKNOWN]} GROUP BY destination",
                {"now": now},
            ).fetchall()
        )
        return {destination: count for destination, count in rows}

    async def purge_audit(self, *, before: float, batch: int) -> int:
        return await self._executor.run(
            lambda c: (
                c.execute(
                    "DELETE FROM audit WHERE id IN (SELECT id FROM audit WHERE at < ? "
                    "ORDER BY id LIMIT ?)",
                    (before, batch),
                ).rowcount
            )
        )


def _list_keys(conn: sqlite3.Connection, query: KeyQuery, now: float) -> list[KeyRecord]:
    clauses: list[str] = []
    params: dict[str, Any] = {"now": now, "limit": query.limit}
    for clause, name, value in (
        ("destination = :destination", "destination", query.destination),
        ("job_id = :job_id", "job_id", query.job_id),
        ("updated_at >= :since", "since", query.since),
        ("updated_at <= :until", "until", query.until),
    ):
        if value is not None:
            clauses.append(clause)
            params[name] = value
    if query.state is not None:
        clauses.append(f"({_STATE_SQL[query.state]})")
    if query.after is not None:
        clauses.append("(updated_at, destination, key) < (:a_at, :a_destination, :a_key)")
        params.update(a_at=query.after[0], a_destination=query.after[1], a_key=query.after[2])
    where = f"WHERE {' AND '.join(clauses)} " if clauses else ""
    # Only the unknown and in-flight states are few: there the index pays.
    indexed = _BY_STATE + " " if query.state in (KeyState.UNKNOWN, KeyState.IN_FLIGHT) else ""
    rows = conn.execute(
        f"SELECT {KEY_COLUMNS_SQL} FROM idempotency {indexed}{where}"
        "ORDER BY updated_at DESC, destination DESC, key DESC LIMIT :limit",
        params,
    ).fetchall()
    return [key_record(row) for row in rows]


def _read_key(conn: sqlite3.Connection, destination: str, key: str) -> KeyRecord | None:
    row = conn.execute(
        f"SELECT {KEY_COLUMNS_SQL} FROM idempotency WHERE destination = ? AND key = ?",
        (destination, key),
    ).fetchone()
    return None if row is None else key_record(row)


def _resolve_tx(conn: sqlite3.Connection, r: Resolution, now: float) -> KeyRecord:
    params: dict[str, Any] = {
        "destination": r.destination,
        "key": r.key,
        "attempt": r.attempt,
        "now": now,
    }
    where = f" WHERE destination = :destination AND key = :key AND {RESOLVE_GUARD}"
    before: KeyRecord | None = None
    if r.applied:
        # A new attempt id: the dead attempt, should it still record an outcome,
        # no longer holds the key (`record_outcome` answers False) and cannot undo
        # the operator's verdict.
        params.update(
            new_attempt=new_attempt_id(),
            status=r.status,
            headers=json.dumps([["Content-Type", r.content_type]]),
            body=r.body,
        )
        cursor = conn.execute(
            "UPDATE idempotency SET state = 'completed', attempt = :new_attempt, "
            "status = :status, headers = :headers, body = :body, body_omitted = 0, "
            "completed_at = :now, updated_at = :now" + where,
            params,
        )
    else:
        before = _read_key(conn, r.destination, r.key)
        cursor = conn.execute("DELETE FROM idempotency" + where, params)
    if cursor.rowcount != 1:
        _refuse(_read_key(conn, r.destination, r.key), r, now)
    action = "resolve_applied" if r.applied else "resolve_not_applied"
    _insert_audit(conn, now, action, r.destination, r.key, r.attempt, r.note, r.remote, r.operator)
    record = _read_key(conn, r.destination, r.key) if r.applied else before
    assert record is not None  # the guard matched this very row in this transaction
    return record


def _refuse(record: KeyRecord | None, r: Resolution, now: float) -> None:
    """Why the guard matched no row: raise the refusal that says so."""
    if record is None:
        raise ResolveRefused(Reason.NOT_FOUND, None)
    if record.state_at(now) is not KeyState.UNKNOWN:
        raise ResolveRefused(Reason.KEY_NOT_UNKNOWN, record)
    raise ResolveRefused(Reason.ATTEMPT_MISMATCH, record)


def _insert_audit(conn: sqlite3.Connection, now: float, *row: str | None) -> int:
    cursor = conn.execute(
        "INSERT INTO audit (at, action, destination, key, attempt, note, remote, operator) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (now, *row),
    )
    assert cursor.lastrowid is not None
    return cursor.lastrowid


def _list_audit(conn: sqlite3.Connection, query: AuditQuery) -> list[AuditEntry]:
    where, params = where_set(audit_filters(query), numbered=False)
    rows = conn.execute(
        f"SELECT {_AUDIT_COLUMNS} FROM audit {where}ORDER BY id DESC LIMIT ?",
        (*params, query.limit),
    ).fetchall()
    return [AuditEntry(*row) for row in rows]


def _summary(conn: sqlite3.Connection, since: float, until: float, now: float) -> Summary:
    width, start = bucket_width(since, until)
    summary = Summary(since=since, until=until, bucket_seconds=width, first_bucket=start)
    # One pass over the window, on the covering index (at, reason, destination).
    rows = conn.execute(SUMMARY_SQL, (start, width, since, until)).fetchall()
    for bucket, reason, destination, count in rows:
        add_counts(summary, bucket, reason, destination, count)
    keys = conn.execute(
        "SELECT destination, CASE WHEN state = 'in_flight' AND deadline <= ? THEN 'unknown' "
        "ELSE state END, count(*) FROM idempotency GROUP BY 1, 2",
        (now,),
    ).fetchall()
    for destination, state, count in keys:
        summary.keys_by_state.setdefault(destination, {})
        by_state = summary.keys_by_state[destination]
        by_state[state] = by_state.get(state, 0) + count
    return summary


def add_counts(
    summary: Summary, bucket: int, reason: str, destination: str | None, count: int
) -> None:
    """Fold one (bucket, reason, destination) count into the summary's three views."""
    summary.by_reason[reason] = summary.by_reason.get(reason, 0) + count
    if destination is not None:
        summary.by_destination[destination] = summary.by_destination.get(destination, 0) + count
    series = summary.series.setdefault(bucket, {})
    series[reason] = series.get(reason, 0) + count
