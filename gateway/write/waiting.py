"""Writes held under `Prefer: wait` until what blocks them settles (SPEC 2 "Waiting").

A write answered 409 `request_in_progress` (its key is in flight) or
`older_generation_in_flight` (an older generation of its job is on the wire),
carrying the preference, is held here instead of being answered. It waits on
what blocks it: the key `(destination, key)` or the job. It is woken

- at once when the blocking attempt settles in this process (the write route
  calls `settled` as soon as an outcome is recorded);
- when another process says so: on PostgreSQL the store's notifications
  (`SettlementFeed`) call `settled` in every process;
- by a poll of the blocker's row (`WaitStore`), one read per blocker however many
  writes wait on it: at a short interval where other processes share the store
  without notifications (SQLite with `--workers N`), as a fallback otherwise;
- when the blocker's own deadline passes (the `Retry-After` the 409 carried).

Woken, the write is decided again as if it had just arrived, so its answer is
one the contract gives: a replay, a forward, or a refusal. Nothing is ever
forwarded here. Where the write route can (`WokenStart`), that decision is
started by the wake itself, and the held write resumes once, with its verdict
in hand; otherwise it resumes, and its own call decides it again. At most
`limit` writes wait in one process; a waiter whose worker has gone away stops,
and changes nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import structlog

from gateway.errors import Rejection
from gateway.policy.decision import KeyState, Reject, Replay, WriteFacts, retry_after
from gateway.policy.records import Verdict
from gateway.store.protocol import WaitStore
from gateway.telemetry.metrics import Metrics
from gateway.write.line import milliseconds
from leases.errors import StoreUnavailable
from leases.reasons import Reason

log = structlog.get_logger("gateway.write")

WAITABLE = frozenset({Reason.REQUEST_IN_PROGRESS, Reason.OLDER_GENERATION_IN_FLIGHT})
# How often waiters are checked for a worker gone away, when nothing polls sooner.
GONE_CHECK_S = 1.0
# Reads of one poll at once: writes held on many blockers take a few of the
# store's connections at a time, not a burst of one per blocker.
POLL_READS = 8
# How near its cap a held write decided again counts as at it (see `_hold`).
CAP_SLACK_S = 0.01

T = TypeVar("T")
Decide = Callable[[], Awaitable[Verdict]]
Gone = Callable[[], bool]
# What a held write awaits: None when it is only woken, its verdict when the
# wake started its decision (`WokenStart`).
Woken = asyncio.Future[Verdict | None]


class WokenStart(Protocol):
    """Starts a woken write's decision from the wake itself, so that the held write
    resumes once, with the verdict, instead of resuming to ask for it."""

    def start(self, answer: Woken) -> bool:
        """Start the decision, its verdict (or failure) to be set on `answer`;
        False if it cannot start now (the write then decides on its own)."""
        ...

    def finish(self, answer: Woken) -> Verdict:
        """The verdict of a started decision, from its settled `answer`."""
        ...

    def abandon(self) -> None:
        """A started decision nobody waits for any more (the handler was cancelled)."""
        ...


def waitable(verdict: Verdict) -> bool:
    """A refusal that `Prefer: wait` turns into a wait."""
    decision = verdict.decision
    return isinstance(decision, Reject) and decision.reason in WAITABLE


@dataclass(eq=False, slots=True)
class _Waiter:
    facts: WriteFacts
    gone: Gone
    woken: Woken
    starter: WokenStart | None = None
    until: float = 0.0  # the cap, monotonic
    holding: bool = False  # refused and waiting (not deciding): what polls look at
    started: bool = False  # a wake started its decision (`WokenStart`)
    timer: asyncio.TimerHandle | None = None  # its wait's end (cap or blocker's deadline)


class Waited(NamedTuple):
    """A write's final verdict and how its wait went. `applied`: the preference
    was honoured (False: one more than `max_waiting`, answered at once, `result`
    "full"; or the gateway stopping); `result` None: it did not have to wait.
    (A named tuple: see `gateway.write.line`.)"""

    verdict: Verdict
    applied: bool = True
    result: str | None = None
    seconds: float = 0.0


class Waiters:
    """The waiter registry of one process."""

    def __init__(
        self,
        *,
        limit: int,
        metrics: Metrics,
        store: WaitStore | None = None,
        poll_s: float | None = None,
    ) -> None:
        self.limit = limit
        self.count = 0
        # Set while this process holds writes: a store that tells every process of
        # settlements may tell none while no process holds any.
        self.holding = asyncio.Event()
        self._metrics = metrics
        self._store = store
        self._poll_s = poll_s if store is not None else None
        # Each key's and job's waiters in the order they came (a dict as an ordered
        # set): a settlement wakes them, and so decides them, first come first.
        self._keys: dict[tuple[str, str], dict[_Waiter, None]] = {}
        self._jobs: dict[str, dict[_Waiter, None]] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._stopping = False

    def settled(self, destination: str, key: str | None, job_id: str) -> None:
        """An attempt of `job_id` (on `key`, if keyed) settled: its outcome was
        recorded or it was released, so it neither holds its key nor bars newer
        generations any more. Wakes whoever waits on either."""
        by_key: Iterable[_Waiter] = () if key is None else self._keys.pop((destination, key), ())
        by_job = self._jobs.pop(job_id, ())
        # Both taken first: a woken write whose decision starts watches its key
        # and job again at once, and must not be woken twice by this settlement.
        self._wake(by_key)
        self._wake(by_job)

    async def decide(
        self,
        facts: WriteFacts,
        cap: int,
        decide: Decide,
        gone: Gone,
        starter: WokenStart | None = None,
    ) -> Waited:
        """`decide` the write; while that is a refusal `Prefer: wait` applies to,
        hold it (up to `cap` seconds) and decide it again whenever what blocks it
        may have settled: by `starter` from the wake, when it can start, else by
        `decide`. A settlement during a decision is not missed: the write watches
        its key and job from before each decision."""
        started = time.monotonic()
        waiter = _Waiter(facts, gone, _future(), starter, started + cap)
        self._register(waiter)  # woken by a settlement of its key or of its job
        try:
            verdict = await decide()
            if not waitable(verdict):
                return Waited(verdict)
            if self._stopping:
                return Waited(verdict, applied=False)
            if self.count >= self.limit:  # answered at once; counted, for max_waiting's sake
                metrics = self._metrics
                metrics.tally.add(metrics.child(metrics.waits, "full"))
                return Waited(verdict, applied=False, result="full")
            self._enter()
            try:
                verdict, result = await self._hold(verdict, waiter, decide)
            except Exception as exc:
                # A decision again failed (the store down, too many being decided):
                # the write gets that refusal, and the wait is counted as ended so.
                waited = self._count(started, "failed")
                if isinstance(exc, Rejection):
                    exc.line_extra = {"wait": "failed", "waited_ms": milliseconds(waited)}
                raise
            finally:
                self._leave()
        finally:
            self._unwatch(waiter)
        return Waited(verdict, result=result, seconds=self._count(started, result))

    def _count(self, started: float, result: str) -> float:
        """Count a wait that ended in `result`; how long it took."""
        waited = time.monotonic() - started
        metrics = self._metrics
        metrics.tally.add(metrics.child(metrics.waits, result))
        metrics.tally.observe(metrics.wait_seconds, waited)
        return waited

    async def _hold(self, verdict: Verdict, waiter: _Waiter, decide: Decide) -> tuple[Verdict, str]:
        """Wait and decide again until the verdict is no waitable refusal, the cap
        has passed, or the worker is gone."""
        until = waiter.until
        while True:
            decision = verdict.decision
            assert isinstance(decision, Reject) and decision.retry_after is not None
            blocker_ends = time.monotonic() + decision.retry_after
            self._narrow(waiter, decision.reason)
            woken = waiter.woken
            if not woken.done():  # here, not in a coroutine of its own: one frame
                # less to resume for each of the hundreds of writes a settlement wakes
                delay = max(0.0, min(until, blocker_ends) - time.monotonic())
                timer = asyncio.get_running_loop().call_later(delay, _wake_one, waiter)
                waiter.timer = timer  # the wake cancels it when it starts the decision
                try:
                    await woken
                except asyncio.CancelledError:
                    if waiter.started:
                        waiter.started = False
                        assert waiter.starter is not None
                        waiter.starter.abandon()
                    raise
                except Exception:
                    if not waiter.started:
                        raise
                finally:
                    timer.cancel()
            if waiter.started:  # the wake decided it: already watching again
                waiter.started = False
                assert waiter.starter is not None
                verdict = waiter.starter.finish(woken)
                if not waitable(verdict):
                    return verdict, _result(verdict)
                continue
            if waiter.gone():
                return verdict, "disconnected"
            now = time.monotonic()
            if self._stopping:
                remaining = retry_after(blocker_ends - now)
                return _with_retry_after(verdict, decision, remaining), "stopped"
            # Past the cap too, decided again as if it had just arrived: the 409 it
            # would get at once, its Retry-After counted from now (not from a whole
            # second rounded up before), or what settled unseen meanwhile. Within
            # `CAP_SLACK_S` of the cap counts as at it: a timer set for the cap can
            # fire a hair before it, and the write was then decided twice, once
            # uncapped and once more a moment later.
            capped = now >= until - CAP_SLACK_S
            self._rewatch(waiter)
            verdict = await decide()
            if not waitable(verdict):
                return verdict, _result(verdict)
            if capped:
                return verdict, "timed_out"

    def _register(self, waiter: _Waiter) -> None:
        facts = waiter.facts
        if facts.key is not None:
            self._keys.setdefault((facts.destination, facts.key), {})[waiter] = None
        self._jobs.setdefault(facts.job_id, {})[waiter] = None

    def _rewatch(self, waiter: _Waiter) -> None:
        """`waiter`, woken, watches its key and job again before its next decision
        (the same waiter: whoever unwatches it at the end finds it). Where it is
        still listed, woken by its own timer, it keeps its place."""
        waiter.woken = _future()
        waiter.holding = False
        self._register(waiter)

    def _narrow(self, waiter: _Waiter, reason: str) -> None:
        """Refused for `reason`: wait on what refused it only."""
        facts = waiter.facts
        if reason == Reason.REQUEST_IN_PROGRESS and facts.key is not None:
            _discard(self._jobs, facts.job_id, waiter)
        elif facts.key is not None:
            _discard(self._keys, (facts.destination, facts.key), waiter)
        waiter.holding = True
        self._start_ticker()

    def _unwatch(self, waiter: _Waiter) -> None:
        facts = waiter.facts
        if facts.key is not None:
            _discard(self._keys, (facts.destination, facts.key), waiter)
        _discard(self._jobs, facts.job_id, waiter)

    def _enter(self) -> None:
        self.count += 1
        self.holding.set()
        self._metrics.tally.add(self._metrics.waiting)

    def _leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.holding.clear()
        self._metrics.tally.add(self._metrics.waiting, -1.0)

    # --- the ticker: workers gone away, and polls --------------------------------------

    def _start_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick(), name="waiters")
            self._ticker.add_done_callback(_ticker_done)

    async def _tick(self) -> None:
        """While anything waits: every `GONE_CHECK_S`, wake the waiters whose worker
        went away; every `poll_s`, poll each blocker once."""
        interval = min(GONE_CHECK_S, self._poll_s or GONE_CHECK_S)
        last_gone_check = time.monotonic()
        last_poll = time.monotonic()
        while self._keys or self._jobs:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - last_gone_check >= GONE_CHECK_S:
                last_gone_check = now
                self._wake_gone()
                _collect_young()
            if self._poll_s is not None and now - last_poll >= self._poll_s:
                last_poll = now
                await self._poll()

    def _wake_gone(self) -> None:
        for waiters in (*self._keys.values(), *self._jobs.values()):
            for waiter in waiters:
                if waiter.holding and waiter.gone():
                    _wake_one(waiter)

    async def _poll(self) -> None:
        """One read per blocker that holds writes: wake them if it no longer does."""
        keys = [(i, _holding(w)) for i, w in self._keys.items()]
        jobs = [(j, _holding(w)) for j, w in self._jobs.items()]
        reads = [
            *(self._poll_key(ident, waiters) for ident, waiters in keys if waiters),
            *(self._poll_job(job_id, waiters) for job_id, waiters in jobs if waiters),
        ]
        gate = asyncio.Semaphore(POLL_READS)

        async def one(read: Awaitable[None]) -> None:
            async with gate:
                await read

        try:
            await asyncio.gather(*(one(read) for read in reads))
        except StoreUnavailable as exc:
            log.warning("wait_poll_failed", error=str(exc))

    async def _poll_key(self, ident: tuple[str, str], waiters: list[_Waiter]) -> None:
        assert self._store is not None
        record = await self._store.key_record(*ident)
        if record is None or record.state_at(self._store.clock()) is not KeyState.IN_FLIGHT:
            self._wake(waiters)

    async def _poll_job(self, job_id: str, waiters: list[_Waiter]) -> None:
        assert self._store is not None
        state = await self._store.job_state(job_id)
        on_wire = [] if state is None else [a["generation"] for a in state.in_flight]
        self._wake(w for w in waiters if not any(g < w.facts.generation for g in on_wire))

    def stop(self) -> None:
        """The gateway is stopping: every held write gets its refusal now (its
        worker retries elsewhere), and no write waits any more."""
        self._stopping = True
        for waiters in (*self._keys.values(), *self._jobs.values()):
            for waiter in waiters:
                _wake_one(waiter)

    def _wake(self, waiters: Iterable[_Waiter]) -> None:
        """Wake `waiters`: a held write whose decision can start from here starts
        it and watches its key and job again (it resumes once, with its verdict);
        any other resumes to see for itself (gone, past its cap, stopping, or its
        decision could not start)."""
        now = time.monotonic()
        for waiter in waiters:
            woken = waiter.woken
            if woken.done():
                continue
            starter = waiter.starter
            if (
                starter is not None
                and waiter.holding
                and not self._stopping
                and now < waiter.until
                and not waiter.gone()
                and _start(starter, woken)
            ):
                waiter.started = True
                if waiter.timer is not None:  # its wait is over: the timer would wake
                    waiter.timer.cancel()  # the next one, set by `_rewatch`, too early
                self._rewatch(waiter)
            else:
                woken.set_result(None)

    async def close(self) -> None:
        """Stop the ticker (the waiters themselves end with their handlers)."""
        if self._ticker is not None and not self._ticker.done():
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)


def _future() -> Woken:
    return asyncio.get_running_loop().create_future()


def _start(starter: WokenStart, woken: Woken) -> bool:
    """`starter.start(woken)`; a starter that fails is logged and the write left to
    decide on its own (the wake goes on to the others)."""
    try:
        return starter.start(woken)
    except Exception:
        log.exception("woken_decision_not_started")
        return False


def _wake_one(waiter: _Waiter) -> None:
    if not waiter.woken.done():
        waiter.woken.set_result(None)


def _collect_young() -> None:
    """The young generation collected now, while writes are held and the loop is
    idle, once it is half-way to its threshold: the objects of hundreds of held
    requests fill it, and the collection they would otherwise trigger falls in
    the wake-up, stalling every answer behind it (4-10 ms for 1,000 held writes
    under the gateway's threshold of 20,000). Only then: each collection counts
    towards an older generation's, which would cost more."""
    if gc.get_count()[0] * 2 >= gc.get_threshold()[0]:
        gc.collect(0)


def _holding(waiters: dict[_Waiter, None]) -> list[_Waiter]:
    return [w for w in waiters if w.holding]


def _discard(table: dict[T, dict[_Waiter, None]], ident: T, waiter: _Waiter) -> None:
    """`waiter` out of `table[ident]`; a key or job left without waiters goes too."""
    waiters = table.get(ident)
    if waiters is not None:
        waiters.pop(waiter, None)
        if not waiters:
            del table[ident]


def _ticker_done(task: asyncio.Task[Any]) -> None:
    """Watched: a ticker that fails is logged (waiters still wake on their own
    deadlines and on settlements; a later wait starts a new ticker)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("waiters_ticker_failed", error=repr(task.exception()))


def _result(verdict: Verdict) -> str:
    decision = verdict.decision
    if isinstance(decision, Replay):
        return "replayed"
    if isinstance(decision, Reject):
        return "refused"
    return "forwarded"


def _with_retry_after(verdict: Verdict, decision: Reject, seconds: int) -> Verdict:
    """The refusal decided before the wait, its `Retry-After` counted from now."""
    return dataclasses.replace(verdict, decision=dataclasses.replace(decision, retry_after=seconds))
