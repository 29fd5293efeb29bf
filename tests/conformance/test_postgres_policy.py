"""The policy stated twice: PostgreSQL's decision function against the Python policy.

The PostgreSQL store decides a batch in the server (`postgres_batch`,
`DECIDE_FUNCTION`); the SQLite store runs the Python policy (`gateway.policy`).
Random stored states (leases, marks, key rows, keyless attempts, with times on
and around the clock) and random batches (both fencing modes, keyed and keyless,
the same key or job twice, runs of one job generation and key as woken
duplicates come, rejections logged in between, and a third of the batches
apart, which the function reads at once) go to both: every
verdict must be the same, field for field, and so must every row the batch
leaves (key rows, marks, keyless attempts, rejection-log rows in order). Each
case runs in a transaction that is rolled back. The same cases against the
function with one comparison changed must find the difference.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from gateway.policy import batch_plan
from gateway.policy.decision import (
    RESERVATION_GRACE_S,
    Fencing,
    KeyRecord,
    KeyState,
    WriteFacts,
)
from gateway.policy.plan import WritePlan, plan_write
from gateway.policy.records import RejectionRecord, Verdict, WriteContext
from gateway.store import postgres_batch
from gateway.store.postgres import PostgresStore
from gateway.store.postgres_batch import Decide, Log, Operation
from gateway.store.records import KEY_COLUMNS_SQL, REJECTION_COLUMNS_SQL, key_record
from leases.model import LeaseRow, State
from tests.pg import fresh_database

pytestmark = pytest.mark.postgres

NOW = 1_800_000_000.0
CASES = 400
JOBS = ("j1", "j2", "j3")
KEYS = (("pay", "k1"), ("pay", "k2"), ("mail", "k1"), ("pay", "k3"))
NEW_KEYS = (("pay", "k4"), ("mail", "k2"), ("mail", "k3"), ("pay", "k5"))  # never stored
# Offsets from the clock for every stored time: past, exactly now, soon, later.
OFFSETS = (-30.0, -0.5, 0.0, 0.25, 1.5, 4.0, 40.0)


@pytest.fixture
async def conn() -> AsyncIterator[Any]:
    async with fresh_database() as url:
        store = await PostgresStore.open(url)  # the schema and the function
        await store.close()
        conn = await asyncpg.connect(url)
        try:
            yield conn
        finally:
            await conn.close()


@dataclass
class Case:
    leases: list[LeaseRow]
    marks: dict[str, int]
    keys: list[tuple[KeyRecord, float | None]]
    keyless: list[tuple[str, str, int, float]]  # attempt, job, generation, deadline
    operations: list[Operation]


def _case(rng: random.Random) -> Case:
    at = lambda: NOW + rng.choice(OFFSETS)  # noqa: E731
    leases = [
        LeaseRow(job, rng.choice(("w1", "w2")), rng.randint(1, 4),
                 rng.choice(list(State)), at(), 30.0)
        for job in JOBS if rng.random() < 0.75
    ]  # fmt: skip
    marks = {job: rng.randint(1, 5) for job in JOBS if rng.random() < 0.6}
    keys = []
    for n, (destination, key) in enumerate(KEYS):
        if rng.random() < 0.6:
            state = rng.choice(list(KeyState))
            completed = state is KeyState.COMPLETED
            record = KeyRecord(
                destination, key, state, rng.choice(("fp1", "fp2")), f"old-{n}",
                rng.randint(1, 3), rng.choice(JOBS), rng.randint(1, 4),
                rng.choice((None, "w1")), NOW - 100, NOW - 50, at(),
                completed_at=NOW - 10 if completed else None,
                status=201 if completed else None,
                headers=(("Content-Type", "application/json"),) if completed else (),
                body=b'{"x":1}' if completed else b"",
            )  # fmt: skip
            # A settled row may keep a `barrier_until` (an operator's resolve leaves it):
            # it bars nothing.
            barrier = at() if rng.random() < 0.8 else None
            if barrier is not None and state is KeyState.IN_FLIGHT:
                # As every reservation leaves it: its barrier ends `RESERVATION_GRACE_S`
                # before its deadline, so a key reserved again (its deadline passed)
                # bars nothing any more.
                barrier = min(barrier, record.deadline - RESERVATION_GRACE_S)
            keys.append((record, barrier))
    keyless = [
        (f"kl-{n}", rng.choice(JOBS), rng.randint(1, 4), at()) for n in range(rng.randint(0, 2))
    ]
    operations: list[Operation] = []
    # A third of the batches apart (no key twice, each job in one generation and
    # mode), as most batches under load are: the function reads those at once.
    apart = rng.random() < 1 / 3
    free_keys = rng.sample(KEYS + NEW_KEYS, len(KEYS + NEW_KEYS))
    leased = {lease.job_id: lease.generation for lease in leases}
    per_job = {
        job: (leased[job] if job in leased and rng.random() < 0.6 else rng.randint(0, 5),
              rng.choice(list(Fencing)))
        for job in JOBS
    }  # fmt: skip
    for n in range(rng.randint(1, 8)):
        job = rng.choice(JOBS)
        if rng.random() < 0.1:
            maybe = lambda value: value if rng.random() < 0.7 else None  # noqa: E731
            operations.append(Log(RejectionRecord(
                rng.choice(("unauthorized", "invalid_fencing_token")), f"logged {n}",
                destination=maybe("pay"), method=maybe("PUT"), path=maybe(f"/p{n}?q=1"),
                job_id=maybe(job), generation=maybe(rng.randint(1, 3)), owner=maybe("w9"),
                idempotency_key=maybe(f"lk{n}"), current_generation=maybe(rng.randint(1, 9)),
                highest_generation=maybe(rng.randint(10, 19)), remote=maybe("10.0.0.1"),
                body_sha256=maybe("cd" * 32), body_bytes=maybe(rng.randint(0, 99)),
            )))  # fmt: skip
            continue
        destination, key = rng.choice(KEYS)
        facts = WriteFacts(
            destination, "POST", "/x", rng.choice(("", "a=1")), job, rng.randint(0, 5),
            rng.choice((None, "w1", "w2")), None if rng.random() < 0.2 else key,
            rng.choice(("fp1", "fp2")), rng.choice(list(Fencing)), rng.random() < 0.5,
            rng.choice((1.0, 2.5, 30.0)),
        )  # fmt: skip
        if apart:
            destination, key = free_keys.pop()
            generation, fencing = per_job[job]
            facts = dataclasses.replace(
                facts, destination=destination, key=facts.key and key,
                generation=generation, fencing=fencing,
            )  # fmt: skip
        before = [op for op in operations if isinstance(op, Decide)]
        # a run: the job generation and key of the last
        if not apart and before and rng.random() < 0.4:
            last = before[-1].facts
            facts = dataclasses.replace(
                facts, destination=last.destination, job_id=last.job_id,
                generation=last.generation, key=last.key, fencing=last.fencing,
            )  # fmt: skip
        context = WriteContext(remote="10.0.0.2", body_sha256="ab" * 32, body_bytes=7)
        operations.append(Decide(facts, context, attempt=f"new-{n}"))
    return Case(leases, marks, keys, keyless, operations)


async def _store_state(conn: Any, case: Case) -> None:
    await conn.executemany(
        "INSERT INTO leases VALUES ($1, $2, $3, $4, $5, $6)",
        [(r.job_id, r.owner, r.generation, r.state.value, r.lease_until, r.ttl)
         for r in case.leases],
    )  # fmt: skip
    await conn.executemany(
        "INSERT INTO fences VALUES ($1, $2, 0)", [(job, mark) for job, mark in case.marks.items()]
    )
    await conn.executemany(
        f"INSERT INTO idempotency ({KEY_COLUMNS_SQL}, barrier_until) VALUES "
        "($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18)",
        [(r.destination, r.key, r.state.value, r.fingerprint, r.attempt, r.attempts, r.job_id,
          r.generation, r.owner, r.created_at, r.updated_at, r.deadline, r.completed_at,
          r.status, json.dumps(r.headers) if r.headers else None, r.body or None,
          r.body_omitted, barrier) for r, barrier in case.keys],
    )  # fmt: skip
    await conn.executemany(
        "INSERT INTO attempts VALUES ($1, $2, $3, 'pay', NULL, 0, $4)", case.keyless
    )


def _python(case: Case) -> tuple[list[Verdict | int], list[RejectionRecord], Any]:
    """The Python policy's answers, rejection rows and final state (`batch_plan`)."""
    decides = [op.facts for op in case.operations if isinstance(op, Decide)]
    batch_keys = {(f.destination, f.key) for f in decides if f.key is not None}
    state = batch_plan.batch_state(
        NOW,
        leases=case.leases,
        marks=case.marks.items(),
        barriers=[
            *((r.job_id, r.generation, b) for r, b in case.keys
              if (r.destination, r.key) not in batch_keys and r.state is KeyState.IN_FLIGHT
              and b is not None),
            *((job, generation, deadline) for _, job, generation, deadline in case.keyless),
        ],
        keys=[(r, b) for r, b in case.keys if (r.destination, r.key) in batch_keys],
    )  # fmt: skip
    answers: list[Verdict | int] = []
    rows: list[RejectionRecord] = []
    for op in case.operations:
        if isinstance(op, Log):
            rows.append(op.record)
            answers.append(len(rows))
            continue
        attempt = op.attempt
        plan: WritePlan = plan_write(
            op.facts, op.context, state.state_for(op.facts), NOW, lambda a=attempt: a
        )
        if plan.reservation is not None:
            state.apply(plan.reservation)
            answers.append(plan.verdict())
        else:
            assert plan.rejection is not None
            rows.append(plan.rejection)
            answers.append(plan.verdict(len(rows)))
    return answers, rows, state


async def _postgres(conn: Any, case: Case) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """The function's answers, and the rows the batch left, in a rolled-back transaction."""
    tx = conn.transaction()
    await tx.start()
    try:
        await _store_state(conn, case)
        first = await conn.fetchval("SELECT last_value FROM rejections_id_seq")
        called = await conn.fetchval("SELECT is_called FROM rejections_id_seq")
        base = first if called else first - 1
        answers, now = await postgres_batch.decide_batch(conn, case.operations, 0.0, now=NOW)
        assert now == NOW
        answers = [a - base if isinstance(a, int) else _renumbered(a, base) for a in answers]
        rows = await conn.fetch(f"SELECT {REJECTION_COLUMNS_SQL} FROM rejections ORDER BY id")
        after = {
            "keys": {
                (r["destination"], r["key"]): key_record(list(r.values())[:-1])
                for r in await conn.fetch(
                    f"SELECT {KEY_COLUMNS_SQL}, barrier_until FROM idempotency"
                )
            },
            "barriers": {
                (r["destination"], r["key"]): r["barrier_until"]
                for r in await conn.fetch("SELECT * FROM idempotency")
            },
            "marks": dict(await conn.fetch("SELECT job_id, highest_generation FROM fences")),
            "keyless": sorted(
                tuple(r) for r in await conn.fetch(
                    "SELECT attempt, job_id, generation, deadline FROM attempts"
                )
            ),
        }  # fmt: skip
        return answers, [RejectionRecord(**dict(r)) for r in rows], after
    finally:
        await tx.rollback()


def _renumbered(verdict: Verdict, base: int) -> Verdict:
    if verdict.rejection_id is None:
        return verdict
    return Verdict(verdict.decision, verdict.attempt, verdict.rejection_id - base)


def _expected_rows(case: Case, state: Any) -> dict[str, Any]:
    """The key rows, their barriers and the marks the Python policy leaves."""
    keys = {(r.destination, r.key): r for r, _ in case.keys}
    keys.update(state.records)
    barriers = {(r.destination, r.key): b for r, b in case.keys}
    for ident, barrier in state.key_barriers.items():
        barriers[ident] = barrier.until
    return {"keys": keys, "barriers": barriers, "marks": state.marks}


async def _differences(conn: Any, seed: int) -> list[str]:
    """The cases on which the two statements of the policy disagree."""
    rng = random.Random(seed)
    found = []
    for n in range(CASES):
        case = _case(rng)
        expected, expected_rows, state = _python(case)
        try:
            got, got_rows, after = await _postgres(conn, case)
        except asyncpg.PostgresError as exc:  # where the Python policy decides
            found.append(f"case {n}: the function failed: {exc!r}")
            continue
        if got != expected:
            found.append(f"case {n}: verdicts\n  python   {expected}\n  postgres {got}")
            continue
        if got_rows != expected_rows:
            found.append(f"case {n}: rejection rows\n  {expected_rows}\n  {got_rows}")
            continue
        rows = _expected_rows(case, state)
        reserved_keyless = {
            op.attempt for op, a in zip(case.operations, got, strict=True)
            if isinstance(op, Decide) and op.facts.key is None and isinstance(a, Verdict)
            and a.attempt is not None
        }  # fmt: skip
        keyless = sorted(
            [(a, j, g, d) for a, j, g, d in case.keyless]
            + [(op.attempt, op.facts.job_id, op.facts.generation, NOW + op.facts.timeout)
               for op in case.operations
               if isinstance(op, Decide) and op.attempt in reserved_keyless]
        )  # fmt: skip
        for name, want in (
            ("keys", rows["keys"]),
            ("barriers", rows["barriers"]),
            ("marks", rows["marks"]),
            ("keyless", keyless),
        ):
            if after[name] != want:
                found.append(f"case {n}: {name}\n  python   {want}\n  postgres {after[name]}")
                break
    return found


@pytest.mark.parametrize("seed", [1, 2])
async def test_the_function_decides_every_case_as_the_python_policy(conn: Any, seed: int) -> None:
    differences = await _differences(conn, seed)
    assert not differences, "\n".join(differences[:3])


# One comparison of the function changed at a time (an off-by-one at the clock or
# at the mark, a refusal order swapped): the same cases must tell.
MUTATIONS = {
    "expiry at the clock": ("WHEN v_until <= v_now", "WHEN v_until < v_now"),
    "the forwarded mark": (
        "ELSIF v_mark IS NOT NULL AND g < v_mark",
        "ELSIF v_mark IS NOT NULL AND g <= v_mark",
    ),
    "a settled row's barrier": (
        "AND state = 'in_flight' AND generation <",
        "AND generation <",
    ),
    "in flight at the deadline": (
        "v_key_state = 'in_flight' AND v_deadline > v_now",
        "v_key_state = 'in_flight' AND v_deadline >= v_now",
    ),
    # A run of one job generation and key reads its rows once: a reservation must
    # end the run, or the next write decides on the rows from before it.
    "a run read past a reservation": ("v_read := NULL;", "NULL;"),
    # A batch read at once must be apart, and a forward of a job generation
    # raises the mark the job's later decisions of that batch see.
    "a key twice read at once": (
        "FILTER (WHERE k IS NOT NULL) = count(k)",
        "FILTER (WHERE k IS NOT NULL) >= 0",
    ),
    "a job in two generations read at once": (
        "count(DISTINCT (j, gen, m)) = count(DISTINCT j)",
        "count(DISTINCT (j, m)) = count(DISTINCT j)",
    ),
    "the rejection ids of a batch read at once, out of order": (
        "o_id[j_at[k]] := nextval",
        "o_id[j_at[cardinality(j_at) + 1 - k]] := nextval",
    ),
    "the mark before a forward of the batch": (
        "v_mark := greatest(v_mark, g);",
        "NULL;",
    ),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
async def test_a_function_with_one_comparison_changed_is_told_apart(
    conn: Any, mutation: str
) -> None:
    old, new = MUTATIONS[mutation]
    ddl = postgres_batch.DECIDE_FUNCTION_DDL
    assert old in ddl  # every place (a barrier is read in two statements)
    await conn.execute(ddl.replace(old, new))
    try:
        assert await _differences(conn, 1)
    finally:
        await conn.execute(ddl)
