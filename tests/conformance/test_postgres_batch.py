"""PostgreSQL group commit: what one batch must keep of one-after-the-other decisions.

Each protection is shown twice: the test that holds with it, and the same race
with it switched off (a monkeypatched lock statement or batch state), which
must show the violation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from gateway.policy.decision import Fencing, Forward, WriteFacts
from gateway.policy.records import Outcome, RejectionRecord
from gateway.store import postgres as postgres_store
from gateway.store import postgres_batch, postgres_outcomes, postgres_schema
from gateway.store.postgres import PostgresStore
from gateway.store.postgres_batch import Decide, Log
from gateway.store.postgres_outcomes import OUTCOMES_FUNCTION
from gateway.store.records import RejectionQuery
from leases.errors import StoreUnavailable
from tests.conformance.test_store_conformance import COMPLETED, CONTEXT, reason, write
from tests.harness import eventually
from tests.pg import fresh_database

pytestmark = pytest.mark.postgres


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with fresh_database() as url:
        yield url


@pytest.fixture
async def store(url: str) -> AsyncIterator[PostgresStore]:
    store = await PostgresStore.open(url)
    try:
        yield store
    finally:
        await store.close()


def _names(verdicts: list[Any]) -> list[str]:
    return ["forward" if isinstance(v.decision, Forward) else reason(v) for v in verdicts]


async def _one_batch(store: PostgresStore, writes: list[WriteFacts]) -> list[str]:
    """Decide `writes` together; asserts they rode one batch."""
    before = store._decisions.batches
    verdicts = await asyncio.gather(*(store.decide_write(w, CONTEXT) for w in writes))
    assert store._decisions.batches == before + 1
    return _names(list(verdicts))


# --- in-batch ordering ----------------------------------------------------------------


async def test_two_writes_of_one_key_in_one_batch_forward_it_once(store: PostgresStore) -> None:
    one_key = [write(job_id="job-a"), write(job_id="job-b")]
    assert await _one_batch(store, one_key) == ["forward", "request_in_progress"]
    # A newer generation first raises the mark the older one then finds.
    two_generations = [write(job_id="j", generation=2, key="g2"), write(job_id="j", key="g1")]
    assert await _one_batch(store, two_generations) == ["forward", "stale_generation"]
    # An older generation first bars the newer one.
    bar = [write(job_id="k", key="h1"), write(job_id="k", generation=2, key="h2")]
    assert await _one_batch(store, bar) == ["forward", "older_generation_in_flight"]
    assert (await store.job_state("j")).highest_generation == 2  # type: ignore[union-attr]


async def test_a_started_decision_rides_the_batch_and_keeps_its_reservations_deadline(
    store: PostgresStore,
) -> None:
    """`start_decision` (a held write's wake): decided in the same batch as a
    write submitted beside it, in arrival order, its verdict set on the future
    given, and its reservation's deadline kept for its outcome (as `decide_write`
    keeps it); a future cancelled before the batch drops the decision."""
    loop = asyncio.get_running_loop()
    started, dropped = loop.create_future(), loop.create_future()
    before = store._decisions.batches
    store.start_decision(write(job_id="job-a"), CONTEXT, started)
    store.start_decision(write(job_id="job-c", key="key-3"), CONTEXT, dropped)
    dropped.cancel()
    submitted = await store.decide_write(write(job_id="job-b"), CONTEXT)
    verdict = await started
    assert store._decisions.batches == before + 1
    assert _names([verdict, submitted]) == ["forward", "request_in_progress"]
    assert verdict.attempt is not None
    assert verdict.attempt in store._reserved_until._until
    assert await store.key_record("pay", "key-3") is None  # dropped: nothing reserved
    assert await store.record_outcome(write(job_id="job-a"), verdict.attempt, COMPLETED)
    assert verdict.attempt not in store._reserved_until._until


async def test_against_the_state_before_the_batch_one_key_is_forwarded_twice(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-batch ordering switched off (each write decided against the rows as
    they were before the batch, its changes still applied): shows the test above
    can fail."""
    join = "LEFT JOIN idempotency k ON "
    assert join in postgres_schema.DECIDE_FUNCTION_DDL
    before_the_batch = join + "k.xmin <> xid(pg_current_xact_id()) AND "
    monkeypatch.setattr(
        postgres_schema,
        "DECIDE_FUNCTION_DDL",
        postgres_schema.DECIDE_FUNCTION_DDL.replace(join, before_the_batch),
    )
    store = await PostgresStore.open(url)
    try:
        one_key = [write(job_id="job-a"), write(job_id="job-b")]
        assert await _one_batch(store, one_key) == ["forward", "forward"]
    finally:
        await store.close()


# --- runs of one key: its rows read once, its stored answer sent back once -------------


async def _replays_of_runs(store: PostgresStore) -> list[Any]:
    """Two keys with stored answers of their own, then one batch of their duplicates
    in runs (k1 k1 k2 k1 k2): the replays, in order."""
    for key, body in (("k1", b'{"one":1}'), ("k2", b'{"two":2}')):
        reserved = await store.decide_write(write(key=key), CONTEXT)
        assert reserved.attempt is not None
        answer = Outcome("completed", 201, (("Content-Type", "application/json"),), body)
        assert await store.record_outcome(write(key=key), reserved.attempt, answer)
    keys = ["k1", "k1", "k2", "k1", "k2"]
    before = store._decisions.batches
    verdicts = await asyncio.gather(*(store.decide_write(write(key=k), CONTEXT) for k in keys))
    assert store._decisions.batches == before + 1
    return [v.decision for v in verdicts]


async def test_a_run_of_duplicates_gets_its_keys_answer_sent_back_once(
    store: PostgresStore,
) -> None:
    replays = await _replays_of_runs(store)
    assert [r.record.body for r in replays] == [
        b'{"one":1}', b'{"one":1}', b'{"two":2}', b'{"one":1}', b'{"two":2}'
    ]  # fmt: skip
    # One row per run, decoded once: a run's replays share it.
    assert replays[0].record is replays[1].record
    assert replays[3].record is not replays[0].record
    rows = await store.list_rejections(RejectionQuery(limit=10))
    assert [r.record.reason for r in rows] == ["duplicate"] * 5  # each still logged


async def test_a_run_that_keeps_the_row_of_the_run_before_replays_the_wrong_answer(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new run not reading its own key's row again: shows the test above can fail."""
    # the sequential path's new run (an apart batch has no runs)
    new_run = re.compile(r"(IS NOT NULL THEN i END;\s+)v_rec_read := false;")
    kept = new_run.sub(r"\1NULL;", postgres_schema.DECIDE_FUNCTION_DDL, count=1)
    assert kept != postgres_schema.DECIDE_FUNCTION_DDL
    monkeypatch.setattr(postgres_schema, "DECIDE_FUNCTION_DDL", kept)
    store = await PostgresStore.open(url)
    try:
        replays = await _replays_of_runs(store)
        assert replays[2].record.body == b'{"one":1}'  # k2's duplicate, k1's answer
    finally:
        await store.close()


async def _held_between_its_writes(
    store: PostgresStore, url: str, run: list[WriteFacts], meanwhile: Any
) -> list[str]:
    """Decide `run` in one batch, whose first refusal is held back from logging its
    row (the rejection order lock taken here) while `meanwhile()` runs: the verdicts."""
    holder = await asyncpg.connect(url)
    try:
        async with holder.transaction():
            await holder.execute(
                "SELECT pg_advisory_xact_lock($1, $2)", *postgres_batch.REJECTION_ORDER_LOCK
            )
            decided = asyncio.ensure_future(_one_batch(store, run))

            async def waiting() -> bool:
                return bool(
                    await holder.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' "
                        "AND datname = current_database()"
                    )
                )

            await eventually(waiting, what="the run's first refusal waiting to log its row")
            await meanwhile()
        return await decided
    finally:
        await holder.close()


async def _unknown_key_of_a_claimed_job(
    store: PostgresStore,
) -> tuple[WriteFacts, Callable[[], Awaitable[None]]]:
    """A write of job-r's key kr, forwarded with an unknown outcome (not idempotent,
    so a write of it is refused; idempotent, forwarded again), and what hands job-r
    to a newer generation through the lease API."""
    lease = await store.claim("job-r", owner="w1", ttl=60)
    unknown = write(job_id="job-r", generation=lease.generation, key="kr", fencing=Fencing.LEASE)
    reserved = await store.decide_write(unknown, CONTEXT)
    assert reserved.attempt is not None
    assert await store.record_outcome(unknown, reserved.attempt, Outcome("unknown"))

    async def newer_generation() -> None:
        await store.release(lease)
        assert (await store.claim("job-r", owner="w2", ttl=60)).generation > lease.generation

    return unknown, newer_generation


async def _claimed_between_two_decisions_of_a_run(url: str) -> list[str]:
    """A run of two writes of one key whose outcome is unknown: the first, not
    idempotent, is refused; while it waits to log its row the lease API hands the
    job to a newer generation; the second, idempotent, would forward the key again."""
    store = await PostgresStore.open(url)
    try:
        first, newer_generation = await _unknown_key_of_a_claimed_job(store)
        run = [first, dataclasses.replace(first, upstream_idempotent=True)]
        return await _held_between_its_writes(store, url, run, newer_generation)
    finally:
        await store.close()


async def _barrier_lowered_between_two_decisions_of_a_run(url: str) -> list[str]:
    """A run of two writes of a newer generation, refused while the older one's
    write of another key is on the wire; while the first waits to log its row, the
    older write's outcome is recorded."""
    store = await PostgresStore.open(url)
    try:
        older = await store.claim("job-b", owner="w1", ttl=60)
        on_wire = write(
            job_id="job-b", generation=older.generation, key="ka", fencing=Fencing.LEASE
        )
        reserved = await store.decide_write(on_wire, CONTEXT)
        assert reserved.attempt is not None
        await store.release(older)
        newer = await store.claim("job-b", owner="w2", ttl=60)
        run = [write(job_id="job-b", generation=newer.generation, key="kb", fencing=Fencing.LEASE)]

        async def settled() -> None:
            assert reserved.attempt is not None
            assert await store.record_outcome(on_wire, reserved.attempt, COMPLETED)

        return await _held_between_its_writes(store, url, run * 2, settled)
    finally:
        await store.close()


async def test_a_run_reads_its_lease_again_for_each_write(url: str) -> None:
    assert await _claimed_between_two_decisions_of_a_run(url) == [
        "outcome_unknown",
        "stale_generation",
    ]


async def test_a_run_that_keeps_the_lease_it_read_first_forwards_a_replaced_generation(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the clock read again within a run: shows the test above can fail."""
    clock_only = f"SELECT {postgres_batch._NOW} INTO v_now"
    ddl = postgres_schema.DECIDE_FUNCTION_DDL
    assert postgres_batch.READ_AGAIN in ddl
    monkeypatch.setattr(
        postgres_schema, "DECIDE_FUNCTION_DDL", ddl.replace(postgres_batch.READ_AGAIN, clock_only)
    )
    assert await _claimed_between_two_decisions_of_a_run(url) == ["outcome_unknown", "forward"]


async def test_a_run_reads_the_older_attempts_barrier_again_for_each_write(url: str) -> None:
    """Decided as if it had just arrived: the older write settled, the second goes."""
    assert await _barrier_lowered_between_two_decisions_of_a_run(url) == [
        "older_generation_in_flight",
        "forward",
    ]


async def test_a_run_that_keeps_the_barrier_it_read_first_refuses_again(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The barrier taken as read within a run: shows the test above can fail."""
    kept = postgres_batch.READ_AGAIN.replace(f"{postgres_batch._OLDER}, ", "").replace(
        "v_older, ", ""
    )
    ddl = postgres_schema.DECIDE_FUNCTION_DDL
    assert kept != postgres_batch.READ_AGAIN and postgres_batch.READ_AGAIN in ddl
    monkeypatch.setattr(
        postgres_schema, "DECIDE_FUNCTION_DDL", ddl.replace(postgres_batch.READ_AGAIN, kept)
    )
    assert await _barrier_lowered_between_two_decisions_of_a_run(url) == [
        "older_generation_in_flight",
        "older_generation_in_flight",
    ]


async def _claimed_while_an_apart_batch_waits_to_log(url: str) -> list[str]:
    """An apart batch (its rows read at once): three refusals of a job without a
    lease, then an idempotent write of a key whose outcome is unknown. While the
    batch waits to log its refusals, the lease API hands that key's job to a newer
    generation."""
    store = await PostgresStore.open(url)
    try:
        unknown, newer_generation = await _unknown_key_of_a_claimed_job(store)
        refused = [write(job_id="job-x", key=f"x{n}", fencing=Fencing.LEASE) for n in range(3)]
        batch = [*refused, dataclasses.replace(unknown, upstream_idempotent=True)]
        assert len(batch) >= postgres_batch.APART_FROM
        return await _held_between_its_writes(store, url, batch, newer_generation)
    finally:
        await store.close()


async def test_an_apart_batch_that_waited_to_log_decides_again_after_the_wait(url: str) -> None:
    """Its decisions were taken before the wait: taken again after it, the handed-on
    lease refuses the write (decided as if it had just arrived, as one after the other)."""
    assert await _claimed_while_an_apart_batch_waits_to_log(url) == [
        *["lease_not_held"] * 3,
        "stale_generation",
    ]


async def test_an_apart_batch_that_keeps_what_it_read_before_the_wait_forwards_it(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order lock waited for without deciding again: shows the test above can fail."""
    ddl = postgres_schema.DECIDE_FUNCTION_DDL
    again = postgres_batch._APART_ORDERED.strip()
    assert again in ddl
    waits = f"IF cardinality(j_at) > 0 THEN {postgres_batch.ORDERED_INSERTS}; END IF;"
    monkeypatch.setattr(postgres_schema, "DECIDE_FUNCTION_DDL", ddl.replace(again, waits))
    assert await _claimed_while_an_apart_batch_waits_to_log(url) == [
        *["lease_not_held"] * 3,
        "forward",
    ]


async def _apart_batch_called_twice(url: str) -> tuple[list[Any], list[Any], list[Any], int]:
    """An apart batch of keyed and keyless writes whose call committed and lost its
    answer, run again with the same attempt ids: both calls' answers, the key rows
    and the number of keyless attempts."""
    store = await PostgresStore.open(url)  # the schema and the function
    await store.close()
    conn = await asyncpg.connect(url)
    try:
        batch = [
            Decide(write(job_id=f"job-{n % 2}", key=f"again-{n}" if n < 3 else None), CONTEXT)
            for n in range(5)
        ]
        assert len(batch) >= postgres_batch.APART_FROM
        first, _ = await postgres_batch.decide_batch(conn, batch, 0.0)
        again, _ = await postgres_batch.decide_batch(conn, batch, 0.0)
        keys = await conn.fetch("SELECT key, attempt, attempts FROM idempotency ORDER BY key")
        keyless = await conn.fetchval("SELECT count(*) FROM attempts")
        assert [op.attempt for op in batch] == [v.attempt for v in first]
        return first, again, [tuple(r) for r in keys], keyless
    finally:
        await conn.close()


async def test_an_apart_batch_run_again_after_its_commit_answers_forward_and_reserves_once(
    url: str,
) -> None:
    first, again, keys, keyless = await _apart_batch_called_twice(url)
    assert _names(first) == _names(again) == ["forward"] * 5
    assert again == first
    assert keys == [(f"again-{n}", first[n].attempt, 1) for n in range(3)]
    assert keyless == 2


async def test_an_apart_batch_without_its_attempts_found_refuses_its_own_writes(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cursor no longer looks for a keyed write's own attempt: the call run again
    refuses the writes its first run reserved. Shows the test above can fail."""
    mine = "ELSE k.attempt IS NOT DISTINCT FROM u.attempt END"
    ddl = postgres_schema.DECIDE_FUNCTION_DDL
    assert mine in ddl
    monkeypatch.setattr(postgres_schema, "DECIDE_FUNCTION_DDL", ddl.replace(mine, "ELSE false END"))
    _, again, _, _ = await _apart_batch_called_twice(url)
    assert _names(again)[:3] == ["request_in_progress"] * 3


# --- the lock order across replicas ------------------------------------------------------


async def _crossed_batches(url: str) -> list[Any]:
    """Two replicas each decide a batch of the jobs J1 and J2, in opposite arrival
    orders, released together onto the job locks; returns both replicas."""
    admin = await asyncpg.connect(url)
    await admin.execute(f"ALTER DATABASE \"{url.rsplit('/', 1)[1]}\" SET deadlock_timeout = '50ms'")
    replicas = [await PostgresStore.open(url, max_size=2) for _ in range(2)]
    try:
        await admin.execute(
            "SELECT pg_advisory_lock(hashtextextended('job:J1', 0)), "
            "pg_advisory_lock(hashtextextended('job:J2', 0))"
        )
        first = [write(job_id="J1", key="a1"), write(job_id="J2", key="a2")]
        second = [write(job_id="J2", key="b2"), write(job_id="J1", key="b1")]
        tasks = [
            asyncio.create_task(_gathered(r, batch))
            for r, batch in zip(replicas, (first, second), strict=True)
        ]

        async def both_waiting() -> bool:
            waiting = await admin.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' "
                "AND datname = current_database()"
            )
            return bool(waiting == 2)

        await eventually(both_waiting, every=0.01, what="both batches waiting on a job lock")
        await admin.execute("SELECT pg_advisory_unlock_all()")
        verdicts = await asyncio.gather(*tasks)
        assert all(v == ["forward", "forward"] for v in verdicts)  # a failed batch is retried
        return [r.isolated for r in replicas]
    finally:
        await admin.close()
        for r in replicas:
            await r.close()


async def _gathered(store: PostgresStore, writes: list[WriteFacts]) -> list[str]:
    return await _one_batch(store, writes)


async def test_replicas_batches_of_the_same_jobs_in_opposite_orders_never_deadlock(
    url: str,
) -> None:
    assert await _crossed_batches(url) == [{}, {}]


async def test_in_arrival_order_the_same_batches_deadlock(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock order switched off: shows the test above can fail."""
    monkeypatch.setattr(postgres_batch, "LOCKS_ORDERED", False)  # arrival order
    isolated = await _crossed_batches(url)
    assert sum(i["40P01"] for i in isolated) >= 1  # deadlock_detected, then run alone


# --- rejection ids in commit order -------------------------------------------------------


async def _ids_skipped(url: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Replica A logs a rejection and holds its transaction open after taking its
    id (its call made inside a transaction left open); replica B logs one
    meanwhile. The ids visible then must be a prefix of all ids: returns those that
    committed later yet below a visible one (a reader paging down from the newest
    would never see them)."""
    held, release = asyncio.Event(), asyncio.Event()
    original = postgres_store.decide_batch

    async def holding(conn: Any, batch: Any, offset: float) -> Any:
        if not any(isinstance(op, Log) and op.record.detail == "held" for op in batch):
            return await original(conn, batch, offset)
        async with conn.transaction():  # the call's COMMIT, delayed
            answers = await original(conn, batch, offset)
            held.set()
            await release.wait()
        return answers

    monkeypatch.setattr(postgres_store, "decide_batch", holding)
    a, b = [await PostgresStore.open(url) for _ in range(2)]
    try:
        await a.record_rejection(RejectionRecord(reason="unauthorized", detail="first"))
        held_task = asyncio.create_task(
            a.record_rejection(RejectionRecord(reason="unauthorized", detail="held"))
        )
        await held.wait()
        late = asyncio.create_task(
            b.record_rejection(RejectionRecord(reason="unauthorized", detail="late"))
        )
        watcher = await asyncpg.connect(url)

        async def b_committed_or_waiting() -> bool:
            waiting = await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' "
                "AND datname = current_database()"
            )
            return late.done() or waiting == 1

        await eventually(b_committed_or_waiting, what="B's rejection committed or waiting")
        await watcher.close()
        visible = {r.id for r in await b.list_rejections(RejectionQuery(limit=100))}
        release.set()
        await asyncio.gather(held_task, late)
        every = {r.id for r in await b.list_rejections(RejectionQuery(limit=100))}
        return sorted(i for i in every - visible if i < max(visible))
    finally:
        release.set()
        await a.close()
        await b.close()


async def test_rejection_ids_become_visible_in_order_across_replicas(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert await _ids_skipped(url, monkeypatch) == []


async def test_without_the_order_lock_a_late_commit_hides_below_the_cursor(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The protection switched off: shows the test above can fail."""
    lock = postgres_batch.ORDERED_INSERTS
    assert lock in postgres_schema.DECIDE_FUNCTION_DDL
    unordered = postgres_schema.DECIDE_FUNCTION_DDL.replace(lock, "PERFORM 1")
    monkeypatch.setattr(postgres_schema, "DECIDE_FUNCTION_DDL", unordered)
    assert await _ids_skipped(url, monkeypatch) == [2]


# --- failures stay with their own operation -----------------------------------------------


async def test_a_write_the_database_refuses_fails_alone(store: PostgresStore) -> None:
    writes = [write(job_id="ok-1", key="k1"), write(job_id="bad\x00", key="k2")]
    writes.append(write(job_id="ok-2", key="k3"))
    answers = await asyncio.gather(
        *(store.decide_write(w, CONTEXT) for w in writes), return_exceptions=True
    )
    assert isinstance(answers[1], StoreUnavailable)
    assert _names([answers[0], answers[2]]) == ["forward", "forward"]
    assert set(store.isolated) == {"22021"}  # character_not_in_repertoire: the NUL


async def test_an_unreachable_store_fails_the_whole_batch_at_once(store: PostgresStore) -> None:
    await store._pool.close()  # every connection gone, as when the server is
    answers = await asyncio.gather(
        *(store.decide_write(write(key=f"k{n}"), CONTEXT) for n in range(3)),
        return_exceptions=True,
    )
    assert all(isinstance(a, StoreUnavailable) for a in answers)
    assert store.isolated == {}  # not run again one by one


# --- outcomes ------------------------------------------------------------------------------


async def test_outcomes_recorded_together_share_one_statement(store: PostgresStore) -> None:
    writes = [write(key=f"k{n}", job_id=f"j{n}") for n in range(3)] + [write(key=None)]
    verdicts = [await store.decide_write(w, CONTEXT) for w in writes]
    attempts = [v.attempt for v in verdicts]
    outcomes = [COMPLETED, Outcome("released"), Outcome("unknown"), COMPLETED]
    attempts[1] = "not-its-attempt"
    before = store._outcomes.batches
    held = await asyncio.gather(
        *(
            store.record_outcome(w, a, o)  # type: ignore[arg-type]
            for w, a, o in zip(writes, attempts, outcomes, strict=True)
        )
    )
    assert store._outcomes.batches == before + 1
    assert held == [True, False, True, True]
    states = [await store.key_record("pay", f"k{n}") for n in range(3)]
    assert [s.state for s in states] == ["completed", "in_flight", "unknown"]  # type: ignore[union-attr]
    assert (states[0].status, states[0].body) == (201, b'{"ok":1}')  # type: ignore[union-attr]
    assert (await store.job_state("job-1")).in_flight == ()  # type: ignore[union-attr]


# --- plans --------------------------------------------------------------------------------

# Plans kept per connection, made while the tables are empty: with the settings of
# `PLAN_SETTINGS` every table is still reached through an index once it has grown.
# Switched off, the same functions with a plan kept and nothing ruled out.
_KEPT_PLANS_ONLY = "SET plan_cache_mode = force_generic_plan"


async def _seq_scans_after_growth(url: str, protected: bool) -> dict[str, int]:
    """Per table, whole-table scans of one decision batch and one outcome batch,
    run on a connection whose plans were made while the tables were empty."""
    store = await PostgresStore.open(url, max_size=1)
    try:
        async with store._pool.acquire() as conn:
            # No autovacuum: an ANALYZE would replan the statements for the grown table.
            for table in ("idempotency", "attempts", "fences", "leases"):
                await conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
            if not protected:
                for ddl in (
                    postgres_batch.DECIDE_FUNCTION_DDL,
                    postgres_outcomes.OUTCOMES_FUNCTION_DDL,
                ):
                    await conn.execute(ddl.replace(postgres_outcomes.SET_CLAUSES, _KEPT_PLANS_ONLY))
        for n in range(3):  # the plans, made on empty tables
            facts = write(key=f"small-{n}", generation=1)
            verdict = await store.decide_write(facts, CONTEXT)
            assert verdict.attempt is not None
            assert await store.record_outcome(facts, verdict.attempt, COMPLETED)
        async with store._pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO idempotency (destination, key, state, fingerprint, attempt, "
                "attempts, job_id, generation, created_at, updated_at, deadline) "
                "SELECT 'pay', 'grown-' || g, 'completed', 'fp', 'a-' || g, 1, "
                "'job-' || (g % 8), 1, 0, 0, 0 FROM generate_series(1, 20000) AS g"
            )
            async with conn.transaction():
                facts = write(key="after-growth", generation=1)
                answers, _ = await postgres_batch.decide_batch(
                    conn, [postgres_batch.Decide(facts, CONTEXT)], 0.0
                )
                (verdict,) = answers
                assert isinstance(verdict.decision, Forward)
                recorded = postgres_outcomes.Recorded(facts, verdict.attempt, COMPLETED)
                assert await postgres_outcomes.record_outcomes(conn, [recorded], 0.0) == [True]
                rows = await conn.fetch(
                    "SELECT relname, seq_scan, idx_scan FROM pg_stat_xact_user_tables "
                    "WHERE relname IN ('idempotency', 'attempts', 'fences', 'leases')"
                )
                assert sum(r["idx_scan"] for r in rows) > 0  # the transaction's counts
    finally:
        await store.close()
    return {r["relname"]: r["seq_scan"] for r in rows}


async def test_batch_statements_reach_a_grown_table_through_its_indexes(url: str) -> None:
    """A plan is kept per connection (planning again for every batch was half of the
    database's CPU), made on the statistics of its moment: made while the tables
    were small, it hashed the whole key table on every batch once they had grown.
    With the scans and joins that read a whole table ruled out, none is read whole."""
    assert await _seq_scans_after_growth(url, protected=True) == {
        "idempotency": 0,
        "attempts": 0,
        "fences": 0,
        "leases": 0,
    }


async def test_without_the_plan_settings_a_plan_made_small_scans_the_grown_table(
    url: str,
) -> None:
    """The protection switched off: the same plans, kept but with nothing ruled out,
    read the whole key table after it has grown."""
    scans = await _seq_scans_after_growth(url, protected=False)
    assert scans["idempotency"] > 0


async def test_the_batch_functions_plan_through_the_indexes(url: str) -> None:
    """Both functions declare the settings (`SET` clauses: in force while they run,
    so for the plans of their statements, and not left behind in the session)."""
    store = await PostgresStore.open(url)
    await store.close()
    settings = dict(postgres_outcomes.PLAN_SETTINGS)
    conn = await asyncpg.connect(url)
    try:
        for function in (OUTCOMES_FUNCTION, postgres_batch.DECIDE_FUNCTION):
            config = await conn.fetchval(
                "SELECT proconfig FROM pg_proc WHERE proname = $1", function
            )
            assert config == [f"{name}={value}" for name, value in settings.items()]
        defaults = {name: await conn.fetchval(f"SHOW {name}") for name in settings}
        assert defaults != settings
        answers, _ = await postgres_batch.decide_batch(
            conn, [postgres_batch.Decide(write(), CONTEXT)], 0.0
        )
        assert isinstance(answers[0].decision, Forward)  # type: ignore[union-attr]
        assert {name: await conn.fetchval(f"SHOW {name}") for name in settings} == defaults
    finally:
        await conn.close()


async def test_the_outcomes_function_commits_durably_and_leaves_no_setting_behind(
    url: str,
) -> None:
    """Called with `synchronous_commit` off for the session, the outcomes' function
    raises it for the transaction it is called in (its COMMIT waits for the WAL
    flush); its own plan settings end with the call."""
    store = await PostgresStore.open(url)
    await store.close()
    conn = await asyncpg.connect(url, server_settings={"synchronous_commit": "off"})
    try:
        async with conn.transaction():
            await conn.fetchval(postgres_outcomes._CALL_SQL, *([[]] * 9), 0.0)
            assert await conn.fetchval("SHOW synchronous_commit") == "on"
            assert await conn.fetchval("SHOW plan_cache_mode") == "auto"
            assert await conn.fetchval("SHOW enable_hashjoin") == "on"
        assert await conn.fetchval("SHOW synchronous_commit") == "off"
    finally:
        await conn.close()


# --- isolation -----------------------------------------------------------------------------


async def _decided_after_a_mark_raised_meanwhile(url: str) -> tuple[str, bool]:
    """A database whose default isolation is REPEATABLE READ. Job j's mark is 2; a
    write of generation 2 waits for the job's lock while another transaction
    raises the mark to 3 and commits. Returns the write's decision, and whether
    the store went over to explicit READ COMMITTED transactions."""
    admin = await asyncpg.connect(url)
    await admin.execute(
        f'ALTER DATABASE "{url.rsplit("/", 1)[1]}" '
        "SET default_transaction_isolation = 'repeatable read'"
    )
    store = await PostgresStore.open(url)
    try:
        first = await store.decide_write(write(job_id="j", generation=2, key="a"), CONTEXT)
        assert isinstance(first.decision, Forward)
        raising = admin.transaction()
        await raising.start()
        await admin.execute("SELECT pg_advisory_xact_lock(hashtextextended('job:j', 0))")
        await admin.execute("UPDATE fences SET highest_generation = 3 WHERE job_id = 'j'")
        late = asyncio.create_task(
            store.decide_write(write(job_id="j", generation=2, key="b"), CONTEXT)
        )
        watcher = await asyncpg.connect(url)

        async def waiting() -> bool:
            count = await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' "
                "AND datname = current_database()"
            )
            return bool(count == 1)

        await eventually(waiting, every=0.01, what="the write waiting for the job's lock")
        await watcher.close()
        await raising.commit()
        verdict = await late
        return _names([verdict])[0], store._read_committed
    finally:
        await admin.close()
        await store.close()


async def test_under_another_default_isolation_the_batch_still_reads_after_its_locks(
    url: str,
) -> None:
    """The function refuses to decide under REPEATABLE READ (its snapshot would be
    taken before the locks it waits for); the store then decides inside explicit
    READ COMMITTED transactions, and the raised mark is seen."""
    assert await _decided_after_a_mark_raised_meanwhile(url) == ("stale_generation", True)


async def test_without_the_isolation_check_the_raised_mark_is_missed(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check switched off: the write is decided on a snapshot taken before it
    waited, and a generation below the mark is forwarded. Shows the test above can fail."""
    check = "IF current_setting('transaction_isolation') <> 'read committed' THEN"
    assert check in postgres_schema.DECIDE_FUNCTION_DDL
    monkeypatch.setattr(
        postgres_schema,
        "DECIDE_FUNCTION_DDL",
        postgres_schema.DECIDE_FUNCTION_DDL.replace(check, "IF false THEN"),
    )
    assert await _decided_after_a_mark_raised_meanwhile(url) == ("forward", False)
