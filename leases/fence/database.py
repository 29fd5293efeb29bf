"""The database a fence middleware checks in, named by URL; the one module of the
fence that loads a driver (aiosqlite or asyncpg, when the URL asks for it).

It is opened on first use, so building an app never does I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from ..urls import check_readable, shown_scheme, split_statement_cache
from .core import Fence

CONNECT_TIMEOUT_S = 10.0


class FenceDatabase:
    """The database a middleware checks in: `sqlite:///path` or `postgresql://...`.

    SQLite: one aiosqlite connection, each check one `BEGIN IMMEDIATE` transaction
    (checks of one process queue on a lock; other processes on SQLite's write
    lock). PostgreSQL: a small asyncpg pool, each check one transaction.
    """

    def __init__(self, fence: Fence, url: str) -> None:
        if not isinstance(fence, Fence):
            raise ValueError(f"fence must be a Fence, not {type(fence).__name__}")
        if not isinstance(url, str):
            raise ValueError(f"database_url must be a string, not {type(url).__name__}")
        scheme = url.split(":", 1)[0].lower()
        if scheme == "sqlite":
            from ..sqlite import sqlite_path

            self._path: str | None = sqlite_path(url)
        elif scheme in ("postgresql", "postgres"):
            check_readable(url)  # asyncpg's error for it may quote the password
            self._path = None
        else:
            # The scheme only: a URL may carry a password.
            raise ValueError(
                f"database_url must be sqlite:///path or postgresql://..., not {shown_scheme(url)}"
            )
        self.fence = fence
        # A pooler in transaction mode is told `statement_cache_size=0` in the URL.
        self.url, self._statement_cache = split_statement_cache(url)
        self._conn: Any = None  # aiosqlite connection or asyncpg pool, once opened
        self._opening = asyncio.Lock()
        self._serial = asyncio.Lock()

    async def _open(self) -> Any:
        async with self._opening:
            if self._conn is None:
                self._conn = await (self._open_sqlite() if self._path else self._open_postgres())
            return self._conn

    async def _open_sqlite(self) -> Any:
        import aiosqlite

        assert self._path is not None
        # As the gateway's own store and `open_store` do: a missing directory is
        # made, rather than every fenced request answered 503.
        await asyncio.to_thread(Path(self._path).parent.mkdir, parents=True, exist_ok=True)
        pending = aiosqlite.connect(self._path, timeout=10.0, isolation_level=None)
        pending._thread.daemon = True  # as leases.sqlite does: never hang the exit
        try:
            conn = await pending
        except BaseException:
            # A failed connect leaves aiosqlite's thread stopping on its own, with a
            # result to hand to this loop: let it finish while the loop still runs.
            await asyncio.to_thread(pending._thread.join, 5.0)
            raise
        try:
            from leases.sqlite import enable_wal

            await enable_wal(conn)
            await self.fence.setup(conn)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _open_postgres(self) -> Any:
        import asyncpg  # type: ignore[import-untyped]

        from ..postgres import STATEMENT_TIMEOUT_S

        # Each statement bounded as in the lease store: a silent connection fails
        # the check (503) instead of holding the request for minutes.
        pool = await asyncpg.create_pool(
            self.url,
            min_size=1,
            max_size=4,
            statement_cache_size=100 if self._statement_cache is None else self._statement_cache,
            timeout=CONNECT_TIMEOUT_S,
            command_timeout=STATEMENT_TIMEOUT_S,
        )
        try:
            async with pool.acquire() as conn:
                await self.fence.setup(conn)
        except BaseException:
            await pool.close()
            raise
        return pool

    async def check(self, job_id: str, token: int) -> None:
        """One committed check; `StaleToken` if refused, `OSError`-like errors if the
        database cannot be reached (the caller answers 503)."""
        conn = await self._open()
        if self._path is not None:
            async with self._serial:
                try:
                    # Inside the try: a request cancelled while BEGIN waits for the
                    # write lock still opens the transaction in aiosqlite's thread,
                    # and left so, it held SQLite's write lock for good (every later
                    # check 503, the user's other writers locked out).
                    await conn.execute_fetchall("BEGIN IMMEDIATE")
                    await self.fence.check(conn, job_id, token)
                    # Inside too: a COMMIT that fails (SQLITE_BUSY once busy_timeout
                    # has run out, in rollback-journal mode) leaves the transaction open.
                    await conn.execute_fetchall("COMMIT")
                except BaseException:
                    # Queued behind what was sent, so it runs even if this task is
                    # cancelled again; with no transaction open it fails harmlessly.
                    with contextlib.suppress(Exception):
                        await conn.execute_fetchall("ROLLBACK")
                    raise
            return
        from ..postgres import ACQUIRE_TIMEOUT_S, transaction

        # READ COMMITTED whatever the database's default: the check is one upsert
        # that locks the job's row, and under SERIALIZABLE two requests of one job
        # failed each other (503) where one waits for the other here.
        async with transaction(conn, ACQUIRE_TIMEOUT_S, isolation="read_committed") as pg:
            await self.fence.check(pg, job_id, token)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()
