"""What the three lease backends share: the held-lease verbs through one `_held`, and closing."""

from __future__ import annotations

from typing import Self

from .model import Lease, LeaseRef, validate_ttl


class Closing:
    """Base of the backends: renew/complete/release through the backend's one
    `_held` verb, and `async with store:` closing the store on exit."""

    async def _held(self, op: str, lease: Lease | LeaseRef, ttl: float | None) -> Lease:
        raise NotImplementedError

    async def renew(self, lease: Lease | LeaseRef, *, ttl: float | None = None) -> Lease:
        """Extend the lease by `ttl` seconds from the store's now (default: the ttl
        it was claimed or last renewed with)."""
        return await self._held("renew", lease, None if ttl is None else validate_ttl(ttl))

    async def complete(self, lease: Lease | LeaseRef) -> Lease:
        return await self._held("complete", lease, None)

    async def release(self, lease: Lease | LeaseRef) -> Lease:
        return await self._held("release", lease, None)

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
