"""One batch of write decisions on PostgreSQL: BEGIN, two calls, COMMIT.

`decide_batch(conn, operations)` runs inside a READ COMMITTED transaction:

1. one call of a server-side function (`STATE_FUNCTION`, created by the schema
   migration) doing what were two statements:
   - `synchronous_commit` on for this transaction, plans through the indexes
     for the statements after it (`postgres_outcomes.INDEX_PLANS`), then
     `pg_advisory_xact_lock` on every job and every (destination, key) of the
     batch, in the order of the locks' keys. The job lock serialises the
     decisions of one job across replicas, which the generation barrier needs
     (two generations must not both see "no older attempt"); the key lock
     serialises first reservations of one key, which no row lock can do (the row
     does not exist yet). Every batch takes its locks in one and the same global
     order, so two batches (of two replicas) never wait on each other in
     opposite orders.
   - then, in a statement of its own and so with a snapshot taken after the
     locks (`_STATE_SQL`), everything the batch's decisions need: the store's
     clock, the leases and marks of the batch's jobs, the barriers of their
     older attempts, and the batch's key rows `FOR UPDATE`, locked in
     (destination, key) order as the outcome statement locks them
     (`postgres_outcomes`).
2. the decisions, in Python, in arrival order, each seeing the ones before it
   (`batch_plan`).
3. one statement applying them all (`_APPLY_SQL`): key reservations, attempts,
   marks, and the batch's rejection-log rows. The rows are inserted after the
   transaction-scoped lock `REJECTION_ORDER_LOCK`, held until COMMIT by every
   transaction that inserts rejections: ids are handed out in commit order, so
   every set of rows a reader can see is a prefix of the ids and the admin
   cursor (`id < before`) never skips a row that commits late.

The lease row is read, not locked: every read of the batch comes from one
snapshot and the clock is read in the same statement, so each decision is the
one SQLite would have taken at that instant; later writes of the job see this
batch's attempts through the job lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.policy import batch_plan
from gateway.policy.batch_plan import BatchState
from gateway.policy.decision import WriteFacts
from gateway.policy.plan import Reservation, WritePlan
from gateway.policy.records import RejectionRecord, Verdict, WriteContext
from gateway.store.postgres_outcomes import INDEX_PLANS
from gateway.store.records import (
    KEY_COLUMNS,
    KEY_COLUMNS_SQL,
    REJECTION_FIELDS,
    key_record,
    new_attempt_id,
    rejection_values,
)
from leases.model import LeaseRow, State
from leases.postgres import DURABLE, STORE_NOW, Conn


@dataclass(frozen=True, slots=True)
class Decide:
    """A write decision to take in the batch."""

    facts: WriteFacts
    context: WriteContext


@dataclass(frozen=True, slots=True)
class Log:
    """A rejection decided outside the store (SPEC 2 steps 3 and 5), logged in the batch."""

    record: RejectionRecord


Operation = Decide | Log

# The advisory locks the batch takes (see `batch_plan.lock_names`); tests take
# one kind away to show the race it closes.
LOCK_KINDS: tuple[str, ...] = ("job", "key")

# Held by every transaction inserting rejection-log rows, from just before the
# insert to COMMIT (see the module doc). The two-key form: a lock space of its
# own, apart from the one-key locks on jobs, keys and the schema.
REJECTION_ORDER_LOCK = (0x73696E6B, 1)  # "sink", 1

# Whether the batch takes its locks in the order of their keys (DISTINCT + ORDER
# BY the lock key: one global order). Tests switch it off (arrival order) to show
# the deadlock it prevents.
LOCKS_ORDERED = True

# The state read, inside `STATE_FUNCTION` after the locks: $1 clock offset, $2 the
# batch's jobs, $3/$4 destinations/keys of its keyed writes, $5 per job the highest
# generation it writes (only older attempts bar it).
# Barriers: aggregated per (job, generation), job by job on the indexes by (job,
# generation) (a scan of every in-flight row would also walk the dead versions of
# completed ones), except the rows of the batch's own
# keys, which come whole with their `barrier_until` (a reservation replaces them).
_STATE_SQL = f"""
WITH n AS MATERIALIZED (SELECT {STORE_NOW.format("$1")} AS now),
k AS MATERIALIZED (
    SELECT {KEY_COLUMNS_SQL}, barrier_until FROM idempotency
    WHERE (destination, key) IN (SELECT * FROM unnest($3::text[], $4::text[]))
    ORDER BY destination, key FOR UPDATE
)
SELECT n.now,
    ARRAY(SELECT row(job_id, owner, generation, state, lease_until, ttl) FROM leases
        WHERE job_id = ANY($2::text[])),
    ARRAY(SELECT row(job_id, highest_generation) FROM fences
        WHERE job_id = ANY($2::text[])),
    ARRAY(SELECT row(j.job_id, b.generation, b.until) FROM unnest($2::text[], $5::int8[])
            AS j(job_id, below)
        CROSS JOIN LATERAL (SELECT generation, max(barrier_until) AS until FROM idempotency i
            WHERE i.job_id = j.job_id AND state = 'in_flight' AND generation < j.below
            AND barrier_until > n.now
            AND NOT EXISTS (SELECT 1 FROM k WHERE k.destination = i.destination
                AND k.key = i.key)
            GROUP BY generation) AS b),
    ARRAY(SELECT row(j.job_id, b.generation, b.until) FROM unnest($2::text[], $5::int8[])
            AS j(job_id, below)
        CROSS JOIN LATERAL (SELECT generation, max(deadline) AS until FROM attempts a
            WHERE a.job_id = j.job_id AND generation < j.below AND deadline > n.now
            GROUP BY generation) AS b),
    ARRAY(SELECT row(k.*) FROM k)
FROM n
"""

# BEGIN, then one round trip for what the batch took two statements for: this
# function takes the advisory locks of $6 (the lock names; in the order of their
# keys unless $7 is false), then reads the state with a snapshot taken after them
# (each statement of a function under READ COMMITTED sees what committed before it
# began), and sets the transaction durable and its plans through the indexes
# (`DURABLE`, `INDEX_PLANS`: set_config with is_local, so they last to COMMIT and
# the apply statement is planned so too). It returns anonymous records (`SETOF
# record`, typed by the call), which the driver decodes without looking up a type.
# Created and replaced by the schema migration; the version in the name is the call's.
STATE_FUNCTION = "sinkgate_decision_state_v1"
STATE_FUNCTION_DDL = f"""
CREATE OR REPLACE FUNCTION {STATE_FUNCTION}(float8, text[], text[], text[], int8[],
    text[], boolean)
RETURNS SETOF record LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    PERFORM {DURABLE}, {INDEX_PLANS};
    IF $7 THEN
        PERFORM count(pg_advisory_xact_lock(h)) FROM (SELECT DISTINCT
            hashtextextended(name, 0) AS h FROM unnest($6) AS name ORDER BY h) AS ordered;
    ELSE
        PERFORM count(pg_advisory_xact_lock(hashtextextended(name, 0)))
            FROM unnest($6) AS name;
    END IF;
    RETURN QUERY {_STATE_SQL.strip()};
END
$fn$;
"""
_STATE_CALL = (
    f"SELECT * FROM {STATE_FUNCTION}($1, $2, $3, $4, $5, $6, $7) AS s(now float8, "
    "leases record[], marks record[], keyed record[], keyless record[], records record[])"
)

# fmt: off
_REJECTION_TYPES = (  # the types of REJECTION_FIELDS, in order
    "text", "text", "text", "text", "text", "text", "int8", "text", "text", "int8", "int8",
    "text", "text", "int8",
)
# fmt: on
assert len(_REJECTION_TYPES) == len(REJECTION_FIELDS)
_REJECTION_ARGS = ", ".join(f"${22 + n}::{t}[]" for n, t in enumerate(_REJECTION_TYPES))

# $1-$12 key reservations, $13-$18 keyless attempts, $19-$20 raised marks, $21 now,
# $22.. the rejection rows' columns. Every array may be empty.
_APPLY_SQL = f"""
WITH reserve AS (
    INSERT INTO idempotency (destination, key, state, fingerprint, attempt, attempts,
        job_id, generation, owner, created_at, updated_at, deadline, barrier_until)
    SELECT d, k, 'in_flight', f, a, n, j, g, o, c, u, dl, b FROM unnest($1::text[],
        $2::text[], $3::text[], $4::text[], $5::int4[], $6::text[], $7::int8[], $8::text[],
        $9::float8[], $10::float8[], $11::float8[], $12::float8[])
        AS r(d, k, f, a, n, j, g, o, c, u, dl, b)
    ON CONFLICT (destination, key) DO UPDATE SET state = 'in_flight',
        attempt = excluded.attempt, attempts = excluded.attempts,
        job_id = excluded.job_id, generation = excluded.generation, owner = excluded.owner,
        updated_at = excluded.updated_at, deadline = excluded.deadline,
        barrier_until = excluded.barrier_until, completed_at = NULL,
        status = NULL, headers = NULL, body = NULL, body_omitted = false
), attempt AS (
    INSERT INTO attempts (attempt, job_id, generation, destination, key, started_at, deadline)
    SELECT a, j, g, d, NULL, s, dl FROM unnest($13::text[], $14::text[], $15::int8[],
        $16::text[], $17::float8[], $18::float8[]) AS r(a, j, g, d, s, dl)
), mark AS (
    INSERT INTO fences (job_id, highest_generation, updated_at)
    SELECT j, g, $21::float8 FROM unnest($19::text[], $20::int8[]) AS r(j, g)
    ON CONFLICT (job_id) DO UPDATE SET
        highest_generation = GREATEST(fences.highest_generation, excluded.highest_generation),
        updated_at = excluded.updated_at
), ordered AS MATERIALIZED (
    SELECT pg_advisory_xact_lock({REJECTION_ORDER_LOCK[0]}, {REJECTION_ORDER_LOCK[1]}) AS held
    WHERE cardinality($22::text[]) > 0
), logged AS (
    INSERT INTO rejections (at, {", ".join(REJECTION_FIELDS)})
    SELECT $21::float8, {", ".join(f"r.{f}" for f in REJECTION_FIELDS)}
    FROM ordered, unnest({_REJECTION_ARGS}) WITH ORDINALITY
        AS r({", ".join(REJECTION_FIELDS)}, n)
    ORDER BY r.n
    RETURNING id
)
SELECT ARRAY(SELECT id FROM logged ORDER BY id)
"""


async def decide_batch(
    conn: Conn, operations: Sequence[Operation], offset: float
) -> tuple[list[Verdict | int], float]:
    """Decide and apply the batch inside the caller's transaction: each operation's
    answer (a Verdict, or a `Log`'s rejection id) and the store's clock."""
    writes = [(op.facts, op.context) for op in operations if isinstance(op, Decide)]
    facts = [f for f, _ in writes]
    names = batch_plan.lock_names(facts, LOCK_KINDS)
    row = await conn.fetchrow(_STATE_CALL, offset, *_read_args(facts), names, LOCKS_ORDERED)
    state = _batch_state(row)
    plans = iter(batch_plan.plan_batch(writes, state, new_attempt_id))
    planned = [next(plans) if isinstance(op, Decide) else op for op in operations]
    rejections = [
        r
        for r in (p.rejection if isinstance(p, WritePlan) else p.record for p in planned)
        if r is not None
    ]
    forwarded = [
        p.reservation for p in planned if isinstance(p, WritePlan) and p.reservation is not None
    ]
    args = _apply_args(forwarded, state, rejections)
    ids = iter(await conn.fetchval(_APPLY_SQL, *args))
    return [_answer(p, ids) for p in planned], state.now


def _answer(planned: WritePlan | Log, ids: Any) -> Verdict | int:
    if isinstance(planned, Log):
        return int(next(ids))
    if planned.rejection is None:
        return planned.verdict()
    return planned.verdict(int(next(ids)))


def _read_args(facts: Sequence[WriteFacts]) -> tuple[list[Any], ...]:
    below: dict[str, int] = {}
    for f in facts:
        below[f.job_id] = max(f.generation, below.get(f.job_id, f.generation))
    keyed = sorted({(f.destination, f.key) for f in facts if f.key is not None})
    return list(below), [d for d, _ in keyed], [k for _, k in keyed], list(below.values())


def _batch_state(row: Any) -> BatchState:
    width = len(KEY_COLUMNS)
    return batch_plan.batch_state(
        row["now"],
        leases=(
            LeaseRow(job, owner, generation, State(lease_state), until, ttl)
            for job, owner, generation, lease_state, until, ttl in row["leases"]
        ),
        marks=((job, mark) for job, mark in row["marks"]),
        barriers=(*row["keyed"], *row["keyless"]),
        keys=((key_record(values[:width]), values[width]) for values in row["records"]),
    )


def _apply_args(
    forwarded: Sequence[Reservation],
    state: BatchState,
    rejections: Sequence[RejectionRecord],
) -> list[Any]:
    """The arguments of `_APPLY_SQL`, in order."""
    reservations = batch_plan.final_reservations(forwarded)
    keyed = [r for r in reservations if r.key is not None]
    records = [state.records[(r.destination, r.key)] for r in keyed]  # type: ignore[index]
    keyless = [r for r in reservations if r.key is None]
    marks = batch_plan.raised_marks(forwarded, state)
    rows = [rejection_values(record) for record in rejections]
    return [
        *_columns(keyed, ("destination", "key", "fingerprint", "attempt")),
        [k.attempts for k in records],
        *_columns(keyed, ("job_id", "generation", "owner")),
        [k.created_at for k in records],
        *_columns(keyed, ("at", "deadline", "barrier_until")),
        *_columns(keyless, ("attempt", "job_id", "generation", "destination", "at")),
        [r.barrier_until for r in keyless],
        list(marks),
        list(marks.values()),
        state.now,
        *([row[n] for row in rows] for n in range(len(REJECTION_FIELDS))),
    ]


def _columns(reservations: Sequence[Reservation], names: Sequence[str]) -> list[list[Any]]:
    return [[getattr(r, name) for r in reservations] for name in names]
