"""A duplicate arriving 10 ms after its original, against a 200 ms upstream:
how long after the original's answer it gets its own, with `Prefer: wait` and
without, side by side (issue 32's first target).

    python3 -m bench.waiting                    # 5 rounds, SQLite
    python3 -m bench.waiting --rounds 10 --store postgres
    python3 -m bench.waiting --waiters 1000     # the second target (below)
    python3 -m bench.waiting --waiters 1000 --store postgres --workers 2   # two replicas

One upstream (`bench/upstream.py --latency-ms 200`) and one gateway (`sinkgate
serve`, destination `bench`, lease fencing). Each round claims a fresh job and,
for each mode in turn (the order alternating between rounds), sends an original
write through `FencedWriter` and, 10 ms later, its duplicate through a second
`FencedWriter` with the same key: `wait=5` (the writer's default) or `wait=0`
(no header: the writer's retry loop, `Retry-After` capped at
`max_retry_wait`). Figures per mode: the duplicate's answer time minus the
original's (median and max over the rounds), the requests the duplicate sent
to the gateway, and whether it was a replay.

`--waiters N` measures the second target instead: N duplicates, each on its own
connection with `Prefer: wait=30` (sent and read by `RawAnswer`, a bare protocol,
unless `--client aiohttp`), held on one key whose original the upstream
answers in `--hold-s` (6) seconds. Figures: the gateway's CPU (share of one
core) over one second once all are held, and each duplicate's answer time
minus the original's (p50, p99, max), the original's and the last duplicate's
answer times after the upstream's answer was due (the original's sending time
plus `--hold-s`: a mark the gateway cannot move, where it can send the
original's own answer before or after the held ones), the gateway's CPU from then to the
last answer (the wake-up), with the part its event loops took (their main
threads, from the scheduler's nanosecond counter). A second row (unless `--no-floor`) runs the same
burst, from the same client, against `bench.held_floor`: the same aiohttp
stack answering the held writes with one precomputed body once the original is
answered, deciding nothing: the part of the figure that is the server stack and
the client alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
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


async def _all_held(session: aiohttp.ClientSession, metrics_url: str, waiters: int) -> None:
    """Until the gateway says `waiters` writes are held (its /metrics)."""
    while True:
        async with session.get(metrics_url) as resp:
            text = await resp.text()
        for line in text.splitlines():
            if line.startswith("sinkgate_waiting_writes ") and float(line.split()[1]) >= waiters:
                return
        await asyncio.sleep(0.1)


class RawAnswer(asyncio.Protocol):
    """One held write on its own connection, sent and read without an HTTP client:
    its answer's arrival time, status and whether it is a replay. One Python
    client reading 1,000 answers through aiohttp takes about as long as the
    gateway's whole wake-up (the held floor's last answer); this takes a few
    microseconds each, so the figure is the server's."""

    def __init__(self, request: bytes, done: asyncio.Future[tuple[float, int, bool]]) -> None:
        self._request = request
        self._done = done
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        at = time.monotonic()
        self._buffer += data
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        status_line, *lines = self._buffer[:end].decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" not in headers:
            self._fail(ConnectionError(f"no Content-Length in {status_line!r}"))
            return
        if len(self._buffer) - end - 4 < int(headers["content-length"]):
            return
        if not self._done.done():  # the connection stays open, as a client's pool
            # keeps it: its closing is not the server's answer (`close` after all)
            replayed = headers.get("idempotent-replayed") == "true"
            self._done.set_result((at, int(status_line.split()[1]), replayed))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"closed before the answer: {exc!r}"))
        self._transport = None

    def _fail(self, exc: Exception) -> None:
        if not self._done.done():
            self._done.set_exception(exc)


async def raw_post(
    base: str, headers: dict[str, str], opened: list[RawAnswer]
) -> tuple[float, int, bool]:
    """A write of `{}` to the bench destination through a `RawAnswer`, added to
    `opened` (for the caller to close)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    lines = ["POST /to/bench/items HTTP/1.1", f"Host: {host}:{port}", "Content-Length: 2"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    request = ("\r\n".join(lines) + "\r\n\r\n{}").encode("latin-1")
    loop = asyncio.get_running_loop()
    done: asyncio.Future[tuple[float, int, bool]] = loop.create_future()
    _, protocol = await loop.create_connection(lambda: RawAnswer(request, done), host, int(port))
    opened.append(protocol)
    return await done


async def many(
    base: str, admin: str, waiters: int, gateway_pid: int, hold_s: float, client: str
) -> str:
    """N duplicates held on one slow key: CPU while held, then how soon they are answered."""
    leases = await HTTPLeaseStore.open(base)
    try:
        lease = await leases.claim("job-many", owner="bench", ttl=120)
    finally:
        await leases.close()
    headers = {
        "Content-Type": "application/json",
        "Fencing-Job": lease.job_id,
        "Fencing-Token": str(lease.generation),
        "Idempotency-Key": "many-1",
    }
    return await burst(base, f"{admin}/metrics", headers, waiters, gateway_pid, hold_s, client)


async def burst(
    base: str,
    metrics_url: str,
    headers: dict[str, str],
    waiters: int,
    pid: int,
    hold_s: float,
    client: str,
) -> str:
    """An original, then N writes with `Prefer: wait=30` held until it is answered,
    sent and read by `client`: "raw" (`RawAnswer`) or "aiohttp"."""
    url = f"{base}/to/bench/items"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def post(extra: dict[str, str]) -> tuple[float, int, bool]:
            async with session.post(url, data=b"{}", headers={**headers, **extra}) as resp:
                await resp.read()
                replayed = resp.headers.get("Idempotent-Replayed") == "true"
                return time.monotonic(), resp.status, replayed

        original = asyncio.create_task(post({}))
        original_sent = time.monotonic()
        await asyncio.sleep(0.05)
        started = time.monotonic()
        wait = {"Prefer": "wait=30"}
        opened: list[RawAnswer] = []
        held = [
            asyncio.create_task(
                raw_post(base, {**headers, **wait}, opened) if client == "raw" else post(wait)
            )
            for _ in range(waiters)
        ]
        await _all_held(session, metrics_url, waiters)
        held_after = time.monotonic() - started
        cpu_before, at = bench.cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(1.0)
        cpu_held = bench.cpu_seconds(pid)
        cpu_share = (cpu_held - cpu_before) / (time.monotonic() - at)
        # The wake-up's CPU is counted from just before the original's answer is due,
        # not from here: the idle seconds between are not the wake-up's.
        await asyncio.sleep(max(0.0, original_sent + hold_s - 0.2 - time.monotonic()))
        cpu_due, loop_due = run_seconds(pid)
        original_at, status, _ = await original
        answers = await asyncio.gather(*held)
        cpu_done, loop_done = run_seconds(pid)
        cpu_woken, loop_woken = cpu_done - cpu_due, loop_done - loop_due
        for protocol in opened:
            protocol.close()
    after = sorted((answered - original_at) * 1000 for answered, _, _ in answers)
    # The upstream answers the original `hold_s` after it was sent (plus the time
    # the gateway took to forward it): a mark the gateway cannot move, where the
    # original's own answer can be sent sooner or later than the held ones'.
    due = original_sent + hold_s
    replays = sum(1 for _, code, replayed in answers if replayed and code == status)
    return (
        f"{waiters} held on one key (all held {held_after:.1f} s after the first was sent): "
        f"CPU while held {cpu_share:.1%} of a core; "
        f"answered after the original: p50 {statistics.median(after):.1f} ms, "
        f"p99 {after[int(len(after) * 0.99) - 1]:.1f} ms, max {after[-1]:.1f} ms; "
        f"after the upstream's answer was due: the original {(original_at - due) * 1000:.1f} ms,"
        f" the last held {after[-1] + (original_at - due) * 1000:.1f} ms; "
        f"replays {replays}/{waiters}; CPU from then to the last answer {cpu_woken * 1000:.0f} ms"
        f" (event loop {loop_woken * 1000:.1f} ms)"
    )


def run_seconds(pgid: int) -> tuple[float, float]:
    """The CPU time of every thread of every process in the group, and of their
    main threads (the event loops) alone, from the scheduler's nanosecond
    counters rather than the 10 ms ticks of `bench.cpu_seconds`."""
    every, main = 0, 0
    for pid in bench.group_pids(pgid):
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ns = int(f.read().split()[0])
            except OSError:
                continue
            every += ns
            main += ns if tid == str(pid) else 0
    return every / 1e9, main / 1e9


def floor(procs: bench.Processes, tmp: Path, waiters: int, hold_s: float, client: str) -> str:
    """The same burst against `bench.held_floor`: the server's part, nothing decided."""
    base = f"http://127.0.0.1:{bench.free_port()}"
    command = [sys.executable, "-m", "bench.held_floor", "--port", base.rsplit(":", 1)[1]]
    proc = procs.start([*command, "--hold-s", str(hold_s)], tmp / "floor.log")
    _wait_listening(base)
    headers = {"Content-Type": "application/json"}
    return asyncio.run(burst(base, f"{base}/metrics", headers, waiters, proc.pid, hold_s, client))


def _wait_listening(base: str, within: float = 30.0) -> None:
    """Until `base` accepts connections (the slow upstream's answers are no signal)."""
    host, port = base.rsplit("/", 1)[1].split(":")
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{base} did not listen within {within} s")


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
    parser.add_argument("--waiters", type=int, default=0)
    parser.add_argument("--hold-s", type=float, default=6.0)
    parser.add_argument("--workers", type=int, default=1, help="gateway processes (replicas)")
    parser.add_argument(
        "--no-floor", action="store_true", help="--waiters without the held floor's row"
    )
    parser.add_argument(
        "--client",
        choices=("raw", "aiohttp"),
        default="raw",
        help="--waiters: what sends the held writes and reads their answers",
    )
    args = parser.parse_args(argv)
    if args.waiters:
        args.upstream_latency_ms = args.hold_s * 1000
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
            _wait_listening(up.base)
            store_url = f"sqlite:///{tmp / 'data' / 'sinkgate.db'}"
            if args.store == "postgres":
                db = f"sinkgate_waiting_{int(time.time())}"
                asyncio.run(bench._pg(bench.PG_ADMIN_URL, f"CREATE DATABASE {db}"))
                store_url = bench.pg_db_url(bench.PG_ADMIN_URL, db)
            port, admin_port = bench.free_port(), bench.free_port()
            root = tmp / "gateway"
            config = bench.write_gateway_config(root, port, admin_port, store_url, up.base)
            gateway = bench.Target("gateway", f"http://127.0.0.1:{port}", logfile=tmp / "gw.log")
            command = bench.gateway_command(config, args.workers)
            gateway.proc = procs.start(command, tmp / "gw.log")
            bench.wait_ready(gateway, "/healthz")
            if args.waiters:
                assert gateway.proc is not None
                admin = f"http://127.0.0.1:{admin_port}"
                text = "gateway:     " + asyncio.run(
                    many(
                        gateway.base,
                        admin,
                        args.waiters,
                        gateway.proc.pid,
                        args.hold_s,
                        args.client,
                    )
                )
                if not args.no_floor:
                    held_floor = floor(procs, tmp, args.waiters, args.hold_s, args.client)
                    text += "\nheld floor:  " + held_floor
            else:
                text = summary(asyncio.run(measure(gateway.base, args.rounds)))
        finally:
            procs.stop_all()
            if args.store == "postgres":
                asyncio.run(bench._pg(bench.PG_ADMIN_URL, f"DROP DATABASE IF EXISTS {db}"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
