"""Instructions per ordinary write (no `Prefer: wait`), counted by callgrind in the
gateway's process only, split by thread.

    python3 -m bench.write_instr --tree . --out wi-head                # 2,000 unique keys
    git worktree add --detach ../before <commit>
    python3 -m bench.write_instr --tree ../before --out wi-before      # the same, before
    python3 -m bench.write_instr --compare wi-before wi-head           # by thread and function
    python3 -m bench.write_instr --tree . --mix --out wi-head-mix      # replays and stale writes

`sinkgate serve` of the tree `--tree` (started there: the working directory comes
first on `sys.path`, as `bench.run --baseline` does with its exported tree) runs
under `valgrind --tool=callgrind --separate-threads=yes` on a SQLite store in a
temporary directory, JSON log lines to a file, forwarding to `bench.upstream` in
a process of its own. This process is the client (aiohttp, `--connections`
requests at a time, each its own keep-alive connection to the gateway): it
claims the jobs, sends `--warmup` writes, then has callgrind dump its counters so far
(`callgrind_control -d`, part 1), sends `--writes` writes, waits for the gateway to go
quiet and has callgrind dump again (part 2): one file per thread, covering only
the measured writes. Then, as a control, the same for `--idle`
seconds with no writes at all (aiosqlite's thread polls its queue every 0.1 s,
and the gateway has timers of its own): that idle cost per second times the
measured window's seconds is printed next to the figures, not subtracted.

Printed: instructions per write per thread (the thread with sqlite3's functions
is "store", thread 1 is "loop"; any other thread by number) and the total; the
answers' statuses (every write must have been answered 200, or 409/replayed as
the mix asks). Left in `--out`: the dumps, `callgrind_annotate --inclusive=yes`
of each, and `summary.json`. Unique keys by default; `--mix`: of the measured
writes 10 % repeat an earlier key of the same worker with its body (a replay)
and 5 % carry the stale generation (409), as `bench.run`'s mix; the sequence
is the same for every tree (seeded).

Under callgrind a write takes 20-60 ms, so 500 + 2,000 writes take a few
minutes; PYTHONHASHSEED is fixed for the gateway so that two runs of one tree
differ only by the schedule (repeat runs at one connection: within about 0.1 %).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import aiohttp

from . import run as bench

OWNER = "bench-worker"
EVENTS_RE = re.compile(r"^(?:totals|summary):\s+(\d+)", re.M)


def _free(port: int) -> None:
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


async def _wait_http(url: str, within: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"process exited ({proc.returncode}) before {url} answered")
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status < 500:
                        return
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} did not answer in {within} s")


def callgrind_control(option: str, pid: int) -> None:
    subprocess.run(["callgrind_control", option, str(pid)], check=True, capture_output=True)


class Client:
    def __init__(self, base: str, connections: int, jobs: int, seed: str) -> None:
        self.base = base
        self.connections = connections
        self.jobs_count = jobs
        self.seed = seed
        self.jobs: list[tuple[str, int, int]] = []  # id, current, stale generation
        self.history: list[list[tuple[str, bytes]]] = [[] for _ in range(connections)]
        self.seq = [0] * connections
        self.rng = [random.Random(f"{seed}-{w}") for w in range(connections)]

    async def claim(self, session: aiohttp.ClientSession) -> None:
        async def post(path: str, payload: dict) -> dict:
            async with session.post(self.base + path, json=payload) as resp:
                body = await resp.json(content_type=None)
                if resp.status != 200:
                    raise RuntimeError(f"POST {path} -> {resp.status} {body}")
                return body

        for i in range(self.jobs_count):
            job = f"wi-{self.seed}-{i}"
            path = f"/leases/{quote(job, safe='')}"
            lease = await post(f"{path}/claim", {"owner": OWNER, "ttl": 3600})
            stale = int(lease["generation"])
            await post(f"{path}/release", {"owner": OWNER, "generation": stale})
            lease = await post(f"{path}/claim", {"owner": OWNER, "ttl": 3600})
            self.jobs.append((job, int(lease["generation"]), stale))

    async def send(self, sessions: list[aiohttp.ClientSession], count: int, mixed: bool) -> dict:
        """`count` writes, `connections` at a time (worker w on its own session);
        returns the answers tallied as 'status[/replayed]'."""
        tally: dict[str, int] = {}
        left = count
        url = self.base + bench.WRITE_PATH

        async def worker(w: int) -> None:
            nonlocal left
            session = sessions[w]
            rng = self.rng[w]
            job, gen, stale = self.jobs[w % len(self.jobs)]
            history = self.history[w]
            while left > 0:
                left -= 1
                self.seq[w] += 1
                seq = self.seq[w]
                r = rng.random() if mixed else 1.0
                token = gen
                if r < 0.05:
                    token = stale
                    key, body = f"{self.seed}-{w}-{seq}", b'{"n":%d,"w":%d}' % (seq, w)
                elif r < 0.15 and len(history) > 8:
                    key, body = history[rng.randrange(len(history))]
                else:
                    key, body = f"{self.seed}-{w}-{seq}", b'{"n":%d,"w":%d}' % (seq, w)
                    history.append((key, body))
                headers = {
                    "Content-Type": "application/json",
                    "Idempotency-Key": key,
                    "Fencing-Job": job,
                    "Fencing-Token": str(token),
                    "Fencing-Owner": OWNER,
                }
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    name = str(resp.status)
                    if resp.headers.get("Idempotent-Replayed") == "true":
                        name += "/replayed"
                tally[name] = tally.get(name, 0) + 1

        await asyncio.gather(*(worker(w) for w in range(self.connections)))
        return tally


def thread_names(prefix: str) -> dict[int, str]:
    """Thread 1 is the event loop's; the one running sqlite3's functions the store's."""
    names: dict[int, str] = {}
    for path in sorted(glob.glob(prefix + "-*")):
        tid = int(path.rsplit("-", 1)[1])
        text = Path(path).read_text(errors="replace")
        if tid == 1:
            names[tid] = "loop"
        elif "sqlite3VdbeExec" in text and "store" not in names.values():
            names[tid] = "store"
        else:
            names[tid] = f"thread-{tid}"
    return names


def thread_totals(prefix: str, names: dict[int, str]) -> dict[str, int]:
    """{thread name: instructions} of the per-thread dump files `prefix`-NN."""
    out: dict[str, int] = {}
    for path in sorted(glob.glob(prefix + "-*")):
        tid = int(path.rsplit("-", 1)[1])
        m = EVENTS_RE.search(Path(path).read_text(errors="replace"))
        out[names.get(tid, f"thread-{tid}")] = int(m.group(1)) if m else 0
    return out


def annotate(prefix: str, out_dir: Path, tag: str) -> None:
    """`callgrind_annotate --inclusive=yes` of each thread's dump. (Its self view,
    `--inclusive=no`, puts the whole total on one uvloop function on these dumps
    (valgrind 3.19): self costs are `--compare`'s, from `functions`.)"""
    for path in sorted(glob.glob(prefix + "-*")):
        tid = path.rsplit("-", 1)[1]
        text = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", "--threshold=99.5", path],
            capture_output=True,
            text=True,
        ).stdout
        (out_dir / f"{tag}-t{tid}.incl.txt").write_text(text)


_NAMED = re.compile(r"^(c?(?:fn|fl|fi|fe|ob))=\((\d+)\)(?: (.*))?$")


def functions(path: str) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Self cost, inclusive cost and calls received per function of one callgrind
    dump (Ir only). Inclusive = self + the costs of the calls it makes to other
    functions (a recursion level callgrind names `f'2` is another function, so a
    function's outermost name carries its whole inclusive cost)."""
    self_cost: dict[str, int] = {}
    incl: dict[str, int] = {}
    calls_in: dict[str, int] = {}
    names: dict[tuple[str, str], str] = {}
    fn = cfn = ""
    after_calls = 0
    with open(path, errors="replace") as f:
        for line in f:
            c = line[0]
            if c.isdigit() or c in "+-*":
                cost = int(line.split()[1]) if " " in line.strip() else 0
                if after_calls:
                    after_calls = 0
                    if cfn != fn:
                        incl[fn] = incl.get(fn, 0) + cost
                else:
                    self_cost[fn] = self_cost.get(fn, 0) + cost
                    incl[fn] = incl.get(fn, 0) + cost
                continue
            if line.startswith("calls="):
                after_calls = 1
                calls_in[cfn] = calls_in.get(cfn, 0) + int(line[6:].split()[0])
                continue
            m = _NAMED.match(line.rstrip("\n"))
            if not m:
                continue
            kind, ident, name = m.groups()
            base = kind.lstrip("c")
            if base in ("fi", "fe"):
                base = "fl"
            if name is not None:
                names[(base, ident)] = name
            else:
                name = names.get((base, ident), ident)
            if kind == "fn":
                fn = name
            elif kind == "cfn":
                cfn = name
    return self_cost, incl, calls_in


def compare(a: Path, b: Path, top: int) -> None:
    """Per write, thread by thread: b - a, and the functions whose self and
    inclusive costs and calls differ most."""
    sa = json.loads((a / "summary.json").read_text())
    sb = json.loads((b / "summary.json").read_text())
    na, nb = sa["writes"], sb["writes"]
    print(f"A = {sa['rev']} ({a}), B = {sb['rev']} ({b}); per write, k instructions")
    for name in sorted(set(sa["instructions"]) | set(sb["instructions"])):
        ia = sa["instructions"].get(name, 0) / na
        ib = sb["instructions"].get(name, 0) / nb
        if ia == ib == 0:
            continue
        pct = (ib - ia) / ia * 100 if ia else float("nan")
        print(
            f"  {name:10s} A {ia / 1000:9.1f}  B {ib / 1000:9.1f}  B-A {(ib - ia) / 1000:+8.1f}"
            f"  ({pct:+.2f} %)"
        )
    ta = sum(sa["instructions"].values()) / na
    tb = sum(sb["instructions"].values()) / nb
    print(
        f"  {'total':10s} A {ta / 1000:9.1f}  B {tb / 1000:9.1f}  B-A {(tb - ta) / 1000:+8.1f}"
        f"  ({(tb - ta) / ta * 100:+.2f} %)"
    )
    for pa in sorted(glob.glob(sa["dumps"] + "-*")):
        tid = pa.rsplit("-", 1)[1]
        pb = sb["dumps"] + "-" + tid
        if not os.path.exists(pb):
            continue
        fa, fb = functions(pa), functions(pb)
        if sum(fa[0].values()) + sum(fb[0].values()) == 0:
            continue
        for label, i in (("self", 0), ("inclusive", 1), ("calls", 2)):
            keys = set(fa[i]) | set(fb[i])
            diff = {k: fb[i].get(k, 0) / nb - fa[i].get(k, 0) / na for k in keys}
            ranked = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]
            unit = "calls" if i == 2 else "instructions"
            print(f"\nthread {tid}: {label}, B-A per write ({unit}), A and B per write")
            for k, d in ranked:
                if abs(d) < (0.05 if i == 2 else 20):
                    continue
                va, vb = fa[i].get(k, 0) / na, fb[i].get(k, 0) / nb
                print(f"  {d:+10.1f}  {va:11.1f} {vb:11.1f}  {k[:110]}")


async def drive(args: argparse.Namespace, pid: int, base: str):
    client = Client(base, args.connections, min(args.connections, 64), args.seed)
    sessions = [
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1, keepalive_timeout=600),
            timeout=aiohttp.ClientTimeout(total=600),
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        for _ in range(args.connections)
    ]
    try:
        await client.claim(sessions[0])
        t0 = time.monotonic()
        warm = await client.send(sessions, args.warmup, args.mix)
        print(f"warm-up: {args.warmup} writes in {time.monotonic() - t0:.0f} s {warm}", flush=True)
        await asyncio.sleep(args.settle)
        # A dump, not -z: after a zero, the dumped functions' costs summed exceed
        # the thread's total by a constant (~16M on the loop), kept from before.
        callgrind_control("-d", pid)  # part 1: start-up and warm-up
        t0 = time.monotonic()
        tally = await client.send(sessions, args.writes, args.mix)
        measured_s = time.monotonic() - t0
        await asyncio.sleep(args.settle)  # the outcomes' statements, the lines
        window_s = time.monotonic() - t0
        callgrind_control("-d", pid)  # part 2: the measured writes
        print(f"measured: {args.writes} writes in {measured_s:.0f} s {tally}", flush=True)
        idle = {}
        if args.idle > 0:
            await asyncio.sleep(args.idle)
            callgrind_control("-d", pid)  # part 3: idle
        return tally, measured_s, window_s, idle
    finally:
        for s in sessions:
            await s.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", default=".", help="the source tree whose gateway is measured")
    p.add_argument("--writes", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--connections", type=int, default=1)
    p.add_argument("--mix", action="store_true", help="10 %% replays, 5 %% stale generation")
    p.add_argument("--idle", type=float, default=10.0, help="seconds of the idle control")
    p.add_argument("--settle", type=float, default=2.0)
    p.add_argument("--port", type=int, default=int(os.environ.get("WI_PORT", "33100")))
    p.add_argument("--seed", default="wi")
    p.add_argument("--out", help="directory for dumps and annotations")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="two --out directories: B - A per write by thread and by function (nothing is run)",
    )
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    if args.compare:
        compare(Path(args.compare[0]), Path(args.compare[1]), args.top)
        return 0
    if not args.out:
        p.error("--out is required")

    tree = Path(args.tree).resolve()
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in glob.glob(str(out_dir / "callgrind.out.*")):
        os.unlink(old)
    up_port, gw_port, admin_port = args.port, args.port + 1, args.port + 2
    for port in (up_port, gw_port, admin_port):
        _free(port)
    tmp = Path(tempfile.mkdtemp(prefix="sinkgate-wi-"))
    config = bench.write_gateway_config(
        tmp,
        gw_port,
        admin_port,
        f"sqlite:///{tmp / 'data' / 'sinkgate.db'}",
        f"http://127.0.0.1:{up_port}",
    )
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("PYTHONPATH", None)
    upstream = subprocess.Popen(
        [sys.executable, "-m", "bench.upstream", "--port", str(up_port)],
        cwd=bench.REPO,
        env=env,
        start_new_session=True,
    )
    prefix = str(out_dir / "callgrind.out")
    log = open(out_dir / "gateway.log", "wb")
    gateway = subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            "--separate-threads=yes",
            f"--callgrind-out-file={prefix}.%p",
            *bench.gateway_command(config),
        ],
        cwd=tree,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{gw_port}"
        asyncio.run(_wait_http(f"http://127.0.0.1:{up_port}/", 30, upstream))
        asyncio.run(_wait_http(base + "/healthz", 300, gateway))
        tally, measured_s, window_s, _ = asyncio.run(drive(args, gateway.pid, base))
    finally:
        for proc in (gateway, upstream):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in (gateway, upstream):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
    measured_prefix = f"{prefix}.{gateway.pid}.2"
    idle_prefix = f"{prefix}.{gateway.pid}.3"
    names = thread_names(measured_prefix)
    measured = thread_totals(measured_prefix, names)
    idle = thread_totals(idle_prefix, names) if args.idle > 0 else {}
    annotate(measured_prefix, out_dir, "measured")
    n = args.writes
    print(
        f"tree {tree} ({_rev(tree)}), {n} writes, {args.connections} connection(s)"
        f"{', mix' if args.mix else ''}; window {window_s:.1f} s"
    )
    for name, total in sorted(measured.items()):
        if total == 0:
            continue
        idle_part = ""
        if name in idle and args.idle > 0:
            per_write = idle[name] / args.idle * window_s / n
            idle_part = f"   (of which idle-like, by the control: ~{per_write / 1000:.1f}k)"
        print(f"  {name:10s} {total / n / 1000:9.1f}k instructions per write{idle_part}")
    print(f"  {'total':10s} {sum(measured.values()) / n / 1000:9.1f}k")
    summary = {
        "tree": str(tree),
        "rev": _rev(tree),
        "writes": n,
        "connections": args.connections,
        "mix": args.mix,
        "answers": tally,
        "measured_s": measured_s,
        "window_s": window_s,
        "instructions": measured,
        "idle_instructions": idle,
        "idle_s": args.idle,
        "dumps": measured_prefix,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


def _rev(tree: Path) -> str:
    r = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "gateway", "leases"],
        cwd=tree,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())
