"""Would the decision and outcome batches gain from sharing one PostgreSQL call?

    python3 -m bench.shared_call                     # batches of 1, 4 and 16 writes
    python3 -m bench.shared_call --writes 4 --cycles 1000

A measurement for issue 33, not the store's way: the store sends each batch of
decisions and each batch of outcomes in a call of its own (two transactions,
two commits). Here one connection runs cycles of N writes in two ways,
alternating: "apart" decides N new keys in one call, then records the outcomes
of the cycle before in another, as the store does; "shared" sends both in one
statement (the outcome function in the select list of the decision function's
row), one transaction and one commit. Also the decision call alone, whose wall
time against the shared one's is what sharing would add before a forward.
Prints per way the median wall time of a cycle and the backend's CPU per write
(the scheduler's count in /proc). Needs the
PostgreSQL of the tests (`SINKGATE_TEST_PG`), on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any


def _backend_cpu(pid: int) -> float:
    """Seconds the process has run on a CPU (the scheduler's count, in ns)."""
    with open(f"/proc/{pid}/schedstat") as schedstat:
        return int(schedstat.read().split()[0]) / 1e9


class Batches:
    """New writes in batches of `writes` (unique keys, 8 jobs, monotonic fencing),
    and the arguments of the store's decision and outcome calls for a batch: the
    ones `bench.pg_call_parts` sends too."""

    def __init__(self, writes: int) -> None:
        from gateway.policy.records import WriteContext

        self.writes = writes
        self._numbers = itertools.count()
        self._context = WriteContext(remote="127.0.0.1", body_sha256="ab" * 32, body_bytes=2)

    def new(self) -> list[Any]:
        from gateway.policy.decision import Fencing, WriteFacts
        from gateway.store import postgres_batch as pb

        def facts(n: int) -> WriteFacts:
            return WriteFacts(
                destination="d", method="POST", path="/x", query="", job_id=f"job-{n % 8}",
                generation=1, owner=None, key=f"k{n}", fingerprint="fp",
                fencing=Fencing.MONOTONIC, upstream_idempotent=False, timeout=30.0,
            )  # fmt: skip

        return [pb.Decide(facts(next(self._numbers)), self._context) for _ in range(self.writes)]

    @staticmethod
    def decision_args(ops: list[Any]) -> list[Any]:
        from gateway.policy import batch_plan
        from gateway.store import postgres_batch as pb

        names = batch_plan.lock_names([op.facts for op in ops], pb.LOCK_KINDS)
        return [0.0, None, names, pb.LOCKS_ORDERED, *pb._args(ops)]

    @staticmethod
    def outcome_args(ops: list[Any]) -> list[Any]:
        """Each write's outcome: completed, 201."""
        n = len(ops)
        return [
            [op.facts.destination for op in ops], [op.facts.key for op in ops],
            [op.attempt for op in ops], ["completed"] * n, [201] * n, ["[]"] * n,
            [b"{}"] * n, [False] * n, [], 0.0,
        ]  # fmt: skip


async def measure(url: str, writes: int, cycles: int) -> None:
    import asyncpg  # type: ignore[import-untyped]

    from gateway.store import postgres_batch as pb
    from gateway.store import postgres_outcomes as po
    from gateway.store.postgres import PostgresStore

    await (await PostgresStore.open(url)).close()  # the schema and the functions
    conn = await asyncpg.connect(url)
    pid = await conn.fetchval("SELECT pg_backend_pid()")
    batches = Batches(writes)
    new_writes, decision_args, outcome_args = (
        batches.new,
        batches.decision_args,
        batches.outcome_args,
    )
    outcome_params = ", ".join(f"${n}" for n in range(pb._ARITY + 1, pb._ARITY + 11))
    shared_sql = pb._DECIDE_CALL.replace(
        "SELECT * FROM", f"SELECT s.*, (SELECT {po.OUTCOMES_FUNCTION}({outcome_params})) FROM"
    )

    before = {"apart": new_writes(), "shared": new_writes()}
    for ops in before.values():
        await conn.fetchrow(pb._DECIDE_CALL, *decision_args(ops))

    async def apart() -> None:
        ops = new_writes()
        await conn.fetchrow(pb._DECIDE_CALL, *decision_args(ops))
        await conn.fetchval(po._CALL_SQL, *outcome_args(before["apart"]))
        before["apart"] = ops

    async def shared() -> None:
        ops = new_writes()
        row = await conn.fetchrow(shared_sql, *decision_args(ops), *outcome_args(before["shared"]))
        assert len(row[-1]) == writes  # every outcome recorded
        before["shared"] = ops

    async def decision_alone() -> None:
        await conn.fetchrow(pb._DECIDE_CALL, *decision_args(new_writes()))

    ways = {"decision alone": decision_alone, "apart": apart, "shared": shared}
    try:
        for way in ways.values():  # the plans made first
            for _ in range(30):
                await way()
        walls: dict[str, list[float]] = {name: [] for name in ways}
        cpu = dict.fromkeys(ways, 0.0)
        for n in range(cycles):
            order = list(ways.items()) if n % 2 else list(reversed(ways.items()))
            for name, way in order:
                started, backend = time.perf_counter(), _backend_cpu(pid)
                await way()
                walls[name].append(time.perf_counter() - started)
                cpu[name] += _backend_cpu(pid) - backend
    finally:
        await conn.close()
    for name in ways:
        per_write = cpu[name] * 1000 / cycles / writes
        print(
            f"{writes:>3} writes, {name:>14}: {statistics.median(walls[name]) * 1000:.3f} ms "
            f"a cycle (median), backend CPU {per_write:.3f} ms per write"
        )


Measure = Callable[[str, int, int], Awaitable[None]]


def run_cli(measure: Measure, description: str, cycles: int, argv: list[str] | None) -> int:
    """`--writes` and `--cycles` from `argv`; `measure(url, writes, cycles)` on a
    fresh database for each number of writes per batch."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--writes", default="1,4,16", help="writes per batch")
    parser.add_argument("--cycles", type=int, default=cycles)
    args = parser.parse_args(argv)
    sys.path.insert(0, os.getcwd())

    async def each() -> None:
        from tests.pg import fresh_database

        for writes in (int(w) for w in args.writes.split(",")):
            async with fresh_database() as url:
                await measure(url, writes, args.cycles)

    asyncio.run(each())
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(measure, __doc__.splitlines()[0], 600, argv)


if __name__ == "__main__":
    sys.exit(main())
