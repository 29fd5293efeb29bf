"""One PostgreSQL decision call: a run of duplicates of one key, and new keys.

    python3 -m bench.decide_runs                     # 256 duplicates, 32 new keys, 1 new key
    python3 -m bench.decide_runs --body 20000        # the key's stored answer 20 kB long
    python3 -m bench.decide_runs --src DIR           # the gateway of another tree

What the store sends for the writes a settlement wakes: one batch of N
duplicates of a key whose answer is stored (each replayed, each logged), and,
for comparison, batches of new keys (each forwarded). Each batch is one call
of `postgres_batch.decide_batch` on one connection, outside any transaction,
as the store makes it. Prints per batch the median wall time of the call and
the client's CPU to send it and decode its answer. `--src DIR` imports the
gateway from another source tree (e.g. `git archive` of an older revision), to
compare two revisions in one sitting. Needs the PostgreSQL of the tests
(`SINKGATE_TEST_PG`); each run gets a fresh database.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time
from typing import Any


async def measure(url: str, body: int, calls: int) -> list[tuple[str, float, float]]:
    import asyncpg  # type: ignore[import-untyped]

    from gateway.policy.records import Outcome
    from gateway.store import postgres_batch
    from gateway.store.postgres import PostgresStore

    # The names as the batch module itself imports them.
    WriteFacts, WriteContext = postgres_batch.WriteFacts, postgres_batch.WriteContext
    Fencing, Decide = postgres_batch.Fencing, postgres_batch.Decide
    store = await PostgresStore.open(url)
    context = WriteContext(remote="127.0.0.1", body_sha256="ab" * 32, body_bytes=2)
    numbers = itertools.count()

    def facts(key: str) -> Any:
        return WriteFacts(
            destination="bench", method="POST", path="/items", query="", job_id=f"job-{key}",
            generation=1, owner=None, key=key, fingerprint="fp", fencing=Fencing.MONOTONIC,
            upstream_idempotent=False, timeout=30.0,
        )  # fmt: skip

    try:
        stored = facts("stored")
        reserved = await store.decide_write(stored, context)
        completed = Outcome("completed", 200, (("Content-Type", "application/json"),), b"x" * body)
        assert await store.record_outcome(stored, reserved.attempt, completed)
    finally:
        await store.close()
    batches = {
        "256 duplicates": lambda: [Decide(stored, context) for _ in range(256)],
        "32 new keys": lambda: [Decide(facts(f"k{next(numbers)}"), context) for _ in range(32)],
        "1 new key": lambda: [Decide(facts(f"k{next(numbers)}"), context)],
    }
    conn = await asyncpg.connect(url)
    try:
        results = []
        for name, batch in batches.items():
            walls: list[float] = []
            cpus: list[float] = []
            for n in range(calls + 10):  # the first 10 not counted: plans made
                operations = batch()
                wall, cpu = time.perf_counter(), time.thread_time()
                await postgres_batch.decide_batch(conn, operations, 0.0)
                if n >= 10:
                    walls.append(time.perf_counter() - wall)
                    cpus.append(time.thread_time() - cpu)
            results.append((name, statistics.median(walls), statistics.median(cpus)))
        return results
    finally:
        await conn.close()


async def main_async(args: argparse.Namespace) -> None:
    from tests.pg import fresh_database

    async with fresh_database() as url:
        for name, wall, cpu in await measure(url, args.body, args.calls):
            print(f"{name:>15}: call {wall * 1000:.2f} ms, client CPU {cpu * 1000:.2f} ms (median)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--body", type=int, default=200, help="the stored answer's bytes")
    parser.add_argument("--calls", type=int, default=50, help="calls measured per batch")
    parser.add_argument("--src", help="import the gateway from this source tree")
    args = parser.parse_args(argv)
    source = os.path.abspath(args.src) if args.src else os.getcwd()
    sys.path.insert(0, source)
    if args.src:  # `tests.pg` from this tree if the other has none
        sys.path.append(os.getcwd())
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
