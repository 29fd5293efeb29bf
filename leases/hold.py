"""`hold()`: keep a lease renewed while a body of work runs, and stop the work the
moment the lease may be gone.

The watchdog renews at a fraction of the ttl. Two things end the hold early:
a renewal the store refuses (the job was reclaimed, completed, ...), or the
worker's own monotonic deadline, started *before* the claim request was sent,
passing without a successful renewal. Either way the body is cancelled and
`LeaseLost` leaves the `async with` - before the store could hand the job to
anybody else, since the store's lease always ends after the local deadline.

A cancellation from outside (the worker shutting down) is not a lost lease: the
lease is released at once, so the job does not stay blocked for up to a ttl, and
the `CancelledError` goes on. That holds while the claim is still on its way
too: a claim the store grants after all is given back. The store calls of an
exit run in a task of their own, so a cancellation cannot cut one off halfway;
once one has arrived they get `cancel_timeout` seconds, so a dead store cannot
hang a shutdown.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from typing import Literal

import structlog

from .errors import LeaseLost, StoreUnavailable
from .model import Lease, default_owner, validate_ttl
from .reasons import Reason
from .store import LeaseStore

log = structlog.get_logger("leases.hold")

OnExit = Literal["complete", "release", "keep"]

# Exit tasks given up on after `cancel_timeout`, kept referenced until they end.
_abandoned: set[asyncio.Task[None]] = set()
# A claim refused with these granted nothing: there is nothing to give back.
_NOTHING_GRANTED = frozenset({Reason.LEASE_HELD, Reason.JOB_COMPLETED})


class Hold:
    """The live state of a held lease: the latest `lease`, and `lost` once it is gone."""

    def __init__(
        self, lease: Lease, deadline: float, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.lease = lease
        self.deadline = deadline
        self.lost: LeaseLost | None = None
        # The clock `deadline` was computed on; comparing it with another is meaningless.
        self._monotonic = monotonic

    @property
    def job_id(self) -> str:
        return self.lease.job_id

    @property
    def generation(self) -> int:
        return self.lease.generation

    @property
    def owner(self) -> str:
        return self.lease.owner

    def check(self) -> None:
        """Raise `LeaseLost` if the lease is lost or the local deadline has passed."""
        if self.lost is None and self._monotonic() >= self.deadline:
            self.lost = LeaseLost(self.lease.job_id, self.lease.generation, Reason.LEASE_EXPIRED)
        if self.lost is not None:
            raise self.lost


@dataclass(frozen=True, slots=True)
class HeldLease(Lease):
    """The `Lease` that `hold()` yields; `hold` is its live state, so a writer
    given this lease can refuse to send once the lease is lost."""

    hold: Hold = field(compare=False, repr=False, kw_only=True)


def _held(lease: Lease, state: Hold) -> HeldLease:
    return HeldLease(**{f.name: getattr(lease, f.name) for f in fields(Lease)}, hold=state)


@dataclass(frozen=True, slots=True)
class RenewalSchedule:
    """PURE: when to renew, and until when the lease is safe, on the worker's own clock.

    A renewal is due every `ttl * renew_fraction`; the lease is taken as lost
    `ttl * (1 - safety_margin)` after the last successful renewal was *sent* (or
    the claim), which is before the store can end it even on a slow worker clock.
    """

    ttl: float
    renew_fraction: float = 1 / 3
    safety_margin: float = 0.05

    def __post_init__(self) -> None:
        validate_ttl(self.ttl)
        if not 0 < self.renew_fraction < 1:
            raise ValueError("renew_fraction must be between 0 and 1")
        if not 0 <= self.safety_margin < self.renew_fraction:
            raise ValueError("safety_margin must be between 0 and renew_fraction")

    def deadline(self, sent: float) -> float:
        """The local deadline of a lease claimed or renewed by a request sent at `sent`."""
        return sent + self.ttl * (1 - self.safety_margin)

    def wait(self, now: float, deadline: float) -> float:
        """How long to sleep before the next renewal (never past the deadline)."""
        return max(0.0, min(now + self.ttl * self.renew_fraction, deadline) - now)


Sleep = Callable[[float], Awaitable[None]]


def _check_exit_settings(on_exit: str, cancel_timeout: float) -> None:
    if on_exit not in ("complete", "release", "keep"):
        # Checked before the claim: found only at exit, the job would stay claimed.
        raise ValueError(f"on_exit must be complete, release or keep, not {on_exit!r}")
    if (
        isinstance(cancel_timeout, bool)
        or not isinstance(cancel_timeout, int | float)
        or not (math.isfinite(cancel_timeout) and cancel_timeout > 0)
    ):
        raise ValueError("cancel_timeout must be a positive number of seconds")


class _Renewer:
    """The watchdog of one held lease: renews on schedule, and on a refusal or a
    passed deadline marks the hold lost and cancels the body's task."""

    def __init__(
        self,
        store: LeaseStore,
        state: Hold,
        schedule: RenewalSchedule,
        body: asyncio.Task[object],
        monotonic: Callable[[], float],
        sleep: Sleep,
    ) -> None:
        self.store, self.state, self.schedule = store, state, schedule
        self.body, self.monotonic, self.sleep = body, monotonic, sleep
        self.cancelled_body = False  # the body's cancellation is ours, not an outside one

    def lose(self, reason: str, current_generation: int | None = None) -> None:
        state = self.state
        if state.lost is None:
            state.lost = LeaseLost(
                state.job_id, state.generation, reason, current_generation=current_generation
            )
        log.warning(
            "lease_lost",
            job_id=state.job_id,
            generation=state.generation,
            owner=state.owner,
            reason=reason,
        )
        self.cancelled_body = True
        self.body.cancel()

    async def run(self) -> None:
        state, now = self.state, self.monotonic
        while True:
            await self.sleep(self.schedule.wait(now(), state.deadline))
            if now() >= state.deadline:
                return self.lose(Reason.LEASE_EXPIRED)
            sent = now()
            try:
                async with asyncio.timeout(max(0.0, state.deadline - sent)):
                    state.lease = await self.store.renew(state.lease, ttl=self.schedule.ttl)
            except LeaseLost as exc:
                return self.lose(exc.reason, exc.current_generation)
            except (StoreUnavailable, TimeoutError):
                if now() >= state.deadline:
                    return self.lose(Reason.STORE_UNAVAILABLE)
                continue  # transient: try again until the local deadline
            state.deadline = self.schedule.deadline(sent)


@asynccontextmanager
async def hold(
    store: LeaseStore,
    job_id: str,
    owner: str | None = None,
    ttl: float = 30.0,
    *,
    on_exit: OnExit = "complete",
    renew_fraction: float = 1 / 3,
    safety_margin: float = 0.05,
    cancel_timeout: float = 2.0,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Sleep = asyncio.sleep,
) -> AsyncIterator[HeldLease]:
    """Claim `job_id`, yield the `Lease` (a `HeldLease`), renew it in the background.

    `on_exit` says what a normal exit of the body does: "complete" (default,
    marks the job done), "release" (frees it for another claim) or "keep" (leave
    it to expire). An exception from the body releases the lease, so another
    worker can take over at once; `LeaseLost` from the body is re-raised.

    Cancelling the body's task from outside (e.g. a worker shutting down) releases
    the lease too, then re-raises the `CancelledError`. A cancellation that arrives
    while the exit's store call is in flight lets that call finish. Either way the
    store call gets at most `cancel_timeout` seconds after the cancellation, and
    its failure is logged (`lease_exit_failed`) instead of raised.

    `safety_margin` (fraction of the ttl) makes the local deadline fire a little
    before the lease can possibly end in the store, which absorbs a worker clock
    that runs slow. `monotonic` and `sleep` are the worker's clock and how the
    watchdog waits on it (tests pass a virtual pair).
    """
    schedule = RenewalSchedule(validate_ttl(ttl), renew_fraction, safety_margin)
    _check_exit_settings(on_exit, cancel_timeout)
    owner = default_owner() if owner is None else owner
    started = monotonic()
    claiming = asyncio.ensure_future(store.claim(job_id, owner=owner, ttl=schedule.ttl))
    try:
        lease = await asyncio.shield(claiming)
    except asyncio.CancelledError:
        await _give_back_claim(store, claiming, cancel_timeout, job_id, owner)
        raise
    state = Hold(lease, schedule.deadline(started), monotonic)
    body = asyncio.current_task()
    assert body is not None
    watchdog = _Renewer(store, state, schedule, body, monotonic, sleep)
    renewer = asyncio.create_task(watchdog.run(), name=f"lease-renewal:{job_id}")
    try:
        yield _held(lease, state)
    except asyncio.CancelledError:
        if watchdog.cancelled_body:
            if body.uncancel() == 0:
                assert state.lost is not None
                raise state.lost from None
            raise  # cancelled from outside as well, but the lease is gone: nothing to give
        # Cancelled from outside: give the lease back now rather than at its expiry.
        work = _release(store, state, renewer)
        await _settle(renewer, work, state, "release", cancel_timeout, cancelled=True)
        raise
    except LeaseLost:
        raise
    except BaseException:
        work = _wind_up(store, state, renewer, "release")
        await _settle(renewer, work, state, "release", cancel_timeout, cancelled=False)
        raise
    else:
        work = _wind_up(store, state, renewer, on_exit, raise_lost=True)
        await _settle(renewer, work, state, on_exit, cancel_timeout, cancelled=False)
    finally:
        await _stop(renewer)


async def _stop(task: asyncio.Task[None]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _release(store: LeaseStore, state: Hold, renewer: asyncio.Task[None]) -> None:
    """After an outside cancellation: stop renewing, then release unless lost.

    The renewal in flight is cancelled and awaited first, so the release is never
    overtaken by it; a renewal the store applied but never answered leaves an older
    `state.lease` of the same generation, which releases just as well.
    """
    await _stop(renewer)
    if state.lost is None:
        state.lease = await store.release(state.lease)


async def _wind_up(
    store: LeaseStore,
    state: Hold,
    renewer: asyncio.Task[None],
    on_exit: OnExit,
    *,
    raise_lost: bool = False,
) -> None:
    """Stop renewing, then apply `on_exit` (or raise `LeaseLost`, if asked, when lost)."""
    await _stop(renewer)
    if raise_lost and state.lost is not None:
        raise state.lost
    await _finish(store, state, on_exit)


async def _settle(
    renewer: asyncio.Task[None],
    work: Coroutine[object, object, None],
    state: Hold,
    action: OnExit,
    limit: float,
    *,
    cancelled: bool,
) -> None:
    """Run an exit's store calls (`work`) in a task of their own, out of reach of a
    cancellation of the body's task.

    Until a cancellation has arrived (`cancelled`, or one meanwhile) `work` takes as
    long as it takes and its outcome, an error included, is the caller's. From then
    on it gets `limit` seconds and then is given up on; further
    cancellations are absorbed, a failure is logged and not raised, and the
    cancellation is the outcome: raised here if it arrived here, else left to the
    caller, who is handling it.
    """
    # Synchronously, before anything can yield: a watchdog still running could
    # otherwise cancel the body's task once more and pass as an outside cancellation.
    renewer.cancel()
    task = asyncio.get_running_loop().create_task(work, name=f"lease-exit:{state.job_id}")
    arrived = await _bounded(task, limit, cancelled=cancelled)
    if not cancelled and arrived is None:
        task.result()  # no cancellation: the exit's outcome, as if run inline
        return
    reason = _failure(task)
    if reason is not None:
        lease = state.lease
        log.warning(
            "lease_exit_failed",
            job_id=lease.job_id,
            generation=lease.generation,
            owner=lease.owner,
            action=action,
            reason=reason,
        )
    if arrived is not None:
        raise arrived


async def _bounded(
    task: asyncio.Task[None], limit: float, *, cancelled: bool
) -> asyncio.CancelledError | None:
    """Wait for `task`; return the cancellation that arrived meanwhile, if any.

    Once a cancellation has happened (`cancelled`, or one arriving here) `task`
    gets at most `limit` more seconds, further cancellations are absorbed, and a
    task still running then is cancelled and abandoned (kept referenced until
    it ends)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit if cancelled else None
    arrived: asyncio.CancelledError | None = None
    while not task.done():
        remaining = None if deadline is None else deadline - loop.time()
        if remaining is not None and remaining <= 0:
            break
        try:
            await asyncio.wait((task,), timeout=remaining)
        except asyncio.CancelledError as exc:
            if not cancelled and arrived is None:
                arrived = exc
                deadline = loop.time() + limit
    if not task.done():
        task.cancel()
        _abandoned.add(task)
        task.add_done_callback(_forget)
    return arrived


def _failure(task: asyncio.Task[None]) -> str | None:
    """Why an exit task did not succeed ("timeout" if abandoned); None if it did."""
    if not task.done():
        return "timeout"
    if task.cancelled():
        return None
    error = task.exception()
    return None if error is None else getattr(error, "reason", type(error).__name__)


async def _give_back_claim(
    store: LeaseStore, claiming: asyncio.Future[Lease], limit: float, job_id: str, owner: str
) -> None:
    """The body's task was cancelled while its claim was on the wire: the store
    may grant the claim all the same. Wait for the answer (at most `limit`) and
    release what was granted, so the job is not blocked for a ttl."""

    async def give_back() -> None:
        await store.release(await claiming)

    task = asyncio.get_running_loop().create_task(give_back(), name="lease-claim-give-back")
    await _bounded(task, limit, cancelled=True)
    reason = _failure(task)
    if reason is not None and reason not in _NOTHING_GRANTED:
        log.warning(
            "lease_exit_failed", job_id=job_id, owner=owner, action="release", reason=reason
        )


def _forget(task: asyncio.Task[None]) -> None:
    _abandoned.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: an abandoned exit's late failure is not news


async def _finish(store: LeaseStore, state: Hold, on_exit: OnExit) -> None:
    if on_exit == "keep" or state.lost is not None:
        return
    if on_exit == "complete":
        state.lease = await store.complete(state.lease)
    elif on_exit == "release":
        try:
            state.lease = await store.release(state.lease)
        except (LeaseLost, StoreUnavailable):
            pass  # nothing to give back; the lease expires by itself
    else:
        raise ValueError(f"on_exit must be complete, release or keep, not {on_exit!r}")
