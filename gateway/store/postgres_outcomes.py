"""The outcomes of a batch of attempts on PostgreSQL, in one round trip.

The outcomes recorded while the previous batch is on its way go together in one
statement inside a server-side function (`OUTCOMES_FUNCTION`), called on its own:
the call is its transaction, durable (`DURABLE`) and planned through the indexes
(`PLAN_SETTINGS`), one round trip whatever the batch's size (it was four: BEGIN,
the setting, the statement, COMMIT).

No advisory lock is needed: the statement first locks the rows it will change,
`FOR UPDATE`, in (destination, key) order, the order in which a decision batch
locks its key rows (`postgres_batch`), so neither ever waits on the other in the
opposite order. A row is locked only while it is still held by the attempt
(`attempt = o.attempt`, re-checked on the latest committed version under READ
COMMITTED): an attempt whose key a decision has meanwhile given to another
attempt touches nothing, and is answered False.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.policy.decision import RESERVATION_GRACE_S, WriteFacts
from gateway.policy.records import Outcome
from leases.postgres import DURABLE, STORE_NOW, Conn

# The planner settings of the batch statements. They join arrays to the tables,
# and a plan kept per connection is costed on the statistics of the moment it was
# made: made while the tables were small (a new database, or one that grew faster
# than autovacuum analyses it), it joined by hashing the whole key table, and went
# on doing so at 50,000 rows: 10 ms a statement, a tenth of the writes per second.
# Custom plans (planned again for every call) fixed that, but planning was then
# half of the database's CPU per batch. So the statements keep one plan per
# connection (`force_generic_plan`), and the scans and joins that read a whole
# table are ruled out (`enable_seqscan`, `enable_hashjoin`, `enable_mergejoin`
# off): every table is reached through an index by the arrays' values, whatever the
# statistics say. `jit` off: the penalty those settings add to a plan's cost would
# otherwise have a statement without an index path (the triggers' read of
# `sinkgate_holding`, a table of a few rows) compiled on every execution.
# `(name, value)`, declared on both batch functions (`SET_CLAUSES`: in force while
# a call runs, so when its statements are planned, and restored after it).
PLAN_SETTINGS = (
    ("plan_cache_mode", "force_generic_plan"),
    ("enable_seqscan", "off"),
    ("enable_hashjoin", "off"),
    ("enable_mergejoin", "off"),
    ("jit", "off"),
)
SET_CLAUSES = " ".join(f"SET {name} = {value}" for name, value in PLAN_SETTINGS)


class ReservationDeadlines:
    """Until when, by this process's monotonic clock, each attempt decided here
    holds its reservation: how long its outcome is worth sending again.

    Taken when the verdict comes back, so a little after the store's own deadline
    (the commit's latency): an outcome that arrives late changes nothing, as its
    statement touches the key only while the attempt still holds it. An attempt
    whose outcome is never recorded (its caller went away before forwarding) is
    dropped once its deadline has passed.
    """

    PRUNE_AT = 4096

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        self._prune_at = self.PRUNE_AT

    def add(self, attempt: str, seconds: float) -> None:
        now = time.monotonic()
        if len(self._until) >= self._prune_at:
            self._until = {a: t for a, t in self._until.items() if t > now}
            # Twice what is left: many attempts in flight never make every add scan.
            self._prune_at = max(self.PRUNE_AT, 2 * len(self._until))
        self._until[attempt] = now + seconds

    def pop(self, attempt: str) -> float:
        """The attempt's deadline (for one not decided here: the grace alone)."""
        default = time.monotonic() + RESERVATION_GRACE_S
        return self._until.pop(attempt, default)


@dataclass(frozen=True, slots=True)
class Recorded:
    """One attempt's outcome, to record in the next batch."""

    facts: WriteFacts
    attempt: str
    outcome: Outcome


# The statement recording a batch of outcomes, inside `OUTCOMES_FUNCTION`.
# $1-$8 the keyed outcomes' columns, $9 the keyless attempts, $10 clock offset.
# Yields the attempts whose key row was touched.
_OUTCOMES_SQL = f"""
WITH n AS MATERIALIZED (SELECT {STORE_NOW.format("$10")} AS now),
held AS MATERIALIZED (
    SELECT i.destination, i.key, i.attempt, o.kind, o.status, o.headers, o.body, o.omitted
    FROM idempotency i JOIN unnest($1::text[], $2::text[], $3::text[], $4::text[],
        $5::int4[], $6::text[], $7::bytea[], $8::bool[])
        AS o(destination, key, attempt, kind, status, headers, body, omitted)
        ON i.destination = o.destination AND i.key = o.key AND i.attempt = o.attempt
    ORDER BY i.destination, i.key
    FOR UPDATE OF i
), completed AS (
    UPDATE idempotency i SET state = 'completed', status = h.status, headers = h.headers,
        body = h.body, body_omitted = h.omitted, completed_at = n.now, updated_at = n.now,
        barrier_until = NULL
    FROM held h, n
    WHERE h.kind = 'completed' AND i.destination = h.destination AND i.key = h.key
        AND i.attempt = h.attempt
    RETURNING i.attempt
), released AS (
    DELETE FROM idempotency i USING held h
    WHERE h.kind = 'released' AND i.destination = h.destination AND i.key = h.key
        AND i.attempt = h.attempt
    RETURNING i.attempt
), unknown AS (
    UPDATE idempotency i SET state = 'unknown', updated_at = n.now, barrier_until = NULL
    FROM held h, n
    WHERE h.kind = 'unknown' AND i.destination = h.destination AND i.key = h.key
        AND i.attempt = h.attempt
    RETURNING i.attempt
), gone AS (
    DELETE FROM attempts WHERE attempt = ANY($9::text[])
)
SELECT ARRAY(SELECT attempt FROM completed UNION ALL SELECT attempt FROM released
    UNION ALL SELECT attempt FROM unknown) INTO touched
"""

# One round trip per batch of outcomes: the statement in a server-side function,
# called outside any explicit transaction (the call is its own transaction, and
# COMMIT is part of it). The function's `SET` clauses plan its statement (and the
# triggers' read) through the indexes (see `PLAN_SETTINGS`), and `DURABLE` raised inside it lasts
# to that COMMIT (a SET clause restores only the variable it names). Created and
# replaced by the schema migration (`postgres_schema`); the version in its name is
# the call's, so replicas of two releases each call their own.
OUTCOMES_FUNCTION = "sinkgate_record_outcomes_v1"
OUTCOMES_FUNCTION_DDL = f"""
CREATE OR REPLACE FUNCTION {OUTCOMES_FUNCTION}(text[], text[], text[], text[], int4[],
    text[], bytea[], bool[], text[], float8)
RETURNS text[] LANGUAGE plpgsql VOLATILE {SET_CLAUSES} AS $fn$
DECLARE
    touched text[];
BEGIN
    PERFORM {DURABLE};
    {_OUTCOMES_SQL.strip()};
    RETURN touched;
END
$fn$;
"""
_CALL_SQL = f"SELECT {OUTCOMES_FUNCTION}({', '.join(f'${n}' for n in range(1, 11))})"

_KINDS = ("completed", "released", "unknown")


async def record_outcomes(conn: Conn, batch: Sequence[Recorded], offset: float) -> list[bool]:
    """Record every outcome of `batch` in one statement; per outcome, whether its
    attempt still held its key (always True for a keyless write)."""
    keyed = [r for r in batch if r.facts.key is not None]
    for r in keyed:
        if r.outcome.kind not in _KINDS:  # pragma: no cover - programming error
            raise AssertionError(r.outcome.kind)
    touched = set(
        await conn.fetchval(
            _CALL_SQL,
            [r.facts.destination for r in keyed],
            [r.facts.key for r in keyed],
            [r.attempt for r in keyed],
            [r.outcome.kind for r in keyed],
            [r.outcome.status for r in keyed],
            [_headers(r.outcome) for r in keyed],
            [r.outcome.body if r.outcome.kind == "completed" else None for r in keyed],
            [r.outcome.body_omitted for r in keyed],
            [r.attempt for r in batch if r.facts.key is None],
            offset,
        )
    )
    return [r.facts.key is None or r.attempt in touched for r in batch]


def _headers(outcome: Outcome) -> str | None:
    return json.dumps(outcome.headers) if outcome.kind == "completed" else None
