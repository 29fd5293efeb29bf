"""A duplicate arriving 10 ms after its original, against a 200 ms upstream:
how long after the original's answer it gets its own, with `Prefer: wait` and
without, side by side (issue 32's first target).

    python3 -m bench.waiting                    # 5 rounds, SQLite
    python3 -m bench.waiting --rounds 10 --store postgres

One upstream (`bench/upstream.py --latency-ms 200`) and one gateway (`sinkgate
serve`, destination `bench`, lease fencing). Each round claims a fresh job and,
for each mode in turn (the order alternating between rounds), sends an original
write through `FencedWriter` and, 10 ms later, its duplicate through a second
`FencedWriter` with the same key: `wait=5` (the writer's default) or `wait=0`
(no header: the writer's retry loop, `Retry-After` capped at
`max_retry_wait`). Figures per mode: the duplicate's answer time minus the
original's (median and max over the rounds), the requests the duplicate sent
to the gateway, and whether it was a replay.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from leases.http import HTTPLeaseStore
from leases.writer import FencedWriter

from . import run as bench

MODES = {"wait": 5, "no-wait": 0}


class Counted:
    """An aiohttp session that counts the requests sent through it."""

    def __init__(self) -> None:
        self.sent = 0
        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(self._count)
        self.session = aiohttp.ClientSession(trace_configs=[trace])

    async def _count(self, *_: Any) -> None:
        self.sent += 1


async def timed(write: Any) -> tuple[float, Any]:
    result = await write
    return time.monotonic(), result


async def one_round(base: str, job: str, wait: int) -> dict[str, Any]:
    """An original and its duplicate 10 ms later; what the duplicate saw."""
    async with await HTTPLeaseStore.open(base) as leases:
        lease = await leases.claim(job, owner="bench", ttl=60)
    first, second = Counted(), Counted()
    try:
        original_writer = FencedWriter(base, lease, session=first.session, wait=wait)
        duplicate_writer = FencedWriter(base, lease, session=second.session, wait=wait)
        body = {"amount": 100}
        original = asyncio.create_task(
            timed(original_writer.post("bench", "/items", json=body, step="charge"))
        )
        await asyncio.sleep(0.01)
        duplicate_at, result = await timed(
            duplicate_writer.post("bench", "/items", json=body, step="charge")
        )
        original_at, _ = await original
    finally:
        await first.session.close()
        await second.session.close()
    return {
        "after_original_ms": (duplicate_at - original_at) * 1000,
        "requests": second.sent,
        "replayed": result.replayed,
    }


async def measure(base: str, rounds: int) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for n in range(rounds):
        order = list(MODES) if n % 2 == 0 else list(reversed(MODES))
        for mode in order:
            row = await one_round(base, f"job-{mode}-{n}", MODES[mode])
            results[mode].append(row)
            bench.log(f"round {n + 1} {mode}: {row}")
    return results


def summary(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = [f"{'mode':8} {'dup - original p50':>20} {'max':>10} {'requests':>9} {'replayed':>9}"]
    for mode, rows in results.items():
        after = [r["after_original_ms"] for r in rows]
        lines.append(
            f"{mode:8} {statistics.median(after):18.1f}ms {max(after):8.1f}ms "
            f"{statistics.median(r['requests'] for r in rows):9.0f} "
            f"{sum(r['replayed'] for r in rows):>4}/{len(rows)}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--upstream-latency-ms", type=float, default=200.0)
    args = parser.parse_args(argv)
    procs = bench.Processes()
    with tempfile.TemporaryDirectory(prefix="sinkgate-waiting-") as tmp_dir:
        tmp = Path(tmp_dir)
        try:
            up = bench.Target("upstream", f"http://127.0.0.1:{bench.free_port()}")
            up.proc = procs.start(
                [
                    *(sys.executable, "-m", "bench.upstream"),
                    *("--port", up.base.rsplit(":", 1)[1]),
                    *("--latency-ms", str(args.upstream_latency_ms)),
                ],
                tmp / "upstream.log",
            )
            bench.wait_ready(up)
            store_url = f"sqlite:///{tmp / 'data' / 'sinkgate.db'}"
            if args.store == "postgres":
                db = f"sinkgate_waiting_{int(time.time())}"
                asyncio.run(bench._pg(bench.PG_ADMIN_URL, f"CREATE DATABASE {db}"))
                store_url = bench.pg_db_url(bench.PG_ADMIN_URL, db)
            port = bench.free_port()
            root = tmp / "gateway"
            config = bench.write_gateway_config(root, port, bench.free_port(), store_url, up.base)
            gateway = bench.Target("gateway", f"http://127.0.0.1:{port}", logfile=tmp / "gw.log")
            gateway.proc = procs.start(bench.gateway_command(config), tmp / "gw.log")
            bench.wait_ready(gateway, "/healthz")
            results = asyncio.run(measure(gateway.base, args.rounds))
        finally:
            procs.stop_all()
            if args.store == "postgres":
                asyncio.run(bench._pg(bench.PG_ADMIN_URL, f"DROP DATABASE IF EXISTS {db}"))
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
