"""A held lease's live state (`Hold`), when to renew it (`RenewalSchedule`, pure)
and the watchdog that renews it and cancels the body once it may be gone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from .errors import LeaseLost, StoreUnavailable
from .model import Lease, validate_ttl
from .reasons import Reason
from .store import LeaseStore

log = structlog.get_logger("leases.hold")


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
        for name in ("renew_fraction", "safety_margin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, not {type(value).__name__}")
        if not 0 < self.renew_fraction < 1:
            raise ValueError("renew_fraction must be between 0 and 1")
        if not 0 <= self.safety_margin < self.renew_fraction:
            raise ValueError("safety_margin must be between 0 and renew_fraction")
        if not self.renew_fraction + self.safety_margin < 1:
            # The first renewal would fall due after the local deadline: the lease
            # would be taken as lost at every hold, the store still holding it.
            raise ValueError("renew_fraction + safety_margin must be below 1")

    def deadline(self, sent: float) -> float:
        """The local deadline of a lease claimed or renewed by a request sent at `sent`."""
        return sent + self.ttl * (1 - self.safety_margin)

    def wait(self, now: float, deadline: float) -> float:
        """How long to sleep before the next renewal (never past the deadline)."""
        return max(0.0, min(now + self.ttl * self.renew_fraction, deadline) - now)


Sleep = Callable[[float], Awaitable[None]]


class Renewer:
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

    def lose(
        self,
        reason: str,
        current_generation: int | None = None,
        cause: BaseException | None = None,
    ) -> None:
        """`cause`: the last renewal's failure, kept as the loss's `__cause__` (what
        the store said, or that it did not answer in time)."""
        state = self.state
        if state.lost is None:
            state.lost = LeaseLost(
                state.job_id, state.generation, reason, current_generation=current_generation
            )
            state.lost.__cause__ = cause
        log.warning(
            "lease_lost",
            job_id=state.job_id,
            generation=state.generation,
            owner=state.owner,
            reason=reason,
            error=None if cause is None else str(cause),
        )
        self.cancelled_body = True
        self.body.cancel()

    async def run(self) -> None:
        state, now = self.state, self.monotonic
        # The deadline passing after a failed renewal is the store's fault, not the
        # worker's: the loss then says `store_unavailable`.
        failed: BaseException | None = None  # the last renewal's failure, since a success
        while True:
            await self.sleep(self.schedule.wait(now(), state.deadline))
            if now() >= state.deadline:
                if failed is None:
                    return self.lose(Reason.LEASE_EXPIRED)
                return self.lose(Reason.STORE_UNAVAILABLE, cause=failed)
            sent = now()
            try:
                async with asyncio.timeout(max(0.0, state.deadline - sent)):
                    state.lease = await self.store.renew(state.lease, ttl=self.schedule.ttl)
            except LeaseLost as exc:
                return self.lose(exc.reason, exc.current_generation)
            except Exception as exc:  # StoreUnavailable, TimeoutError: an outage
                failed = _failure(exc)
                if not _outage(exc):
                    # Not an outage (a gateway answering 400 to the renewal, or 401 to
                    # a wrong lease token, say), but the lease is just as unrenewed:
                    # retried, and lost at the same deadline. Raised out, it ended
                    # this watchdog and left the body running past its lease.
                    log.warning("renewal_failed", job_id=state.job_id, error=repr(exc))
                if now() >= state.deadline:
                    return self.lose(Reason.STORE_UNAVAILABLE, cause=failed)
                continue  # transient: try again until the local deadline
            failed = None
            state.deadline = self.schedule.deadline(sent)


def _failure(exc: Exception) -> BaseException:
    """A failed renewal as the loss's cause: a renewal cut at the local deadline
    in words (asyncio's TimeoutError has none), anything else as it was raised."""
    if isinstance(exc, TimeoutError):
        cut = StoreUnavailable("the lease store did not answer a renewal before the local deadline")
        cut.__cause__ = exc
        return cut
    return exc


def _outage(exc: Exception) -> bool:
    """Whether a failed renewal is the store being out of reach (nothing answered,
    or a 5xx), not an answer about the request itself: a 401/403 (the lease token)
    or another 4xx, or a 200 the client could not read, is the configuration's
    and said in the log."""
    if isinstance(exc, TimeoutError):
        return True
    return isinstance(exc, StoreUnavailable) and (exc.status is None or exc.status >= 500)
