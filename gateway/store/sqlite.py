"""The gateway's store on SQLite (aiosqlite): fence, barrier, keys, rejection log.

Every verb is a small synchronous transaction function handed to the shared
group-commit executor (`leases.sqlite.SQLiteExecutor`): concurrent decisions
share one `BEGIN IMMEDIATE ... COMMIT` and one fsync, each still atomic on its
own, and each caller gets its answer only once the batch is durable.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from typing import Any

import orjson

from gateway.policy import batch_plan
from gateway.policy.batch_plan import BatchState
from gateway.policy.decision import KeyRecord, WriteFacts
from gateway.policy.plan import Reservation, WritePlan
from gateway.policy.records import Outcome, RejectionRecord, Verdict, WriteContext
from gateway.store import sqlite_admin
from gateway.store.protocol import Queued
from gateway.store.records import (
    KEY_COLUMNS,
    KEY_COLUMNS_SQL,
    REJECTION_COLUMNS_SQL,
    REJECTION_FIELDS,
    Clock,
    JobState,
    RejectionQuery,
    StoredRejection,
    key_record,
    new_attempt_id,
    rejection_filters,
    rejection_values,
    schema_line,
    where_set,
)
from gateway.store.sqlite_schema import GATEWAY_SCHEMA_VERSION, init_schema
from leases import sqlite as lease_sql
from leases.errors import StoreUnavailable
from leases.model import LeaseRow, State
from leases.sqlite import SQLiteExecutor, SQLiteLeaseStore, in_thread, read_lease

__all__ = ["GATEWAY_SCHEMA_VERSION", "SQLiteStore"]

_KEY_COLUMNS = KEY_COLUMNS_SQL
_REJECTION_COLUMNS = REJECTION_COLUMNS_SQL


class SQLiteStore(sqlite_admin.SQLiteAdmin, SQLiteLeaseStore):
    """Gateway store on one SQLite file; also the lease store the lease API uses."""

    def __init__(self, executor: SQLiteExecutor, clock: Clock = time.time) -> None:
        super().__init__(executor, clock)
        self.clock = clock

    @classmethod
    async def open(cls, url: str, *, clock: Clock = time.time, **options: Any) -> SQLiteStore:  # type: ignore[override]
        if options:
            raise ValueError(f"unknown SQLite store options: {', '.join(sorted(options))}")
        executor = await SQLiteExecutor.open(lease_sql.sqlite_path(url))
        try:
            before = await in_thread(executor._writer, init_schema)
        except BaseException as exc:
            await executor.close()
            if isinstance(exc, sqlite3.Error):
                raise StoreUnavailable(f"cannot create the gateway schema: {exc}") from exc
            raise  # SchemaTooNew, or a bug: the store is closed either way
        schema_line("sqlite", before, GATEWAY_SCHEMA_VERSION)
        return cls(executor, clock)

    async def decide_write(self, facts: WriteFacts, context: WriteContext) -> Verdict:
        clock = self.clock
        return await self._executor.run(
            lambda c: _decide_tx(c, facts, context, clock()), drop_cancelled=True
        )

    async def decide_group(self, writes: Sequence[Queued]) -> list[Verdict | None]:
        """`GroupDecisions`: one operation of the group commit for the whole group."""
        clock = self.clock
        return await self._executor.run(lambda c: _decide_group_tx(c, writes, clock()))

    async def record_outcome(self, facts: WriteFacts, attempt: str, outcome: Outcome) -> bool:
        clock = self.clock
        return await self._executor.run(lambda c: _outcome_tx(c, facts, attempt, outcome, clock()))

    async def record_rejection(self, record: RejectionRecord) -> int:
        clock = self.clock
        return await self._executor.run(lambda c: _insert_rejection(c, record, clock()))

    async def list_rejections(self, query: RejectionQuery) -> list[StoredRejection]:
        return await self._executor.read(lambda c: _list_rejections(c, query))

    async def get_rejection(self, rejection_id: int) -> StoredRejection | None:
        rows = await self._executor.read(
            lambda c: c.execute(
                f"SELECT id, at, {_REJECTION_COLUMNS} FROM rejections WHERE id = ?",
                (rejection_id,),
            ).fetchall()
        )
        return _rejection(rows[0]) if rows else None

    async def job_state(self, job_id: str) -> JobState | None:
        now = self.clock()
        return await self._executor.read(lambda c: _job_state(c, job_id, now))

    async def key_record(self, destination: str, key: str) -> KeyRecord | None:
        return await self._executor.read(lambda c: _read_key(c, destination, key))

    async def purge(
        self, *, completed_before: float, rejections_before: float, batch: int
    ) -> tuple[int, int]:
        return await self._executor.run(
            lambda c: _purge_tx(c, completed_before, rejections_before, batch)
        )

    async def ping(self) -> None:
        """Ready means a write can commit: an empty operation rides the next group
        commit, so it waits for SQLite's write lock like a decision would (and,
        changing nothing, costs no fsync). A read alone answers under WAL even while
        another process holds the write lock and every write is failing."""
        await self._executor.run(_nothing)


def _nothing(conn: sqlite3.Connection) -> None:
    return None


# --- the write decision, in one transaction -------------------------------------------


def _decide_tx(
    conn: sqlite3.Connection, facts: WriteFacts, context: WriteContext, now: float
) -> Verdict:
    state = _read_state(conn, facts, now)
    (plan,) = batch_plan.plan_batch([(facts, context)], state, new_attempt_id)
    return _apply(conn, plan, now)


def _apply(conn: sqlite3.Connection, plan: WritePlan, now: float) -> Verdict:
    """A planned decision's change: its reservation, or its rejection row."""
    if plan.reservation is not None:
        _reserve(conn, plan.reservation)
        return plan.verdict()
    assert plan.rejection is not None
    return plan.verdict(_insert_rejection(conn, plan.rejection, now))


def _decide_group_tx(
    conn: sqlite3.Connection, writes: Sequence[Queued], now: float
) -> list[Verdict | None]:
    """`_decide_tx` for each write of one key's group, in order, the state read
    once: a plan sees what the ones before it changed (`batch_plan`), a rejection
    changes nothing a later decision reads. `dropped` is read here, once, as the
    group commit reads a cancelled caller's future before its batch begins."""
    live = [w for w in writes if not w.dropped]
    if not live:
        return [None] * len(writes)
    first = live[0].facts
    ident = (first.job_id, first.generation, first.destination, first.key)
    assert all(
        (w.facts.job_id, w.facts.generation, w.facts.destination, w.facts.key) == ident
        for w in live
    ), "one group, one job generation and key"
    state = _read_state(conn, first, now)
    plans = batch_plan.plan_batch([(w.facts, w.context) for w in live], state, new_attempt_id)
    verdicts = {id(w): _apply(conn, plan, now) for w, plan in zip(live, plans, strict=True)}
    return [verdicts.get(id(w)) for w in writes]


# The rows a decision reads (the PostgreSQL decision function reads the same),
# assembled by `batch_plan.batch_state`: the job's mark and lease, the key's row with its
# `barrier_until`, and per older generation of the job the latest barrier still on
# the wire (a keyed write's in its key's row, other than this write's own key; a
# keyless one's in the attempts table). ?1 job, ?2 generation, ?3 now,
# ?4 destination, ?5 key (NULL: none).
_STATE_SQL = (
    "SELECT (SELECT highest_generation FROM fences WHERE job_id = ?1), "
    "l.job_id, l.owner, l.generation, l.state, l.lease_until, l.ttl, "
    + ", ".join(f"k.{c}" for c in KEY_COLUMNS)
    + ", k.barrier_until FROM (SELECT 1) LEFT JOIN leases AS l ON l.job_id = ?1 "
    "LEFT JOIN idempotency AS k ON k.destination = ?4 AND k.key = ?5"
)
_BARRIERS_SQL = (
    "SELECT job_id, generation, max(barrier_until) FROM idempotency "
    "WHERE job_id = ?1 AND state = 'in_flight' AND generation < ?2 AND barrier_until > ?3 "
    "AND NOT (destination = ?4 AND key IS ?5) GROUP BY generation "
    "UNION ALL SELECT job_id, generation, max(deadline) FROM attempts "
    "WHERE job_id = ?1 AND generation < ?2 AND deadline > ?3 GROUP BY generation"
)
_KEY_END = 7 + len(KEY_COLUMNS)


def _read_state(conn: sqlite3.Connection, facts: WriteFacts, now: float) -> BatchState:
    args = (facts.job_id, facts.generation, now, facts.destination, facts.key)
    row = conn.execute(_STATE_SQL, args).fetchone()
    return batch_plan.batch_state(
        now,
        leases=() if row[1] is None else (_lease(row),),
        marks=() if row[0] is None else ((facts.job_id, row[0]),),
        barriers=conn.execute(_BARRIERS_SQL, args).fetchall(),
        keys=() if row[7] is None else ((key_record(row[7:_KEY_END]), row[_KEY_END]),),
    )


def _lease(row: tuple[Any, ...]) -> LeaseRow:
    return LeaseRow(row[1], row[2], row[3], State(row[4]), row[5], row[6])


def _reserve(conn: sqlite3.Connection, r: Reservation) -> None:
    if r.key is not None:
        conn.execute(
            "INSERT INTO idempotency (destination, key, state, fingerprint, attempt, attempts, "
            "job_id, generation, owner, created_at, updated_at, deadline, barrier_until) "
            "VALUES (?, ?, 'in_flight', ?, ?, 1, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (destination, key) DO UPDATE SET state = 'in_flight', "
            "attempt = excluded.attempt, attempts = attempts + 1, job_id = excluded.job_id, "
            "generation = excluded.generation, owner = excluded.owner, "
            "updated_at = excluded.updated_at, deadline = excluded.deadline, "
            "barrier_until = excluded.barrier_until, "
            "completed_at = NULL, status = NULL, headers = NULL, body = NULL, body_omitted = 0",
            (
                r.destination,
                r.key,
                r.fingerprint,
                r.attempt,
                r.job_id,
                r.generation,
                r.owner,
                r.at,
                r.at,
                r.deadline,
                r.barrier_until,
            ),
        )
    else:  # a keyless write has no row of its own to carry its barrier
        conn.execute(
            "INSERT INTO attempts (attempt, job_id, generation, destination, key, started_at, "
            "deadline) VALUES (?, ?, ?, ?, NULL, ?, ?)",
            (r.attempt, r.job_id, r.generation, r.destination, r.at, r.barrier_until),
        )
    if r.raise_mark:
        conn.execute(
            "INSERT INTO fences (job_id, highest_generation, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT (job_id) DO UPDATE SET "
            "highest_generation = max(highest_generation, excluded.highest_generation), "
            "updated_at = excluded.updated_at",
            (r.job_id, r.generation, r.at),
        )


def _outcome_tx(
    conn: sqlite3.Connection, facts: WriteFacts, attempt: str, outcome: Outcome, now: float
) -> bool:
    if facts.key is None:
        conn.execute("DELETE FROM attempts WHERE attempt = ?", (attempt,))
        return True
    where = " WHERE destination = ? AND key = ? AND attempt = ?"
    ident = (facts.destination, facts.key, attempt)
    if outcome.kind == "completed":
        cursor = conn.execute(
            "UPDATE idempotency SET state = 'completed', status = ?, headers = ?, body = ?, "
            "body_omitted = ?, completed_at = ?, updated_at = ?, barrier_until = NULL" + where,
            (
                outcome.status,
                orjson.dumps(outcome.headers).decode(),
                outcome.body,
                int(outcome.body_omitted),
                now,
                now,
                *ident,
            ),
        )
    elif outcome.kind == "released":
        cursor = conn.execute("DELETE FROM idempotency" + where, ident)
    elif outcome.kind == "unknown":
        cursor = conn.execute(
            "UPDATE idempotency SET state = 'unknown', updated_at = ?, barrier_until = NULL"
            + where,
            (now, *ident),
        )
    else:  # pragma: no cover - programming error
        raise AssertionError(outcome.kind)
    return cursor.rowcount == 1


_INSERT_REJECTION = (
    f"INSERT INTO rejections (at, {_REJECTION_COLUMNS}) "
    f"VALUES (?, {', '.join('?' * len(REJECTION_FIELDS))})"
)


def _insert_rejection(conn: sqlite3.Connection, record: RejectionRecord, now: float) -> int:
    cursor = conn.execute(_INSERT_REJECTION, (now, *rejection_values(record)))
    assert cursor.lastrowid is not None
    return cursor.lastrowid


# --- reads -------------------------------------------------------------------------------


_READ_KEY_SQL = f"SELECT {_KEY_COLUMNS} FROM idempotency WHERE destination = ? AND key = ?"


def _read_key(conn: sqlite3.Connection, destination: str, key: str) -> KeyRecord | None:
    row = conn.execute(_READ_KEY_SQL, (destination, key)).fetchone()
    return None if row is None else key_record(row)


def _rejection(row: tuple[Any, ...]) -> StoredRejection:
    return StoredRejection(id=row[0], at=row[1], record=RejectionRecord(*row[2:]))


def _list_rejections(conn: sqlite3.Connection, query: RejectionQuery) -> list[StoredRejection]:
    where, params = where_set(rejection_filters(query), numbered=False)
    rows = conn.execute(
        f"SELECT id, at, {_REJECTION_COLUMNS} FROM rejections {where}ORDER BY id DESC LIMIT ?",
        (*params, query.limit),
    ).fetchall()
    return [_rejection(row) for row in rows]


def _job_state(conn: sqlite3.Connection, job_id: str, now: float) -> JobState | None:
    lease = read_lease(conn, job_id)
    mark = conn.execute(
        "SELECT highest_generation FROM fences WHERE job_id = ?", (job_id,)
    ).fetchone()
    in_flight = conn.execute(
        "SELECT attempt, generation, destination, key, updated_at, barrier_until "
        "FROM idempotency WHERE job_id = ?1 AND state = 'in_flight' AND barrier_until > ?2 "
        "UNION ALL SELECT attempt, generation, destination, key, started_at, deadline "
        "FROM attempts WHERE job_id = ?1 AND deadline > ?2 ORDER BY 5",
        (job_id, now),
    ).fetchall()
    recent = _list_rejections(conn, RejectionQuery(job_id=job_id, limit=20))
    if lease is None and mark is None and not in_flight and not recent:
        return None
    return JobState(
        job_id=job_id,
        lease=lease,
        highest_generation=None if mark is None else mark[0],
        in_flight=tuple(
            dict(
                zip(
                    ("attempt", "generation", "destination", "key", "started_at", "deadline"),
                    r,
                    strict=True,
                )
            )
            for r in in_flight
        ),
        recent_rejections=tuple(recent),
    )


def _purge_tx(
    conn: sqlite3.Connection, completed_before: float, rejections_before: float, batch: int
) -> tuple[int, int]:
    keys = conn.execute(
        "DELETE FROM idempotency WHERE rowid IN (SELECT rowid FROM idempotency "
        "WHERE state = 'completed' AND completed_at < ? LIMIT ?)",
        (completed_before, batch),
    ).rowcount
    rejections = conn.execute(
        "DELETE FROM rejections WHERE id IN (SELECT id FROM rejections WHERE at < ? "
        "ORDER BY id LIMIT ?)",
        (rejections_before, batch),
    ).rowcount
    # An attempt whose gateway died never deletes its own row; past its deadline it
    # no longer bars anything (reads only look at deadline > now), so once it is
    # as old as a purgeable key it is garbage.
    conn.execute(
        "DELETE FROM attempts WHERE rowid IN (SELECT rowid FROM attempts WHERE deadline < ? "
        "LIMIT ?)",
        (completed_before, batch),
    )
    return keys, rejections
