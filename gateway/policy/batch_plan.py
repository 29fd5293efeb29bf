"""PURE: the decisions of one group-committed batch, in arrival order.

A backend that decides a whole batch in one transaction can read the stored
state of every job and key of the batch once, at the start (`BatchState`), then
plan each write in the order it arrived (`plan_batch`): the SQLite store does so
for the woken writes of one key. (The PostgreSQL store decides in the server,
write by write, in the same order: `gateway/store/postgres_batch.py`, held to
this module by a property test.) Each plan sees what the ones
before it changed: a forwarded write holds its key in flight, bars the newer
generations of its job and raises its job's mark, exactly as if it had been
decided and committed alone just before the next one. So two writes of one key
in one batch behave as one after the other (the second finds the key in
flight), and so do two generations of one job (the newer one finds the older one
on the wire, the older one finds the mark raised).

The state a write reads is the one `decide` reads in a transaction of its own:
the job's lease and mark, the latest barrier of an older generation of the job
still on the wire (`Barrier`), and the key's record. Rejections change nothing
a later decision reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gateway.policy.decision import (
    Fencing,
    KeyRecord,
    KeyState,
    Reject,
    Replay,
    StoredState,
    WriteFacts,
)
from gateway.policy.plan import Reservation, WritePlan, plan_write
from gateway.policy.records import WriteContext, rejection_record
from leases.model import LeaseRow

KeyId = tuple[str, str]  # (destination, key)


@dataclass(frozen=True, slots=True)
class Barrier:
    """An attempt on the wire: it bars generations above `generation` of its job
    until `until` (a keyed write's in its key's row, a keyless one's in attempts)."""

    job_id: str
    generation: int
    until: float


@dataclass(slots=True)
class BatchState:
    """What the batch's decisions read, as stored when the batch began, then
    changed by each forwarded write in turn (`apply`).

    `barriers`: the barriers of the batch's jobs that no write of the batch can
    change (keyless attempts, and rows of keys outside the batch). `key_barriers`:
    those held by the rows of the batch's own keys, which a reservation replaces.
    """

    now: float
    leases: dict[str, LeaseRow] = field(default_factory=dict)
    marks: dict[str, int] = field(default_factory=dict)
    barriers: list[Barrier] = field(default_factory=list)
    records: dict[KeyId, KeyRecord] = field(default_factory=dict)
    key_barriers: dict[KeyId, Barrier] = field(default_factory=dict)

    def state_for(self, facts: WriteFacts) -> StoredState:
        """The stored state `facts`' decision reads now."""
        lease = self.leases.get(facts.job_id) if facts.fencing is Fencing.LEASE else None
        record = None if facts.key is None else self.records.get((facts.destination, facts.key))
        return StoredState(
            lease=lease,
            highest_generation=self.marks.get(facts.job_id),
            older_in_flight_until=self._older(facts.job_id, facts.generation),
            record=record,
        )

    def apply(self, r: Reservation) -> None:
        """What a forwarded write changes for the decisions after it."""
        barrier = Barrier(r.job_id, r.generation, r.barrier_until)
        if r.key is None:
            self.barriers.append(barrier)
        else:
            ident = (r.destination, r.key)
            self.records[ident] = r.key_record(self.records.get(ident))
            self.key_barriers[ident] = barrier
        if r.raise_mark:
            self.marks[r.job_id] = max(r.generation, self.marks.get(r.job_id, r.generation))

    def _older(self, job_id: str, generation: int) -> float | None:
        untils = [
            b.until
            for b in (*self.barriers, *self.key_barriers.values())
            if b.job_id == job_id and b.generation < generation and b.until > self.now
        ]
        return max(untils, default=None)


def batch_state(
    now: float,
    leases: Iterable[LeaseRow],
    marks: Iterable[tuple[str, int]],
    barriers: Iterable[tuple[str, int, float]],
    keys: Iterable[tuple[KeyRecord, float | None]],
) -> BatchState:
    """The state decisions read, assembled alike from the rows every backend reads:
    the jobs' leases and marks; per (job, generation) the latest barrier of an
    older attempt still on the wire, from the rows the decisions cannot change
    (keyless attempts, keys outside the decisions); and the decisions' own key
    rows with their `barrier_until`, which a reservation replaces."""
    state = BatchState(now=now)
    state.leases.update((lease.job_id, lease) for lease in leases)
    state.marks.update(marks)
    state.barriers.extend(Barrier(job, generation, until) for job, generation, until in barriers)
    for record, barrier_until in keys:
        ident = (record.destination, record.key)
        state.records[ident] = record
        barrier = key_barrier(record, barrier_until)
        if barrier is not None:
            state.key_barriers[ident] = barrier
    return state


def key_barrier(record: KeyRecord, barrier_until: float | None) -> Barrier | None:
    """The barrier a stored key row holds: only while in flight (its own column)."""
    if record.state is not KeyState.IN_FLIGHT or barrier_until is None:
        return None
    return Barrier(record.job_id, record.generation, barrier_until)


def plan_batch(
    writes: Sequence[tuple[WriteFacts, WriteContext]],
    state: BatchState,
    new_attempt: Callable[[], str],
) -> list[WritePlan]:
    """Plan every write of the batch in order, each against the state the ones
    before it left (`state` is changed in place).

    A write with the same facts as the one before, which changed nothing (a
    refusal or a replay: the woken duplicates of one key come so), gets the
    same decision without deciding again: the same facts against the same state
    at the same `now`."""
    plans: list[WritePlan] = []
    last: _Planned | None = None
    for facts, context in writes:
        if last is not None and _holds_for(last, facts):
            plan = last[2] if context == last[1] else _refused_alike(last[2], facts, context)
        else:
            plan = plan_write(facts, context, state.state_for(facts), state.now, new_attempt)
            if plan.reservation is not None:
                state.apply(plan.reservation)
        plans.append(plan)
        last = (facts, context, plan)
    return plans


_Planned = tuple[WriteFacts, WriteContext, WritePlan]


def _holds_for(last: _Planned, facts: WriteFacts) -> bool:
    """The last write's plan holds for `facts`: the same facts, and it changed
    nothing a decision reads (no reservation)."""
    return last[2].reservation is None and facts == last[0]


def _refused_alike(plan: WritePlan, facts: WriteFacts, context: WriteContext) -> WritePlan:
    """`plan`'s refusal or replay, its rejection row with `context`'s request facts."""
    decision = plan.decision
    assert isinstance(decision, Replay | Reject)
    return WritePlan(decision, rejection=rejection_record(facts, context, decision))


def lock_names(writes: Iterable[WriteFacts], kinds: Sequence[str] = ("job", "key")) -> list[str]:
    """The advisory locks a batch takes, by name, in arrival order: each write's
    job (`kinds` "job"), then its (destination, key) ("key"; none for a keyless
    write). The store takes them in the order of their hashes, not this one."""
    names: list[str] = []
    for facts in writes:
        if "job" in kinds:
            names.append(f"job:{facts.job_id}")
        if "key" in kinds and facts.key is not None:
            names.append(f"key:{facts.destination}\n{facts.key}")
    return names
