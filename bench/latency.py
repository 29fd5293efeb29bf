"""Fixed-rate latency: what the gateway adds to a write over the plain proxy, at a
load both carry.

    python3 -m bench.latency                      # 50% of the plain proxy's capacity
    python3 -m bench.latency --rate 400 --duration 20 --rounds 3 --workers 1,2

An upstream that answers in `--upstream-latency-ms` (20), the plain proxy and the
gateway (SQLite, and PostgreSQL when reachable), each run with 1 and 2 processes
(`--workers`). The plain proxy's capacity with one process is measured first
(bench/loadgen.py, closed loop at 128 connections); every target is then loaded
open loop at `--share` (0.5) of it, or at `--rate` (req/s): request i is due at
start + i/rate and is sent then, whether or not earlier ones were answered
(new connections are opened as needed). Latency is measured from the time a
request was due, not from when it went out, so a target (or a generator) that
falls behind is charged for the wait instead of the wait being left out
(coordinated omission). The generator's own lag (due -> sent) is reported so
that a run where the generator, not the target, fell behind can be told apart.

The runs alternate their order between rounds; figures are medians over the
rounds, and "added" is the gateway's p50/p99 minus the plain proxy's with the
same number of processes, round by round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from . import run as bench
from ._proc import install_loop
from .loadgen import OWNER, Jobs, claim_jobs, fake_jobs, percentile

JOBS = 32


class Tally:
    """What one fixed-rate run saw, from the requests due after the warm-up."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.lags: list[float] = []
        self.statuses: Counter[str] = Counter()

    def report(self, sent: int, duration: float) -> dict:
        latencies, lags = sorted(self.latencies), sorted(self.lags)
        ok = sum(n for status, n in self.statuses.items() if status[0] == "2")
        return {
            "requests": len(latencies),
            "sent": sent,
            "rps": len(latencies) / duration,
            "p50_ms": percentile(latencies, 50) * 1000,
            "p99_ms": percentile(latencies, 99) * 1000,
            "p999_ms": percentile(latencies, 99.9) * 1000,
            "max_ms": latencies[-1] * 1000 if latencies else 0.0,
            "lag_p99_ms": percentile(lags, 99) * 1000,
            "ok_share": ok / max(1, len(latencies)),
            "statuses": dict(self.statuses),
        }


async def send(session: aiohttp.ClientSession, url: str, i: int, jobs: Jobs, run: str) -> str:
    """Write number `i`; its status (with the rejection reason) or the error's name."""
    job = i % len(jobs.ids)
    headers = {
        "Content-Type": "application/json",
        "Idempotency-Key": f"{run}-{i}",
        "Fencing-Job": jobs.ids[job],
        "Fencing-Token": str(jobs.current[job]),
        "Fencing-Owner": OWNER,
    }
    try:
        async with session.post(url, data=b'{"n":%d}' % i, headers=headers) as resp:
            await resp.read()
            reason = resp.headers.get("Sinkgate-Rejected")
            return f"{resp.status} {reason}" if reason else str(resp.status)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return type(exc).__name__


async def fixed_rate(url: str, rate: float, duration: float, warmup: float, jobs: Jobs) -> dict:
    """Open loop: `rate` requests/s for warmup + duration seconds; latency from due time."""
    loop = asyncio.get_running_loop()
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
        timeout=aiohttp.ClientTimeout(total=30),
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )
    run = f"{time.time_ns():x}"
    start = loop.time() + 0.2
    measure_from = start + warmup
    tally = Tally()

    async def one(i: int, due: float) -> None:
        status = await send(session, url, i, jobs, run)
        if due >= measure_from:
            tally.latencies.append(loop.time() - due)
            tally.statuses[status] += 1

    tasks: set[asyncio.Task[None]] = set()
    count = int(rate * (warmup + duration))
    try:
        for i in range(count):
            due = start + i / rate
            ahead = due - loop.time()
            if ahead > 0:
                await asyncio.sleep(ahead)
            if due >= measure_from:
                tally.lags.append(loop.time() - due)
            task = loop.create_task(one(i, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    finally:
        await session.close()
    return tally.report(count, duration)


def capacity(url: str, duration: float) -> float:
    """The plain proxy's closed-loop requests/s at 128 connections (bench/loadgen.py)."""
    out = subprocess.run(
        [
            *(sys.executable, "-m", "bench.loadgen", "--url", url, "--connections", "128"),
            *("--duration", str(duration), "--warmup", "1"),
        ],
        cwd=bench.REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(json.loads(out)["rps"])


def start_targets(
    procs: bench.Processes, args: argparse.Namespace, tmp: Path, up: bench.Target
) -> dict[tuple[str, int], bench.Target]:
    """The plain proxy and each gateway, once per process count."""
    started: dict[tuple[str, int], bench.Target] = {}
    for workers in args.workers:
        name = f"plain-{workers}"
        base = f"http://127.0.0.1:{bench.free_port()}"
        t = bench.Target(name, base, logfile=tmp / f"{name}.log")
        t.proc = procs.start(
            [
                *(sys.executable, "-m", "bench.plain_proxy", "--port", t.base.rsplit(":", 1)[1]),
                *("--upstream", up.base, "--workers", str(workers)),
            ],
            t.logfile,
        )
        bench.wait_ready(t)
        started["plain", workers] = t
        for store, url in args.stores:
            name = f"{store}-{workers}"
            port = bench.free_port()
            root = tmp / name
            config = bench.write_gateway_config(root, port, bench.free_port(), url, up.base)
            base = f"http://127.0.0.1:{port}"
            t = bench.Target(name, base, claim=True, logfile=tmp / f"{name}.log")
            t.proc = procs.start(bench.gateway_command(config, workers), t.logfile)
            bench.wait_ready(t, "/healthz")
            started[store, workers] = t
    return started


def summarise(results: list[dict], args: argparse.Namespace) -> str:
    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    lines = [
        f"fixed rate {args.rate:.0f} req/s, upstream {args.upstream_latency_ms:g} ms, "
        f"{args.rounds} round(s) of {args.duration:g} s; medians over rounds",
        "",
        "| target | processes | req/s | 2xx | p50 ms | p99 ms | p99.9 ms | added p50 ms "
        "| added p99 ms | cpu ms/req | generator lag p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workers in args.workers:
        for name in ["plain", *(store for store, _ in args.stores)]:
            rows = [r for r in results if r["target"] == name and r["workers"] == workers]
            if not rows:
                continue
            added = ["", ""]
            if name != "plain":
                plain = {
                    r["round"]: r
                    for r in results
                    if r["target"] == "plain" and r["workers"] == workers
                }
                for i, key in enumerate(("p50_ms", "p99_ms")):
                    median = statistics.median(r[key] - plain[r["round"]][key] for r in rows)
                    added[i] = f"{median:+.2f}"
            lines.append(
                f"| {name} | {workers} | {med(rows, 'rps'):.0f} | {med(rows, 'ok_share'):.0%} "
                f"| {med(rows, 'p50_ms'):.2f} "
                f"| {med(rows, 'p99_ms'):.2f} | {med(rows, 'p999_ms'):.2f} | {added[0]} "
                f"| {added[1]} | {med(rows, 'cpu_ms_per_req'):.3f} "
                f"| {med(rows, 'lag_p99_ms'):.2f} |"
            )
    return "\n".join(lines)


def measure(targets: dict[tuple[str, int], bench.Target], args: argparse.Namespace) -> list[dict]:
    jobs: dict[tuple[str, int], Jobs] = {}
    for key, t in targets.items():
        jobs[key] = (
            asyncio.run(claim_jobs(t.base, f"{key[0]}{key[1]}", JOBS, False))
            if t.claim
            else fake_jobs("plain", JOBS)
        )
    results = []
    for rnd in range(1, args.rounds + 1):
        order = list(targets) if rnd % 2 else list(reversed(list(targets)))
        for key in order:
            t = targets[key]
            assert t.proc is not None
            cpu0 = bench.cpu_seconds(t.proc.pid)
            rep = asyncio.run(
                fixed_rate(t.write_url, args.rate, args.duration, args.warmup, jobs[key])
            )
            cpu = bench.cpu_seconds(t.proc.pid) - cpu0  # the target's process group
            rep.update(target=key[0], workers=key[1], round=rnd)
            rep["cpu_ms_per_req"] = 1000 * cpu / max(1, rep["sent"])
            results.append(rep)
            bench.log(
                f"r{rnd} {key[0]} x{key[1]}: {rep['rps']:.0f} req/s p50 {rep['p50_ms']:.2f} "
                f"p99 {rep['p99_ms']:.2f} ms lag p99 {rep['lag_p99_ms']:.2f} {rep['statuses']}"
            )
            time.sleep(args.pause)
    return results


def stores(args: argparse.Namespace) -> tuple[list[tuple[str, str]], str | None]:
    """(name, URL) of each gateway store asked for, and the PostgreSQL database made."""
    found, pg_db = [], None
    for store in args.targets.split(","):
        if store == "sqlite":
            found.append(("sqlite", "sqlite:///data/sinkgate.db"))
        elif store == "postgres" and bench.pg_reachable(args.pg_admin_url):
            pg_db = f"sinkgate_latency_{time.time_ns():x}"
            asyncio.run(bench._pg(args.pg_admin_url, f'CREATE DATABASE "{pg_db}"'))
            found.append(("postgres", bench.pg_db_url(args.pg_admin_url, pg_db)))
    return found, pg_db


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, help="requests/s (default: --share of capacity)")
    p.add_argument("--share", type=float, default=0.5, help="of the plain proxy's capacity")
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workers", default="1,2", help="process counts, e.g. 1,2")
    p.add_argument("--upstream-latency-ms", type=float, default=20.0)
    p.add_argument("--targets", default="sqlite,postgres", help="gateway stores")
    p.add_argument("--pg-admin-url", default=bench.PG_ADMIN_URL)
    p.add_argument("--pause", type=float, default=1.0)
    p.add_argument("--json", help="also write every run to this file")
    args = p.parse_args(argv)
    args.workers = [int(w) for w in args.workers.split(",")]
    install_loop()
    procs = bench.Processes()
    pg_db = None
    tmp = Path(tempfile.mkdtemp(prefix="sinkgate-latency-"))
    try:
        args.stores, pg_db = stores(args)
        up = bench.Target("upstream", f"http://127.0.0.1:{bench.free_port()}", logfile=tmp / "up")
        up.proc = procs.start(
            [
                *(sys.executable, "-m", "bench.upstream", "--port", up.base.rsplit(":", 1)[1]),
                *("--latency-ms", str(args.upstream_latency_ms)),
            ],
            up.logfile,
        )
        bench.wait_ready(up)
        targets = start_targets(procs, args, tmp, up)
        if args.rate is None:
            cap = capacity(targets["plain", args.workers[0]].write_url, 5.0)
            args.rate = args.share * cap
            bench.log(f"plain proxy x{args.workers[0]}: {cap:.0f} req/s closed loop")
        results = measure(targets, args)
        print(summarise(results, args))
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}))
        return 0
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
        if pg_db:
            asyncio.run(
                bench._pg(args.pg_admin_url, f'DROP DATABASE IF EXISTS "{pg_db}" WITH (FORCE)')
            )


if __name__ == "__main__":
    sys.exit(main())
