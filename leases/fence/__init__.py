"""The destination's own fence (SPEC 3.1): refuse a write whose fencing token has
gone backwards, in the destination's own database and transaction.

    from leases.fence import Fence, StaleToken

    fence = Fence()                          # table sinkgate_fence in your database
    await fence.setup(conn)                  # creates it if missing (idempotent)
    async with conn.transaction():           # your transaction, your effect
        await fence.check(conn, job_id, token)   # raises StaleToken if stale
        await conn.execute("INSERT INTO ledger ...")

`conn` is a sqlite3, aiosqlite or asyncpg connection.
"""

from __future__ import annotations

from .core import Fence, StaleToken

__all__ = ["Fence", "StaleToken"]
