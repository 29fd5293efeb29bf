"""`hold()`: keep a lease renewed while a body of work runs, and stop the work the
moment the lease may be gone.

The watchdog renews at a fraction of the ttl. Two things end the hold early:
a renewal the store refuses (the job was reclaimed, completed, ...), or the
worker's own monotonic deadline, started *before* the claim request was sent,
passing without a successful renewal. Either way the body is cancelled and
`LeaseLost` leaves the `async with` - before the store could hand the job to
anybody else, since the store's lease always ends after the local deadline.
A claim whose answer arrives after that deadline never starts the body.

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
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from typing import NoReturn

from .errors import LeaseError, LeaseLost
from .exits import OnExit, exit_failed, give_back_claim, release, settle, stop, wind_up
from .model import Lease, default_owner, validate_seconds, validate_ttl
from .reasons import Reason
from .renewal import Hold, RenewalSchedule, Renewer, Sleep
from .store import LeaseStore

__all__ = ["HeldLease", "Hold", "OnExit", "RenewalSchedule", "Sleep", "hold"]


@dataclass(frozen=True, slots=True)
class HeldLease(Lease):
    """The `Lease` that `hold()` yields; `hold` is its live state, so a writer
    given this lease can refuse to send once the lease is lost."""

    hold: Hold = field(compare=False, repr=False, kw_only=True)


def _held(lease: Lease, state: Hold) -> HeldLease:
    return HeldLease(**{f.name: getattr(lease, f.name) for f in fields(Lease)}, hold=state)


def _check_exit_settings(on_exit: str, cancel_timeout: float) -> None:
    if on_exit not in ("complete", "release", "keep"):
        # Checked before the claim: found only at exit, the job would stay claimed.
        raise ValueError(f"on_exit must be complete, release or keep, not {on_exit!r}")
    validate_seconds("cancel_timeout", cancel_timeout)


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
    started = monotonic()
    lease = await _claim(store, job_id, owner, schedule.ttl, cancel_timeout)
    state = Hold(lease, schedule.deadline(started), monotonic)
    if monotonic() >= state.deadline:
        await _too_late(store, lease, cancel_timeout)
    watchdog, renewer = _watch(store, state, schedule, monotonic, sleep)
    try:
        yield _held(lease, state)
    except asyncio.CancelledError:
        await _cancelled(store, state, watchdog, renewer, cancel_timeout)
        raise
    except LeaseLost:
        raise
    except BaseException:
        try:
            await _exit(store, state, renewer, "release", cancel_timeout)
        except Exception as exc:  # the body's error is the caller's news, not the release's
            # (refused otherwise than as lost or unavailable, a 400 say): logged, and
            # the lease left to expire by itself
            exit_failed(state.lease, "release", getattr(exc, "reason", type(exc).__name__))
        raise
    else:
        await _exit(store, state, renewer, on_exit, cancel_timeout, raise_lost=True)
    finally:
        await stop(renewer)


def _watch(
    store: LeaseStore,
    state: Hold,
    schedule: RenewalSchedule,
    monotonic: Callable[[], float],
    sleep: Sleep,
) -> tuple[Renewer, asyncio.Task[None]]:
    """Start the watchdog of `state`, which cancels the current task (the body's)
    once the lease may be gone."""
    body = asyncio.current_task()
    assert body is not None
    watchdog = Renewer(store, state, schedule, body, monotonic, sleep)
    renewer = asyncio.create_task(watchdog.run(), name=f"lease-renewal:{state.job_id}")
    return watchdog, renewer


async def _exit(
    store: LeaseStore,
    state: Hold,
    renewer: asyncio.Task[None],
    action: OnExit,
    cancel_timeout: float,
    *,
    raise_lost: bool = False,
) -> None:
    """The exit of a body that was not cancelled: `action` unless lost (then
    `LeaseLost`, if `raise_lost`), its outcome the caller's."""
    work = wind_up(store, state, renewer, action, raise_lost=raise_lost)
    await settle(renewer, work, state, action, cancel_timeout, cancelled=False)


async def _claim(
    store: LeaseStore, job_id: str, owner: str | None, ttl: float, cancel_timeout: float
) -> Lease:
    """The claim, given back if the caller is cancelled while it is on the wire."""
    owner = default_owner() if owner is None else owner
    claiming = asyncio.ensure_future(store.claim(job_id, owner=owner, ttl=ttl))
    try:
        return await asyncio.shield(claiming)
    except asyncio.CancelledError:
        await give_back_claim(store, claiming, cancel_timeout, job_id, owner)
        raise


async def _too_late(store: LeaseStore, lease: Lease, cancel_timeout: float) -> NoReturn:
    """The claim's answer came after the worker's own deadline: by its clock the
    lease may already have run out in the store, so the body must not start. The
    lease is given back if it is still ours (if not, the release is refused and
    changes nothing), within `cancel_timeout`, and `LeaseLost` raised."""
    with contextlib.suppress(LeaseError, TimeoutError):  # StoreUnavailable is one
        async with asyncio.timeout(cancel_timeout):
            await store.release(lease)
    raise LeaseLost(lease.job_id, lease.generation, Reason.LEASE_EXPIRED)


async def _cancelled(
    store: LeaseStore,
    state: Hold,
    watchdog: Renewer,
    renewer: asyncio.Task[None],
    cancel_timeout: float,
) -> None:
    """The body's task was cancelled: by the watchdog (raises its `LeaseLost`
    instead, unless cancelled from outside as well), or from outside (the lease
    is given back now rather than at its expiry). The caller re-raises the
    cancellation."""
    if watchdog.cancelled_body:
        if watchdog.body.uncancel() == 0:
            assert state.lost is not None
            raise state.lost from state.lost.__cause__  # the store's failure, if any
        return  # cancelled from outside as well, but the lease is gone: nothing to give
    work = release(store, state, renewer)
    await settle(renewer, work, state, "release", cancel_timeout, cancelled=True)
