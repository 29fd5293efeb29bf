"""How one chaos worker reaches the gateways: a skewed monotonic clock, the lease
store with failover and a freeze switch, and round-robin writers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gateway.tools.chaos.context import DESTINATION, RunContext, step_name
from leases import Lease, LeaseRef, StoreUnavailable
from leases.http import HTTPLeaseStore
from leases.writer import FencedWriter


class SkewedClock:
    """A monotonic clock running `rate` times as fast as the real one."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._origin = time.monotonic()

    def __call__(self) -> float:
        return self._origin + (time.monotonic() - self._origin) * self.rate


class WorkerLeaseStore:
    """The lease store as one worker process sees it: the gateways' lease APIs with
    failover, and a freeze switch (a paused process sends nothing, renewals included)."""

    def __init__(self, stores: list[HTTPLeaseStore], start: int) -> None:
        self._stores = stores
        self._next = start
        self._thawed = asyncio.Event()
        self._thawed.set()

    def freeze(self) -> None:
        self._thawed.clear()

    def thaw(self) -> None:
        self._thawed.set()

    async def _call(self, op: str, *args: Any, **kw: Any) -> Any:
        await self._thawed.wait()
        last: StoreUnavailable | None = None
        for _ in self._stores:
            store = self._stores[self._next % len(self._stores)]
            try:
                return await getattr(store, op)(*args, **kw)
            except StoreUnavailable as exc:
                last = exc
                self._next += 1
        assert last is not None
        raise last

    async def claim(self, job_id: str, *, owner: str | None = None, ttl: float) -> Lease:
        lease: Lease = await self._call("claim", job_id, owner=owner, ttl=ttl)
        return lease

    async def renew(self, lease: Lease | LeaseRef, *, ttl: float | None = None) -> Lease:
        renewed: Lease = await self._call("renew", lease, ttl=ttl)
        return renewed

    async def complete(self, lease: Lease | LeaseRef) -> Lease:
        done: Lease = await self._call("complete", lease)
        return done

    async def release(self, lease: Lease | LeaseRef) -> Lease:
        freed: Lease = await self._call("release", lease)
        return freed

    async def get(self, job_id: str) -> Lease | None:
        current: Lease | None = await self._call("get", job_id)
        return current

    async def close(self) -> None:
        pass  # the underlying stores belong to the run

    async def __aenter__(self) -> WorkerLeaseStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass


class Writers:
    """One `FencedWriter` per write URL under one lease, used round-robin; a
    connection failure moves on to the next gateway."""

    def __init__(self, ctx: RunContext, lease: Lease, start: int) -> None:
        self._writers = [
            FencedWriter(
                url,
                lease,
                session=ctx.session,
                max_retries=2,
                max_retry_wait=1.0,
                timeout=ctx.write_timeout,
            )
            for url in ctx.write_urls
        ]
        self._next = start

    async def post(self, job_id: str, step: int) -> Any:
        writer = self._writers[self._next % len(self._writers)]
        self._next += 1
        return await writer.post(
            DESTINATION,
            f"/effects/{job_id}/{step}",
            json={"job": job_id, "step": step},
            step=step_name(step),
        )
