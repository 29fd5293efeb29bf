"""What a task run under a lease costs, per task, against a real gateway.

    python3 -m bench.queue_overhead                 # 300 tasks per variant, 3 rounds
    python3 -m bench.queue_overhead --tasks 1000 --rounds 5

One task does one write. Variants, run one after the other in each round (the
order alternating between rounds), all sequential on one worker thread:

- `writer`: the write alone, a `FencedWriter` under a lease claimed once up front
  (what a task that manages no lease of its own pays for the gateway);
- `async-gate`: `async with gate.run(job)` around the same write: claim, hold()'s
  renewal task, complete (two lease API round trips more);
- `sync-gate`: `run_sync(gate, job, body)` from a plain thread, as a Celery task
  runs: the same, plus the hops to the private event loop and back.

Printed per variant: wall milliseconds per task (median over rounds of the mean,
and p99 of the last round) and the worker process's CPU milliseconds per task;
the gateway (`sinkgate serve`, SQLite) and the upstream (`bench/upstream.py`) run
as processes of their own. Overhead = a variant minus `writer`, same round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp

from leases import FencedWriter, open_store
from leases.integrations import SyncRun, TaskGate, close_sync, run_sync

from .overload import wait_ready, write_config
from .run import free_port

REPO = Path(__file__).resolve().parents[1]


def start(argv: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SINKGATE_")}
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=cwd,
        env={**env, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


Variant = Callable[[str, int], Coroutine[Any, Any, list[float]]]


async def writer_only(url: str, tasks: int) -> list[float]:
    store = await open_store(url)
    async with store, aiohttp.ClientSession() as session:
        lease = await store.claim(f"w-{time.time_ns()}", owner="bench", ttl=3600)
        writer = FencedWriter(url, lease, session=session)
        times = []
        for n in range(tasks):
            began = time.perf_counter()
            await writer.post("bench", "/x", json={"n": n}, step=f"s{n}")
            times.append(time.perf_counter() - began)
        return times


async def async_gate(url: str, tasks: int) -> list[float]:
    gate = TaskGate(url, ttl=30)
    prefix = f"a-{time.time_ns()}"
    times = []
    for n in range(tasks):
        began = time.perf_counter()
        async with gate.run(f"{prefix}-{n}") as run:
            await run.writer.post("bench", "/x", json={"n": n}, step="s")
        times.append(time.perf_counter() - began)
    await gate.close()
    return times


async def sync_gate(url: str, tasks: int) -> list[float]:
    def body(run: SyncRun, n: int) -> None:
        run.writer.post("bench", "/x", json={"n": n}, step="s")

    def loop() -> list[float]:
        gate = TaskGate(url, ttl=30)
        prefix = f"s-{time.time_ns()}"
        times = []
        for n in range(tasks):
            began = time.perf_counter()
            run_sync(gate, f"{prefix}-{n}", body, n)
            times.append(time.perf_counter() - began)
        close_sync(gate)
        return times

    return await asyncio.to_thread(loop)


VARIANTS: dict[str, Variant] = {
    "writer": writer_only,
    "async-gate": async_gate,
    "sync-gate": sync_gate,
}


async def measure(url: str, tasks: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {
        v: {"mean_ms": [], "cpu_ms": [], "p99_ms": []} for v in VARIANTS
    }
    names = list(VARIANTS)
    await writer_only(url, 50)  # warm-up: connections, the store's caches
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            cpu = time.process_time()
            times = await VARIANTS[name](url, tasks)
            cpu = time.process_time() - cpu
            results[name]["mean_ms"].append(1000 * statistics.fmean(times))
            results[name]["cpu_ms"].append(1000 * cpu / tasks)
            results[name]["p99_ms"].append(1000 * statistics.quantiles(times, n=100)[98])
    return results


def report(results: dict[str, dict[str, list[float]]]) -> None:
    base = results["writer"]
    print(f"{'variant':12} {'ms/task':>8} {'overhead':>9} {'p99 ms':>7} {'CPU ms/task':>12}")
    for name, r in results.items():
        over = statistics.median(m - b for m, b in zip(r["mean_ms"], base["mean_ms"], strict=True))
        print(
            f"{name:12} {statistics.median(r['mean_ms']):8.2f} {over:+9.2f} "
            f"{r['p99_ms'][-1]:7.2f} {statistics.median(r['cpu_ms']):12.2f}"
        )


async def main_async(tasks: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        up_port = free_port()
        upstream = start(["-m", "bench.upstream", "--port", str(up_port)], REPO)
        config, port = write_config(root, f"http://127.0.0.1:{up_port}", 256)
        text = config.parent.joinpath("destinations", "bench.toml").read_text()
        config.parent.joinpath("destinations", "bench.toml").write_text(
            text.replace('fencing = "monotonic"', 'fencing = "lease"')
        )
        gateway = start(["-m", "gateway", "serve", "--config", str(config)], root)
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_ready(url, gateway)
            report(await measure(url, tasks, rounds))
        finally:
            for proc in (gateway, upstream):
                proc.terminate()
                proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=300, help="tasks per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    asyncio.run(main_async(args.tasks, args.rounds))


if __name__ == "__main__":
    main()
