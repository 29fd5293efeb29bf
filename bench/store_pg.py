"""Round trips and CPU per write of the PostgreSQL gateway store alone, without HTTP.

    python3 -m bench.store_pg                        # 4 s at 32 and at 128 callers
    python3 -m bench.store_pg --src DIR              # the gateway of another tree

Each simulated write is what the handler asks of the store: `decide_write`
(monotonic fencing, a unique key, 8 jobs) then `record_outcome` (completed).
Round trips are counted by wrapping asyncpg's `Connection`: every extended-protocol
call (`fetch*`, `execute` with arguments) and every simple query (`BEGIN`,
`COMMIT`) is one. Prints writes/s, round trips per write and per batch of
decisions and of outcomes, the process CPU per write and (with the server on this
machine) the CPU per write of the backends serving the bench database. `--src DIR` imports
the gateway from another source tree (e.g. `git archive` of an older revision),
to compare two revisions in one sitting. Needs the PostgreSQL of the tests
(`SINKGATE_TEST_PG`); each run gets a fresh database.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import time
from typing import Any

from bench.run import cpu_since, matching_cpu_seconds


def _count_round_trips() -> list[int]:
    """Wrap asyncpg's Connection so that every round trip adds one to the counter."""
    from asyncpg.connection import Connection  # type: ignore[import-untyped]

    counter = [0]
    execute, extended = Connection.execute, Connection._execute

    async def counted_execute(self: Any, query: str, *args: Any, **kw: Any) -> Any:
        if not args:  # a simple query; with arguments it goes through _execute
            counter[0] += 1
        return await execute(self, query, *args, **kw)

    async def counted_extended(self: Any, *args: Any, **kw: Any) -> Any:
        counter[0] += 1
        return await extended(self, *args, **kw)

    Connection.execute = counted_execute
    Connection._execute = counted_extended
    return counter


async def run(url: str, callers: int, seconds: float, counter: list[int]) -> dict[str, float]:
    from gateway.store import postgres
    from gateway.store.postgres import PostgresStore

    # The names as the store itself imports them (they moved between revisions).
    WriteFacts, Outcome, WriteContext = postgres.WriteFacts, postgres.Outcome, postgres.WriteContext
    Fencing = sys.modules[WriteFacts.__module__].Fencing

    store = await PostgresStore.open(url, max_size=10)
    context = WriteContext(remote="127.0.0.1", body_sha256="0" * 64, body_bytes=20)
    done = Outcome("completed", status=201, headers=(), body=b"{}")  # type: ignore[arg-type]
    stop = time.monotonic() + seconds
    writes = [0]
    serial = itertools.count()

    def make(job_id: str, key: str) -> Any:
        return WriteFacts(
            destination="d",
            method="POST",
            path="/x",
            query="",
            job_id=job_id,
            generation=1,
            owner=None,
            key=key,
            fingerprint="fp",
            fencing=Fencing.MONOTONIC,
            upstream_idempotent=False,
            timeout=30.0,
        )

    async def caller(c: int) -> None:
        while time.monotonic() < stop:
            facts = make(f"job-{c % 8}", f"k-{c}-{next(serial)}")
            verdict = await store.decide_write(facts, context)
            assert verdict.attempt is not None, verdict
            await store.record_outcome(facts, verdict.attempt, done)
            writes[0] += 1

    async def alone(n: int) -> tuple[int, int]:
        """Round trips of one decision batch and one outcome batch, nothing else running."""
        facts = make(f"job-alone-{n}", f"alone-{n}")
        before = counter[0]
        verdict = await store.decide_write(facts, context)
        middle = counter[0]
        await store.record_outcome(facts, verdict.attempt, done)  # type: ignore[arg-type]
        return middle - before, counter[0] - middle

    try:
        for n in range(3):  # the first prepares the statements on the connection
            decision_trips, outcome_trips = await alone(n)
        await asyncio.gather(*(caller(c) for c in range(callers)))  # warm-up
        stop = time.monotonic() + seconds
        writes[0] = 0
        trips = counter[0]
        decisions, outcomes = store._decisions.batches, store._outcomes.batches
        database = url.rsplit("/", 1)[-1]
        db_cpu = matching_cpu_seconds(database)
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.gather(*(caller(c) for c in range(callers)))
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        db_cpu = cpu_since(db_cpu, matching_cpu_seconds(database))
        trips = counter[0] - trips
        batches = store._decisions.batches - decisions + store._outcomes.batches - outcomes
    finally:
        await store.close()
    return {
        "round trips/decision batch": decision_trips,
        "round trips/outcome batch": outcome_trips,
        "writes/s": writes[0] / wall,
        "round trips/write": trips / writes[0],
        "writes/batch": 2 * writes[0] / batches,
        "CPU ms/write": cpu * 1000 / writes[0],
        "database CPU ms/write": db_cpu * 1000 / writes[0],
    }


async def main_async(callers: list[int], seconds: float) -> None:
    from tests.pg import fresh_database

    counter = _count_round_trips()
    for n in callers:
        async with fresh_database() as url:
            figures = await run(url, n, seconds, counter)
        print(f"callers {n}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--callers", default="32,128")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--src", help="import gateway/ and leases/ from this directory")
    args = p.parse_args(argv)
    if args.src:
        sys.path.insert(0, os.path.abspath(args.src))
    asyncio.run(main_async([int(c) for c in args.callers.split(",")], args.seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
