"""PURE: what a write's verdict changes in the store, computed once for every backend.

`decide` says Forward, Replay or Reject; `plan_write` turns that into the rows to
write: on Forward a `Reservation` (the key in flight, the attempt that bars newer
generations, the job's mark if it rises), otherwise the rejection-log row. Each
backend reads the state, asks for the plan and executes it in the same
transaction; backends differ only in how they read and write, never in what.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.policy.decision import (
    Decision,
    Forward,
    KeyRecord,
    KeyState,
    Reject,
    Replay,
    StoredState,
    WriteFacts,
    barrier_deadline,
    decide,
    reservation_deadline,
)
from gateway.policy.records import RejectionRecord, Verdict, WriteContext, rejection_record


@dataclass(frozen=True, slots=True)
class Reservation:
    """What a forwarded write stores before it goes out (SPEC 2 steps 6-8).

    The key (when there is one) is held `in_flight` by `attempt` until `deadline`;
    the attempt bars newer generations of the job until `barrier_until`; the job's
    highest forwarded generation rises to `generation` when `raise_mark`.
    """

    attempt: str
    destination: str
    key: str | None
    fingerprint: str
    job_id: str
    generation: int
    owner: str | None
    at: float
    deadline: float
    barrier_until: float
    raise_mark: bool

    def key_record(self, previous: KeyRecord | None) -> KeyRecord:
        """The key's record once reserved (`previous`: the record it replaces)."""
        assert self.key is not None
        return KeyRecord(
            destination=self.destination,
            key=self.key,
            state=KeyState.IN_FLIGHT,
            fingerprint=self.fingerprint,
            attempt=self.attempt,
            attempts=1 if previous is None else previous.attempts + 1,
            job_id=self.job_id,
            generation=self.generation,
            owner=self.owner,
            created_at=self.at if previous is None else previous.created_at,
            updated_at=self.at,
            deadline=self.deadline,
        )


@dataclass(frozen=True, slots=True)
class WritePlan:
    """A decision and exactly one of the changes it makes."""

    decision: Decision
    reservation: Reservation | None = None
    rejection: RejectionRecord | None = None

    def verdict(self, rejection_id: int | None = None) -> Verdict:
        """The verdict handed back once the plan has been executed."""
        attempt = None if self.reservation is None else self.reservation.attempt
        return Verdict(self.decision, attempt=attempt, rejection_id=rejection_id)


def plan_write(
    facts: WriteFacts,
    context: WriteContext,
    state: StoredState,
    now: float,
    new_attempt: Callable[[], str],
) -> WritePlan:
    """Decide the write against `state` and say what that changes."""
    decision = decide(facts, state, now)
    if isinstance(decision, Forward):
        mark = state.highest_generation
        # Only a forwarded write raises the job's mark (SPEC 2 step 6); a write at
        # the mark (most of them) leaves it as it is.
        return WritePlan(
            decision,
            reservation=Reservation(
                attempt=new_attempt(),
                destination=facts.destination,
                key=facts.key,
                fingerprint=facts.fingerprint,
                job_id=facts.job_id,
                generation=facts.generation,
                owner=facts.owner,
                at=now,
                deadline=reservation_deadline(facts, now),
                barrier_until=barrier_deadline(facts, now),
                raise_mark=mark is None or facts.generation > mark,
            ),
        )
    assert isinstance(decision, Replay | Reject)
    return WritePlan(decision, rejection=rejection_record(facts, context, decision))
