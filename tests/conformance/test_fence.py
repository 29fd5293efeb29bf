"""`leases.fence.Fence` (SPEC 3.1) on every driver it accepts: sqlite3, aiosqlite and
asyncpg. The same contract on each, including the one that matters most: a check
made while another transaction holds a newer token waits for it and is refused
once it commits, and the same test passes a stale token when the check is made
non-atomic (read, then write)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiosqlite
import pytest

from leases.fence import Fence, StaleToken, core
from leases.fence.core import ForeignTable

FENCE = Fence()
MAX = 2**63 - 1


class Conn:
    """One connection of one driver, with the transaction verbs the tests need."""

    def __init__(self, kind: str, raw: Any) -> None:
        self.kind = kind
        self.raw = raw
        self._tx: Any = None

    async def begin(self) -> None:
        if self.kind == "asyncpg":
            self._tx = self.raw.transaction()
            await self._tx.start()
        # sqlite3 and aiosqlite open a transaction before the check's INSERT themselves

    async def commit(self) -> None:
        if self.kind == "asyncpg":
            await self._tx.commit()
        elif self.kind == "aiosqlite":
            await self.raw.commit()
        else:
            self.raw.commit()

    async def rollback(self) -> None:
        if self.kind == "asyncpg":
            await self._tx.rollback()
        elif self.kind == "aiosqlite":
            await self.raw.rollback()
        else:
            self.raw.rollback()

    async def check(self, job: str, token: int) -> None:
        if self.kind == "sqlite3":
            # Off the loop: a check waiting for another connection's lock blocks.
            await asyncio.to_thread(FENCE.check_sync, self.raw, job, token)
        else:
            await FENCE.check(self.raw, job, token)

    async def checked(self, job: str, token: int) -> None:
        """One check in a transaction of its own, committed."""
        await self.begin()
        try:
            await self.check(job, token)
        except BaseException:
            await self.rollback()
            raise
        await self.commit()

    async def execute(self, sql: str) -> None:
        if self.kind == "asyncpg":
            await self.raw.execute(sql)
        elif self.kind == "aiosqlite":
            await self.raw.execute_fetchall(sql)
            await self.raw.commit()
        else:
            self.raw.execute(sql)
            self.raw.commit()

    async def highest(self, job: str) -> int | None:
        sql = "SELECT highest FROM sinkgate_fence WHERE job_id = "
        if self.kind == "asyncpg":
            value = await self.raw.fetchval(sql + "$1", job)
        elif self.kind == "aiosqlite":
            rows = list(await self.raw.execute_fetchall(sql + "?", (job,)))
            value = rows[0][0] if rows else None
        else:
            row = self.raw.execute(sql + "?", (job,)).fetchone()
            value = row[0] if row else None
        return None if value is None else int(value)


Opener = Callable[[], Any]


@pytest.fixture(params=["sqlite3", "aiosqlite", "asyncpg"])
async def connect(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Opener]:
    """A function opening connections (all to one fresh database) of one driver."""
    opened: list[Conn] = []
    kind = request.param
    if kind == "asyncpg":
        import asyncpg  # type: ignore[import-untyped]

        from tests.pg import fresh_database

        async with fresh_database() as url:

            async def open_pg() -> Conn:
                opened.append(Conn(kind, await asyncpg.connect(url)))
                return opened[-1]

            yield open_pg
            for conn in opened:
                await conn.raw.close()
        return
    path = str(tmp_path / "destination.db")
    with sqlite3.connect(path) as first:
        first.execute("PRAGMA journal_mode=WAL")

    async def open_sqlite() -> Conn:
        if kind == "aiosqlite":
            raw: Any = await aiosqlite.connect(path, timeout=10.0)
        else:
            raw = sqlite3.connect(path, timeout=10.0, check_same_thread=False)
        opened.append(Conn(kind, raw))
        return opened[-1]

    yield open_sqlite
    for conn in opened:
        result = conn.raw.close()
        if asyncio.iscoroutine(result):
            await result


@pytest.fixture
async def conn(connect: Opener) -> Conn:
    first: Conn = await connect()
    await FENCE.setup(first.raw)
    return first


async def test_a_first_token_passes_and_becomes_the_highest(conn: Conn) -> None:
    await conn.checked("job-1", 7)
    assert await conn.highest("job-1") == 7


async def test_higher_and_equal_tokens_pass_a_lower_one_is_refused(conn: Conn) -> None:
    await conn.checked("job-1", 7)
    await conn.checked("job-1", 7)  # one generation may write many times
    await conn.checked("job-1", 9)
    with pytest.raises(StaleToken) as refused:
        await conn.checked("job-1", 8)
    assert (refused.value.job_id, refused.value.token, refused.value.highest) == ("job-1", 8, 9)
    assert refused.value.reason == "stale_generation"
    assert await conn.highest("job-1") == 9  # a refused check changes nothing


async def test_the_mark_rolls_back_with_the_callers_transaction(conn: Conn) -> None:
    await conn.checked("job-1", 3)
    await conn.begin()
    await conn.check("job-1", 10)
    await conn.rollback()  # the effect failed: its token must not fence anyone
    assert await conn.highest("job-1") == 3
    await conn.checked("job-1", 4)


async def test_jobs_are_fenced_independently_and_the_largest_token_works(conn: Conn) -> None:
    await conn.checked("a", MAX)
    await conn.checked("b", 1)
    with pytest.raises(StaleToken):
        await conn.checked("a", MAX - 1)
    assert (await conn.highest("a"), await conn.highest("b")) == (MAX, 1)


async def test_setup_is_idempotent_and_keeps_the_marks(conn: Conn) -> None:
    await conn.checked("job-1", 5)
    await FENCE.setup(conn.raw)
    await FENCE.setup(conn.raw)
    assert await conn.highest("job-1") == 5


@pytest.mark.parametrize(
    ("job", "token"),
    [
        ("", 1),
        ("has space", 1),
        ("x" * 257, 1),
        ("caf\u00e9", 1),
        (None, 1),
        (42, 1),
        ("job", 0),
        ("job", -1),
        ("job", 2**63),
        ("job", True),
        ("job", 1.0),
        ("job", "5"),
        ("job", None),
    ],
)
async def test_bad_arguments_raise_value_error_and_record_nothing(
    conn: Conn, job: Any, token: Any
) -> None:
    with pytest.raises(ValueError):
        await FENCE.check(conn.raw, job, token)
    if isinstance(job, str) and job:
        assert await conn.highest(job) is None


async def test_the_longest_job_id_is_accepted(conn: Conn) -> None:
    job = "~" * 256
    await conn.checked(job, 2)
    assert await conn.highest(job) == 2


async def _race(connect: Opener, *, a_commits: bool) -> bool:
    """A holds token 9 in an open transaction; B checks token 5 meanwhile.
    Returns whether B was refused."""
    a, b = await connect(), await connect()
    await FENCE.setup(a.raw)
    await a.checked("job-r", 1)
    await a.begin()
    await a.check("job-r", 9)
    await b.begin()
    b_check = asyncio.create_task(b.check("job-r", 5))
    # B must be waiting for A's lock, not done: give it every chance to finish early.
    for _ in range(20):
        await asyncio.sleep(0.01)
        if b_check.done():
            break
    b_finished_early = b_check.done()
    await (a.commit() if a_commits else a.rollback())
    try:
        await b_check
    except StaleToken as exc:
        assert exc.highest == 9
        await b.rollback()
        assert not b_finished_early
        return True
    await b.commit()
    return False


async def test_a_check_racing_a_newer_open_transaction_waits_and_is_refused(
    connect: Opener,
) -> None:
    assert await _race(connect, a_commits=True) is True


async def test_a_newer_token_that_rolled_back_fences_nobody(connect: Opener) -> None:
    assert await _race(connect, a_commits=False) is False


def _read_then_write(kind: str) -> Any:
    """The non-atomic check: read the highest, decide, then write. Reads commit
    state without the row lock, so a check racing a newer open transaction passes."""
    select = "SELECT highest FROM sinkgate_fence WHERE job_id = "

    def sync(conn: sqlite3.Connection, sql: str, job: str, token: int) -> int:
        row = conn.execute(select + "?", (job,)).fetchone()
        if row is not None and row[0] > token:
            return int(row[0])
        conn.execute(sql, (job, token)).fetchall()
        return token

    async def aio(conn: Any, sql: str, job: str, token: int) -> int:
        rows = list(await conn.execute_fetchall(select + "?", (job,)))
        if rows and rows[0][0] > token:
            return int(rows[0][0])
        await conn.execute_fetchall(sql, (job, token))
        return token

    async def pg(conn: Any, sql: str, job: str, token: int) -> int:
        value = await conn.fetchval(select + "$1", job)
        if value is not None and value > token:
            return int(value)
        await conn.fetchval(sql, job, token)
        return token

    return {"sqlite3": sync, "aiosqlite": aio, "asyncpg": pg}[kind]


async def test_made_non_atomic_the_racing_stale_check_passes(
    connect: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The protection switched off: the race test above would fail."""
    probe = await connect()
    name = {"sqlite3": "raise_mark_sqlite3", "aiosqlite": "raise_mark_aiosqlite",
            "asyncpg": "raise_mark_asyncpg"}[probe.kind]  # fmt: skip
    monkeypatch.setattr(core, name, _read_then_write(probe.kind))
    assert await _race(connect, a_commits=True) is False


# --- the connection types ---------------------------------------------------------------


def test_sqlite3_works_from_synchronous_code(tmp_path: Path) -> None:
    """With a sqlite3 connection the statement runs at call time: no await needed."""
    with sqlite3.connect(tmp_path / "d.db") as db:
        FENCE.setup(db)
        FENCE.check(db, "job", 4)
        with pytest.raises(StaleToken):
            FENCE.check(db, "job", 3)
        FENCE.setup_sync(db)
        FENCE.check_sync(db, "job", 5)
        with pytest.raises(StaleToken):
            FENCE.check_sync(db, "job", 4)
        assert db.execute("SELECT highest FROM sinkgate_fence").fetchall() == [(5,)]


async def test_sqlite3_can_be_awaited_too(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "d.db") as db:
        await FENCE.setup(db)
        await FENCE.check(db, "job", 4)
        with pytest.raises(StaleToken):
            await FENCE.check(db, "job", 2)


async def test_other_connections_and_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sqlite3, aiosqlite or asyncpg"):
        FENCE.check(object(), "job", 1)
    async with aiosqlite.connect(tmp_path / "d.db") as db:
        with pytest.raises(ValueError, match="sqlite3 connection"):
            FENCE.check_sync(db, "job", 1)  # type: ignore[arg-type]
    for table in ("", "1abc", "a;drop", "x" * 64, None):
        with pytest.raises(ValueError):
            Fence(table)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sqlite_ddl", "pg_ddl"),
    [
        # highest as text: SQLite compares '9' above '10', and a stale 9 passed
        ("job_id TEXT PRIMARY KEY, highest TEXT", "job_id text PRIMARY KEY, highest text"),
        ("job_id TEXT, highest INTEGER", "job_id text, highest bigint"),  # no key
        (
            "id INTEGER PRIMARY KEY, job_id TEXT, highest INTEGER",
            "id int PRIMARY KEY, job_id text, highest bigint",
        ),
    ],
)
async def test_setup_refuses_a_table_of_another_shape(
    connect: Opener, sqlite_ddl: str, pg_ddl: str
) -> None:
    conn = await connect()
    ddl = pg_ddl if conn.kind == "asyncpg" else sqlite_ddl
    await conn.execute(f"CREATE TABLE sinkgate_fence ({ddl})")
    with pytest.raises(ForeignTable, match="the fence needs"):
        await FENCE.setup(conn.raw)


async def test_an_asyncpg_check_outside_a_transaction_is_refused() -> None:
    """asyncpg runs it in autocommit: the mark would commit apart from the effect
    (the docs' first rule), with nothing to say so."""
    import asyncpg

    from tests.pg import fresh_database

    async with fresh_database() as url:
        conn = await asyncpg.connect(url)
        try:
            await FENCE.setup(conn)
            with pytest.raises(ValueError, match="inside the effect's transaction"):
                FENCE.check(conn, "job", 3)
            assert await conn.fetchval("SELECT count(*) FROM sinkgate_fence") == 0
        finally:
            await conn.close()


def test_a_fence_in_its_own_table(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "d.db") as db:
        mine = Fence("ledger_fence")
        mine.setup_sync(db)
        mine.check_sync(db, "job", 4)
        assert db.execute("SELECT job_id, highest FROM ledger_fence").fetchall() == [("job", 4)]


async def test_setup_accepts_an_asyncpg_pool_and_check_refuses_it() -> None:
    """A pool is not a transaction: setup takes a connection of its own; a check
    on the pool would commit the mark by itself, apart from the effect it fences,
    which could then land after a newer generation's."""
    import asyncpg

    from tests.pg import fresh_database

    async with fresh_database() as url:
        pool = await asyncpg.create_pool(url, min_size=1, max_size=2)
        try:
            await FENCE.setup(pool)
            with pytest.raises(ValueError, match="not an asyncpg Pool"):
                FENCE.check(pool, "job", 3)
            async with pool.acquire() as conn, conn.transaction():
                await FENCE.check(conn, "job", 3)  # a pooled connection, in a transaction
            async with pool.acquire() as conn, conn.transaction():
                with pytest.raises(StaleToken):
                    await FENCE.check(conn, "job", 2)
        finally:
            await pool.close()
