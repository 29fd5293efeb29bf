"""The destination's own fence (SPEC 3.1): refuse a write whose fencing token has
gone backwards, in the destination's own database and transaction.

    from leases.fence import Fence, StaleToken

    fence = Fence()                          # table sinkgate_fence in your database
    await fence.setup(conn)                  # creates it if missing (idempotent)
    async with conn.transaction():           # your transaction, your effect
        await fence.check(conn, job_id, token)   # raises StaleToken if stale
        await conn.execute("INSERT INTO ledger ...")

`conn` is a sqlite3, aiosqlite or asyncpg connection. For plain HTTP services,
`aiohttp_middleware(fence, database_url)` and `ASGIFence(app, fence, database_url)`
check the forwarded `Fencing-Job`/`Fencing-Token` of every request. aiohttp is
imported only when `aiohttp_middleware` is used; the drivers only when a
middleware opens its database.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .asgi import ASGIFence
from .core import Fence, StaleToken

if TYPE_CHECKING:
    from .for_aiohttp import AiohttpFence, aiohttp_middleware

__all__ = ["ASGIFence", "AiohttpFence", "Fence", "StaleToken", "aiohttp_middleware"]


def __getattr__(name: str) -> Any:
    # Lazy, so that an ASGI or database-only destination never needs aiohttp.
    if name in ("aiohttp_middleware", "AiohttpFence"):
        from . import for_aiohttp

        return getattr(for_aiohttp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
