"""One batch of write decisions on PostgreSQL: one call, one round trip.

`decide_batch(conn, operations, offset)` calls a server-side function
(`DECIDE_FUNCTION`, created and replaced by the schema migration) outside any
explicit transaction: the call is its transaction, and its COMMIT (durable,
`DURABLE`) is part of the same round trip. Inside it:

1. `pg_advisory_xact_lock` on every job and every (destination, key) of the
   batch, in the order of the locks' keys. The job lock serialises the
   decisions of one job across replicas, which the generation barrier needs (two
   generations must not both see "no older attempt"); the key lock serialises
   first reservations of one key, which no row lock can do (the row does not
   exist yet). Every batch takes its locks in one and the same global order, so
   two batches (of two replicas) never wait on each other in opposite orders.
   Then the batch's key rows `FOR UPDATE`, in (destination, key) order, the order
   in which the outcome statement locks them (`postgres_outcomes`).
2. each operation in arrival order. A decision reads its job's lease and mark,
   the latest barrier of an older attempt of the job still on the wire, and its
   key's row, with the store's clock, in a statement of its own (so with a
   snapshot taken after the locks and after the decisions before it); decides
   (`_POLICY`, the policy of `gateway.policy.decision` written in PL/pgSQL); and
   applies what it decided at once: a forward reserves its key (or records its
   keyless attempt) and raises the job's mark, a refusal or replay inserts its
   rejection-log row. So each decision sees the ones before it, as if it had been
   decided and committed alone just before the next one (`batch_plan` states
   the same order for the Python policy). A rejection decided outside the store
   (a `Log`) is inserted in its turn.

   A run of decisions of one job generation and key (the woken duplicates of a
   key come so, hundreds at once) reads its key's row and its job's mark once:
   while no decision of the run has written anything but rejection-log rows,
   which no decision reads, nothing can change them before COMMIT (the batch
   holds the key's row, and the job's lock that every change of its mark
   takes). What others can change meanwhile without those locks is read again
   for each decision: the clock, the lease (the lease API locks only its row)
   and the older attempts' barriers (an outcome of another key of the job, an
   operator's resolve or the janitor lowers them; only a reservation, under the
   job's lock, raises them). A run ends at any forward, and at any decision of
   another key or job. The key's row goes back once per run for its replays,
   not once per replay (a stored answer can be `max_replay_body` long).

   A batch of `APART_FROM` operations or more whose decisions are apart (no key
   twice, each job in one generation and fencing mode: none reads what another
   writes, but for the job's mark a forward raises) reads every decision's rows
   by one cursor instead, then decides them in the same order, and writes the
   reservations, marks and rejection-log rows together after the last (`_APART`).

   The rejection-log rows are inserted after the transaction-scoped lock
   `REJECTION_ORDER_LOCK`, held until COMMIT by every transaction that inserts
   rejections: ids are handed out in commit order, so every set of rows a reader
   can see is a prefix of the ids and the admin cursor (`id < before`) never
   skips a row that commits late.

The policy is stated twice, in Python (`gateway.policy`, which the SQLite store
runs) and here; `tests/conformance/test_postgres_policy.py` feeds the same random
states and batches to both and compares every verdict and every row written.
The texts of the refusals come from `gateway.policy.decision.DETAILS`.

Attempt ids are drawn in Python, one per decision, before the call (`Decide`),
so running a call again is safe: a call whose answer was lost may have
committed, and a write it reserved is found under its own attempt id (the key's
row, or the keyless attempt's) and answered as forwarded again, before any
policy, with nothing written twice. (A refusal or replay is decided again, and
its rejection-log row is then written twice.) The store runs a call again when
it got no answer (`postgres.PostgresStore._decide_once`).

The function decides only under READ COMMITTED (each statement's snapshot taken
after the locks it waited for); called under another isolation level it raises
`NOT_READ_COMMITTED` before doing anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.policy import batch_plan
from gateway.policy.decision import (
    BELOW_ACCEPTED,
    BELOW_FORWARDED,
    DETAILS,
    RESERVATION_GRACE_S,
    Decision,
    Fencing,
    Forward,
    KeyRecord,
    Reject,
    Replay,
    WriteFacts,
)
from gateway.policy.records import REPLAYED, RejectionRecord, Verdict, WriteContext
from gateway.store.postgres_outcomes import SET_CLAUSES
from gateway.store.records import KEY_COLUMNS, key_record, new_attempt_id
from leases.model import State
from leases.postgres import DURABLE, STORE_NOW, Conn
from leases.reasons import Reason


@dataclass(frozen=True, slots=True)
class Decide:
    """A write decision to take in the batch, and the id its attempt gets if forwarded."""

    facts: WriteFacts
    context: WriteContext
    attempt: str = field(default_factory=new_attempt_id)


@dataclass(frozen=True, slots=True)
class Log:
    """A rejection decided outside the store (SPEC 2 steps 3 and 5), logged in the batch."""

    record: RejectionRecord


Operation = Decide | Log

# The advisory locks the batch takes (see `batch_plan.lock_names`); tests take
# one kind away to show the race it closes.
LOCK_KINDS: tuple[str, ...] = ("job", "key")

# Held by every transaction inserting rejection-log rows, from just before the
# first insert to COMMIT (see the module doc). The two-key form: a lock space of
# its own, apart from the one-key locks on jobs, keys and the schema.
REJECTION_ORDER_LOCK = (0x73696E6B, 1)  # "sink", 1
ORDERED_INSERTS = (
    f"PERFORM pg_advisory_xact_lock({REJECTION_ORDER_LOCK[0]}, {REJECTION_ORDER_LOCK[1]})"
)

# The SQLSTATE the function raises when called under another isolation level than
# READ COMMITTED (a database or role whose default is REPEATABLE READ or
# SERIALIZABLE): the store then calls it inside an explicit READ COMMITTED
# transaction (`PostgresStore._decision_connection`).
NOT_READ_COMMITTED = "SG001"

# Whether the batch takes its locks in the order of their keys (DISTINCT + ORDER
# BY the lock key: one global order). Tests switch it off (arrival order) to show
# the deadlock it prevents.
LOCKS_ORDERED = True


def _text(value: str) -> str:
    """`value` as an SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


def _template(text: str) -> str:
    """A detail template of `gateway.policy.decision` (`{generation}`, `{mark}`) as
    the SQL that formats it, with the write's generation and the job's mark."""
    pattern = text.replace("%", "%%").replace("{generation}", "%1$s").replace("{mark}", "%2$s")
    return f"format({_text(pattern)}, g, v_mark)"


_GRACE = f"{RESERVATION_GRACE_S!r}::float8"
# The fence's refusals (`hold_refusal`'s), each with its detail, as CASE branches.
_FENCE_REFUSALS = (
    Reason.LEASE_NOT_HELD, Reason.STALE_GENERATION, Reason.UNKNOWN_GENERATION,
    Reason.JOB_COMPLETED, Reason.LEASE_EXPIRED, Reason.OWNER_MISMATCH,
)  # fmt: skip
_FENCE_DETAILS = " ".join(f"WHEN {_text(r)} THEN {_text(DETAILS[r])}" for r in _FENCE_REFUSALS)

# Steps 6 (fence, barrier) then 7 (idempotency) of one write, as `decide` and
# `check_fence`/`check_key`/`hold_refusal` take them, in the same order. In: g (the
# write's generation), v_now, the lease's columns (v_leased: found; read only in
# lease mode), v_mark, v_older, the key row's columns (v_keyed: found). Out:
# v_verdict ('f' forward, 'u' forward of an unknown outcome, 'p' replay, 'r'
# refusal) and the refusal's fields.
_POLICY = f"""
v_verdict := NULL; v_reason := NULL; v_detail := NULL; v_current := NULL; v_retry := NULL;
v_highest := v_mark;
IF p_monotonic[i] THEN
    IF v_mark IS NOT NULL AND g < v_mark THEN
        v_verdict := 'r'; v_reason := {_text(Reason.STALE_GENERATION)};
        v_detail := {_template(BELOW_ACCEPTED)};
    END IF;
ELSE
    IF v_leased THEN
        v_current := v_generation;
    END IF;
    v_reason := CASE
        WHEN NOT v_leased THEN {_text(Reason.LEASE_NOT_HELD)}
        WHEN g < v_generation THEN {_text(Reason.STALE_GENERATION)}
        WHEN g > v_generation THEN {_text(Reason.UNKNOWN_GENERATION)}
        WHEN v_state = {_text(State.DONE)} THEN {_text(Reason.JOB_COMPLETED)}
        WHEN v_state = {_text(State.FREE)} THEN {_text(Reason.LEASE_NOT_HELD)}
        WHEN v_until <= v_now THEN {_text(Reason.LEASE_EXPIRED)}
        WHEN p_owner[i] IS NOT NULL AND p_owner[i] <> v_owner
            THEN {_text(Reason.OWNER_MISMATCH)}
    END;
    IF v_reason IS NOT NULL THEN
        v_verdict := 'r';
        v_detail := CASE v_reason
            {_FENCE_DETAILS}
        END;
    ELSIF v_mark IS NOT NULL AND g < v_mark THEN
        v_verdict := 'r'; v_reason := {_text(Reason.STALE_GENERATION)};
        v_detail := {_template(BELOW_FORWARDED)};
    END IF;
END IF;
IF v_verdict IS NULL AND v_older IS NOT NULL AND v_older > v_now THEN
    v_verdict := 'r'; v_reason := {_text(Reason.OLDER_GENERATION_IN_FLIGHT)};
    v_detail := {_text(DETAILS[Reason.OLDER_GENERATION_IN_FLIGHT])};
    v_current := CASE WHEN v_leased THEN v_generation END;
    v_retry := greatest(1, ceil(v_older - v_now))::int4;
END IF;
IF v_verdict IS NULL THEN
    v_current := NULL; v_highest := NULL;
    IF p_key[i] IS NULL OR NOT v_keyed THEN
        v_verdict := 'f';
    ELSIF v_fingerprint <> p_fingerprint[i] THEN
        v_verdict := 'r'; v_reason := {_text(Reason.IDEMPOTENCY_KEY_REUSED)};
        v_detail := {_text(DETAILS[Reason.IDEMPOTENCY_KEY_REUSED])};
    ELSIF v_key_state = 'completed' THEN
        v_verdict := 'p';
    ELSIF v_key_state = 'in_flight' AND v_deadline > v_now THEN
        v_verdict := 'r'; v_reason := {_text(Reason.REQUEST_IN_PROGRESS)};
        v_detail := {_text(DETAILS[Reason.REQUEST_IN_PROGRESS])};
        v_retry := greatest(1, ceil(v_deadline - v_now))::int4;
    ELSIF p_idempotent[i] THEN
        v_verdict := 'u';
    ELSE
        v_verdict := 'r'; v_reason := {_text(Reason.OUTCOME_UNKNOWN)};
        v_detail := {_text(DETAILS[Reason.OUTCOME_UNKNOWN])};
    END IF;
END IF;
"""

# The rows a decision reads that this batch's locks do not keep: the clock, the
# latest barrier of an older attempt of the job still on the wire, and the lease.
_NOW = f"coalesce(p_now, {STORE_NOW.format('p_offset')})"


def _older(job: str, generation: str) -> str:
    """The latest barrier of an older attempt of `job` still on the wire."""
    return f"""greatest(
    (SELECT max(barrier_until) FROM idempotency WHERE job_id = {job}
        AND state = 'in_flight' AND generation < {generation}),
    (SELECT max(deadline) FROM attempts WHERE job_id = {job} AND generation < {generation}))"""


_OLDER = _older("p_job[i]", "g")
_LEASE_COLUMNS = "l.job_id IS NOT NULL, l.owner, l.generation, l.state, l.lease_until"
_LEASE_JOIN = "LEFT JOIN leases l ON NOT p_monotonic[i] AND l.job_id = p_job[i]"
# Read again for each decision of a run (the key's row and the mark taken as read).
READ_AGAIN = (
    f"SELECT {_NOW}, {_OLDER}, {_LEASE_COLUMNS} FROM (SELECT) AS one {_LEASE_JOIN} "
    "INTO v_now, v_older, v_leased, v_owner, v_generation, v_state, v_until"
)
# A reservation's columns of the key's row, and what it sets again on a key's row
# that is there (settled unknown, or in flight past its deadline).
_KEY_RESERVED = (
    "destination, key, state, fingerprint, attempt, attempts, job_id, generation, owner, "
    "created_at, updated_at, deadline, barrier_until"
)
_KEY_RESERVED_AGAIN = """ON CONFLICT (destination, key) DO UPDATE SET state = 'in_flight',
    attempt = excluded.attempt, attempts = idempotency.attempts + 1,
    job_id = excluded.job_id, generation = excluded.generation, owner = excluded.owner,
    updated_at = excluded.updated_at, deadline = excluded.deadline,
    barrier_until = excluded.barrier_until, completed_at = NULL,
    status = NULL, headers = NULL, body = NULL, body_omitted = false"""
# A rejection-log row's columns, as the batch writes them.
_LOGGED = (
    "at, reason, detail, destination, method, path, job_id, generation, owner, "
    "idempotency_key, current_generation, highest_generation, remote, body_sha256, body_bytes"
)
# What a forwarded write stores before it goes out (`plan.Reservation`): its key in
# flight until the deadline (or its keyless attempt), barring newer generations of
# its job until its timeout, and the job's mark raised to its generation.
_RESERVE = f"""
IF p_key[i] IS NULL THEN
    INSERT INTO attempts (attempt, job_id, generation, destination, key, started_at, deadline)
    VALUES (p_attempt[i], p_job[i], g, p_destination[i], NULL, v_now, v_now + p_timeout[i]);
ELSE
    INSERT INTO idempotency ({_KEY_RESERVED})
    VALUES (p_destination[i], p_key[i], 'in_flight', p_fingerprint[i], p_attempt[i], 1,
        p_job[i], g, p_owner[i], v_now, v_now, v_now + p_timeout[i] + {_GRACE},
        v_now + p_timeout[i])
    {_KEY_RESERVED_AGAIN};
END IF;
IF v_mark IS NULL OR g > v_mark THEN
    INSERT INTO fences (job_id, highest_generation, updated_at) VALUES (p_job[i], g, v_now)
    ON CONFLICT (job_id) DO UPDATE SET
        highest_generation = GREATEST(fences.highest_generation, excluded.highest_generation),
        updated_at = excluded.updated_at;
END IF;
"""

# Whether the batch's decisions are apart: no key twice, and each job in one
# generation and fencing mode. Then no decision reads a row another one writes,
# but for its job's mark, which a forward of the same job generation raises to
# that generation (`j_forwarded`, the jobs forwarded so far). (A forward that
# reserves a key again, in flight for another job, ends that row's barrier for
# the other job's newer generations; the barrier had already ended: a key is
# reserved again once its deadline has passed, and every reservation's barrier
# ends `RESERVATION_GRACE_S` before its deadline.) So the rows of every
# decision are read by one statement, a cursor opened before the loop and read a
# row per decision in arrival order (one snapshot, taken after the locks), and
# the reservations and rejection-log rows are written together after the loop
# (`_RESERVE_ALL`, `_LOG_ALL`): a few statements a batch instead of two or three a
# decision, each of which the server starts up on its own, and no wait between a
# decision's read and the next one's. Smaller batches decide as before: for 2
# writes the statements that test and read cost more than they save (`APART_FROM`;
# bench/README, "PostgreSQL: a batch's rows read at once"). The verdicts and rows
# are the same either way (`tests/conformance/test_postgres_policy.py`).
APART_FROM = 4
_APART = f"""
IF coalesce(cardinality(p_kind), 0) >= {APART_FROM} THEN
    SELECT count(DISTINCT (d, k)) FILTER (WHERE k IS NOT NULL) = count(k)
            AND count(DISTINCT (j, gen, m)) = count(DISTINCT j)
        INTO v_apart
        FROM unnest(p_kind, p_destination, p_key, p_job, p_generation, p_monotonic)
            AS u(kind, d, k, j, gen, m)
        WHERE kind = 'd';
END IF;
IF v_apart THEN
    OPEN v_rows FOR SELECT {_NOW},
            (SELECT highest_generation FROM fences WHERE job_id = u.job),
            {_older("u.job", "u.gen")},
            l.job_id IS NOT NULL, l.owner, l.generation, l.state, l.lease_until,
            k.key IS NOT NULL, k.fingerprint, k.state, k.deadline, k.attempts,
            CASE WHEN u.key IS NULL
                THEN EXISTS (SELECT 1 FROM attempts WHERE attempt = u.attempt)
                ELSE k.attempt IS NOT DISTINCT FROM u.attempt END,
            k.attempt
        FROM unnest(p_kind, p_job, p_generation, p_monotonic, p_destination, p_key, p_attempt)
            WITH ORDINALITY AS u(kind, job, gen, monotonic, destination, key, attempt, n)
        LEFT JOIN leases l ON NOT u.monotonic AND l.job_id = u.job
        LEFT JOIN idempotency k ON k.destination = u.destination AND k.key = u.key
        WHERE u.kind = 'd'
        ORDER BY u.n;
END IF;
"""
# One decision's rows, from the cursor `_APART` opened.
_TAKE_READ = """
FETCH v_rows INTO v_now, v_mark, v_older, v_leased, v_owner, v_generation, v_state,
    v_until, v_keyed, v_fingerprint, v_key_state, v_deadline, v_attempts, v_mine,
    v_key_attempt;
IF p_job[i] = ANY(j_forwarded) THEN
    -- A forward of this job generation earlier in the batch raised the mark to it.
    v_mark := greatest(v_mark, g);
END IF;
v_read := NULL; v_rec_read := false;
"""
# `_RESERVE` of every forward of an apart batch, in one statement a table (the
# positions of its keyless and keyed forwards, and of those that raise their job's
# mark: a job's first forward, as the decisions one after the other would).
_RESERVE_ALL = f"""
IF cardinality(r_keyless) > 0 THEN
    INSERT INTO attempts (attempt, job_id, generation, destination, key, started_at, deadline)
    SELECT p_attempt[n], p_job[n], p_generation[n], p_destination[n], NULL, o_at[n],
        o_at[n] + p_timeout[n]
    FROM unnest(r_keyless) AS r(n);
END IF;
IF cardinality(r_keyed) > 0 THEN
    INSERT INTO idempotency ({_KEY_RESERVED})
    SELECT p_destination[n], p_key[n], 'in_flight', p_fingerprint[n], p_attempt[n], 1,
        p_job[n], p_generation[n], p_owner[n], o_at[n], o_at[n],
        o_at[n] + p_timeout[n] + {_GRACE}, o_at[n] + p_timeout[n]
    FROM unnest(r_keyed) AS r(n) ORDER BY p_destination[n], p_key[n]
    {_KEY_RESERVED_AGAIN};
END IF;
IF cardinality(r_raised) > 0 THEN
    INSERT INTO fences (job_id, highest_generation, updated_at)
    SELECT p_job[n], p_generation[n], o_at[n] FROM unnest(r_raised) AS r(n) ORDER BY p_job[n]
    ON CONFLICT (job_id) DO UPDATE SET
        highest_generation = GREATEST(fences.highest_generation, excluded.highest_generation),
        updated_at = excluded.updated_at;
END IF;
"""
# An apart batch that logs rejections takes the rejection order lock after its
# decisions, before it writes anything. Taken at once, nothing can have changed
# what they read. Held by another transaction, it is waited for, and what the
# decisions read may change meanwhile (a lease handed to a newer generation, a
# barrier lowered): the batch is then decided again one write after the other,
# each reading after the wait, as the decisions of a batch always do after a
# wait (the lock held from then on, no write waits again).
_APART_ORDERED = f"""
IF cardinality(j_at) > 0
    AND NOT pg_try_advisory_xact_lock({REJECTION_ORDER_LOCK[0]}, {REJECTION_ORDER_LOCK[1]}) THEN
    {ORDERED_INSERTS};
    v_ordered := true;
    v_apart := false;
    v_read := NULL;
    o_replay := '{{}}';
    o_replay_at := array_fill(NULL::int4, ARRAY[cardinality(p_kind)]);
    j_at := '{{}}'; r_keyed := '{{}}'; r_keyless := '{{}}'; r_raised := '{{}}';
    j_forwarded := '{{}}';
    CONTINUE deciding;
END IF;
"""
# The rejection-log rows of an apart batch (`j_at`, their positions), after
# `_APART_ORDERED` took the order lock: their ids drawn one by one in arrival
# order from the id column's sequence, then the rows inserted with them in one
# statement.
_LOG_ALL = f"""
v_sequence := pg_get_serial_sequence('rejections', 'id')::regclass;
FOR k IN 1 .. cardinality(j_at) LOOP
    o_id[j_at[k]] := nextval(v_sequence);
END LOOP;
INSERT INTO rejections (id, {_LOGGED})
SELECT o_id[n], o_at[n], o_reason[n], o_detail[n], p_destination[n], p_method[n], p_path[n],
    p_job[n], p_generation[n], p_owner[n], p_key[n],
    CASE WHEN o_verdict[n] = 'p' THEN NULL ELSE o_current[n] END,
    CASE WHEN o_verdict[n] = 'p' THEN NULL ELSE o_highest[n] END,
    p_remote[n], p_sha[n], p_bytes[n]
FROM unnest(j_at) AS r(n);
"""

# The function's arguments, declared once for its signature, its call and `_args`:
# the batch's, then one array per column of the operations, in arrival order (a
# `Decide` fills the first 16, a `Log` the first 8 and the last 6, and `_args`
# writes each row in this order).
_BATCH_PARAMETERS = (
    ("p_offset", "float8"), ("p_now", "float8"), ("p_locks", "text[]"), ("p_ordered", "boolean"),
)  # fmt: skip
_OPERATION_PARAMETERS = (
    ("p_kind", "text"), ("p_destination", "text"), ("p_method", "text"), ("p_path", "text"),
    ("p_job", "text"), ("p_generation", "int8"), ("p_owner", "text"), ("p_key", "text"),
    ("p_fingerprint", "text"), ("p_monotonic", "boolean"), ("p_idempotent", "boolean"),
    ("p_timeout", "float8"), ("p_attempt", "text"), ("p_remote", "text"), ("p_sha", "text"),
    ("p_bytes", "int8"), ("p_reason", "text"), ("p_detail", "text"), ("p_current", "int8"),
    ("p_highest", "int8"),
)  # fmt: skip
_SIGNATURE = ", ".join(
    [f"{name} {kind}" for name, kind in _BATCH_PARAMETERS]
    + [f"{name} {kind}[]" for name, kind in _OPERATION_PARAMETERS]
)
_ARITY = len(_BATCH_PARAMETERS) + len(_OPERATION_PARAMETERS)

DECIDE_FUNCTION = "sinkgate_decide_v2"
DECIDE_FUNCTION_DDL = f"""
CREATE OR REPLACE FUNCTION {DECIDE_FUNCTION}({_SIGNATURE})
RETURNS SETOF record LANGUAGE plpgsql VOLATILE {SET_CLAUSES} AS $fn$
DECLARE
    g int8;
    v_now float8;
    v_leased boolean;
    v_owner text;
    v_generation int8;
    v_state text;
    v_until float8;
    v_mark int8;
    v_older float8;
    v_keyed boolean;
    v_fingerprint text;
    v_key_state text;
    v_deadline float8;
    v_attempts int4;
    v_mine boolean := false;
    v_key_attempt text;
    v_read int4;
    v_rec idempotency;
    v_rec_read boolean := false;
    v_verdict text;
    v_reason text;
    v_detail text;
    v_current int8;
    v_highest int8;
    v_retry int4;
    v_id int8;
    v_ordered boolean := false;
    v_apart boolean := false;
    v_sequence regclass;
    v_rows refcursor;
    j_forwarded text[] := '{{}}';
    r_keyed int4[] := '{{}}';
    r_keyless int4[] := '{{}}';
    r_raised int4[] := '{{}}';
    j_at int4[] := '{{}}';
    o_at float8[] := '{{}}';
    o_verdict text[] := '{{}}';
    o_id int8[] := '{{}}';
    o_reason text[] := '{{}}';
    o_detail text[] := '{{}}';
    o_current int8[] := '{{}}';
    o_highest int8[] := '{{}}';
    o_retry int4[] := '{{}}';
    o_replay idempotency[] := '{{}}';
    o_replay_at int4[] := array_fill(NULL::int4, ARRAY[coalesce(cardinality(p_kind), 0)]);
BEGIN
    -- Each statement below must see what committed before it (after the locks it
    -- waited for): only READ COMMITTED takes a snapshot per statement.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'sinkgate decides under READ COMMITTED, not %',
            current_setting('transaction_isolation') USING ERRCODE = {_text(NOT_READ_COMMITTED)};
    END IF;
    PERFORM {DURABLE};
    IF p_ordered THEN
        PERFORM count(pg_advisory_xact_lock(h)) FROM (SELECT DISTINCT
            hashtextextended(name, 0) AS h FROM unnest(p_locks) AS name ORDER BY h) AS ordered;
    ELSE
        PERFORM count(pg_advisory_xact_lock(hashtextextended(name, 0)))
            FROM unnest(p_locks) AS name;
    END IF;
    PERFORM 1 FROM idempotency WHERE (destination, key) IN (
        SELECT d, k FROM unnest(p_kind, p_destination, p_key) AS u(kind, d, k)
        WHERE kind = 'd' AND k IS NOT NULL)
    ORDER BY destination, key FOR UPDATE;
    {_APART.strip()}
    <<deciding>>
    LOOP
        FOR i IN 1 .. coalesce(cardinality(p_kind), 0) LOOP
            g := p_generation[i];
            v_mine := false;
            IF p_kind[i] = 'l' THEN
                v_now := coalesce(p_now, {STORE_NOW.format("p_offset")});
                v_verdict := 'l'; v_reason := p_reason[i]; v_detail := p_detail[i];
                v_current := p_current[i]; v_highest := p_highest[i]; v_retry := NULL;
            ELSE
                IF v_apart THEN
                    {_TAKE_READ.strip()}
                ELSIF v_read IS NOT NULL AND p_key[i] = p_key[v_read]
                    AND p_destination[i] = p_destination[v_read] AND p_job[i] = p_job[v_read]
                    AND g = p_generation[v_read] AND p_monotonic[i] = p_monotonic[v_read] THEN
                    -- The same job generation and key as the write whose rows were read
                    -- last (`v_read`), and nothing written since: its key row and its
                    -- job's mark, which this batch's locks keep, are taken as read; the
                    -- clock, the lease and the older attempts' barriers, which other
                    -- transactions may change meanwhile, are read again.
                    {READ_AGAIN};
                    v_mine := v_key_attempt IS NOT DISTINCT FROM p_attempt[i];
                ELSE
                    SELECT {_NOW},
                        (SELECT highest_generation FROM fences WHERE job_id = p_job[i]),
                        {_OLDER},
                        {_LEASE_COLUMNS},
                        k.key IS NOT NULL, k.fingerprint, k.state, k.deadline, k.attempts,
                        CASE WHEN p_key[i] IS NULL
                            THEN EXISTS (SELECT 1 FROM attempts WHERE attempt = p_attempt[i])
                            ELSE k.attempt IS NOT DISTINCT FROM p_attempt[i] END,
                        k.attempt
                    FROM (SELECT) AS one
                    {_LEASE_JOIN}
                    LEFT JOIN idempotency k ON k.destination = p_destination[i] AND k.key = p_key[i]
                    INTO v_now, v_mark, v_older, v_leased, v_owner, v_generation, v_state,
                        v_until, v_keyed, v_fingerprint, v_key_state, v_deadline, v_attempts,
                        v_mine, v_key_attempt;
                    -- Kept for the writes of the same job generation and key that follow
                    -- (a keyless write's `v_mine` is its own attempt's row: read each time).
                    v_read := CASE WHEN p_key[i] IS NOT NULL THEN i END;
                    v_rec_read := false;
                END IF;
                IF v_mine THEN
                    -- This call was made before and committed (its answer was lost):
                    -- the write is reserved under its own attempt id. It was forwarded
                    -- then; it is answered so again, and nothing is written twice.
                    v_verdict := CASE WHEN v_attempts > 1 THEN 'u' ELSE 'f' END;
                    v_reason := NULL; v_detail := NULL; v_current := NULL; v_highest := NULL;
                    v_retry := NULL;
                ELSE
                    {_POLICY.strip()}
                END IF;
            END IF;
            v_id := NULL;
            IF v_verdict IN ('f', 'u') THEN
                v_read := NULL;  -- a reservation changes the rows the next write reads
            END IF;
            IF v_verdict IN ('f', 'u') AND NOT v_mine AND v_apart THEN
                -- reserved together after the loop (`_RESERVE_ALL`)
                IF p_key[i] IS NULL THEN
                    r_keyless := r_keyless || i;
                ELSE
                    r_keyed := r_keyed || i;
                END IF;
                IF v_mark IS NULL OR g > v_mark THEN
                    r_raised := r_raised || i;
                END IF;
                IF NOT p_job[i] = ANY(j_forwarded) THEN
                    j_forwarded := j_forwarded || p_job[i];
                END IF;
            ELSIF v_verdict IN ('f', 'u') AND NOT v_mine THEN
                {_RESERVE.strip()}
            ELSIF v_verdict IN ('f', 'u') THEN
                NULL;
            ELSE
                IF v_verdict = 'p' THEN
                    -- The key's row goes back once for the replays of a run of writes
                    -- (each may carry up to max_replay_body): each points at it.
                    IF NOT v_rec_read THEN
                        SELECT * INTO v_rec FROM idempotency
                            WHERE destination = p_destination[i] AND key = p_key[i];
                        o_replay := o_replay || v_rec;
                        v_rec_read := true;
                    END IF;
                    o_replay_at[i] := cardinality(o_replay);
                    v_reason := {_text(Reason.DUPLICATE)};
                    v_detail := {_text(REPLAYED)};
                END IF;
                IF v_apart THEN
                    j_at := j_at || i;  -- logged together after the loop (`_LOG_ALL`)
                ELSE
                    IF NOT v_ordered THEN
                        {ORDERED_INSERTS};
                        v_ordered := true;
                    END IF;
                    INSERT INTO rejections ({_LOGGED})
                    VALUES (v_now, v_reason, v_detail, p_destination[i], p_method[i], p_path[i],
                        p_job[i], g, p_owner[i], p_key[i],
                        CASE WHEN v_verdict = 'p' THEN NULL ELSE v_current END,
                        CASE WHEN v_verdict = 'p' THEN NULL ELSE v_highest END,
                        p_remote[i], p_sha[i], p_bytes[i])
                    RETURNING id INTO v_id;
                END IF;
            END IF;
            o_verdict[i] := v_verdict; o_id[i] := v_id; o_reason[i] := v_reason;
            o_detail[i] := v_detail; o_current[i] := v_current; o_highest[i] := v_highest;
            o_retry[i] := v_retry;
            o_at[i] := v_now;
        END LOOP;
        IF v_apart THEN
            CLOSE v_rows;
            {_APART_ORDERED.strip()}
        END IF;
        EXIT deciding;
    END LOOP;
    {_RESERVE_ALL.strip()}
    IF cardinality(j_at) > 0 THEN
        {_LOG_ALL.strip()}
    END IF;
    RETURN QUERY SELECT coalesce(v_now, p_now, {STORE_NOW.format("p_offset")}), o_verdict,
        o_id, o_reason, o_detail, o_current, o_highest, o_retry,
        ARRAY(SELECT row({", ".join(f"r.{c}" for c in KEY_COLUMNS)})
            FROM unnest(o_replay) WITH ORDINALITY AS r ORDER BY r.ordinality), o_replay_at;
END
$fn$;
"""
_DECIDE_CALL = (
    f"SELECT * FROM {DECIDE_FUNCTION}({', '.join(f'${n}' for n in range(1, _ARITY + 1))}) AS s("
    "now float8, verdict text[], id int8[], reason text[], detail text[], current int8[], "
    "highest int8[], retry int4[], replays record[], replay int4[])"
)


async def decide_batch(
    conn: Conn, operations: Sequence[Operation], offset: float, now: float | None = None
) -> tuple[list[Verdict | int], float]:
    """Decide and apply the batch in one call (its own transaction, unless `conn` is
    in one): each operation's answer (a Verdict, or a `Log`'s rejection id) and the
    store's clock. `now` fixes the clock for every decision (tests)."""
    facts = [op.facts for op in operations if isinstance(op, Decide)]
    names = batch_plan.lock_names(facts, LOCK_KINDS)
    row = await conn.fetchrow(_DECIDE_CALL, offset, now, names, LOCKS_ORDERED, *_args(operations))
    replays, replay_at = row["replays"], row["replay"]
    records: dict[int, KeyRecord] = {}  # by position in `replays`: one per run of a key
    answers: list[Verdict | int] = []
    for n, op in enumerate(operations):
        verdict, rejection_id = row["verdict"][n], row["id"][n]
        if isinstance(op, Log):
            answers.append(int(rejection_id))
            continue
        decision: Decision
        if verdict in ("f", "u"):
            decision = Forward(retry_of_unknown=verdict == "u")
            answers.append(Verdict(decision, attempt=op.attempt))
            continue
        if verdict == "p":
            at = replay_at[n]
            record = records.get(at)
            if record is None:
                record = records[at] = key_record(replays[at - 1][: len(KEY_COLUMNS)])
            decision = Replay(record)
        else:
            decision = Reject(
                row["reason"][n],
                row["detail"][n],
                current_generation=row["current"][n],
                highest_generation=row["highest"][n],
                retry_after=row["retry"][n],
            )
        answers.append(Verdict(decision, rejection_id=int(rejection_id)))
    return answers, float(row["now"])


def _args(operations: Sequence[Operation]) -> list[list[Any]]:
    """The per-operation arrays of `DECIDE_FUNCTION` (`_OPERATION_PARAMETERS`)."""
    columns: list[list[Any]] = [[] for _ in _OPERATION_PARAMETERS]
    for op in operations:
        if isinstance(op, Decide):
            f, c = op.facts, op.context
            row: tuple[Any, ...] = (
                "d", f.destination, f.method, f.path + (f"?{f.query}" if f.query else ""),
                f.job_id, f.generation, f.owner, f.key, f.fingerprint,
                f.fencing is Fencing.MONOTONIC, f.upstream_idempotent, f.timeout, op.attempt,
                c.remote, c.body_sha256, c.body_bytes, None, None, None, None,
            )  # fmt: skip
        else:
            r = op.record
            row = (
                "l", r.destination, r.method, r.path, r.job_id, r.generation, r.owner,
                r.idempotency_key, None, None, None, None, None, r.remote, r.body_sha256,
                r.body_bytes, r.reason, r.detail, r.current_generation, r.highest_generation,
            )  # fmt: skip
        for column, value in zip(columns, row, strict=True):
            column.append(value)
    return columns
