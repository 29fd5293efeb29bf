"""gateway.policy.batch_plan as plain tables: one batch decided as one after the other."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest

from gateway.policy import batch_plan
from gateway.policy.batch_plan import Barrier, BatchState, plan_batch
from gateway.policy.decision import Fencing, Forward, KeyState, Reject, Replay, WriteFacts
from gateway.policy.plan import plan_write
from gateway.policy.records import WriteContext
from tests.unit.test_decision import ACTIVE, FACTS, FP, NOW, record
from tests.unit.test_plan import CONTEXT, _ids

MONOTONIC = replace(FACTS, fencing=Fencing.MONOTONIC)


def _verdicts(writes: list[WriteFacts], state: BatchState) -> list[str]:
    plans = plan_batch([(w, CONTEXT) for w in writes], state, _ids())
    return [
        "forward" if isinstance(p.decision, Forward) else str(p.decision.reason)  # type: ignore[union-attr]
        for p in plans
    ]


def test_a_second_write_of_one_key_in_the_batch_finds_it_in_flight() -> None:
    state = BatchState(now=NOW, leases={"job": ACTIVE})
    other_job = replace(FACTS, job_id="job-b", fencing=Fencing.MONOTONIC)
    assert _verdicts([FACTS, other_job], state) == ["forward", "request_in_progress"]
    held = state.records[("pay", "k")]
    assert (held.state, held.attempt, held.attempts) == (KeyState.IN_FLIGHT, "attempt-1", 1)


def test_a_newer_generation_raises_the_mark_for_the_older_one_after_it() -> None:
    state = BatchState(now=NOW)
    newer = replace(MONOTONIC, generation=8, key="k8")
    assert _verdicts([newer, MONOTONIC], state) == ["forward", "stale_generation"]
    assert state.marks == {"job": 8}


def test_an_older_generation_on_the_wire_bars_the_newer_one_after_it() -> None:
    state = BatchState(now=NOW)
    keyless_older = replace(MONOTONIC, key=None)
    newer = replace(MONOTONIC, generation=8, key="k8")
    assert _verdicts([keyless_older, newer], state) == [
        "forward",
        "older_generation_in_flight",
    ]


def test_stored_barriers_bar_only_newer_generations_of_their_job_until_they_end() -> None:
    state = BatchState(
        now=NOW,
        barriers=[Barrier("job", 6, NOW + 3), Barrier("job", 5, NOW - 1), Barrier("x", 1, NOW + 9)],
    )
    assert state.state_for(MONOTONIC).older_in_flight_until == NOW + 3
    assert state.state_for(replace(MONOTONIC, generation=6)).older_in_flight_until is None


def test_a_reservation_replaces_the_barrier_its_key_row_held() -> None:
    """A key's row carries one barrier: reserved again (an unknown outcome retried),
    its previous attempt's barrier is gone, as it is from the row."""
    previous = replace(record(KeyState.UNKNOWN), generation=6)
    state = BatchState(
        now=NOW,
        records={("pay", "k"): previous},
        key_barriers={("pay", "k"): Barrier("job", 6, NOW + 3)},
    )
    retry = replace(MONOTONIC, upstream_idempotent=True, generation=6)
    assert _verdicts([retry], state) == ["forward"]
    assert state.key_barriers[("pay", "k")] == Barrier("job", 6, NOW + 10)
    assert state.records[("pay", "k")].attempts == 2


def test_without_the_batch_state_two_writes_of_one_key_are_both_forwarded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The in-batch ordering switched off (every decision against the state as it
    was before the batch): shows the tests above can fail."""
    monkeypatch.setattr(BatchState, "apply", lambda self, r: None)
    other_job = replace(FACTS, job_id="job-b", fencing=Fencing.MONOTONIC)
    assert _verdicts([FACTS, other_job], BatchState(now=NOW, leases={"job": ACTIVE})) == [
        "forward",
        "forward",
    ]


def test_lock_names_name_each_job_and_key_and_no_key_of_a_keyless_write() -> None:
    writes = [MONOTONIC, replace(MONOTONIC, key=None, job_id="j2")]
    assert batch_plan.lock_names(writes) == ["job:job", "key:pay\nk", "job:j2"]
    assert batch_plan.lock_names(writes, ("job",)) == ["job:job", "job:j2"]


def test_a_rejection_changes_nothing_later_decisions_read() -> None:
    state = BatchState(now=NOW, marks={"job": 9})
    plans = plan_batch([(MONOTONIC, CONTEXT)], state, _ids())
    assert isinstance(plans[0].decision, Reject) and plans[0].rejection is not None
    assert (state.records, state.marks, state.barriers) == ({}, {"job": 9}, [])


# --- a run of the same write: decided once while nothing changes -----------------------


def _one_by_one(writes: list[tuple[WriteFacts, WriteContext]], state: BatchState) -> list[Any]:
    """Each write planned afresh against the state the ones before it left."""
    plans = []
    ids = _ids()
    for facts, context in writes:
        plan = plan_write(facts, context, state.state_for(facts), state.now, ids)
        if plan.reservation is not None:
            state.apply(plan.reservation)
        plans.append(plan)
    return plans


def test_a_run_of_one_write_is_replayed_each_with_its_own_rejection_row() -> None:
    state = BatchState(now=NOW, records={("pay", "k"): record(KeyState.COMPLETED)})
    other = WriteContext("10.0.0.9", "cd" * 32, 3)
    plans = plan_batch(
        [(MONOTONIC, CONTEXT), (MONOTONIC, CONTEXT), (MONOTONIC, other)], state, _ids()
    )
    assert all(isinstance(p.decision, Replay) for p in plans)
    rows = [p.rejection for p in plans]
    assert rows[0] is not None and rows[2] is not None
    assert rows[1] == rows[0] and (rows[2].remote, rows[2].body_bytes) == ("10.0.0.9", 3)


def test_a_run_of_one_write_on_a_free_key_forwards_only_the_first() -> None:
    """The run's decision is reused only while it changed nothing: after a
    reservation the same write finds its key in flight."""
    assert _verdicts([MONOTONIC] * 3, BatchState(now=NOW)) == [
        "forward",
        "request_in_progress",
        "request_in_progress",
    ]


def test_a_run_reusing_a_forward_forwards_the_key_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run's plan reused past a reservation: shows the test above can fail."""
    monkeypatch.setattr(batch_plan, "_holds_for", lambda last, facts: facts == last[0])
    assert _verdicts([MONOTONIC] * 2, BatchState(now=NOW)) == ["forward", "forward"]


@pytest.mark.parametrize("seed", range(4))
def test_runs_are_planned_as_each_write_afresh(seed: int) -> None:
    """Random batches with runs of one write (some with other request facts)
    against random stored states: the same plans as each write decided anew."""
    rng = random.Random(seed)
    contexts = [CONTEXT, WriteContext("10.0.0.9", "cd" * 32, 3)]
    for _ in range(300):
        records = {
            ("pay", key): replace(record(rng.choice(list(KeyState))), key=key,
                                  fingerprint=rng.choice((FP, "other")))
            for key in ("k", "k2") if rng.random() < 0.7
        }  # fmt: skip
        marks = {"job": rng.randint(5, 9)} if rng.random() < 0.5 else {}
        writes: list[tuple[WriteFacts, WriteContext]] = []
        for _ in range(rng.randint(1, 8)):
            if writes and rng.random() < 0.6:
                writes.append((writes[-1][0], rng.choice(contexts)))
                continue
            facts = replace(
                MONOTONIC, key=rng.choice(("k", "k2", None)), generation=rng.randint(5, 9),
                fingerprint=rng.choice((FP, "other")), upstream_idempotent=rng.random() < 0.5,
            )  # fmt: skip
            writes.append((facts, rng.choice(contexts)))

        planned = plan_batch(
            writes, BatchState(NOW, records=dict(records), marks=dict(marks)), _ids()
        )
        afresh = _one_by_one(writes, BatchState(NOW, records=dict(records), marks=dict(marks)))
        assert planned == afresh
