"""`Fence`: the destination's own check on `Fencing-Token`, in the caller's transaction.

One statement per check, the same on every driver: an upsert that raises the
job's highest token to `max(highest, token)` and returns the result. The token
is stale exactly when that result is above it (then it is the highest an earlier
check recorded, left unchanged). The upsert takes the job's row lock before it
reads (SQLite: the database's write lock), so two transactions checking the same
job, in one process or many, are decided one after the other against committed
state: a stale token can never slip past a newer one that has committed.

Connections are told apart by type, without importing a driver: `sqlite3`
(standard library), `aiosqlite` and `asyncpg` (a connection or a pool's proxy).
A `sqlite3` connection is synchronous, so with one `check`/`setup` run the
statement at call time, before they return; what they return may be awaited in
async code or ignored in sync code. `check_sync`/`setup_sync` are the explicit
spellings for synchronous code and accept only `sqlite3` connections.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Awaitable, Generator
from typing import Any

from ..errors import LeaseError
from ..model import validate_generation, validate_ident
from ..reasons import Reason

DEFAULT_TABLE = "sinkgate_fence"
_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")

SQLITE, AIOSQLITE, ASYNCPG = "sqlite3", "aiosqlite", "asyncpg"


class StaleToken(LeaseError):
    """`token` is below the highest token a committed check recorded for `job_id`.

    The write it fences must not take effect: a newer generation of the job has
    written already. `highest` is that newer generation.
    """

    reason = Reason.STALE_GENERATION

    def __init__(self, job_id: str, token: int, highest: int) -> None:
        super().__init__(f"job {job_id!r}: token {token} is below the highest token {highest}")
        self.job_id = job_id
        self.token = token
        self.highest = highest


class ForeignTable(ValueError):
    """The fence's table exists with another shape than the fence's own (made by
    something else): a text `highest` compares as text in SQLite ('9' > '10'),
    and would let a stale token through."""


def validate_token(value: object) -> int:
    """A fencing token: an int (not a bool) from 1 to 2**63-1."""
    return validate_generation(value, "token")


def driver_of(conn: object) -> str:
    """Which driver `conn` belongs to; ValueError for anything else."""
    if isinstance(conn, sqlite3.Connection):
        return SQLITE
    module = type(conn).__module__.split(".", 1)[0]
    if module in (AIOSQLITE, ASYNCPG):
        return module
    raise ValueError(
        "conn must be a sqlite3, aiosqlite or asyncpg connection, "
        f"not {type(conn).__module__}.{type(conn).__name__}"
    )


class _Done:
    """The awaitable a synchronous (sqlite3) check or setup returns: already done."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return None
        yield  # pragma: no cover - makes this a generator


_DONE = _Done()


class Fence:
    """The destination's fence: per job, the highest token a committed check recorded.

    The record lives in `table` (default `sinkgate_fence`) of the caller's own
    database and commits or rolls back with the caller's transaction.
    """

    def __init__(self, table: str = DEFAULT_TABLE) -> None:
        if not isinstance(table, str) or not _TABLE_NAME.fullmatch(table):
            raise ValueError("table must be an SQL identifier: [A-Za-z_][A-Za-z0-9_]{0,62}")
        self.table = table
        self._sqlite_ddl = (
            f"CREATE TABLE IF NOT EXISTS {table} (job_id TEXT PRIMARY KEY, "
            "highest INTEGER NOT NULL CHECK (highest >= 1))"
        )
        self._pg_ddl = (
            f"CREATE TABLE IF NOT EXISTS {table} (job_id text PRIMARY KEY, "
            "highest bigint NOT NULL CHECK (highest >= 1))"
        )
        self._sqlite_upsert = (
            f"INSERT INTO {table} (job_id, highest) VALUES (?, ?) ON CONFLICT (job_id) "
            f"DO UPDATE SET highest = max({table}.highest, excluded.highest) RETURNING highest"
        )
        self._pg_upsert = (
            f"INSERT INTO {table} (job_id, highest) VALUES ($1, $2) ON CONFLICT (job_id) "
            f"DO UPDATE SET highest = GREATEST({table}.highest, EXCLUDED.highest) "
            "RETURNING highest"
        )

    def __repr__(self) -> str:
        return f"Fence(table={self.table!r})"

    # --- setup ---------------------------------------------------------------------

    def setup(self, conn: Any) -> Awaitable[None]:
        """Create the table if it is missing (idempotent; safe from many processes)."""
        driver = driver_of(conn)
        if driver == SQLITE:
            self.setup_sync(conn)
            return _DONE
        return self._setup_async(driver, conn)

    def setup_sync(self, conn: sqlite3.Connection) -> None:
        """`setup` for synchronous code, on a `sqlite3` connection."""
        _need_sqlite3(conn)
        conn.execute(self._sqlite_ddl)
        self._sqlite_shape(conn.execute(f"PRAGMA table_info({self.table})").fetchall())

    def _sqlite_shape(self, columns: list[Any]) -> None:
        """`ForeignTable` unless `job_id` is the primary key alone and `highest` an
        integer (SQLite's affinity: a declared type containing INT)."""
        found = {row[1].lower(): (str(row[2]).upper(), int(row[5])) for row in columns}
        keys = [name for name, (_, pk) in found.items() if pk]
        if keys != ["job_id"] or "INT" not in found.get("highest", ("", 0))[0]:
            self._foreign({name: kind for name, (kind, _) in found.items()}, keys)

    def _foreign(self, columns: dict[str, str], keys: list[str]) -> None:
        shown = ", ".join(f"{name} {kind}" for name, kind in columns.items())
        raise ForeignTable(
            f"table {self.table} exists as ({shown}; primary key {', '.join(keys) or 'none'}): "
            "the fence needs (job_id text PRIMARY KEY, highest integer); "
            "give the fence another table: Fence(table=...)"
        )

    async def _setup_async(self, driver: str, conn: Any) -> None:
        if driver == ASYNCPG and not hasattr(conn, "transaction"):  # an asyncpg pool
            async with conn.acquire() as pooled:
                await self._setup_async(driver, pooled)
            return
        if driver == AIOSQLITE:
            await conn.execute_fetchall(self._sqlite_ddl)
            self._sqlite_shape(
                list(await conn.execute_fetchall(f"PRAGMA table_info({self.table})"))
            )
            return
        # CREATE TABLE IF NOT EXISTS is not atomic in PostgreSQL: processes starting
        # at once take the lock every sinkgate component takes around its DDL.
        from ..postgres import SCHEMA_LOCK_KEY

        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK_KEY)
            await conn.execute(self._pg_ddl)
            rows = await conn.fetch(_PG_SHAPE, self.table)
        columns = {row["name"]: row["kind"] for row in rows}
        keys = [row["name"] for row in rows if row["key"]]
        if keys != ["job_id"] or columns.get("highest") not in ("bigint", "integer"):
            self._foreign(columns, keys)

    # --- check ---------------------------------------------------------------------

    def check(self, conn: Any, job_id: str, token: int) -> Awaitable[None]:
        """Record `token` as `job_id`'s highest, or raise `StaleToken` if it is below it.

        Call it inside the transaction that makes the effect, before the effect.
        Equal tokens pass. Bad arguments raise `ValueError` at call time.
        """
        job_id, token = validate_ident(job_id, "job_id"), validate_token(token)
        driver = driver_of(conn)
        if driver == ASYNCPG and type(conn).__name__ == "Pool":
            # A pool runs the check on a connection of its own, in autocommit: the
            # mark commits apart from the effect, which may then land after a newer
            # generation's. (`setup` takes a pool: it joins no transaction.)
            raise ValueError(
                "conn must be the connection of the effect's transaction, not an asyncpg "
                "Pool: async with pool.acquire() as conn, conn.transaction(): ..."
            )
        if driver == ASYNCPG and not conn.is_in_transaction():
            # asyncpg runs a statement outside a transaction in autocommit: the mark
            # would commit apart from the effect. (SQLite's drivers begin one at
            # the check's own INSERT, so there is nothing to tell there.)
            raise ValueError(
                "check runs inside the effect's transaction: async with conn.transaction(): ..."
            )
        if driver == SQLITE:
            self.check_sync(conn, job_id, token)
            return _DONE
        return self._check_async(driver, conn, job_id, token)

    def check_sync(self, conn: sqlite3.Connection, job_id: str, token: int) -> None:
        """`check` for synchronous code, on a `sqlite3` connection."""
        job_id, token = validate_ident(job_id, "job_id"), validate_token(token)
        _need_sqlite3(conn)
        _verdict(job_id, token, raise_mark_sqlite3(conn, self._sqlite_upsert, job_id, token))

    async def _check_async(self, driver: str, conn: Any, job_id: str, token: int) -> None:
        if driver == AIOSQLITE:
            highest = await raise_mark_aiosqlite(conn, self._sqlite_upsert, job_id, token)
        else:
            highest = await raise_mark_asyncpg(conn, self._pg_upsert, job_id, token)
        _verdict(job_id, token, highest)


# The columns of the table the name resolves to (search_path), and which of them
# make up its primary key.
_PG_SHAPE = """
SELECT a.attname AS name, format_type(a.atttypid, a.atttypmod) AS kind,
       coalesce(a.attnum = ANY(i.indkey), false) AS key
FROM pg_attribute a
LEFT JOIN pg_index i ON i.indrelid = a.attrelid AND i.indisprimary
WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""


def _need_sqlite3(conn: object) -> None:
    if not isinstance(conn, sqlite3.Connection):
        raise ValueError(f"expected a sqlite3 connection, not {type(conn).__name__}")


def _verdict(job_id: str, token: int, highest: int) -> None:
    if highest > token:
        raise StaleToken(job_id, token, highest)


# The one statement per driver; each returns the job's highest token after it.
# Module-level so that a test can swap in a non-atomic variant and watch it fail.


def raise_mark_sqlite3(conn: sqlite3.Connection, sql: str, job_id: str, token: int) -> int:
    rows = conn.execute(sql, (job_id, token)).fetchall()
    return int(rows[0][0])


async def raise_mark_aiosqlite(conn: Any, sql: str, job_id: str, token: int) -> int:
    rows = await conn.execute_fetchall(sql, (job_id, token))
    return int(next(iter(rows))[0])


async def raise_mark_asyncpg(conn: Any, sql: str, job_id: str, token: int) -> int:
    return int(await conn.fetchval(sql, job_id, token))
