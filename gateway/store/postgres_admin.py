"""The operator's verbs on PostgreSQL: key listing, resolve, audit log, summary.

A mixin of `PostgresStore`, kept apart from the write path. Resolve is one READ
COMMITTED transaction that first takes the key's advisory lock, the very lock a
write decision of that key takes (`postgres._LOCK_SQL`), so an operator, a
worker's retry on another replica and a second operator are serialised on the
key; its guard (`RESOLVE_GUARD`, in the `UPDATE`/`DELETE` itself) is then
evaluated on the latest committed row, by the server's clock. The janitor's
purge only ever deletes completed keys older than the retention, and a key
resolved `applied` is completed now, so it is not purged under the operator.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from gateway.policy.decision import KeyRecord, KeyState
from gateway.policy.records import RejectionRecord
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
from gateway.store.records import (
    KEY_COLUMNS,
    KEY_COLUMNS_SQL,
    REJECTION_COLUMNS_SQL,
    REJECTION_FIELDS,
    JobState,
    RejectionQuery,
    StoredRejection,
    key_record,
    new_attempt_id,
    rejection_filters,
    where_set,
)
from gateway.store.sqlite_admin import add_counts
from leases.model import LeaseRow, State
from leases.postgres import STORE_NOW
from leases.reasons import Reason

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from leases.postgres import Conn

ADMIN_DDL = """
CREATE TABLE IF NOT EXISTS audit (
    id bigserial PRIMARY KEY,
    at double precision NOT NULL,
    action text NOT NULL,
    destination text,
    key text,
    attempt text,
    note text,
    remote text,
    operator text
);
-- v4: who made the call; rows from before it keep theirs, with no operator
ALTER TABLE audit ADD COLUMN IF NOT EXISTS operator text;
CREATE INDEX IF NOT EXISTS audit_at ON audit (at);
CREATE INDEX IF NOT EXISTS rejections_window ON rejections (at, reason, destination);
"""

_NOW = STORE_NOW.format("$1")
_KEY_COLUMNS = KEY_COLUMNS_SQL
_REJECTION_COLUMNS = REJECTION_COLUMNS_SQL
# The leases row joined as `l`, each column under its own name (see `lease_row`).
LEASE_ALIASES = "l.job_id AS l_job, l.owner AS l_owner, l.generation AS l_generation, " + (
    "l.state AS l_state, l.lease_until AS l_until, l.ttl AS l_ttl"
)
_KEY_LOCK = (
    "SELECT pg_advisory_xact_lock(hashtextextended('key:' || $1::text || chr(10) || $2::text, 0))"
)

# $1 destination, $2 key, $3 attempt, $4 now. Tests switch it off to show the
# races it closes.
RESOLVE_GUARD = "attempt = $3 AND (state = 'unknown' OR (state = 'in_flight' AND deadline <= $4))"

# The effective state of SPEC 4 as a predicate; `{}` is the placeholder of now.
_STATE_SQL = {
    KeyState.UNKNOWN: (
        "state IN ('unknown', 'in_flight') AND (state = 'unknown' OR deadline <= {})"
    ),
    KeyState.IN_FLIGHT: "state = 'in_flight' AND deadline > {}",
    KeyState.COMPLETED: "state = 'completed'",
}
_AUDIT_COLUMNS = "id, at, action, destination, key, attempt, note, remote, operator"


async def migrate(conn: Conn) -> None:
    """The audit log (with its `operator`, v4) and the summary index (schema v2);
    idempotent, under the schema lock."""
    await conn.execute(ADMIN_DDL)


class PostgresAdmin:
    """`OperatorStore` on PostgreSQL; mixed into `PostgresStore`."""

    if TYPE_CHECKING:  # provided by PostgresStore; declared only, never shadowed
        clock_offset: float

        def _offset(self) -> float: ...
        async def _read(self, fn: Callable[[Conn], Awaitable[Any]]) -> Any: ...
        async def _write_tx(self, fn: Callable[[Conn], Awaitable[Any]]) -> Any: ...
        async def _snapshot(self, fn: Callable[[Conn], Awaitable[Any]]) -> Any: ...

    # --- what the admin API and page read ----------------------------------------------

    async def list_rejections(self, query: RejectionQuery) -> list[StoredRejection]:
        rows: list[StoredRejection] = await self._read(lambda c: _list_rejections(c, query))
        return rows

    async def get_rejection(self, rejection_id: int) -> StoredRejection | None:
        row = await self._read(
            lambda c: c.fetchrow(
                f"SELECT id, at, {_REJECTION_COLUMNS} FROM rejections WHERE id = $1",
                rejection_id,
            )
        )
        return None if row is None else _rejection(row)

    async def job_state(self, job_id: str) -> JobState | None:
        offset = self._offset()
        state: JobState | None = await self._snapshot(lambda c: _job_state(c, job_id, offset))
        return state

    async def key_record(self, destination: str, key: str) -> KeyRecord | None:
        row = await self._read(
            lambda c: c.fetchrow(
                f"SELECT {_KEY_COLUMNS} FROM idempotency WHERE destination = $1 AND key = $2",
                destination,
                key,
            )
        )
        return None if row is None else key_from_row(row)

    async def list_keys(self, query: KeyQuery) -> list[KeyRecord]:
        offset = self._offset()
        result: list[KeyRecord] = await self._read(lambda c: _list_keys(c, query, offset))
        return result

    async def resolve_key(self, resolution: Resolution) -> KeyRecord:
        offset = self._offset()
        result: KeyRecord = await self._write_tx(lambda c: _resolve_tx(c, resolution, offset))
        return result

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
        offset = self._offset()
        row = (action, destination, key, attempt, note, remote, operator)

        async def insert(conn: Conn) -> int:
            return await _insert_audit(conn, await conn.fetchval(f"SELECT {_NOW}", offset), *row)

        result: int = await self._write_tx(insert)
        return result

    async def list_audit(self, query: AuditQuery) -> list[AuditEntry]:
        result: list[AuditEntry] = await self._read(lambda c: _list_audit(c, query))
        return result

    async def summary(self, since: float, until: float) -> Summary:
        offset = self._offset()
        result: Summary = await self._read(lambda c: _summary(c, since, until, offset))
        return result

    async def unknown_counts(self) -> dict[str, int]:
        offset = self._offset()
        rows = await self._read(
            lambda c: c.fetch(
                f"WITH n AS MATERIALIZED (SELECT {_NOW} AS now) "
                "SELECT destination, count(*) AS n FROM idempotency, n WHERE "
                f"{_STATE_SQL[KeyState.UNKNOWN].format('n.now')} GROUP BY destination",
                offset,
            )
        )
        return {row["destination"]: row["n"] for row in rows}

    async def purge_audit(self, *, before: float, batch: int) -> int:
        status: str = await self._write_tx(
            lambda c: c.execute(
                "WITH doomed AS MATERIALIZED (SELECT id FROM audit WHERE at < $1 "
                "ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED) "
                "DELETE FROM audit a USING doomed d WHERE a.id = d.id",
                before,
                batch,
            )
        )
        return int(status.rsplit(" ", 1)[-1])


def _record(row: Any) -> KeyRecord:
    return key_record([row[name] for name in KEY_COLUMNS])


async def _list_keys(conn: Conn, query: KeyQuery, offset: float) -> list[KeyRecord]:
    params: list[Any] = [offset]
    clauses: list[str] = []
    for clause, value in (
        ("destination = ", query.destination),
        ("job_id = ", query.job_id),
        ("updated_at >= ", query.since),
        ("updated_at <= ", query.until),
    ):
        if value is not None:
            params.append(value)
            clauses.append(f"{clause}${len(params)}")
    if query.state is not None:
        clauses.append(f"({_STATE_SQL[query.state].format('n.now')})")
    if query.after is not None:
        params.extend(query.after)
        n = len(params)
        clauses.append(f"(updated_at, destination, key) < (${n - 2}, ${n - 1}, ${n})")
    params.append(query.limit)
    where = f"WHERE {' AND '.join(clauses)} " if clauses else ""
    rows = await conn.fetch(
        f"WITH n AS MATERIALIZED (SELECT {_NOW} AS now) "
        f"SELECT {KEY_COLUMNS_SQL} FROM idempotency, n {where}"
        f"ORDER BY updated_at DESC, destination DESC, key DESC LIMIT ${len(params)}",
        *params,
    )
    return [_record(row) for row in rows]


async def _read_key(conn: Conn, destination: str, key: str) -> KeyRecord | None:
    row = await conn.fetchrow(
        f"SELECT {KEY_COLUMNS_SQL} FROM idempotency WHERE destination = $1 AND key = $2",
        destination,
        key,
    )
    return None if row is None else _record(row)


async def _resolve_tx(conn: Conn, r: Resolution, offset: float) -> KeyRecord:
    await conn.execute(_KEY_LOCK, r.destination, r.key)
    now: float = await conn.fetchval(f"SELECT {_NOW}", offset)
    where = f" WHERE destination = $1 AND key = $2 AND {RESOLVE_GUARD}"
    ident = (r.destination, r.key, r.attempt, now)
    if r.applied:
        # A new attempt id: the dead attempt can no longer record over the verdict.
        row = await conn.fetchrow(
            "UPDATE idempotency SET state = 'completed', attempt = $5, status = $6, "
            "headers = $7, body = $8, body_omitted = false, completed_at = $4, updated_at = $4"
            + where
            + f" RETURNING {KEY_COLUMNS_SQL}",
            *ident,
            new_attempt_id(),
            r.status,
            json.dumps([["Content-Type", r.content_type]]),
            r.body,
        )
    else:
        row = await conn.fetchrow(
            "DELETE FROM idempotency" + where + f" RETURNING {KEY_COLUMNS_SQL}", *ident
        )
    if row is None:
        record = await _read_key(conn, r.destination, r.key)
        if record is None:
            raise ResolveRefused(Reason.NOT_FOUND, None)
        if record.state_at(now) is not KeyState.UNKNOWN:
            raise ResolveRefused(Reason.KEY_NOT_UNKNOWN, record)
        raise ResolveRefused(Reason.ATTEMPT_MISMATCH, record)
    action = "resolve_applied" if r.applied else "resolve_not_applied"
    await _insert_audit(
        conn, now, action, r.destination, r.key, r.attempt, r.note, r.remote, r.operator
    )
    return _record(row)


async def _insert_audit(conn: Conn, now: float, *row: str | None) -> int:
    audit_id: int = await conn.fetchval(
        "INSERT INTO audit (at, action, destination, key, attempt, note, remote, operator) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING id",
        now,
        *row,
    )
    return audit_id


async def _list_audit(conn: Conn, query: AuditQuery) -> list[AuditEntry]:
    where, params = where_set(audit_filters(query), numbered=True)
    params.append(query.limit)
    rows = await conn.fetch(
        f"SELECT {_AUDIT_COLUMNS} FROM audit {where}ORDER BY id DESC LIMIT ${len(params)}",
        *params,
    )
    return [AuditEntry(*row) for row in rows]


async def _summary(conn: Conn, since: float, until: float, offset: float) -> Summary:
    width, start = bucket_width(since, until)
    summary = Summary(since=since, until=until, bucket_seconds=width, first_bucket=start)
    rows = await conn.fetch(
        "SELECT floor((at - $1) / $2)::int AS b, reason, destination, count(*) AS n "
        "FROM rejections WHERE at >= $3 AND at <= $4 GROUP BY 1, 2, 3",
        float(start),
        float(width),
        since,
        until,
    )
    for row in rows:
        add_counts(summary, row["b"], row["reason"], row["destination"], row["n"])
    keys = await conn.fetch(
        f"WITH n AS MATERIALIZED (SELECT {_NOW} AS now) "
        "SELECT destination, CASE WHEN state = 'in_flight' AND deadline <= n.now "
        "THEN 'unknown' ELSE state END AS s, count(*) AS c FROM idempotency, n GROUP BY 1, 2",
        offset,
    )
    for row in keys:
        by_state = summary.keys_by_state.setdefault(row["destination"], {})
        by_state[row["s"]] = by_state.get(row["s"], 0) + row["c"]
    return summary


# --- rejections and job state -----------------------------------------------------------


def key_from_row(row: Any) -> KeyRecord:
    """A KeyRecord from a row selected with `KEY_COLUMNS`."""
    return key_record([row[name] for name in KEY_COLUMNS])


def _rejection(row: Any) -> StoredRejection:
    return StoredRejection(
        id=row["id"],
        at=row["at"],
        record=RejectionRecord(**{name: row[name] for name in REJECTION_FIELDS}),
    )


async def _list_rejections(conn: Conn, query: RejectionQuery) -> list[StoredRejection]:
    where, params = where_set(rejection_filters(query), numbered=True)
    params.append(query.limit)
    rows = await conn.fetch(
        f"SELECT id, at, {_REJECTION_COLUMNS} FROM rejections {where}"
        f"ORDER BY id DESC LIMIT ${len(params)}",
        *params,
    )
    return [_rejection(row) for row in rows]


async def _job_state(conn: Conn, job_id: str, offset: float) -> JobState | None:
    head = await conn.fetchrow(
        f"SELECT {STORE_NOW.format('$2')} AS now, {LEASE_ALIASES}, "
        "(SELECT highest_generation FROM fences WHERE job_id = $1) AS mark "
        "FROM (SELECT 1) one LEFT JOIN leases l ON l.job_id = $1",
        job_id,
        offset,
    )
    in_flight = await conn.fetch(
        "SELECT attempt, generation, destination, key, updated_at AS started_at, "
        "barrier_until AS deadline FROM idempotency WHERE job_id = $1 "
        "AND state = 'in_flight' AND barrier_until > $2 "
        "UNION ALL SELECT attempt, generation, destination, key, started_at, deadline "
        "FROM attempts WHERE job_id = $1 AND deadline > $2 ORDER BY started_at",
        job_id,
        head["now"],
    )
    recent = await _list_rejections(conn, RejectionQuery(job_id=job_id, limit=20))
    lease = lease_row(head)
    if lease is None and head["mark"] is None and not in_flight and not recent:
        return None
    return JobState(
        job_id=job_id,
        lease=lease,
        highest_generation=head["mark"],
        in_flight=tuple(dict(r.items()) for r in in_flight),
        recent_rejections=tuple(recent),
    )


def lease_row(row: Any) -> LeaseRow | None:
    """The lease selected with `LEASE_ALIASES`, or None when the job has no row."""
    if row["l_job"] is None:
        return None
    return LeaseRow(
        row["l_job"],
        row["l_owner"],
        row["l_generation"],
        State(row["l_state"]),
        row["l_until"],
        row["l_ttl"],
    )
