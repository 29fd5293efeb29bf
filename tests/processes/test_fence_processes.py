"""`leases.fence` across OS processes sharing one database (SQLite file, PostgreSQL).

Four processes, released together by a barrier each round, check tokens 1-4 for
the same job and, in the same transaction, record an effect. Whatever the
interleaving, the effects each round must be in non-decreasing token order in
commit order: no process may apply a token below one already committed. The
same run with the check made non-atomic (read, wait a little, then write)
applies stale tokens, which shows the test can fail.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

PROCESSES = 4
ROUNDS = 30
PATIENCE = 60.0
GAP_S = 0.02  # the non-atomic variant's pause between its read and its write


def _effects_sql(pg: bool) -> str:
    key = "id bigserial PRIMARY KEY" if pg else "id INTEGER PRIMARY KEY AUTOINCREMENT"
    return f"CREATE TABLE IF NOT EXISTS effects ({key}, round_no integer, token bigint)"


def _non_atomic(pg: bool) -> Any:
    select = "SELECT highest FROM sinkgate_fence WHERE job_id = "
    if pg:

        async def pg_check(conn: Any, sql: str, job: str, token: int) -> int:
            value = await conn.fetchval(select + "$1", job)
            await asyncio.sleep(GAP_S)
            if value is not None and value > token:
                return int(value)
            await conn.fetchval(sql, job, token)
            return token

        return pg_check

    def sqlite_check(conn: sqlite3.Connection, sql: str, job: str, token: int) -> int:
        row = conn.execute(select + "?", (job,)).fetchone()
        time.sleep(GAP_S)
        if row is not None and row[0] > token:
            return int(row[0])
        conn.execute(sql, (job, token)).fetchall()
        return token

    return sqlite_check


def _checker(target: str, index: int, atomic: bool, barrier: Any, results: Any) -> None:
    from leases.fence import core

    pg = target.startswith("postgresql")
    if not atomic:
        name = "raise_mark_asyncpg" if pg else "raise_mark_sqlite3"
        setattr(core, name, _non_atomic(pg))
    run = _pg_rounds if pg else _sqlite_rounds
    results.put((index, run(target, index + 1, barrier)))


def _sqlite_rounds(path: str, token: int, barrier: Any) -> int:
    from leases.fence import Fence, StaleToken

    fence, refused = Fence(), 0
    conn = sqlite3.connect(path, timeout=PATIENCE)
    try:
        for round_no in range(ROUNDS):
            barrier.wait(timeout=PATIENCE)
            try:
                fence.check_sync(conn, f"job-{round_no}", token)
            except StaleToken:
                conn.rollback()
                refused += 1
                continue
            conn.execute("INSERT INTO effects (round_no, token) VALUES (?, ?)", (round_no, token))
            conn.commit()
    finally:
        conn.close()
    return refused


def _pg_rounds(url: str, token: int, barrier: Any) -> int:
    return asyncio.run(_pg_rounds_async(url, token, barrier))


async def _pg_rounds_async(url: str, token: int, barrier: Any) -> int:
    import asyncpg  # type: ignore[import-untyped]

    from leases.fence import Fence, StaleToken

    fence, refused = Fence(), 0
    conn = await asyncpg.connect(url)
    try:
        for round_no in range(ROUNDS):
            barrier.wait(timeout=PATIENCE)  # blocking on purpose: nothing else runs here
            try:
                async with conn.transaction():
                    await fence.check(conn, f"job-{round_no}", token)
                    await conn.execute(
                        "INSERT INTO effects (round_no, token) VALUES ($1, $2)", round_no, token
                    )
            except StaleToken:
                refused += 1
    finally:
        await conn.close()
    return refused


def _race(target: str, *, atomic: bool) -> tuple[int, list[tuple[int, int]]]:
    """Run the processes; returns (refusals, effects as (round, token) in commit order)."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_checker, args=(target, i, atomic, barrier, results))
        for i in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    try:
        refusals = sum(results.get(timeout=PATIENCE)[1] for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=PATIENCE)
            if proc.is_alive():
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0] * PROCESSES
    return refusals, _read_effects(target)


def _read_effects(target: str) -> list[tuple[int, int]]:
    if target.startswith("postgresql"):
        return asyncio.run(_pg_effects(target))
    with sqlite3.connect(target) as conn:
        return conn.execute("SELECT round_no, token FROM effects ORDER BY id").fetchall()


async def _pg_effects(url: str) -> list[tuple[int, int]]:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT round_no, token FROM effects ORDER BY id")
    finally:
        await conn.close()
    return [(r[0], r[1]) for r in rows]


def _stale_effects(effects: list[tuple[int, int]]) -> list[str]:
    highest: dict[int, int] = {}
    stale = []
    for round_no, token in effects:
        if token < highest.get(round_no, 0):
            stale.append(f"round {round_no}: token {token} after {highest[round_no]}")
        highest[round_no] = max(highest.get(round_no, 0), token)
    return stale


def _prepare_sqlite(tmp_path: Path) -> str:
    from leases.fence import Fence

    path = str(tmp_path / "destination.db")
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        Fence().setup_sync(conn)
        conn.execute(_effects_sql(pg=False))
    return path


async def _prepare_pg(url: str) -> None:
    import asyncpg

    from leases.fence import Fence

    conn = await asyncpg.connect(url)
    try:
        await Fence().setup(conn)
        await conn.execute(_effects_sql(pg=True))
    finally:
        await conn.close()


@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "sqlite":
        yield _prepare_sqlite(tmp_path)
        return
    yield from _fresh_pg()


def _fresh_pg() -> Any:
    """A fresh PostgreSQL database for the processes (created and dropped here: the
    async context manager of tests/pg.py cannot span several event loops)."""
    import secrets

    import asyncpg

    from tests.pg import PG_ADMIN_URL, database_url, pg_skip_reason, skip_or_fail

    reason = asyncio.run(pg_skip_reason())
    if reason is not None:
        skip_or_fail(reason)

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(PG_ADMIN_URL)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    name = f"sinkgate_t_{secrets.token_hex(8)}"
    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        url = database_url(name)
        asyncio.run(_prepare_pg(url))
        yield url
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.mark.slow
def test_racing_processes_never_apply_a_token_below_a_committed_one(target: str) -> None:
    refusals, effects = _race(target, atomic=True)
    assert _stale_effects(effects) == []
    assert {r for r, _ in effects} == set(range(ROUNDS))  # every round applied something
    assert refusals >= 1  # the race was real: some processes came late and were refused
    assert len(effects) + refusals == PROCESSES * ROUNDS


@pytest.mark.slow
def test_made_non_atomic_racing_processes_apply_stale_tokens(target: str) -> None:
    """The protection switched off: the test above would fail."""
    _, effects = _race(target, atomic=False)
    assert _stale_effects(effects) != []
