"""The SQLite group-commit executor: one transaction per batch, each function
atomic on its own, with or without a function that fails after writing."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from pathlib import Path

import aiosqlite
import pytest

import leases.sqlite as leases_sqlite
from leases.errors import StoreUnavailable
from leases.fence import Fence, StaleToken
from leases.fence.database import FenceDatabase
from leases.sqlite import SQLiteExecutor, enable_wal, in_thread


class Refused(Exception):
    pass


@pytest.fixture
async def executor(tmp_path):
    ex = await SQLiteExecutor.open(tmp_path / "x.db")
    await in_thread(ex._writer, lambda c: c.execute("CREATE TABLE t (k TEXT PRIMARY KEY)"))
    yield ex
    await ex.close()


def insert(key: str, *, fail_after: bool = False, fail_before: bool = False):
    def fn(conn: sqlite3.Connection) -> str:
        if fail_before:
            raise Refused(key)
        conn.execute("INSERT INTO t (k) VALUES (?)", (key,))
        if fail_after:
            raise Refused(key)
        return key

    return fn


async def keys(ex: SQLiteExecutor) -> set[str]:
    rows = await ex.read(lambda c: c.execute("SELECT k FROM t").fetchall())
    return {k for (k,) in rows}


async def run_all(ex: SQLiteExecutor, fns) -> list:
    return await asyncio.gather(*(ex.run(fn) for fn in fns), return_exceptions=True)


async def test_one_batch_one_transaction(executor):
    results = await run_all(executor, [insert(f"k{i}") for i in range(10)])
    assert results == [f"k{i}" for i in range(10)]
    assert executor.batches == 1 and executor.operations == 10
    assert await keys(executor) == {f"k{i}" for i in range(10)}


@pytest.mark.parametrize("where", ["first", "middle", "last"])
async def test_failure_after_writing_undoes_only_its_own_rows(executor, where):
    bad = {"first": 0, "middle": 2, "last": 4}[where]
    fns = [insert(f"k{i}", fail_after=i == bad) for i in range(5)]
    results = await run_all(executor, fns)
    assert executor.batches == 1
    assert isinstance(results[bad], Refused)
    assert [r for i, r in enumerate(results) if i != bad] == [f"k{i}" for i in range(5) if i != bad]
    assert await keys(executor) == {f"k{i}" for i in range(5) if i != bad}


async def test_failure_before_writing_leaves_neighbours(executor):
    fns = [insert("a"), insert("b", fail_before=True), insert("c")]
    results = await run_all(executor, fns)
    assert results[0] == "a" and isinstance(results[1], Refused) and results[2] == "c"
    assert await keys(executor) == {"a", "c"}


async def test_database_error_fails_the_whole_batch(executor):
    from leases.errors import StoreUnavailable

    await executor.run(insert("dup"))
    results = await run_all(executor, [insert("x"), insert("dup"), insert("y")])
    assert all(isinstance(r, StoreUnavailable) for r in results)
    assert await keys(executor) == {"dup"}
    assert await executor.run(insert("z")) == "z"  # the connection is usable again


async def test_a_store_never_closed_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    """A program whose bug escapes before `close()` must still exit (with its
    traceback), not hang at exit waiting for aiosqlite's worker threads."""
    script = (
        "import asyncio\n"
        "from leases import open_store\n"
        "async def main():\n"
        f"    store = await open_store('sqlite:///{tmp_path / 'jobs.db'}')\n"
        "    await store.claim('job-1', owner='w', ttl=30)\n"
        "    raise RuntimeError('a bug after open_store')\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1
    assert b"RuntimeError: a bug after open_store" in stderr


def hold_write_lock(path: Path) -> sqlite3.Connection:
    """Another process's view of a new file: still in rollback-journal mode, its
    write lock taken (as while that process switches the file to WAL)."""
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE other (x)")
    holder.execute("BEGIN IMMEDIATE")
    return holder


async def test_opening_a_new_file_waits_for_another_connections_write_lock(
    tmp_path: Path,
) -> None:
    path = tmp_path / "new.db"
    holder = hold_write_lock(path)
    asyncio.get_running_loop().call_later(0.3, holder.execute, "COMMIT")
    ex = await SQLiteExecutor.open(path)  # failed at once with "database is locked"
    try:
        mode = await in_thread(ex._writer, lambda c: c.execute("PRAGMA journal_mode").fetchone())
        assert mode == ("wal",)
    finally:
        await ex.close()
        holder.close()


async def test_without_waiting_the_switch_to_wal_fails_at_once(tmp_path: Path) -> None:
    """The protection switched off (no time to wait): SQLite's own busy timeout
    does not cover this case, which is why `enable_wal` retries."""
    path = tmp_path / "new.db"
    holder = hold_write_lock(path)
    conn = await aiosqlite.connect(path, isolation_level=None, timeout=5)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(sqlite3.OperationalError, match="database is locked"):
            await enable_wal(conn, max_wait=0)
        assert asyncio.get_running_loop().time() - started < 2  # not SQLite's 5 s timeout
    finally:
        await conn.close()
        holder.close()


async def test_the_fence_database_waits_for_the_lock_too(tmp_path: Path) -> None:
    path = tmp_path / "destination.db"
    holder = hold_write_lock(path)
    asyncio.get_running_loop().call_later(0.3, holder.execute, "COMMIT")
    database = FenceDatabase(Fence(), f"sqlite:///{path}")
    try:
        await database.check("job-1", 1)  # opens the file first
        await database.check("job-1", 2)
        with pytest.raises(StaleToken):
            await database.check("job-1", 1)
    finally:
        await database.close()
        holder.close()


# --- another process holding the write lock ---------------------------------------------

LOCK_WAIT_S = 2.0  # the busy timeout in these tests


async def _waits_while_locked(tmp_path: Path, submit_at: list[float]) -> list[float]:
    """Each operation's wait, from when it was queued to its failure, while another
    connection holds the write lock throughout; they are queued at `submit_at`."""
    ex = await SQLiteExecutor.open(tmp_path / "locked.db")
    await in_thread(ex._writer, lambda c: c.execute("CREATE TABLE t (k TEXT PRIMARY KEY)"))
    other = sqlite3.connect(tmp_path / "locked.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(key: str, at: float) -> float:
        await asyncio.sleep(max(0.0, start + at - loop.time()))
        queued = loop.time()
        with pytest.raises(StoreUnavailable, match="locked"):
            await ex.run(insert(key))
        return loop.time() - queued

    try:
        return list(await asyncio.gather(*(one(f"k{i}", at) for i, at in enumerate(submit_at))))
    finally:
        other.execute("ROLLBACK")
        other.close()
        assert await ex.run(insert("after")) == "after"  # the lock gone, writes go on
        await ex.close()


async def test_no_operation_waits_for_the_lock_longer_than_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second operation queues behind the first one's batch, which waits out the
    whole timeout; its own batch then gets only what is left of its timeout. The
    third, queued later in that same batch, is not cut short by it: it goes again."""
    monkeypatch.setattr(leases_sqlite, "BUSY_TIMEOUT_S", LOCK_WAIT_S)
    first, second, third = await _waits_while_locked(tmp_path, [0.0, 0.3, 1.0])
    for wait in (first, second, third):
        assert LOCK_WAIT_S - 0.1 <= wait < LOCK_WAIT_S + 0.9


async def test_without_the_budget_the_second_operation_waits_two_timeouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The protection switched off: every batch gets the whole timeout."""
    monkeypatch.setattr(leases_sqlite, "BUSY_TIMEOUT_S", LOCK_WAIT_S)
    monkeypatch.setattr(leases_sqlite, "busy_budget_ms", lambda waited: round(LOCK_WAIT_S * 1000))
    _, second = await _waits_while_locked(tmp_path, [0.0, 0.3])
    assert second >= 2 * LOCK_WAIT_S - 0.3 - 0.1


async def test_without_going_again_a_later_operation_is_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other protection switched off: the third operation fails with the second's
    batch, long before its own timeout."""
    monkeypatch.setattr(leases_sqlite, "BUSY_TIMEOUT_S", LOCK_WAIT_S)
    monkeypatch.setattr(leases_sqlite, "_locked", lambda exc: False)
    _, _, third = await _waits_while_locked(tmp_path, [0.0, 0.3, 1.0])
    assert third < LOCK_WAIT_S - 0.5
