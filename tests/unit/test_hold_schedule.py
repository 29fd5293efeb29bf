"""hold()'s timing on a virtual clock: the pure schedule, and the watchdog driven by it.

Nothing here waits on real time: the worker's monotonic clock and the watchdog's
sleep are one `VirtualTime`, moved by the test.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from datetime import UTC, datetime

import pytest
import structlog

from leases import Lease, LeaseLost, LeaseRef, StoreUnavailable, hold, renewal
from leases.hold import RenewalSchedule


class VirtualTime:
    """A monotonic clock and a `sleep` on it; time moves only in `advance`."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        wake = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + seconds, next(self._order), wake))
        await wake

    async def advance(self, seconds: float) -> None:
        """Move time forward, waking each sleeper at its own moment, in order."""
        end = self.now + seconds
        await _settle()
        while self._sleepers and self._sleepers[0][0] <= end:
            at, _, wake = heapq.heappop(self._sleepers)
            self.now = max(self.now, at)
            if not wake.done():
                wake.set_result(None)
            await _settle()
        self.now = end
        await _settle()


async def _settle() -> None:
    for _ in range(20):  # let every task that can run, run
        await asyncio.sleep(0)


class RecordingStore:
    """A lease store in memory that notes the virtual time of each renewal."""

    def __init__(self, clock: VirtualTime) -> None:
        self.clock = clock
        self.renewed_at: list[float] = []
        self.refuse_from: float | None = None
        self.unavailable = False
        self.fails_with: Exception | None = None
        self.completed = False

    def _lease(self, job_id: str, owner: str, generation: int, state: str = "active") -> Lease:
        return Lease(job_id, owner, generation, state, datetime.fromtimestamp(0, UTC), 30.0)

    async def claim(self, job_id: str, *, owner: str | None = None, ttl: float) -> Lease:
        return self._lease(job_id, owner or "w", 1)

    async def renew(self, lease: Lease | LeaseRef, *, ttl: float | None = None) -> Lease:
        if self.unavailable:
            raise StoreUnavailable("down")
        if self.fails_with is not None:
            raise self.fails_with
        if self.refuse_from is not None and self.clock.now >= self.refuse_from:
            raise LeaseLost(lease.job_id, lease.generation, "stale_generation")
        self.renewed_at.append(self.clock.now)
        return self._lease(lease.job_id, lease.owner, lease.generation)

    async def complete(self, lease: Lease | LeaseRef) -> Lease:
        self.completed = True
        return self._lease(lease.job_id, lease.owner, lease.generation, "done")

    async def release(self, lease: Lease | LeaseRef) -> Lease:
        if self.fails_with is not None:
            raise self.fails_with
        return self._lease(lease.job_id, lease.owner, lease.generation, "free")

    async def get(self, job_id: str) -> Lease | None:
        return None

    async def close(self) -> None:
        pass

    async def __aenter__(self) -> RecordingStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass


# --- the pure schedule -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("now", "deadline", "wait"),
    [(0.0, 28.5, 10.0), (25.0, 28.5, 3.5), (30.0, 28.5, 0.0)],
)
def test_the_next_renewal_is_a_third_of_the_ttl_away_but_never_past_the_deadline(
    now: float, deadline: float, wait: float
) -> None:
    assert RenewalSchedule(30.0).wait(now, deadline) == pytest.approx(wait)


def test_the_local_deadline_runs_from_when_the_request_was_sent_less_the_margin() -> None:
    assert RenewalSchedule(30.0, safety_margin=0.05).deadline(100.0) == pytest.approx(128.5)


@pytest.mark.parametrize(
    ("fraction", "margin"),
    [(0.0, 0.0), (1.0, 0.0), (0.3, 0.3), (0.3, -0.1), (0.9, 0.2), (0.96, 0.05), (0.8, 0.2)],
)
def test_a_schedule_that_could_not_renew_in_time_is_refused(fraction: float, margin: float) -> None:
    """(0.9, 0.2): the first renewal falls due at 27 s, after the local deadline at
    24 s; every hold would end LeaseLost(lease_expired) with the store holding it."""
    with pytest.raises(ValueError):
        RenewalSchedule(30.0, renew_fraction=fraction, safety_margin=margin)


def test_a_schedule_renews_before_its_local_deadline() -> None:
    schedule = RenewalSchedule(30.0, renew_fraction=0.5, safety_margin=0.4)
    assert 100.0 + schedule.wait(100.0, float("inf")) < schedule.deadline(100.0)


@pytest.mark.parametrize("options", [{"renew_fraction": "x"}, {"safety_margin": None}])
def test_a_fraction_that_is_not_a_number_is_a_value_error(options: dict[str, object]) -> None:
    # a TypeError from the comparison before
    with pytest.raises(ValueError, match="must be a number"):
        RenewalSchedule(30.0, **options)  # type: ignore[arg-type]


# --- the watchdog on virtual time --------------------------------------------------------------


async def _held(clock: VirtualTime, store: RecordingStore, body_for: float) -> None:
    async with hold(store, "job-1", ttl=30.0, monotonic=clock.monotonic, sleep=clock.sleep):
        await clock.sleep(body_for)


async def test_hold_renews_every_third_of_the_ttl_of_the_workers_clock() -> None:
    clock = VirtualTime()
    store = RecordingStore(clock)
    task = asyncio.create_task(_held(clock, store, body_for=95.0))
    await clock.advance(100.0)
    await task
    assert store.renewed_at == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0]
    assert store.completed


async def test_a_refused_renewal_cancels_the_body_at_that_renewal() -> None:
    clock = VirtualTime()
    store = RecordingStore(clock)
    store.refuse_from = 35.0
    task = asyncio.create_task(_held(clock, store, body_for=1000.0))
    await clock.advance(100.0)
    with pytest.raises(LeaseLost) as lost:
        await task
    assert lost.value.reason == "stale_generation"
    assert store.renewed_at == [10.0, 20.0, 30.0] and not store.completed


async def test_an_unreachable_store_loses_the_lease_at_the_local_deadline_not_later() -> None:
    """Renewals that fail transiently are retried; once the worker's deadline (28.5 s
    after the claim was sent) passes, the body is stopped, the loss put down to the
    store (`store_unavailable`: the worker's lease ran out only because it could
    not be renewed)."""
    clock = VirtualTime()
    store = RecordingStore(clock)
    store.unavailable = True
    task = asyncio.create_task(_held(clock, store, body_for=1000.0))
    await clock.advance(28.4)
    assert not task.done()
    await clock.advance(0.2)
    with pytest.raises(LeaseLost) as lost:
        await task
    assert lost.value.reason == "store_unavailable"
    assert clock.now == pytest.approx(28.6)
    # what the store said is kept (it was dropped: nothing told an outage from a bug)
    assert isinstance(lost.value.__cause__, StoreUnavailable)
    assert str(lost.value.__cause__) == "down"


async def test_a_renewal_failing_otherwise_loses_the_lease_at_the_same_deadline() -> None:
    """A renewal that raises what no outage raises (the HTTP store's ValueError for
    a 400 answer) is as unrenewed as an unreachable store: the body is stopped at
    the local deadline. It used to end the watchdog, and the body ran on."""
    clock = VirtualTime()
    store = RecordingStore(clock)
    store.fails_with = ValueError("ttl: out of range")
    task = asyncio.create_task(_held(clock, store, body_for=1000.0))
    await clock.advance(28.4)
    assert not task.done()
    await clock.advance(0.2)
    assert task.done()  # the body stopped, not left running on
    with pytest.raises(LeaseLost) as lost:
        await task
    assert lost.value.reason == "store_unavailable"
    assert repr(lost.value.__cause__) == "ValueError('ttl: out of range')"
    assert not store.completed


async def test_the_bodys_error_is_raised_when_the_release_after_it_fails_otherwise() -> None:
    """A release refused with ValueError (the HTTP store's 400) replaced the body's
    own error, which the caller's `except` then missed."""
    clock = VirtualTime()
    store = RecordingStore(clock)

    async def failing() -> None:
        async with hold(store, "job-1", ttl=30.0, monotonic=clock.monotonic, sleep=clock.sleep):
            store.fails_with = ValueError("release refused")
            raise RuntimeError("body failed")

    with structlog.testing.capture_logs() as logs, pytest.raises(RuntimeError, match="body failed"):
        await failing()
    [line] = [e for e in logs if e["event"] == "lease_exit_failed"]
    assert (line["action"], line["reason"]) == ("release", "ValueError")


def test_a_renewal_cut_at_the_local_deadline_is_said_in_words() -> None:
    """asyncio's TimeoutError has no message: as the loss's cause it said nothing."""
    cut = renewal._failure(TimeoutError())
    assert isinstance(cut, StoreUnavailable) and isinstance(cut.__cause__, TimeoutError)
    assert "did not answer a renewal before the local deadline" in str(cut)
    refused = ValueError("ttl: out of range")
    assert renewal._failure(refused) is refused
