"""Property tests of the write decision: for any sequence of claims, renewals,
completions, releases, clock moves, writes and upstream answers, the forwards the
gateway allows satisfy the contract's invariants (SPEC 2 steps 6-8, SPEC 8).

Two backends run the same sequences through the same checker:

- `ModelBackend`: a small in-memory store that calls `gateway.policy.decision.decide`
  and the `leases.model` transitions exactly as `SQLiteStore` does (read the
  state, decide, apply the verdict);
- `SQLiteBackend`: the real `SQLiteStore` on a fresh file with a fake clock.

The checker does not trust the backend's decision: it keeps its own history of
what was forwarded and answered, and reads the lease and the mark before and
after each write.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.policy.decision import (
    Fencing,
    Forward,
    KeyRecord,
    KeyState,
    Reject,
    Replay,
    StoredState,
    WriteFacts,
    barrier_deadline,
    fingerprint,
    reservation_deadline,
)
from gateway.policy.plan import plan_write
from gateway.policy.records import Outcome, WriteContext
from gateway.store.sqlite import SQLiteStore
from leases import model
from leases.errors import JobCompleted, LeaseHeld, LeaseLost
from leases.model import Lease, LeaseRow, State

START = 1_800_000_000.0
TIMEOUT = 5.0  # every destination's forward timeout


@dataclass(frozen=True)
class Dest:
    name: str
    fencing: Fencing
    upstream_idempotent: bool


DESTS = {
    "pay": Dest("pay", Fencing.LEASE, False),
    "idem": Dest("idem", Fencing.LEASE, True),
    "mono": Dest("mono", Fencing.MONOTONIC, False),
}
# Lease-mode and monotonic jobs are kept apart: a job fenced by a lease must not
# also be written with tokens of another lock service (see test below).
LEASE_JOBS = ("j1", "j2")
MONO_JOBS = ("m1", "m2")
OWNERS = ("a", "b")


# --- operations --------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    job: str
    owner: str
    ttl: float


@dataclass(frozen=True)
class Held:
    op: str  # renew | complete | release
    job: str
    owner: str
    generation: int


@dataclass(frozen=True)
class Advance:
    seconds: float


@dataclass(frozen=True)
class Write:
    dest: str
    job: str
    generation: int
    owner: str | None
    key: str
    payload: bytes


@dataclass(frozen=True)
class Answer:
    index: int
    kind: str  # completed | released | unknown


generations = st.integers(1, 5)
lease_job = st.sampled_from(LEASE_JOBS)
owner = st.sampled_from(OWNERS)
writes = st.one_of(
    st.builds(
        Write,
        st.sampled_from(["pay", "idem"]),
        lease_job,
        generations,
        st.none() | owner,
        st.sampled_from(["k1", "k2", "k3"]),
        st.sampled_from([b"x", b"y"]),
    ),
    st.builds(
        Write,
        st.just("mono"),
        st.sampled_from(MONO_JOBS),
        generations,
        st.none(),
        st.sampled_from(["k1", "k2", "k3"]),
        st.sampled_from([b"x", b"y"]),
    ),
)
operations = st.lists(
    st.one_of(
        st.builds(Claim, lease_job, owner, st.sampled_from([1.0, 4.0, 30.0])),
        st.builds(
            Held, st.sampled_from(["renew", "complete", "release"]), lease_job, owner, generations
        ),
        st.builds(Advance, st.sampled_from([0.5, 2.0, 6.0, 12.0, 40.0])),
        writes,
        writes,
        st.builds(Answer, st.integers(0, 7), st.sampled_from(["completed", "released", "unknown"])),
    ),
    max_size=40,
)


def facts_for(w: Write) -> WriteFacts:
    dest = DESTS[w.dest]
    return WriteFacts(
        destination=dest.name,
        method="POST",
        path="/x",
        query="",
        job_id=w.job,
        generation=w.generation,
        owner=w.owner,
        key=w.key,
        fingerprint=fingerprint("POST", "/x", "", "application/json", w.payload),
        fencing=dest.fencing,
        upstream_idempotent=dest.upstream_idempotent,
        timeout=TIMEOUT,
    )


def outcome_for(kind: str) -> Outcome:
    if kind == "completed":
        return Outcome(
            "completed", status=201, headers=(("Content-Type", "text/plain"),), body=b"ok"
        )
    return Outcome(kind)


# --- backends ----------------------------------------------------------------------------


class Backend(Protocol):
    now: float

    async def advance(self, seconds: float) -> None: ...
    async def claim(self, job: str, owner: str, ttl: float) -> Lease | None: ...
    async def held(self, op: str, job: str, owner: str, generation: int) -> Lease | None: ...
    async def lease(self, job: str) -> LeaseRow | None: ...
    async def mark(self, job: str) -> int | None: ...
    async def decide(self, facts: WriteFacts) -> tuple[Any, str | None]: ...
    async def record(self, facts: WriteFacts, attempt: str, outcome: Outcome) -> bool: ...


_CONTEXT = WriteContext("127.0.0.1", "0" * 64, 1)


@dataclass
class ModelBackend:
    """The store's algorithm over dicts: read state, plan the write, execute the plan."""

    now: float = START
    leases: dict[str, LeaseRow] = field(default_factory=dict)
    marks: dict[str, int] = field(default_factory=dict)
    attempts: dict[str, tuple[str, int, float]] = field(default_factory=dict)
    keys: dict[tuple[str, str], KeyRecord] = field(default_factory=dict)
    counter: int = 0

    async def advance(self, seconds: float) -> None:
        self.now += seconds

    async def claim(self, job: str, owner: str, ttl: float) -> Lease | None:
        row = self.leases.get(job)
        if model.claim_refusal(row, self.now) is not None:
            return None
        self.leases[job] = model.claimed(row, job, owner, ttl, self.now)
        return Lease.from_row(self.leases[job], self.now)

    async def held(self, op: str, job: str, owner: str, generation: int) -> Lease | None:
        row = self.leases.get(job)
        if row is None or model.hold_refusal(row, generation, owner, self.now) is not None:
            return None
        transition = {
            "renew": lambda r: model.renewed(r, r.ttl, self.now),
            "complete": lambda r: model.completed(r, self.now),
            "release": lambda r: model.released(r, self.now),
        }[op]
        self.leases[job] = transition(row)
        return Lease.from_row(self.leases[job], self.now)

    async def lease(self, job: str) -> LeaseRow | None:
        return self.leases.get(job)

    async def mark(self, job: str) -> int | None:
        return self.marks.get(job)

    async def decide(self, facts: WriteFacts) -> tuple[Any, str | None]:
        now = self.now
        older = [
            deadline
            for job, gen, deadline in self.attempts.values()
            if job == facts.job_id and gen < facts.generation and deadline > now
        ]
        assert facts.key is not None
        state = StoredState(
            lease=self.leases.get(facts.job_id) if facts.fencing is Fencing.LEASE else None,
            highest_generation=self.marks.get(facts.job_id),
            older_in_flight_until=max(older, default=None),
            record=self.keys.get((facts.destination, facts.key)),
        )
        plan = plan_write(facts, state=state, context=_CONTEXT, now=now, new_attempt=self._next)
        r = plan.reservation
        if r is None:  # nothing but a rejection-log row, which the model does not keep
            return plan.decision, None
        self.keys[(facts.destination, facts.key)] = r.key_record(state.record)
        self.attempts[r.attempt] = (r.job_id, r.generation, r.barrier_until)
        if r.raise_mark:
            self.marks[r.job_id] = r.generation
        return plan.decision, r.attempt

    def _next(self) -> str:
        self.counter += 1
        return f"a{self.counter}"

    async def record(self, facts: WriteFacts, attempt: str, outcome: Outcome) -> bool:
        self.attempts.pop(attempt, None)
        assert facts.key is not None
        ident = (facts.destination, facts.key)
        record = self.keys.get(ident)
        if record is None or record.attempt != attempt:
            return False
        if outcome.kind == "released":
            del self.keys[ident]
        elif outcome.kind == "unknown":
            self.keys[ident] = _replace(record, state=KeyState.UNKNOWN)
        else:
            self.keys[ident] = _replace(
                record,
                state=KeyState.COMPLETED,
                status=outcome.status,
                headers=outcome.headers,
                body=outcome.body,
                completed_at=self.now,
            )
        return True


def _replace(record: KeyRecord, **changes: Any) -> KeyRecord:
    from dataclasses import replace

    return replace(record, **changes)


class FakeClock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


class SQLiteBackend:
    """The real SQLiteStore; the checker reads leases and marks through its verbs."""

    def __init__(self, store: SQLiteStore, clock: FakeClock) -> None:
        self.store = store
        self.clock = clock

    @property
    def now(self) -> float:
        return self.clock.now

    async def advance(self, seconds: float) -> None:
        self.clock.now += seconds

    async def claim(self, job: str, owner: str, ttl: float) -> Lease | None:
        try:
            return await self.store.claim(job, owner=owner, ttl=ttl)
        except (LeaseHeld, JobCompleted):
            return None

    async def held(self, op: str, job: str, owner: str, generation: int) -> Lease | None:
        named = Lease(job, owner, generation, "active", Lease.from_row(_ZERO, 0).lease_until, 0.0)
        try:
            return await getattr(self.store, op)(named)  # type: ignore[no-any-return]
        except LeaseLost:
            return None

    async def lease(self, job: str) -> LeaseRow | None:
        state = await self.store.job_state(job)
        return None if state is None else state.lease

    async def mark(self, job: str) -> int | None:
        state = await self.store.job_state(job)
        return None if state is None else state.highest_generation

    async def decide(self, facts: WriteFacts) -> tuple[Any, str | None]:
        verdict = await self.store.decide_write(facts, _CONTEXT)
        return verdict.decision, verdict.attempt

    async def record(self, facts: WriteFacts, attempt: str, outcome: Outcome) -> bool:
        return await self.store.record_outcome(facts, attempt, outcome)


_ZERO = LeaseRow("z", "z", 1, State.ACTIVE, 0.0, 1.0)


# --- the checker -------------------------------------------------------------------------


@dataclass
class Sent:
    """One forward the checker saw, and what became of it."""

    facts: WriteFacts
    attempt: str
    at: float
    outcome: str | None = None  # None while unanswered


@dataclass
class Checker:
    backend: Backend
    sent: list[Sent] = field(default_factory=list)
    forwards: int = 0
    rejections: dict[str, int] = field(default_factory=dict)

    async def run(self, ops: list[Any]) -> None:
        for op in ops:
            await self.apply(op)

    async def apply(self, op: Any) -> None:
        b = self.backend
        if isinstance(op, Advance):
            await b.advance(op.seconds)
        elif isinstance(op, Claim):
            before = await b.lease(op.job)
            lease = await b.claim(op.job, op.owner, op.ttl)
            if lease is not None:
                expected = 1 if before is None else before.generation + 1
                assert lease.generation == expected, "a claim bumps the generation by one"
        elif isinstance(op, Held):
            await b.held(op.op, op.job, op.owner, op.generation)
        elif isinstance(op, Write):
            await self.write(op)
        elif isinstance(op, Answer):
            pending = [s for s in self.sent if s.outcome is None]
            if pending:
                chosen = pending[op.index % len(pending)]
                chosen.outcome = op.kind
                await b.record(chosen.facts, chosen.attempt, outcome_for(op.kind))

    async def write(self, op: Write) -> None:
        b = self.backend
        facts = facts_for(op)
        now = b.now
        lease = await b.lease(op.job)
        mark_before = await b.mark(op.job)
        decision, attempt = await b.decide(facts)
        mark_after = await b.mark(op.job)
        if mark_before is not None:
            assert mark_after is not None and mark_after >= mark_before, "a mark was lowered"
        if not isinstance(decision, Forward):
            assert isinstance(decision, Reject | Replay)
            assert mark_after == mark_before, "a rejected or replayed write moved the mark"
            reason = "duplicate" if isinstance(decision, Replay) else decision.reason
            self.rejections[reason] = self.rejections.get(reason, 0) + 1
            if isinstance(decision, Replay):
                assert self._last_outcome(facts) == "completed"
            return
        assert attempt is not None
        self.forwards += 1
        assert mark_after == max(mark_before or 0, op.generation), "the mark is the token"
        if facts.fencing is Fencing.LEASE:
            assert lease is not None and lease.state is State.ACTIVE
            assert lease.generation == op.generation, "forwarded a non-current generation"
            assert lease.lease_until > now, "forwarded under an expired lease"
            assert op.owner in (None, lease.owner), "forwarded for another owner"
        else:
            assert mark_before is None or op.generation >= mark_before, (
                "forwarded a generation below the job's mark"
            )
        same_job = [s for s in self.sent if s.facts.job_id == op.job]
        assert all(s.facts.generation <= op.generation for s in same_job), (
            "a generation older than one already forwarded for the job was forwarded"
        )
        assert not any(
            s.outcome is None
            and s.facts.generation < op.generation
            and barrier_deadline(s.facts, s.at) > now
            for s in same_job
        ), "two generations of one job on the wire at once"
        self._check_key_reuse(facts, now)
        self.sent.append(Sent(facts, attempt, now))

    def _last(self, facts: WriteFacts) -> Sent | None:
        same = [
            s
            for s in self.sent
            if (s.facts.destination, s.facts.key) == (facts.destination, facts.key)
        ]
        return same[-1] if same else None

    def _last_outcome(self, facts: WriteFacts) -> str | None:
        last = self._last(facts)
        return None if last is None else last.outcome

    def _check_key_reuse(self, facts: WriteFacts, now: float) -> None:
        """A key goes out again only after its last attempt was released, or, on an
        upstream_idempotent destination, after it ended unknown (or died)."""
        last = self._last(facts)
        if last is None or last.outcome == "released":
            return
        dead = last.outcome is None and reservation_deadline(last.facts, last.at) <= now
        assert facts.upstream_idempotent and (last.outcome == "unknown" or dead), (
            f"key {facts.key} forwarded twice to {facts.destination} (last: {last.outcome})"
        )


# --- the properties --------------------------------------------------------------------------


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_the_decision_never_allows_a_forward_that_breaks_the_invariants(ops: list[Any]) -> None:
    asyncio.run(Checker(ModelBackend()).run(ops))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(operations)
def test_the_sqlite_store_never_allows_a_forward_that_breaks_the_invariants(
    ops: list[Any],
) -> None:
    async def run() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            clock = FakeClock()
            store = await SQLiteStore.open(f"sqlite:///{Path(tmp) / 'g.db'}", clock=clock)
            try:
                await Checker(SQLiteBackend(store, clock)).run(ops)
            finally:
                await store.close()

    asyncio.run(run())


def test_the_checker_catches_a_second_forward_of_a_key() -> None:
    """The checker can fail: a store that forgets keys is caught."""

    class Forgetful(ModelBackend):
        async def decide(self, facts: WriteFacts) -> tuple[Any, str | None]:
            self.keys.clear()
            return await super().decide(facts)

    ops = [Write("mono", "m1", 1, None, "k1", b"x"), Write("mono", "m1", 1, None, "k1", b"x")]
    try:
        asyncio.run(Checker(Forgetful()).run(ops))
    except AssertionError as exc:
        assert "forwarded twice" in str(exc)
    else:
        raise AssertionError("the checker missed a second forward of one key")


def test_the_checker_catches_a_stale_generation() -> None:
    class Unfenced(ModelBackend):
        async def decide(self, facts: WriteFacts) -> tuple[Any, str | None]:
            saved, self.marks = self.marks, {}  # decide without the mark...
            result = await super().decide(facts)
            for job, mark in saved.items():  # ...but keep marks monotonic
                self.marks[job] = max(mark, self.marks.get(job, 0))
            return result

    ops = [Write("mono", "m1", 3, None, "k1", b"x"), Write("mono", "m1", 2, None, "k2", b"x")]
    try:
        asyncio.run(Checker(Unfenced()).run(ops))
    except AssertionError as exc:
        assert "generation" in str(exc)
    else:
        raise AssertionError("the checker missed a stale generation")


def test_one_job_across_a_monotonic_and_a_lease_destination_never_goes_back() -> None:
    ops = [
        Claim("j1", "a", 30.0),
        Write("mono", "j1", 5, None, "k1", b"x"),
        Write("pay", "j1", 1, None, "k2", b"x"),
    ]
    asyncio.run(Checker(ModelBackend()).run(ops))
