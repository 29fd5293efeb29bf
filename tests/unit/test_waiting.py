"""The waiter registry (SPEC 2 "Waiting") with a decision the test plays: what wakes
a held write, that it is then decided again by the same call, and its bounds."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

import pytest

from gateway.policy.decision import (
    Fencing,
    Forward,
    KeyRecord,
    KeyState,
    Reject,
    Replay,
    WriteFacts,
)
from gateway.policy.records import Verdict
from gateway.store.records import JobState
from gateway.telemetry.metrics import Metrics
from gateway.write import waiting
from gateway.write.waiting import Waited, Waiters
from leases.reasons import Reason

FACTS = WriteFacts(
    destination="pay",
    method="POST",
    path="/x",
    query="",
    job_id="job-1",
    generation=2,
    owner=None,
    key="key-1",
    fingerprint="fp",
    fencing=Fencing.LEASE,
    upstream_idempotent=False,
    timeout=10.0,
)
IN_PROGRESS = Verdict(Reject(Reason.REQUEST_IN_PROGRESS, "in flight", retry_after=60))
BARRED = Verdict(Reject(Reason.OLDER_GENERATION_IN_FLIGHT, "older", retry_after=60))
RECORD = KeyRecord("pay", "key-1", KeyState.COMPLETED, "fp", "a", 1, "job-1", 1, None, 0, 0, 0)
REPLAY = Verdict(Replay(RECORD))


def decisions(*verdicts: Verdict) -> tuple[Callable[[], Awaitable[Verdict]], list[Verdict]]:
    """A decision answering `verdicts` in turn; the list of those given so far."""
    given: list[Verdict] = []

    async def decide() -> Verdict:
        verdict = verdicts[len(given)]
        given.append(verdict)
        return verdict

    return decide, given


def never_gone() -> bool:
    return False


def nothing_left(waiters: Waiters) -> bool:
    """No write watches anything any more (nothing kept for a key never settled again)."""
    return waiters.count == 0 and not waiters._keys and not waiters._jobs


async def held(waiters: Waiters, n: int = 1) -> None:
    for _ in range(200):
        if waiters.count == n:
            return
        await asyncio.sleep(0.005)
    pytest.fail(f"{n} writes never held")


async def test_a_settlement_of_its_key_wakes_it_and_it_is_decided_again() -> None:
    waiters = Waiters(limit=10, metrics=Metrics())
    decide, given = decisions(IN_PROGRESS, REPLAY)
    task = asyncio.create_task(waiters.decide(FACTS, 30, decide, never_gone))
    await held(waiters)
    waiters.settled("pay", "other-key", "job-9")  # someone else's: still held
    await asyncio.sleep(0.01)
    assert len(given) == 1
    waiters.settled("pay", "key-1", "job-1")
    waited = await asyncio.wait_for(task, 5)
    assert waited.verdict is REPLAY and waited.result == "replayed" and waited.applied
    assert nothing_left(waiters)


async def test_a_barred_write_is_woken_by_its_job() -> None:
    waiters = Waiters(limit=10, metrics=Metrics())
    forward = Verdict(Forward(), attempt="a2")
    decide, _ = decisions(BARRED, forward)
    task = asyncio.create_task(waiters.decide(FACTS, 30, decide, never_gone))
    await held(waiters)
    waiters.settled("other", None, "job-1")  # a keyless attempt of the job, elsewhere
    waited = await asyncio.wait_for(task, 5)
    assert waited.verdict is forward and waited.result == "forwarded"
    assert nothing_left(waiters)


async def test_a_settlement_during_the_decision_is_not_missed() -> None:
    """Checked by hand: watching only after the decision, this write waits its
    whole cap (the test times out)."""
    waiters = Waiters(limit=10, metrics=Metrics())
    given: list[Verdict] = []

    async def decide() -> Verdict:
        if not given:
            waiters.settled("pay", "key-1", "job-1")  # committed just after the read
            given.append(IN_PROGRESS)
            return IN_PROGRESS
        given.append(REPLAY)
        return REPLAY

    waited = await asyncio.wait_for(waiters.decide(FACTS, 30, decide, never_gone), 5)
    assert waited.verdict is REPLAY and len(given) == 2
    assert nothing_left(waiters)


async def test_one_more_than_the_limit_is_answered_at_once() -> None:
    metrics = Metrics()
    waiters = Waiters(limit=1, metrics=metrics)
    first = asyncio.create_task(waiters.decide(FACTS, 30, decisions(IN_PROGRESS)[0], never_gone))
    await held(waiters)
    decide, given = decisions(IN_PROGRESS)
    waited = await waiters.decide(FACTS, 30, decide, never_gone)
    assert waited.verdict is IN_PROGRESS and not waited.applied and waited.result == "full"
    assert len(given) == 1
    # Counted (and said in the decision's log line as wait=full), for max_waiting's sake.
    assert b'sinkgate_waits_total{result="full"} 1.0' in metrics.render()[0]
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert nothing_left(waiters)  # a cancelled handler leaves nothing behind


async def test_a_worker_gone_away_ends_the_wait_without_deciding_again() -> None:
    waiters = Waiters(limit=10, metrics=Metrics())
    gone = False
    decide, given = decisions(IN_PROGRESS)
    task = asyncio.create_task(waiters.decide(FACTS, 30, decide, lambda: gone))
    await held(waiters)
    gone = True
    waited = await asyncio.wait_for(task, 5)
    assert waited.result == "disconnected" and len(given) == 1
    assert nothing_left(waiters)


async def test_the_blockers_deadline_ends_the_wait_by_deciding_again() -> None:
    """A reservation whose gateway died settles by its deadline alone (nobody tells)."""
    waiters = Waiters(limit=10, metrics=Metrics())
    soon = Verdict(dataclasses.replace(IN_PROGRESS.decision, retry_after=0))
    unknown = Verdict(Reject(Reason.OUTCOME_UNKNOWN, "unknown"))
    decide, _ = decisions(soon, unknown)
    waited = await asyncio.wait_for(waiters.decide(FACTS, 30, decide, never_gone), 5)
    assert waited.verdict is unknown and waited.result == "refused"
    assert nothing_left(waiters)


async def test_a_write_decided_again_just_short_of_its_cap_is_answered_then() -> None:
    """What blocks it due to end a few milliseconds before the cap: the write was
    decided there, uncapped, held again for what was left, and decided a second
    time at the cap (two store transactions and two rejection rows for one
    answer). Now a decision that near the cap is the capped one."""
    waiters = Waiters(limit=10, metrics=Metrics())
    soon = Verdict(dataclasses.replace(IN_PROGRESS.decision, retry_after=0))
    later = Verdict(dataclasses.replace(IN_PROGRESS.decision, retry_after=7))
    given: list[Verdict] = []

    async def decide() -> Verdict:  # the first decision takes all but 5 ms of the cap
        given.append(soon if not given else later)
        if len(given) == 1:
            await asyncio.sleep(1 - 0.005)
        return given[-1]

    waited = await asyncio.wait_for(waiters.decide(FACTS, 1, decide, never_gone), 5)
    assert waited.result == "timed_out" and waited.verdict is later
    assert len(given) == 2  # not 3
    assert nothing_left(waiters)


async def test_at_its_cap_the_write_is_answered_as_if_it_had_just_arrived() -> None:
    """Held 1 s: the 409 is decided then (its Retry-After counted from then, not
    one made of the first answer's whole seconds), and what settled unseen in
    the meantime is answered as it now is."""
    waiters = Waiters(limit=10, metrics=Metrics())
    later = Verdict(dataclasses.replace(IN_PROGRESS.decision, retry_after=7))
    decide, given = decisions(IN_PROGRESS, later)
    waited = await asyncio.wait_for(waiters.decide(FACTS, 1, decide, never_gone), 5)
    assert waited.verdict is later and waited.result == "timed_out"
    assert waited.seconds >= 1.0 and len(given) == 2
    decide, _ = decisions(IN_PROGRESS, REPLAY)
    waited = await asyncio.wait_for(waiters.decide(FACTS, 1, decide, never_gone), 5)
    assert waited.verdict is REPLAY and waited.result == "replayed"
    assert nothing_left(waiters)


async def test_a_decision_again_that_fails_fails_the_write_and_is_counted() -> None:
    """At the cap the store is down: the write gets the store's refusal (as one
    arriving then would), and its wait is counted `failed`, not left out."""
    metrics = Metrics()
    waiters = Waiters(limit=10, metrics=metrics)
    calls = 0

    async def decide() -> Verdict:
        nonlocal calls
        calls += 1
        if calls == 1:
            return IN_PROGRESS
        raise RuntimeError("store down")

    with pytest.raises(RuntimeError, match="store down"):
        await asyncio.wait_for(waiters.decide(FACTS, 1, decide, never_gone), 5)
    assert b'sinkgate_waits_total{result="failed"} 1.0' in metrics.render()[0]
    assert nothing_left(waiters)


class Starter:
    """A `WokenStart` the test plays: each started decision's answer kept for the
    test to settle; `can` False: nothing starts (the write decides on its own)."""

    def __init__(self, can: bool = True) -> None:
        self.can = can
        self.answers: list[asyncio.Future[Verdict | None]] = []
        self.finished = 0
        self.abandoned = 0

    def start(self, answer: asyncio.Future[Verdict | None]) -> bool:
        if self.can:
            self.answers.append(answer)
        return self.can

    def finish(self, answer: asyncio.Future[Verdict | None]) -> Verdict:
        self.finished += 1
        verdict = answer.result()
        assert verdict is not None
        return verdict

    def abandon(self) -> None:
        self.abandoned += 1


async def woken_with(
    starter: Starter, decide: Callable[[], Awaitable[Verdict]]
) -> tuple[Waiters, asyncio.Task[Waited]]:
    """A write refused `request_in_progress`, held, then woken by its key's
    settlement, with `starter` to start its decision."""
    waiters = Waiters(limit=10, metrics=Metrics())
    task = asyncio.create_task(waiters.decide(FACTS, 30, decide, never_gone, starter))
    await held(waiters)
    waiters.settled("pay", "key-1", "job-1")
    return waiters, task


async def test_the_wake_starts_the_decision_and_the_write_resumes_with_its_verdict() -> None:
    starter = Starter()
    decide, given = decisions(IN_PROGRESS)  # its own call decides once only
    waiters, task = await woken_with(starter, decide)
    assert len(starter.answers) == 1  # started by the wake itself, before any resume
    await asyncio.sleep(0.01)
    assert not task.done()  # not resumed: its decision is still being taken
    starter.answers[0].set_result(REPLAY)
    waited = await asyncio.wait_for(task, 5)
    assert waited.verdict is REPLAY and waited.result == "replayed"
    assert len(given) == 1 and starter.finished == 1
    assert nothing_left(waiters)


async def test_writes_held_on_one_key_are_woken_in_the_order_they_came() -> None:
    """The first held is decided first (on SQLite, the first of a run is the one
    forwarded after a release). The registry held them in a set: a later write
    could be forwarded and an earlier one, held longer, replayed."""
    started: list[int] = []

    class Recording(Starter):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.n = n

        def start(self, answer: asyncio.Future[Verdict | None]) -> bool:
            started.append(self.n)
            return super().start(answer)

    waiters = Waiters(limit=100, metrics=Metrics())
    starters = [Recording(n) for n in range(40)]
    tasks = []
    for n, starter in enumerate(starters):  # one at a time: held in this order
        decide, _ = decisions(IN_PROGRESS)
        tasks.append(asyncio.create_task(waiters.decide(FACTS, 30, decide, never_gone, starter)))
        await held(waiters, n + 1)
    waiters.settled("pay", "key-1", "job-1")
    assert started == list(range(40))
    for starter in starters:
        starter.answers[0].set_result(REPLAY)
    assert all(w.verdict is REPLAY for w in await asyncio.gather(*tasks))


async def test_a_decision_that_cannot_start_is_left_to_the_write() -> None:
    starter = Starter(can=False)
    decide, given = decisions(IN_PROGRESS, REPLAY)
    waiters, task = await woken_with(starter, decide)
    waited = await asyncio.wait_for(task, 5)
    assert waited.verdict is REPLAY and len(given) == 2 and starter.finished == 0
    assert nothing_left(waiters)


async def test_a_settlement_during_a_started_decision_is_not_missed() -> None:
    """Checked by hand: with the write given a new future but not registered again
    when its decision starts (`_rewatch` out of `Waiters._wake`), it waits its
    whole cap (the test times out)."""
    starter = Starter()
    decide, given = decisions(IN_PROGRESS, REPLAY)
    waiters, task = await woken_with(starter, decide)
    waiters.settled("pay", "key-1", "job-1")  # the next attempt settled meanwhile
    assert len(starter.answers) == 1  # the first settlement's decision only
    starter.answers[0].set_result(IN_PROGRESS)  # it read the key before that settled
    waited = await asyncio.wait_for(task, 5)
    assert waited.verdict is REPLAY and len(given) == 2
    assert nothing_left(waiters)


async def test_a_write_cancelled_during_its_started_decision_abandons_it() -> None:
    starter = Starter()
    waiters, task = await woken_with(starter, decisions(IN_PROGRESS)[0])
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert starter.abandoned == 1 and starter.finished == 0
    assert starter.answers[0].cancelled()  # so the group drops it, undecided
    assert nothing_left(waiters)


async def test_a_started_decision_that_fails_fails_the_write_and_leaves_nothing() -> None:
    starter = Starter()
    waiters, task = await woken_with(starter, decisions(IN_PROGRESS)[0])
    starter.answers[0].set_exception(RuntimeError("store down"))
    with pytest.raises(RuntimeError, match="store down"):
        await asyncio.wait_for(task, 5)
    assert starter.finished == 1  # the starter turned the failure into its answer
    assert nothing_left(waiters)


async def test_a_started_decision_is_not_cut_short_by_the_waits_timer() -> None:
    """Woken just before its blocker's deadline, a write whose decision takes past
    it: the timer of the wait that ended must not wake the next wait, or a verdict
    of "still in flight" is decided again at once, alone. Checked by hand: without
    the timer cancelled at the start, the write's own call decides it twice."""
    waiters = Waiters(limit=10, metrics=Metrics())
    starter = Starter()
    soon = Verdict(dataclasses.replace(IN_PROGRESS.decision, retry_after=1))
    decide, given = decisions(soon, REPLAY)
    task = asyncio.create_task(waiters.decide(FACTS, 30, decide, never_gone, starter))
    await asyncio.sleep(0.5)  # held, its blocker due in 1 s
    waiters.settled("pay", "key-1", "job-1")
    await asyncio.sleep(1.0)  # the decision still running past that second
    starter.answers[0].set_result(IN_PROGRESS)  # still in flight, for 60 s more
    await asyncio.sleep(0.1)
    assert not task.done() and len(given) == 1  # held again, not decided again
    waiters.settled("pay", "key-1", "job-1")
    starter.answers[1].set_result(REPLAY)
    waited = await asyncio.wait_for(task, 5)
    assert waited.verdict is REPLAY and len(given) == 1 and starter.finished == 2
    assert nothing_left(waiters)


class FailingStarter(Starter):
    def start(self, answer: asyncio.Future[Verdict | None]) -> bool:
        raise RuntimeError("cannot start")


async def test_a_starter_that_fails_leaves_the_write_to_decide_and_wakes_the_others() -> None:
    waiters = Waiters(limit=10, metrics=Metrics())
    first, second = decisions(IN_PROGRESS, REPLAY), decisions(IN_PROGRESS, REPLAY)
    tasks = [
        asyncio.create_task(waiters.decide(FACTS, 30, decide, never_gone, FailingStarter()))
        for decide, _ in (first, second)
    ]
    await held(waiters, 2)
    waiters.settled("pay", "key-1", "job-1")
    done = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert [w.result for w in done] == ["replayed", "replayed"]
    assert len(first[1]) == len(second[1]) == 2
    assert nothing_left(waiters)


async def test_a_write_whose_worker_is_gone_is_not_started() -> None:
    waiters = Waiters(limit=10, metrics=Metrics())
    starter = Starter()
    gone = False
    task = asyncio.create_task(
        waiters.decide(FACTS, 30, decisions(IN_PROGRESS)[0], lambda: gone, starter)
    )
    await held(waiters)
    gone = True
    waiters.settled("pay", "key-1", "job-1")
    waited = await asyncio.wait_for(task, 5)
    assert waited.result == "disconnected" and starter.answers == []
    assert nothing_left(waiters)


class PolledStore:
    """What the poll reads: the key in flight until `settle()`, no job attempts."""

    def __init__(self) -> None:
        self.record: KeyRecord | None = dataclasses.replace(
            RECORD, state=KeyState.IN_FLIGHT, deadline=1e12
        )
        self.reads = 0

    def clock(self) -> float:
        return 0.0

    async def key_record(self, destination: str, key: str) -> KeyRecord | None:
        self.reads += 1
        return self.record

    async def job_state(self, job_id: str) -> JobState | None:
        return None


async def test_a_poll_of_the_keys_row_wakes_it_when_nothing_else_tells() -> None:
    store = PolledStore()
    waiters = Waiters(limit=10, metrics=Metrics(), store=store, poll_s=0.01)

    async def decide() -> Verdict:
        return IN_PROGRESS if store.record is not None else REPLAY

    tasks = [asyncio.create_task(waiters.decide(FACTS, 30, decide, never_gone)) for _ in (1, 2)]
    await held(waiters, 2)
    reads = store.reads
    await asyncio.sleep(0.05)
    assert store.reads > reads  # polled while in flight, and still held
    assert waiters.count == 2
    store.record = None  # settled by another process
    done = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert [w.result for w in done] == ["replayed", "replayed"]
    assert nothing_left(waiters)


async def test_a_stopping_gateway_answers_held_writes_at_once() -> None:
    """Shutdown does not wait out anyone's wait: the 409, with a fresh Retry-After,
    and the next write is not held at all."""
    waiters = Waiters(limit=10, metrics=Metrics())
    decide, given = decisions(IN_PROGRESS)
    task = asyncio.create_task(waiters.decide(FACTS, 30, decide, never_gone))
    await held(waiters)
    waiters.stop()
    waited = await asyncio.wait_for(task, 5)
    assert waited.result == "stopped" and len(given) == 1
    assert waited.verdict.decision.reason == Reason.REQUEST_IN_PROGRESS
    assert 1 <= waited.verdict.decision.retry_after <= 60
    late = await waiters.decide(FACTS, 30, decisions(IN_PROGRESS)[0], never_gone)
    assert not late.applied


async def test_a_poll_of_the_job_wakes_a_barred_write_once_no_older_attempt_is_on_the_wire() -> (
    None
):
    store = PolledStore()
    older = {"generation": 1, "attempt": "a1", "destination": "pay", "key": "k0"}
    newer = {"generation": 2, "attempt": "a2", "destination": "pay", "key": "k9"}
    on_wire = [older, newer]

    async def job_state(job_id: str) -> JobState | None:
        return JobState(job_id, None, 2, in_flight=tuple(on_wire))

    store.job_state = job_state  # type: ignore[method-assign]
    waiters = Waiters(limit=10, metrics=Metrics(), store=store, poll_s=0.01)
    forward = Verdict(Forward(), attempt="a3")

    async def decide() -> Verdict:
        return BARRED if older in on_wire else forward

    task = asyncio.create_task(waiters.decide(FACTS, 30, decide, never_gone))
    await held(waiters)
    on_wire.remove(older)  # only its own generation's attempt is left: no barrier
    waited = await asyncio.wait_for(task, 5)
    assert waited.result == "forwarded" and nothing_left(waiters)


async def test_a_poll_reads_a_few_blockers_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes held on 40 keys: their poll takes at most `POLL_READS` of the store's
    connections at once, not one per key."""
    monkeypatch.setattr(waiting, "POLL_READS", 4)
    store = PolledStore()
    reading, most = 0, 0
    every_key_read = asyncio.Event()

    async def key_record(destination: str, key: str) -> KeyRecord | None:
        nonlocal reading, most
        reading += 1
        most = max(most, reading)
        await asyncio.sleep(0.005)
        reading -= 1
        store.reads += 1
        if store.reads >= 40:
            every_key_read.set()
        return store.record

    store.key_record = key_record  # type: ignore[method-assign]
    waiters = Waiters(limit=100, metrics=Metrics(), store=store, poll_s=0.01)
    tasks = [
        asyncio.create_task(
            waiters.decide(
                dataclasses.replace(FACTS, key=f"k{n}"),
                30,
                decisions(IN_PROGRESS, REPLAY)[0],
                never_gone,
            )
        )
        for n in range(40)
    ]
    await held(waiters, 40)
    await asyncio.wait_for(every_key_read.wait(), 5)
    assert 1 < most <= 4
    store.record = None
    await asyncio.wait_for(asyncio.gather(*tasks), 5)


@pytest.mark.parametrize(("young", "collected"), [(9_999, []), (10_000, [0])])
def test_the_young_generation_is_collected_while_held_once_half_way_to_its_threshold(
    monkeypatch: pytest.MonkeyPatch, young: int, collected: list[int]
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(waiting.gc, "get_threshold", lambda: (20_000, 20, 20))
    monkeypatch.setattr(waiting.gc, "get_count", lambda: (young, 0, 0))
    monkeypatch.setattr(waiting.gc, "collect", calls.append)
    waiting._collect_young()
    assert calls == collected


async def test_a_write_that_wakes_on_its_own_keeps_its_place() -> None:
    """Woken by its own timer and refused again, a write is watched again where it
    was, not behind the writes that came after it."""
    waiters = Waiters(limit=10, metrics=Metrics())
    first, second = (
        waiting._Waiter(FACTS, never_gone, asyncio.get_running_loop().create_future(), None, 1e9)
        for _ in range(2)
    )
    waiters._register(first)
    waiters._register(second)
    waiters._rewatch(first)
    assert list(waiters._keys[("pay", "key-1")]) == [first, second]
    assert list(waiters._jobs["job-1"]) == [first, second]
