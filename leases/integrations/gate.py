"""One task run under a lease, for any job queue: claim, renew, write fenced, finish.

    gate = TaskGate("http://gateway:8480", ttl=30)
    async with gate.run("order-1001") as run:        # claims, renews with hold()
        result = await run.writer.post("payments", "/charges", json=charge, step="charge")
        if result.status in (429, 502, 503, 504):  # relayed, not stored: nothing done
            raise UpstreamBusy(result.status)          # released: run it again later
    # left normally: the job is completed; by an exception: released

(`UpstreamBusy` is an exception of the program's own.)

The queue adapters (`leases.integrations.celery`, `leases.integrations.arq`) wrap
this and turn what ended a run into the queue's own idiom with `verdict()`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import uuid
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
from yarl import URL

from ..errors import JobCompleted, LeaseHeld, LeaseLost, StoreUnavailable
from ..hold import HeldLease, hold
from ..model import IDENT, VISIBLE, default_owner, validate_ident, validate_ttl
from ..reasons import Reason
from ..store import LeaseStore, open_store
from ..writer import FencedWriter, GatewayUnavailable, StaleWrite, derive_key

__all__ = ["TaskGate", "TaskRun", "Verdict", "job_id_from", "verdict"]

Action = Literal["done", "retry", "stop"]

# A newer generation exists: another run owns the job and answers for it.
_SUPERSEDED = frozenset({"stale_generation", Reason.UNKNOWN_GENERATION, Reason.OWNER_MISMATCH})


def job_id_from(*parts: object) -> str:
    """A job id from `parts` joined by ":": kept as it is when it is a valid job id
    (1-256 visible ASCII), else a readable prefix and a hash, equally stable; the
    same as the TypeScript `jobIdFrom` gives for the same text. Surrogates are
    read as JavaScript reads them: a high one followed by a low one is the one
    character they encode, and a lone one (from JSON's `\\ud800`, say) is hashed
    as its own bytes, not refused."""
    for part in parts:
        # None would be the job "None" (a `msg.get("id")` that found nothing): every
        # such task one job, all but the first skipped as done.
        if isinstance(part, bool) or not isinstance(part, str | int | uuid.UUID):
            raise ValueError(f"a job id is made of strings, integers and UUIDs, not {part!r}")
    text = ":".join(str(part) for part in parts)
    if IDENT.fullmatch(text):
        return text
    # Pairs joined: "\ud83d\ude00" built in Python is the "😀" a JS string holds.
    text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    readable = "".join(ch if "\x21" <= ch <= "\x7e" else "_" for ch in text[:200])
    return f"{readable}:{digest}"


@dataclass(frozen=True, slots=True)
class TaskRun:
    """What a task body gets: its job id, the held lease and a writer fenced by it."""

    job_id: str
    lease: HeldLease
    writer: FencedWriter

    @property
    def generation(self) -> int:
        return self.lease.generation

    def key(self, step: str) -> str:
        """The idempotency key of `step` of this job: the same in every run of it."""
        return derive_key(self.job_id, step)

    def check(self) -> None:
        """Raise `LeaseLost` if the lease is lost: call it in long loops between writes."""
        self.lease.hold.check()


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the queue should do with a run that ended in `error`: "done" (skip, the
    job is complete), "retry" (after `delay` seconds) or "stop" (another run owns it)."""

    action: Action
    reason: str
    delay: float = 0.0


@dataclass
class _Clients:
    store: LeaseStore
    session: aiohttp.ClientSession


@dataclass(eq=False)  # one gate, one set of clients: identity, not field equality
class TaskGate:
    """Where a queue's task runs take their leases and send their writes.

    `gateway` is the gateway's main listener (writes go to its `/to/...`); `store`
    the lease store URL, by default the same gateway's lease API. `ttl` is the lease
    length (renewed every third of it); `token` the destination's worker token,
    `lease_token` the lease API's. `retry_delay` is how long to wait before a retry
    when nobody can say who holds the job (store unreachable, lease expired).
    Stores and HTTP sessions are opened once per event loop and reused.
    """

    gateway: str
    store: str | None = None
    ttl: float = 30.0
    owner: str | None = None
    token: str | None = None
    lease_token: str | None = None
    retry_delay: float = 1.0
    _clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[_Clients]] = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )

    def __post_init__(self) -> None:
        url = URL(self.gateway) if isinstance(self.gateway, str) else None
        if url is None or url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"gateway must be http(s)://host[:port], not {self.gateway!r}")
        # Refused here, not at every task's run (where the queue's wrappers would
        # fail each task with it).
        validate_ttl(self.ttl)
        if self.owner is not None:
            validate_ident(self.owner, "owner")
        for name in ("token", "lease_token"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and VISIBLE.fullmatch(value)):
                raise ValueError(f"{name} must be visible ASCII")
        delay = self.retry_delay
        number = isinstance(delay, int | float) and not isinstance(delay, bool)
        if not (number and 0 <= delay < math.inf):
            raise ValueError("retry_delay must be a number of seconds >= 0")

    @asynccontextmanager
    async def run(self, job_id: str) -> AsyncIterator[TaskRun]:
        """Hold the lease of `job_id` while the body runs (see `leases.hold`).

        Raises `LeaseHeld` / `JobCompleted` from the claim, `LeaseLost` when the
        lease goes; a normal exit completes the job, an exception releases it.
        """
        clients = await self._open()
        owner = self.owner or default_owner()
        async with hold(clients.store, job_id, owner=owner, ttl=self.ttl) as lease:
            writer = FencedWriter(self.gateway, lease, session=clients.session, token=self.token)
            yield TaskRun(job_id, lease, writer)

    async def verdict(self, error: BaseException, job_id: str) -> Verdict | None:
        """`verdict(error)`, asking the store who holds `job_id` when the error alone
        cannot tell (a lease that expired locally may or may not have been taken)."""
        found = verdict(error, self.retry_delay)
        if isinstance(error, LeaseHeld) and found is not None:
            # The holder renews every third of the ttl: look again at about that
            # pace rather than only at its expiry, so a short holder is not waited out.
            pace = max(self.retry_delay, self.ttl / 3)
            return Verdict("retry", found.reason, min(found.delay, pace))
        if found is None or found.action != "retry":
            return found
        try:
            current = await (await self._open()).store.get(job_id)
        except (StoreUnavailable, ValueError):
            return found
        mine = getattr(error, "generation", None)
        if current is not None and current.state == "done":
            return Verdict("done", Reason.JOB_COMPLETED)
        if current is not None and isinstance(mine, int) and current.generation > mine:
            return Verdict("stop", Reason.STALE_GENERATION)
        return found

    async def close(self) -> None:
        """Close the store and session this event loop opened."""
        task = self._clients.pop(asyncio.get_running_loop(), None)
        if task is None or task.cancelled():
            return
        try:
            clients = await task
        except Exception:
            return  # the opening failed and opened nothing (its session is closed)
        await clients.store.close()
        await clients.session.close()

    async def on_shutdown(self, ctx: object = None) -> None:
        """`close()` with the signature of a worker's shutdown hook (arq's `on_shutdown`)."""
        await self.close()

    async def _open(self) -> _Clients:
        loop = asyncio.get_running_loop()
        task = self._clients.get(loop)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            # Never opened, or the opening failed: try again rather than fail for good.
            task = loop.create_task(self._connect())
            self._clients[loop] = task
        return await asyncio.shield(task)

    async def _connect(self) -> _Clients:
        session = aiohttp.ClientSession()
        url = self.store or self.gateway
        try:
            if url.split(":", 1)[0].lower() in ("http", "https"):
                store = await open_store(url, session=session, token=self.lease_token)
            else:
                store = await open_store(url)
        except BaseException:
            await session.close()
            raise
        return _Clients(store, session)


def verdict(error: BaseException, retry_delay: float = 1.0) -> Verdict | None:
    """How a queue should treat a run that ended in `error`; None: not ours, let the
    queue's own error handling have it."""
    if isinstance(error, JobCompleted):
        return Verdict("done", Reason.JOB_COMPLETED)
    if isinstance(error, LeaseHeld):
        return Verdict("retry", Reason.LEASE_HELD, max(error.expires_in, 0.05))
    if isinstance(error, LeaseLost | StaleWrite):
        if error.reason == Reason.JOB_COMPLETED:
            return Verdict("done", Reason.JOB_COMPLETED)
        if error.reason in _SUPERSEDED:
            return Verdict("stop", error.reason)
        return Verdict("retry", error.reason, retry_delay)
    if isinstance(error, StoreUnavailable):
        return Verdict("retry", Reason.STORE_UNAVAILABLE, retry_delay)
    if isinstance(error, GatewayUnavailable):
        # "Retry later with the same key" (the writer's own advice): the run again,
        # its earlier writes replayed by their keys. An outcome that stayed unknown
        # comes back as DuplicateWrite(outcome_unknown), for an operator.
        return Verdict("retry", error.reason, retry_delay)
    return None
