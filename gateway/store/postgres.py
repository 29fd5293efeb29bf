"""The gateway's store on PostgreSQL (asyncpg): fence, barrier, keys, rejection log.

The same tables as `sqlite_store` (PostgreSQL types: `double precision` epoch
seconds, `bigint` generations, `bytea` bodies, `bigserial` rejection ids), in the
database the lease store (`leases.postgres`) uses, so the lease-mode fence reads
the very lease table the lease API writes.

A write decision is one short READ COMMITTED transaction on a pooled connection:

1. `BEGIN`
2. one statement: `synchronous_commit` on for this transaction, then
   `pg_advisory_xact_lock` on the job, then on (destination, key). The job lock
   serialises the decisions of one job across replicas, which the generation
   barrier needs (two generations must not both see "no older attempt"); the
   key lock serialises first reservations of one key, which no row lock can do
   (the row does not exist yet). Always job then key, in one statement, so two
   decisions never wait on each other in opposite orders.
3. one statement reading everything `decide` needs, with a snapshot taken after
   the locks: the store's clock, the lease, the job's mark, the latest deadline
   of an older generation's attempt, and the key's record `FOR UPDATE` (an
   outcome being recorded for the key finishes first, or waits for us).
4. one statement applying the verdict: reservation + attempt + mark, or the
   rejection (a replay is logged as `duplicate`).
5. `COMMIT` (durable).

An outcome (and a rejection logged outside a decision) is one statement
outside a transaction block: its own atomic, durable transaction, one round
trip (see `_DURABLE`, `_OUTCOME_SQL`).

The lease row is read, not locked: every read of the decision comes from one
snapshot and the clock is read in the same statement, so the decision is the
one SQLite would have taken at that instant; a claim committing meanwhile could
only take over a lease already expired by then (its clock reads later), and
later writes of the job see this decision's attempt through the job lock.

The store's clock is the server's `clock_timestamp()` plus `clock_offset`.
`clock()` is synchronous (the lease API stamps `server_time`, the janitor and
admin views take their cut-offs from it), so it answers from the local clock
corrected by the skew last measured against the server: at open, and at every
write decision. It is for display and retention cut-offs; no fence or
reservation is decided by it.

No session state (see `leases.postgres`): works behind PgBouncer in
transaction mode.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from gateway.store import postgres_admin
from gateway.store.plan import plan_write
from gateway.store.postgres_admin import LEASE_ALIASES, key_from_row, lease_row
from gateway.store.postgres_schema import GATEWAY_SCHEMA_VERSION, init_schema
from gateway.store.records import (
    KEY_COLUMNS_SQL,
    REJECTION_COLUMNS_SQL,
    Outcome,
    RejectionRecord,
    Verdict,
    WriteContext,
    new_attempt_id,
    rejection_values,
)
from gateway.write.decision import (
    Fencing,
    StoredState,
    WriteFacts,
)
from leases.postgres import (
    DURABLE,
    STORE_NOW,
    Conn,
    PostgresLeaseStore,
    db_now,
    driver_errors,
    require_durable_commit,
)

T = TypeVar("T")

__all__ = ["GATEWAY_SCHEMA_VERSION", "PostgresStore"]

_NOW = STORE_NOW
_KEY_COLUMNS = KEY_COLUMNS_SQL
_REJECTION_COLUMNS = REJECTION_COLUMNS_SQL
_LEASE_ALIASES = LEASE_ALIASES

# $1 job, $2 destination, $3 key (NULL: no key). A NULL lock key skips the lock
# (the functions are strict). The target list is evaluated left to right.
_LOCK_SQL = (
    f"SELECT {DURABLE}, "
    "pg_advisory_xact_lock(hashtextextended('job:' || $1::text, 0)), "
    "pg_advisory_xact_lock(hashtextextended('key:' || $2::text || chr(10) || $3::text, 0))"
)

# $1 job, $2 generation, $3 destination, $4 key, $5 clock offset.
_STATE_SQL = f"""
WITH n AS MATERIALIZED (SELECT {_NOW.format("$5")} AS now)
SELECT n.now, {_LEASE_ALIASES},
    (SELECT highest_generation FROM fences WHERE job_id = $1) AS mark,
    GREATEST((SELECT max(barrier_until) FROM idempotency WHERE job_id = $1
            AND state = 'in_flight' AND generation < $2 AND barrier_until > n.now),
        (SELECT max(deadline) FROM attempts
            WHERE job_id = $1 AND generation < $2 AND deadline > n.now)) AS older,
    k.*
FROM n
LEFT JOIN leases l ON l.job_id = $1
LEFT JOIN LATERAL (
    SELECT {_KEY_COLUMNS} FROM idempotency
    WHERE destination = $3 AND key = $4 FOR UPDATE
) k ON true
"""

# $1 destination, $2 key (NULL: keyless), $3 fingerprint, $4 attempt, $5 job,
# $6 generation, $7 owner, $8 now, $9 reservation deadline, $10 barrier deadline.
_FORWARD_SQL = """
WITH reserve AS (
    INSERT INTO idempotency (destination, key, state, fingerprint, attempt, attempts,
        job_id, generation, owner, created_at, updated_at, deadline, barrier_until)
    SELECT $1, $2, 'in_flight', $3, $4, 1, $5, $6, $7, $8, $8, $9, $10
    WHERE $2::text IS NOT NULL
    ON CONFLICT (destination, key) DO UPDATE SET state = 'in_flight',
        attempt = excluded.attempt, attempts = idempotency.attempts + 1,
        job_id = excluded.job_id, generation = excluded.generation, owner = excluded.owner,
        updated_at = excluded.updated_at, deadline = excluded.deadline,
        barrier_until = excluded.barrier_until, completed_at = NULL,
        status = NULL, headers = NULL, body = NULL, body_omitted = false
), attempt AS (
    INSERT INTO attempts (attempt, job_id, generation, destination, key, started_at, deadline)
    SELECT $4, $5, $6, $1, NULL, $8, $10 WHERE $2::text IS NULL
)
INSERT INTO fences (job_id, highest_generation, updated_at) VALUES ($5, $6, $8)
ON CONFLICT (job_id) DO UPDATE SET
    highest_generation = GREATEST(fences.highest_generation, excluded.highest_generation),
    updated_at = excluded.updated_at
"""


# Durability of a single statement run outside a transaction block. Such a
# statement is its own (implicit) transaction, committed by the server after the
# statement has finished (at the extended protocol's Sync). `synchronous_commit`
# is consulted only at that commit, and `set_config(..., is_local => true)` lasts
# until the end of the current transaction, here the implicit one: so evaluating
# this once, anywhere in the statement, makes its commit wait for the WAL flush
# exactly as `require_durable_commit` does for a BEGIN ... COMMIT block (raised to
# `on` only when the server or role has it `off`; stronger settings kept), and the
# setting ends with the statement (no session state). The sub-select must be read
# by the statement (`FROM (...) durable`): a plain SELECT CTE that nothing
# references is never evaluated.
_DURABLE = f"SELECT {DURABLE}"

# An outcome: one statement, hence one round trip and one atomic transaction,
# instead of BEGIN, durability setting, DELETE, UPDATE, COMMIT. No lock is needed
# beyond the row locks the statement takes: the key's UPDATE/DELETE waits for a
# decision holding the row FOR UPDATE and re-checks `attempt = $3` on the row
# version that decision committed (READ COMMITTED), as the separate statements
# did. $1 destination, $2 key (NULL: keyless), $3 attempt; returns the number of
# key rows touched (0 or 1).
_OUTCOME_SQL = """
WITH gone AS (DELETE FROM attempts WHERE attempt = $3 AND $2::text IS NULL),
touched AS ({}
    WHERE destination = $1 AND key = $2 AND attempt = $3 RETURNING 1)
SELECT (SELECT count(*) FROM touched) FROM ({}) durable
"""
_COMPLETED_SQL = _OUTCOME_SQL.format(
    "UPDATE idempotency SET state = 'completed', status = $4, headers = $5, body = $6, "
    f"body_omitted = $7, completed_at = {_NOW.format('$8')}, updated_at = {_NOW.format('$8')}, "
    "barrier_until = NULL",
    _DURABLE,
)
_RELEASED_SQL = _OUTCOME_SQL.format("DELETE FROM idempotency", _DURABLE)
_UNKNOWN_SQL = _OUTCOME_SQL.format(
    f"UPDATE idempotency SET state = 'unknown', updated_at = {_NOW.format('$4')}, "
    "barrier_until = NULL",
    _DURABLE,
)


class PostgresStore(postgres_admin.PostgresAdmin, PostgresLeaseStore):
    """Gateway store on PostgreSQL; also the lease store the lease API uses.

    Several gateway processes may share one database: every decision is taken
    under the database's locks and by the database server's clock.
    """

    def __init__(self, pool: Any, *, clock_offset: float = 0.0) -> None:
        super().__init__(pool, clock_offset=clock_offset)
        self._skew = 0.0  # server clock minus local clock, seconds
        self.clock = self._clock

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        clock_offset: float = 0.0,
        min_size: int = 1,
        max_size: int = 10,
        statement_cache_size: int = 100,
        connect_timeout: float = 10.0,
    ) -> PostgresStore:
        """Open a pool on `url`, create or check the lease and gateway schema."""
        store = cast(
            PostgresStore,
            await super().open(
                url,
                clock_offset=clock_offset,
                min_size=min_size,
                max_size=max_size,
                statement_cache_size=statement_cache_size,
                connect_timeout=connect_timeout,
            ),
        )
        try:
            with driver_errors("cannot create the PostgreSQL gateway schema"):
                async with store._pool.acquire() as conn:
                    await init_schema(conn)
                    before = time.time()
                    server = await db_now(conn, 0.0)
                    store._skew = server - (before + time.time()) / 2
        except BaseException:
            await store.close()
            raise
        return store

    def _clock(self) -> float:
        return time.time() + self._skew + self._offset()

    def _observed(self, now: float, offset: float) -> None:
        self._skew = now - offset - time.time()

    # --- writes ------------------------------------------------------------------------

    async def decide_write(self, facts: WriteFacts, context: WriteContext) -> Verdict:
        offset = self._offset()
        self._check_open()
        with driver_errors("PostgreSQL write decision failed"):
            async with self._pool.acquire() as conn, conn.transaction(isolation="read_committed"):
                await conn.execute(_LOCK_SQL, facts.job_id, facts.destination, facts.key)
                row = await conn.fetchrow(
                    _STATE_SQL,
                    facts.job_id,
                    facts.generation,
                    facts.destination,
                    facts.key,
                    offset,
                )
                now: float = row["now"]
                verdict = await _apply(conn, facts, context, _state(facts, row), now)
        self._observed(now, offset)
        return verdict

    async def record_outcome(self, facts: WriteFacts, attempt: str, outcome: Outcome) -> bool:
        offset = self._offset()
        if outcome.kind == "completed":
            sql = _COMPLETED_SQL
            args: tuple[Any, ...] = (
                outcome.status,
                json.dumps(outcome.headers),
                outcome.body,
                outcome.body_omitted,
                offset,
            )
        elif outcome.kind == "released":
            sql, args = _RELEASED_SQL, ()
        elif outcome.kind == "unknown":
            sql, args = _UNKNOWN_SQL, (offset,)
        else:  # pragma: no cover - programming error
            raise AssertionError(outcome.kind)
        # A keyless write has only its attempt to delete: `key = NULL` matches no row.
        held = await self._autocommit(
            lambda c: c.fetchval(sql, facts.destination, facts.key, attempt, *args)
        )
        return facts.key is None or held == 1

    async def record_rejection(self, record: RejectionRecord) -> int:
        offset = self._offset()
        values = rejection_values(record)
        rejection_id: int = await self._autocommit(
            lambda c: c.fetchval(
                f"INSERT INTO rejections (at, {_REJECTION_COLUMNS}) "
                f"SELECT {_NOW.format('$1')}, {_placeholders(2, len(values))} "
                f"FROM ({_DURABLE}) durable RETURNING id",
                offset,
                *values,
            )
        )
        return rejection_id

    async def purge(
        self, *, completed_before: float, rejections_before: float, batch: int
    ) -> tuple[int, int]:
        return await self._write_tx(
            lambda c: _purge_tx(c, completed_before, rejections_before, batch)
        )

    async def _autocommit(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        """`fn(conn)`: one statement that is its own (durable) transaction; see
        `_DURABLE`."""
        self._check_open()
        with driver_errors("PostgreSQL gateway write failed"):
            async with self._pool.acquire() as conn:
                return await fn(conn)

    async def _write_tx(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        """`fn(conn)` in one durable READ COMMITTED transaction (as the lease verbs)."""
        self._check_open()
        with driver_errors("PostgreSQL gateway write failed"):
            async with self._pool.acquire() as conn, conn.transaction(isolation="read_committed"):
                await require_durable_commit(conn)
                return await fn(conn)

    async def _snapshot(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        """Run `fn` in one read-only REPEATABLE READ transaction: a consistent view."""
        self._check_open()
        with driver_errors("PostgreSQL read failed"):
            async with (
                self._pool.acquire() as conn,
                conn.transaction(isolation="repeatable_read", readonly=True),
            ):
                return await fn(conn)

    async def ping(self) -> None:
        await self._read(lambda c: c.fetchval("SELECT 1"))

    async def _read(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        self._check_open()
        with driver_errors("PostgreSQL read failed"):
            async with self._pool.acquire() as conn:
                return await fn(conn)


# --- the write decision -------------------------------------------------------------------


def _state(facts: WriteFacts, row: Any) -> StoredState:
    lease = lease_row(row) if facts.fencing is Fencing.LEASE else None
    return StoredState(
        lease=lease,
        highest_generation=row["mark"],
        older_in_flight_until=row["older"],
        record=None if row["key"] is None else key_from_row(row),
    )


async def _apply(
    conn: Conn, facts: WriteFacts, context: WriteContext, state: StoredState, now: float
) -> Verdict:
    plan = plan_write(facts, context, state, now, new_attempt_id)
    r = plan.reservation
    if r is not None:
        # One statement: key, attempt and mark (GREATEST keeps a mark that is higher).
        await conn.execute(
            _FORWARD_SQL,
            r.destination,
            r.key,
            r.fingerprint,
            r.attempt,
            r.job_id,
            r.generation,
            r.owner,
            r.at,
            r.deadline,
            r.barrier_until,
        )
        return plan.verdict()
    assert plan.rejection is not None
    values = rejection_values(plan.rejection)
    rejection_id = await conn.fetchval(
        f"INSERT INTO rejections (at, {_REJECTION_COLUMNS}) "
        f"VALUES ($1, {_placeholders(2, len(values))}) RETURNING id",
        now,
        *values,
    )
    return plan.verdict(rejection_id)


async def _purge_tx(
    conn: Conn, completed_before: float, rejections_before: float, batch: int
) -> tuple[int, int]:
    # The batch is picked in a MATERIALIZED CTE: a LIMIT in an IN (...) subquery may
    # be evaluated more than once and delete more than `batch`. SKIP LOCKED: the
    # janitors of several replicas share the work instead of queueing on each other.
    keys = await conn.execute(
        "WITH doomed AS MATERIALIZED (SELECT destination, key FROM idempotency "
        "WHERE state = 'completed' AND completed_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED) "
        "DELETE FROM idempotency i USING doomed d "
        "WHERE i.destination = d.destination AND i.key = d.key AND i.state = 'completed'",
        completed_before,
        batch,
    )
    rejections = await conn.execute(
        "WITH doomed AS MATERIALIZED (SELECT id FROM rejections WHERE at < $1 "
        "ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED) "
        "DELETE FROM rejections r USING doomed d WHERE r.id = d.id",
        rejections_before,
        batch,
    )
    # An attempt whose gateway died never deletes its own row; past its deadline it
    # bars nothing (reads only look at deadline > now), so once it is as old as a
    # purgeable key it is garbage.
    await conn.execute(
        "WITH doomed AS MATERIALIZED (SELECT attempt FROM attempts WHERE deadline < $1 "
        "LIMIT $2 FOR UPDATE SKIP LOCKED) "
        "DELETE FROM attempts a USING doomed d WHERE a.attempt = d.attempt",
        completed_before,
        batch,
    )
    return _rowcount(keys), _rowcount(rejections)


def _placeholders(first: int, count: int) -> str:
    return ", ".join(f"${i}" for i in range(first, first + count))


def _rowcount(status: str) -> int:
    """Rows touched, from a command tag such as 'UPDATE 1' or 'DELETE 0'."""
    return int(status.rsplit(" ", 1)[-1])
