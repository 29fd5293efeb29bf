"""gateway.policy.batch_plan as plain tables: one batch decided as one after the other."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.policy import batch_plan
from gateway.policy.batch_plan import Barrier, BatchState, plan_batch
from gateway.policy.decision import Fencing, Forward, KeyState, Reject, WriteFacts
from tests.unit.test_decision import ACTIVE, FACTS, NOW, record
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
