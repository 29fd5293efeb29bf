"""What the two middlewares share: reading the fencing headers, the per-job
serialisation and the problem+json answers.

Framework-free: the aiohttp and ASGI adapters only translate requests and
answers. Each check runs in a short transaction of its own (`database.py`),
committed before the handler is called.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..model import IDENT, generation_of
from ..reasons import Reason, status_of, title_of
from .core import Fence, ForeignTable, StaleToken
from .database import FenceDatabase

PROBLEM_JSON = "application/problem+json"
PROBLEM_TYPE_BASE = "urn:sinkgate:problem:"  # the gateway's own problem types
REJECTED_HEADER = "Sinkgate-Rejected"


@dataclass(frozen=True, slots=True)
class Refusal:
    """An answer the middleware makes itself instead of calling the handler."""

    status: int
    reason: str
    body: bytes

    @property
    def headers(self) -> dict[str, str]:
        return {"Content-Type": PROBLEM_JSON, REJECTED_HEADER: self.reason}


def refusal(reason: str, detail: str, **members: Any) -> Refusal:
    """A problem+json answer (RFC 9457) in the gateway's shape."""
    status = status_of(reason)  # the gateway's own statuses and titles (leases.reasons)
    body = {
        "type": PROBLEM_TYPE_BASE + reason,
        "title": title_of(reason),
        "status": status,
        "detail": detail,
        "reason": reason,
        **{k: v for k, v in members.items() if v is not None},
    }
    return Refusal(status, reason, json.dumps(body, separators=(",", ":")).encode())


def stale_refusal(exc: StaleToken) -> Refusal:
    """The 409 `stale_generation` answer for a refused token."""
    return refusal(
        Reason.STALE_GENERATION,
        f"generation {exc.token} is below generation {exc.highest}, "
        "which has already written to this destination",
        job_id=exc.job_id,
        generation=exc.token,
        highest_generation=exc.highest,
    )


def fencing_of(jobs: list[str], tokens: list[str]) -> tuple[str, int] | Refusal | None:
    """(job_id, token) from the values of `Fencing-Job` and `Fencing-Token`.

    None when neither is sent (or both are empty, which counts as missing): the
    request is not fenced. One without the other is refused, so is a malformed
    or repeated value.
    """
    if len(jobs) > 1 or len(tokens) > 1:  # an empty one too: the gateway reads `a, `
        return refusal(Reason.INVALID_FENCING_TOKEN, "fencing headers must be sent once")
    job, token = (jobs or [""])[0], (tokens or [""])[0]
    if not job and not token:
        return None
    if not job or not token:
        missing = "Fencing-Job" if not job else "Fencing-Token"
        return refusal(Reason.MISSING_FENCING_TOKEN, f"{missing} is missing")
    if not IDENT.fullmatch(job):
        return refusal(
            Reason.INVALID_FENCING_TOKEN, "Fencing-Job must be 1-256 visible ASCII characters"
        )
    generation = generation_of(token)
    if generation is None:
        return refusal(
            Reason.INVALID_FENCING_TOKEN,
            "Fencing-Token must be a decimal integer from 1 to 2^63-1 without sign or leading zero",
        )
    return job, generation


# The job locks the running request holds, each with the mark of that holding
# (its task's context). A task the request starts copies the context, and may
# outlive the holding: only a mark that is still the lock's current holder lets
# a second fence pass without taking the lock.
_LockKey = tuple[asyncio.AbstractEventLoop, str]
_HELD: ContextVar[Mapping[_LockKey, object]] = ContextVar(
    "sinkgate_fence_held", default=MappingProxyType({})
)


class JobLocks:
    """One lock per job id and event loop, dropped once nobody holds or waits for it.

    One instance serves the whole process (`PROCESS_LOCKS`): SPEC 3.1 serialises a
    job's requests within the process, so two middlewares (two apps, or one app
    mounted twice) must take the same lock for one job. Keyed by the running loop
    as well, since an asyncio lock belongs to one loop.
    """

    def __init__(self) -> None:
        self._locks: dict[_LockKey, tuple[asyncio.Lock, int]] = {}
        self._holders: dict[_LockKey, object] = {}  # the mark of each lock's holding

    @asynccontextmanager
    async def hold(self, job_id: str) -> AsyncIterator[None]:
        key = (asyncio.get_running_loop(), job_id)
        held = _HELD.get()
        mine = held.get(key)
        if mine is not None and self._holders.get(key) is mine:
            # A fence inside a fence (a sub-app's middleware, a wrapped ASGI app):
            # this request holds the job's lock now, and would wait for itself.
            yield
            return
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                holding = object()
                self._holders[key] = holding
                mark = _HELD.set({**held, key: holding})
                try:
                    yield
                finally:
                    _HELD.reset(mark)
                    del self._holders[key]
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)


PROCESS_LOCKS = JobLocks()


class FenceGate:
    """The middlewares' decision for one request: refuse it, or run its handler
    under the job's lock after a committed check."""

    def __init__(self, fence: Fence, database_url: str) -> None:
        self.database = FenceDatabase(fence, database_url)
        self.locks = PROCESS_LOCKS

    @asynccontextmanager
    async def admit(self, job_id: str, token: int) -> AsyncIterator[Refusal | None]:
        """Yields None with the job's lock held (run the handler inside), or the
        refusal to answer with instead."""
        async with self.locks.hold(job_id):
            yield await self._check(job_id, token)

    async def _check(self, job_id: str, token: int) -> Refusal | None:
        try:
            await self.database.check(job_id, token)
        except StaleToken as exc:
            return stale_refusal(exc)
        except (OSError, TimeoutError, ForeignTable) as exc:
            return unavailable(exc)
        except Exception as exc:
            if _is_driver_error(exc):  # the database failed: fail closed, never a 500
                return unavailable(exc)
            raise
        return None

    async def close(self) -> None:
        await self.database.close()


def unavailable(exc: BaseException) -> Refusal:
    return refusal(Reason.STORE_UNAVAILABLE, f"the fence's database failed: {type(exc).__name__}")


def _is_driver_error(exc: Exception) -> bool:
    module = type(exc).__module__.split(".", 1)[0]
    return module in ("sqlite3", "asyncpg", "aiosqlite")
