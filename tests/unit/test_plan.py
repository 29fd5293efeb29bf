"""gateway.policy.plan.plan_write as plain tables: what each verdict writes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from gateway.policy.decision import Forward, KeyState, Reject, Replay, StoredState
from gateway.policy.plan import plan_write
from gateway.policy.records import WriteContext
from leases.model import LeaseRow, State
from tests.unit.test_decision import ACTIVE, FACTS, NOW, record

CONTEXT = WriteContext("10.0.0.1", "ab" * 32, 2)


def _ids() -> Callable[[], str]:
    return iter(f"attempt-{i}" for i in range(1, 100)).__next__


def test_a_first_forward_reserves_the_key_bars_until_timeout_and_raises_the_mark() -> None:
    plan = plan_write(FACTS, CONTEXT, StoredState(ACTIVE, None, None, None), NOW, _ids())
    r = plan.reservation
    assert isinstance(plan.decision, Forward) and plan.rejection is None and r is not None
    assert (r.attempt, r.key, r.job_id, r.generation) == ("attempt-1", "k", "job", 7)
    assert (r.at, r.barrier_until, r.deadline) == (NOW, NOW + 10, NOW + 15)
    assert r.raise_mark
    assert plan.verdict().attempt == "attempt-1"


def test_a_forward_at_the_mark_leaves_it_and_a_keyless_forward_reserves_no_key() -> None:
    at_mark = StoredState(ACTIVE, 7, None, None)
    plan = plan_write(replace(FACTS, key=None), CONTEXT, at_mark, NOW, _ids())
    assert plan.reservation is not None
    assert (plan.reservation.key, plan.reservation.raise_mark) == (None, False)


def test_a_retry_of_a_released_key_counts_its_attempts_and_keeps_created_at() -> None:
    previous = record(KeyState.UNKNOWN)
    plan = plan_write(
        replace(FACTS, upstream_idempotent=True),
        CONTEXT,
        StoredState(ACTIVE, 7, None, previous),
        NOW,
        _ids(),
    )
    assert plan.reservation is not None
    again = plan.reservation.key_record(previous)
    assert (again.state, again.attempts, again.created_at) == (
        KeyState.IN_FLIGHT,
        2,
        previous.created_at,
    )


def test_a_rejection_writes_only_its_log_row_with_the_request_facts() -> None:
    stale = StoredState(LeaseRow("job", "b", 8, State.ACTIVE, NOW + 5, 10.0), 8, None, None)
    plan = plan_write(FACTS, CONTEXT, stale, NOW, _ids())
    assert isinstance(plan.decision, Reject) and plan.reservation is None
    assert plan.rejection is not None
    assert (plan.rejection.reason, plan.rejection.current_generation) == ("stale_generation", 8)
    assert (plan.rejection.remote, plan.rejection.body_bytes) == ("10.0.0.1", 2)
    assert plan.verdict(41).rejection_id == 41 and plan.verdict(41).attempt is None


def test_a_replay_is_logged_as_duplicate_and_reserves_nothing() -> None:
    done = StoredState(ACTIVE, 7, None, record(KeyState.COMPLETED))
    plan = plan_write(FACTS, CONTEXT, done, NOW, _ids())
    assert isinstance(plan.decision, Replay) and plan.reservation is None
    assert plan.rejection is not None and plan.rejection.reason == "duplicate"
