"""Time the admin summary and the unknown-keys count over a large rejection log.

    python -m bench.summary [--rows 1000000] [--keys 100000] [--pg URL]

Fills a fresh store (SQLite in a temporary directory; PostgreSQL in the database
at --pg, which must be empty) with `--rows` rejections spread over the last 7
days and `--keys` completed idempotency records plus a few unknown ones, then
times, best of 5: `summary` over the last 24 h and over 7 days, and
`unknown_counts` (what the gauge runs). The same queries are then timed with the
covering index `rejections_window` dropped, side by side. Nothing else may use
the database meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gateway.store import open_store

REASONS = (
    "stale_generation",
    "duplicate",
    "lease_expired",
    "request_in_progress",
    "owner_mismatch",
)
DESTINATIONS = ("payments", "emails", "crm", "warehouse")
WEEK = 7 * 86400.0
BATCH = 50_000


def _rejection_rows(rows: int, now: float) -> list[tuple[Any, ...]]:
    return [
        (now - WEEK * (i / rows), DESTINATIONS[i % 4], REASONS[i % 5], "detail", f"job-{i % 5000}")
        for i in range(rows)
    ]


def _key_rows(keys: int, now: float) -> list[tuple[Any, ...]]:
    return [
        (DESTINATIONS[i % 4], f"key-{i}", "completed" if i % 1000 else "unknown", "fp",
         f"attempt-{i}", 1, f"job-{i % 5000}", 1, now - i, now - i, now - i + 15, now - i, 200)
        for i in range(keys)
    ]  # fmt: skip


_KEY_INSERT = (
    "INSERT INTO idempotency (destination, key, state, fingerprint, attempt, attempts, "
    "job_id, generation, created_at, updated_at, deadline, completed_at, status) VALUES "
)


def fill_sqlite(path: Path, rows: int, keys: int, now: float) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("BEGIN")
    data = _rejection_rows(rows, now)
    for lo in range(0, rows, BATCH):
        conn.executemany(
            "INSERT INTO rejections (at, destination, reason, detail, job_id) VALUES (?,?,?,?,?)",
            data[lo : lo + BATCH],
        )
    conn.executemany(_KEY_INSERT + "(?,?,?,?,?,?,?,?,?,?,?,?,?)", _key_rows(keys, now))
    conn.execute("COMMIT")
    conn.execute("ANALYZE")
    conn.close()


async def fill_postgres(url: str, rows: int, keys: int, now: float) -> None:
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(url)
    try:
        await conn.copy_records_to_table(
            "rejections",
            records=_rejection_rows(rows, now),
            columns=["at", "destination", "reason", "detail", "job_id"],
        )
        await conn.copy_records_to_table(
            "idempotency",
            records=_key_rows(keys, now),
            columns=["destination", "key", "state", "fingerprint", "attempt", "attempts",
                     "job_id", "generation", "created_at", "updated_at", "deadline",
                     "completed_at", "status"],
        )  # fmt: skip
        await conn.execute("VACUUM ANALYZE rejections")
        await conn.execute("VACUUM ANALYZE idempotency")
    finally:
        await conn.close()


async def best_of(fn: Callable[[], Awaitable[Any]], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1000


async def measure(store: Any, now: float) -> dict[str, float]:
    return {
        "summary 24h": await best_of(lambda: store.summary(now - 86400, now)),
        "summary 7d": await best_of(lambda: store.summary(now - WEEK, now)),
        "unknown_counts": await best_of(store.unknown_counts),
    }


async def run(kind: str, url: str, fill: Callable[[float], Awaitable[None]], drop: str) -> None:
    store = await open_store(url)
    await store.close()  # the schema exists now; fill it behind the store's back
    now = time.time()
    started = time.perf_counter()
    await fill(now)
    print(f"{kind}: filled in {time.perf_counter() - started:.0f} s")
    for label in ("with the covering index", "without it"):
        store = await open_store(url)
        try:
            if label == "without it":
                await _drop_index(store, kind, drop)
            results = await measure(store, now)
        finally:
            await store.close()
        print(f"  {label}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in results.items()))


async def _drop_index(store: Any, kind: str, sql: str) -> None:
    if kind == "sqlite":
        from gateway.store import sqlite_admin

        # The summary names the index (INDEXED BY); without it, SQLite's own plan.
        plain = sqlite_admin.SUMMARY_SQL.replace(" INDEXED BY rejections_window", "")
        sqlite_admin.SUMMARY_SQL = plain
        await store._executor.run(lambda c: c.execute(sql))
    else:
        async with store._pool.acquire() as conn:
            await conn.execute(sql)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--pg", help="an empty PostgreSQL database to fill")
    args = parser.parse_args()
    print(f"{args.rows} rejections over 7 days, {args.keys} keys ({args.keys // 1000} unknown)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.db"
        await run(
            "sqlite",
            f"sqlite:///{path}",
            lambda now: asyncio.to_thread(fill_sqlite, path, args.rows, args.keys, now),
            "DROP INDEX rejections_window",
        )
    if args.pg:
        await run(
            "postgres",
            args.pg,
            lambda now: fill_postgres(args.pg, args.rows, args.keys, now),
            "DROP INDEX rejections_window",
        )


if __name__ == "__main__":
    asyncio.run(main())
