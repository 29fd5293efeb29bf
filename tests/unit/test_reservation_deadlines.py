"""The PostgreSQL store's memory of when each attempt's reservation ends (how long
an outcome is worth sending again): bounded, and cheap with many attempts in flight."""

from __future__ import annotations

import time

from gateway.policy.decision import RESERVATION_GRACE_S
from gateway.store.postgres_outcomes import ReservationDeadlines


def test_an_attempt_decided_here_is_retried_until_its_own_deadline() -> None:
    deadlines = ReservationDeadlines()
    before = time.monotonic()
    deadlines.add("a", 30.0)
    assert before + 30.0 <= deadlines.pop("a") <= time.monotonic() + 30.0
    # Popped: asked again (or for an attempt not decided here), only the grace.
    assert deadlines.pop("a") <= time.monotonic() + RESERVATION_GRACE_S


def test_attempts_whose_outcome_never_comes_are_dropped_once_past_their_deadline() -> None:
    deadlines = ReservationDeadlines()
    for n in range(3 * ReservationDeadlines.PRUNE_AT):
        deadlines.add(f"gone-{n}", -1.0)  # already past
    assert len(deadlines._until) <= ReservationDeadlines.PRUNE_AT


def test_many_attempts_in_flight_raise_the_bound_instead_of_scanning_at_every_add() -> None:
    deadlines = ReservationDeadlines()
    for n in range(3 * ReservationDeadlines.PRUNE_AT):
        deadlines.add(f"live-{n}", 60.0)
    assert len(deadlines._until) == 3 * ReservationDeadlines.PRUNE_AT  # none lost
    assert deadlines._prune_at > len(deadlines._until)  # the next add does not scan
