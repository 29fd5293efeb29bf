"""Overload run: 1000 concurrent connections against a gateway whose upstream is slow.

    python -m bench.overload [--connections 1000] [--duration 20] [--latency-ms 500]
                             [--max-in-flight 256] [--rss-limit-mib 300]

Everything runs on loopback: a slow upstream (aiohttp, in this process), a real
`python -m gateway serve` subprocess on a temporary SQLite store (one monotonic
destination, `max_in_flight` forwards at once), and `--connections` workers,
each on its own keep-alive connection, writing with fresh idempotency keys for
`--duration` seconds. With far more connections than `max_in_flight` and an
upstream that takes `--latency-ms` per answer, most writes must be turned away.

It reports the answers by kind and the gateway's resident memory (VmRSS from
/proc, sampled every 0.5 s), and exits non-zero unless:

- every answer is the upstream's 200 or the gateway's `503 overloaded` (with
  `Retry-After`): no other error, no connection error, no timeout — the gateway
  answers at once instead of queueing without bound;
- the peak RSS stays under `--rss-limit-mib` and the second half of the run does
  not grow past the first half's peak by more than 10% (no growth with load).

Linux only (reads /proc); raises the open-files limit for itself and the gateway.
Not a test: it takes `--duration` seconds and needs a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def raise_open_files(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, max(soft, wanted))
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        print(f"warning: open-files limit {target} < {wanted}", file=sys.stderr)


async def slow_upstream(latency: float) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(latency)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, backlog=4096).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


def write_config(root: Path, upstream: str, max_in_flight: int) -> tuple[Path, int]:
    port = free_port()
    (root / "destinations").mkdir()
    (root / "gateway.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\nadmin_listen = "127.0.0.1:{free_port()}"\n'
        f'max_in_flight = {max_in_flight * 2}\nshutdown_grace = "5s"\n\n'
        '[store]\nurl = "sqlite:///sinkgate.db"\n\n[destinations]\ndir = "destinations"\n'
    )
    (root / "destinations" / "bench.toml").write_text(
        f'upstream = "{upstream}/api"\nfencing = "monotonic"\ntimeout = "10s"\n'
        f"max_in_flight = {max_in_flight}\n"
    )
    return root / "gateway.toml", port


async def wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            if proc.poll() is not None:
                raise SystemExit("the gateway exited during start-up")
            try:
                async with session.get(f"{url}/healthz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("the gateway did not come up")


async def connection(n: int, url: str, until: float, tally: collections.Counter[str]) -> None:
    """One worker on one keep-alive connection of its own."""
    connector = aiohttp.TCPConnector(limit=1)
    timeout = aiohttp.ClientTimeout(total=30)
    seq = 0
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        while time.monotonic() < until:
            seq += 1
            headers = {
                "Fencing-Job": f"job-{n}",
                "Fencing-Token": "1",
                "Idempotency-Key": f"c{n}-{seq}",
                "Content-Type": "application/json",
            }
            try:
                async with session.post(f"{url}/to/bench/x", data=b"{}", headers=headers) as r:
                    await r.read()
                    reason = r.headers.get("Sinkgate-Rejected")
                    if r.status == 200 and reason is None:
                        tally["ok"] += 1
                    elif r.status == 503 and reason == "overloaded" and "Retry-After" in r.headers:
                        tally["overloaded"] += 1
                        await asyncio.sleep(0.05)  # a polite client backs off a little
                    else:
                        tally[f"error {r.status} {reason}"] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                tally[f"error {type(exc).__name__}"] += 1


async def main(args: argparse.Namespace) -> int:
    raise_open_files(args.connections * 3 + 512)
    upstream_runner, upstream = await slow_upstream(args.latency_ms / 1000)
    with tempfile.TemporaryDirectory() as tmp:
        config, port = write_config(Path(tmp), upstream, args.max_in_flight)
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once
            [
                sys.executable,
                "-m",
                "gateway",
                "serve",
                "--config",
                str(config),
                "--log-level",
                "warning",
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            await wait_ready(url, proc)
            start_rss = rss_kib(proc.pid)
            tally: collections.Counter[str] = collections.Counter()
            samples: list[tuple[float, int]] = []
            started = time.monotonic()
            until = started + args.duration
            workers = [
                asyncio.create_task(connection(i, url, until, tally))
                for i in range(args.connections)
            ]
            while not all(w.done() for w in workers):
                samples.append((time.monotonic() - started, rss_kib(proc.pid)))
                await asyncio.wait(workers, timeout=0.5)
            await asyncio.gather(*workers)
        finally:
            proc.terminate()
            code = proc.wait(timeout=30)
            await upstream_runner.cleanup()
    return report(args, tally, samples, start_rss, code)


def report(
    args: argparse.Namespace,
    tally: collections.Counter[str],
    samples: list[tuple[float, int]],
    start_rss: int,
    exit_code: int,
) -> int:
    half = args.duration / 2
    first = max((r for t, r in samples if t < half), default=0)
    second = max((r for t, r in samples if t >= half), default=0)
    peak = max((r for _, r in samples), default=0)
    errors = sum(v for k, v in tally.items() if k.startswith("error"))
    total = sum(tally.values())
    print(
        f"connections {args.connections}, {args.duration:g} s, upstream {args.latency_ms:g} ms,"
        f" destination max_in_flight {args.max_in_flight}"
    )
    print(
        f"answers {total}: ok {tally['ok']}, 503 overloaded {tally['overloaded']},"
        f" other errors {errors}"
    )
    for kind, count in sorted(tally.items()):
        if kind.startswith("error"):
            print(f"  {kind}: {count}")
    print(
        f"gateway RSS MiB: start {start_rss / 1024:.1f}, peak {peak / 1024:.1f},"
        f" first-half peak {first / 1024:.1f}, second-half peak {second / 1024:.1f}"
    )
    print(f"gateway exit code after SIGTERM: {exit_code}")
    bounded = peak < args.rss_limit_mib * 1024 and second <= first * 1.10
    ok = errors == 0 and tally["ok"] > 0 and bounded and exit_code == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--latency-ms", type=float, default=500.0)
    parser.add_argument("--max-in-flight", type=int, default=256)
    parser.add_argument("--rss-limit-mib", type=float, default=300.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    os.environ.pop("SINKGATE_ADMIN_TOKEN", None)
    sys.exit(asyncio.run(main(parse_args())))
