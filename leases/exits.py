"""How a hold ends: the exit's store calls (complete, release, or nothing) in a
task of their own, out of reach of a cancellation of the body, bounded once one
has arrived; and the give-back of a claim granted after its caller was cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Literal

import structlog

from .errors import LeaseLost, StoreUnavailable
from .model import Lease
from .reasons import Reason
from .renewal import Hold
from .store import LeaseStore

log = structlog.get_logger("leases.hold")

OnExit = Literal["complete", "release", "keep"]


# Exit tasks given up on after `cancel_timeout`, kept referenced until they end.
_abandoned: set[asyncio.Task[None]] = set()


# A claim refused with these granted nothing: there is nothing to give back.
_NOTHING_GRANTED = frozenset({Reason.LEASE_HELD, Reason.JOB_COMPLETED})


async def stop(task: asyncio.Task[None]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def release(store: LeaseStore, state: Hold, renewer: asyncio.Task[None]) -> None:
    """After an outside cancellation: stop renewing, then release unless lost.

    The renewal in flight is cancelled and awaited first, so the release is never
    overtaken by it; a renewal the store applied but never answered leaves an older
    `state.lease` of the same generation, which releases just as well.
    """
    await stop(renewer)
    if state.lost is None:
        state.lease = await store.release(state.lease)


async def wind_up(
    store: LeaseStore,
    state: Hold,
    renewer: asyncio.Task[None],
    on_exit: OnExit,
    *,
    raise_lost: bool = False,
) -> None:
    """Stop renewing, then apply `on_exit` (or raise `LeaseLost`, if asked, when lost)."""
    await stop(renewer)
    if raise_lost and state.lost is not None:
        raise state.lost
    await _finish(store, state, on_exit)


async def settle(
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
        exit_failed(state.lease, action, reason)
    if arrived is not None:
        raise arrived


def exit_failed(lease: Lease, action: OnExit, reason: str) -> None:
    """An exit's store call that did not succeed, and is not raised: said."""
    log.warning(
        "lease_exit_failed",
        job_id=lease.job_id,
        generation=lease.generation,
        owner=lease.owner,
        action=action,
        reason=reason,
    )


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


async def give_back_claim(
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
