"""What the two middlewares share: reading the fencing headers, the per-job
serialisation, the problem+json answers, and the database a URL names.

Framework-free: the aiohttp and ASGI adapters only translate requests and
answers. The database is opened on first use (so building an app never does
I/O) and each check runs in a short transaction of its own, committed before
the handler is called.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from ..model import IDENT, MAX_GENERATION
from .core import Fence, StaleToken

PROBLEM_JSON = "application/problem+json"
PROBLEM_TYPE_BASE = "urn:sinkgate:problem:"  # the gateway's own problem types
REJECTED_HEADER = "Sinkgate-Rejected"
_TOKEN = re.compile(r"[1-9][0-9]{0,18}")
_TITLES = {
    "stale_generation": "Stale generation",
    "missing_fencing_token": "Missing fencing token",
    "invalid_fencing_token": "Invalid fencing token",
    "store_unavailable": "Store unavailable",
}
_STATUS = {
    "stale_generation": 409,
    "missing_fencing_token": 400,
    "invalid_fencing_token": 400,
    "store_unavailable": 503,
}


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
    status = _STATUS[reason]
    body = {
        "type": PROBLEM_TYPE_BASE + reason,
        "title": _TITLES[reason],
        "status": status,
        "detail": detail,
        "reason": reason,
        **{k: v for k, v in members.items() if v is not None},
    }
    return Refusal(status, reason, json.dumps(body, separators=(",", ":")).encode())


def stale_refusal(exc: StaleToken) -> Refusal:
    """The 409 `stale_generation` answer for a refused token."""
    return refusal(
        "stale_generation",
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
    jobs = [v for v in jobs if v]
    tokens = [v for v in tokens if v]
    if not jobs and not tokens:
        return None
    if not jobs or not tokens:
        missing = "Fencing-Job" if not jobs else "Fencing-Token"
        return refusal("missing_fencing_token", f"{missing} is missing")
    if len(jobs) > 1 or len(tokens) > 1:
        return refusal("invalid_fencing_token", "fencing headers must be sent once")
    job, token = jobs[0], tokens[0]
    if not IDENT.fullmatch(job):
        return refusal(
            "invalid_fencing_token", "Fencing-Job must be 1-256 visible ASCII characters"
        )
    if not _TOKEN.fullmatch(token) or int(token) > MAX_GENERATION:
        return refusal(
            "invalid_fencing_token",
            "Fencing-Token must be a decimal integer from 1 to 2^63-1 without sign or leading zero",
        )
    return job, int(token)


class JobLocks:
    """One lock per job id, dropped once nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, job_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(job_id, (asyncio.Lock(), 0))
        self._locks[job_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[job_id]
            if users == 1:
                del self._locks[job_id]
            else:
                self._locks[job_id] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)


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
            self._path = None
        else:
            raise ValueError(
                f"database_url must be sqlite:///path or postgresql://..., not {url!r}"
            )
        self.fence = fence
        self.url = url
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
            await conn.execute_fetchall("PRAGMA journal_mode=WAL")
            await self.fence.setup(conn)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _open_postgres(self) -> Any:
        import asyncpg  # type: ignore[import-untyped]

        pool = await asyncpg.create_pool(self.url, min_size=1, max_size=4)
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
                await conn.execute_fetchall("BEGIN IMMEDIATE")
                try:
                    await self.fence.check(conn, job_id, token)
                except BaseException:
                    await conn.execute_fetchall("ROLLBACK")
                    raise
                await conn.execute_fetchall("COMMIT")
            return
        async with conn.acquire() as pg, pg.transaction():
            await self.fence.check(pg, job_id, token)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()


class FenceGate:
    """The middlewares' decision for one request: refuse it, or run its handler
    under the job's lock after a committed check."""

    def __init__(self, fence: Fence, database_url: str) -> None:
        self.database = FenceDatabase(fence, database_url)
        self.locks = JobLocks()

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
        except (OSError, TimeoutError) as exc:
            return unavailable(exc)
        except Exception as exc:
            if _is_driver_error(exc):  # the database failed: fail closed, never a 500
                return unavailable(exc)
            raise
        return None

    async def close(self) -> None:
        await self.database.close()


def unavailable(exc: BaseException) -> Refusal:
    return refusal("store_unavailable", f"the fence's database failed: {type(exc).__name__}")


def _is_driver_error(exc: Exception) -> bool:
    module = type(exc).__module__.split(".", 1)[0]
    return module in ("sqlite3", "asyncpg", "aiosqlite")
