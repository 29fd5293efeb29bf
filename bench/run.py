"""One command: upstream, plain proxy and gateway(s) measured side by side.

    python3 -m bench.run                 # full run (about 5-8 minutes)
    python3 -m bench.run --quick         # ~30 s smoke run
    python3 -m bench.run --targets upstream,plain,sqlite,postgres --duration 10 --rounds 2
    python3 -m bench.run --workers 2     # plain proxy and gateways as 2 processes each
    python3 -m bench.run --prefill 1000000   # adds target sqlite-prefill: same gateway,
                                             # store pre-filled with N keys and N/10 jobs

Every target runs as its own process on a free loopback port; the load
generator (bench/loadgen.py: wrk when installed, else aiohttp) is a separate
process too. For each scenario (unique keys at each connection count, and the
10%-duplicate/5%-stale mix) and each round, all targets are loaded one after
the other, the order alternating between rounds, so every ratio compares
figures taken minutes apart on the same noisy machine. Figures: requests/s,
p50/p99 latency, CPU seconds per request of the target's process group, its
peak RSS (VmHWM), the generator's CPU and the machine's idle share during the
run. Ratios gateway / plain proxy are printed per round with their median.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ALL_TARGETS = (
    "upstream", "plain", "sqlite", "sqlite-base", "sqlite-prefill", "postgres", "postgres-base",
)  # fmt: skip
GATEWAY_TARGETS = ("sqlite", "sqlite-base", "sqlite-prefill", "postgres", "postgres-base")
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
WRITE_PATH = "/to/bench/items"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------- process figures

CLK_TCK = os.sysconf("SC_CLK_TCK")


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # field 5: pgrp
            pids.append(int(entry))
    return pids


def cpu_seconds(pgid: int) -> float:
    """User+system CPU of every live process in the group (each target is its own group)."""
    total = 0.0
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
    return total


def matching_cpu_seconds(needle: str) -> dict[int, float]:
    """CPU per live process whose command line contains `needle` (the PostgreSQL
    backends serving the bench database: `postgres: user db 127.0.0.1(port) ...`)."""
    found: dict[int, float] = {}
    data = needle.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if data not in f.read():
                    continue
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        found[int(entry)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return found


def cpu_since(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU the processes alive at the end used since `before`. A backend that exited
    in between is left out (its CPU is lost with it) instead of making the sum
    go negative, as a plain difference of totals did."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


def main_thread_cpu_seconds(pid: int) -> float:
    """CPU of the process's main thread only (its event loop); the rest is other threads."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_switches(pgid: int | None) -> tuple[int, int]:
    """(read- and write-family system calls, voluntary context switches) of the group.

    System calls come from /proc/<pid>/io, which keeps the counts of the
    process's threads that have exited (a per-thread sum lost them, and its
    difference could fall to zero). Switches are summed over the live threads
    from /proc/<pid>/task/<tid>/status (the kernel keeps no per-process total):
    a voluntary switch is a thread going to sleep, an event loop with nothing
    to do, a thread waiting for the GIL, a lock or its queue; each one is a
    wake-up that some other thread pays for too."""
    calls = switches = 0
    if pgid is None:
        return calls, switches
    for pid in group_pids(pgid):
        calls += _process_syscalls(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    status = dict(
                        line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line
                    )
            except (OSError, ValueError):
                continue  # a thread that ended meanwhile
            switches += int(status.get("voluntary_ctxt_switches", 0))
    return calls, switches


def _process_syscalls(pid: int) -> int:
    """Read- and write-family system calls of a process, its exited threads included."""
    try:
        with open(f"/proc/{pid}/io") as f:
            io = dict(line.split(": ") for line in f.read().splitlines() if line)
    except (OSError, ValueError):
        return 0  # a process that ended meanwhile, or /proc without io (permissions)
    return int(io.get("syscr", 0)) + int(io.get("syscw", 0))


def memory_mb(pgid: int) -> tuple[float, float]:
    """(peak RSS, current RSS) in MB summed over the group, from /proc/<pid>/status."""
    hwm = rss = 0
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        hwm += int(line.split()[1])
                    elif line.startswith("VmRSS:"):
                        rss += int(line.split()[1])
        except OSError:
            continue
    return hwm / 1024, rss / 1024


def machine_ticks() -> tuple[int, int]:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values), values[3] + values[4]  # total, idle + iowait


# ---------------------------------------------------------------------- targets


@dataclass
class Target:
    name: str
    base: str  # http://127.0.0.1:port
    proc: subprocess.Popen | None = None
    claim: bool = False  # has the lease API
    logfile: Path | None = None
    extra: dict = field(default_factory=dict)

    @property
    def write_url(self) -> str:
        return self.base + WRITE_PATH


class Processes:
    """Every process started here, stopped (whole process group) in `stop_all`."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(
        self, cmd: list[str], logfile: Path, env: dict | None = None, cwd: Path = REPO
    ) -> subprocess.Popen:
        out = open(logfile, "wb")
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        out.close()
        self.procs.append(proc)
        return proc

    @staticmethod
    def stop(proc: subprocess.Popen, grace: float = 8.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # the group may outlive its leader
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)
        self.procs.clear()


def wait_ready(target: Target, path: str = "/", timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if target.proc is not None and target.proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(target.base + path, timeout=2) as resp:
                if resp.status < 500:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                return
            last = str(exc)
        except (OSError, urllib.error.URLError) as exc:
            last = str(exc)
        time.sleep(0.2)
    tail = ""
    if target.logfile and target.logfile.exists():
        tail = target.logfile.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{target.name} did not become ready ({last}); log tail:\n{tail}")


def gateway_command(config: Path, workers: int = 1) -> list[str]:
    code = "import sys; from gateway.cli import main; sys.exit(main())"
    more = ["--workers", str(workers)] if workers > 1 else []  # older revisions lack it
    return [sys.executable, "-c", code, "serve", "--config", str(config), *more]


def export_revision(rev: str, dest: Path) -> Path:
    """The gateway's source (gateway/, leases/) at git revision `rev`, extracted into
    `dest`; a gateway started there (cwd first on sys.path) runs that revision."""
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", rev, "gateway", "leases"], cwd=REPO, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def gateway_available() -> bool:
    return (REPO / "gateway" / "cli.py").exists()


def write_gateway_config(root: Path, port: int, admin_port: int, store_url: str, upstream: str):
    (root / "destinations").mkdir(parents=True, exist_ok=True)
    (root / "data").mkdir(exist_ok=True)
    config = root / "gateway.toml"
    config.write_text(
        "[server]\n"
        f'listen = "127.0.0.1:{port}"\n'
        f'admin_listen = "127.0.0.1:{admin_port}"\n\n'
        "[store]\n"
        f'url = "{store_url}"\n\n'
        "[destinations]\n"
        'dir = "destinations"\n'
    )
    (root / "destinations" / "bench.toml").write_text(
        f'upstream = "{upstream}"\n'
        'fencing = "lease"\n'
        "require_idempotency_key = true\n"
        'methods = ["POST", "PUT", "PATCH", "DELETE"]\n'
        'timeout = "10s"\n'
        'connect_timeout = "2s"\n'
    )
    return config


# ----------------------------------------------------------------- PostgreSQL


async def _pg(admin_url: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(admin_url, timeout=3)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def pg_reachable(admin_url: str) -> bool:
    try:
        import asyncpg  # noqa: F401
    except ImportError:
        return False
    try:
        asyncio.run(_pg(admin_url, "SELECT 1"))
        return True
    except Exception as exc:
        log(f"PostgreSQL not reachable ({type(exc).__name__}: {exc}); skipping postgres")
        return False


def pg_db_url(admin_url: str, db: str) -> str:
    return admin_url.rsplit("/", 1)[0] + "/" + db


# -------------------------------------------------------------------- prefill


def prefill_sqlite(db_path: Path, records: int) -> bool:
    """Insert `records` completed idempotency records and records/10 leases directly."""
    from . import prefill

    return prefill.prefill_sqlite(db_path, records, log)


# ------------------------------------------------------------------------ runs


def run_load(
    target: Target,
    args: argparse.Namespace,
    conns: int,
    dup: float,
    stale: float,
    upstream: Target | None = None,
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bench.loadgen",
        "--url",
        target.write_url,
        "--connections",
        str(conns),
        "--duration",
        str(args.duration),
        "--warmup",
        str(args.warmup),
        "--engine",
        args.engine,
        "--dup-rate",
        str(dup),
        "--stale-rate",
        str(stale),
    ]
    if target.claim:
        cmd += ["--claim-url", target.base]
    pgid = target.proc.pid if target.proc else None
    up_pgid = upstream.proc.pid if upstream and upstream.proc and upstream is not target else None
    cpu0, main0 = cpu_seconds(pgid), main_thread_cpu_seconds(pgid)
    calls0, switches0 = thread_switches(pgid)
    up0 = cpu_seconds(up_pgid) if up_pgid else 0.0
    db_needle = target.extra.get("db_process")
    db0 = matching_cpu_seconds(db_needle) if db_needle else {}
    tot0, idle0 = machine_ticks()
    wall0 = time.monotonic()
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=args.duration + args.warmup + 120,
    )
    cpu1, main1 = cpu_seconds(pgid), main_thread_cpu_seconds(pgid)
    calls1, switches1 = thread_switches(pgid)
    up1 = cpu_seconds(up_pgid) if up_pgid else 0.0
    db1 = matching_cpu_seconds(db_needle) if db_needle else {}
    db_cpu = cpu_since(db0, db1)
    tot1, idle1 = machine_ticks()
    wall = time.monotonic() - wall0
    if proc.returncode != 0:
        raise RuntimeError(f"loadgen failed on {target.name}: {proc.stderr[-2000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    hwm, rss = memory_mb(pgid)
    total = max(1, report["total_requests"])
    report.update(
        target=target.name,
        cpu_s=cpu1 - cpu0,
        cpu_ms_per_req=(cpu1 - cpu0) * 1000 / total,
        peak_rss_mb=hwm,
        rss_mb=rss,
        main_thread_ms_per_req=(main1 - main0) * 1000 / total,
        syscalls_per_req=(calls1 - calls0) / total,
        switches_per_req=(switches1 - switches0) / total,
        upstream_cpu_s=up1 - up0,
        db_cpu_s=db_cpu,
        db_ms_per_req=db_cpu * 1000 / total,
        idle_pct=100.0 * (idle1 - idle0) / max(1, tot1 - tot0),
    )
    # cores busy with something else than the target, the upstream and the generator
    ncpu = os.cpu_count() or 1
    busy_cores = ncpu * (1 - report["idle_pct"] / 100.0)
    ours = report["cpu_s"] + report["upstream_cpu_s"] + report["loadgen_cpu_s"] + report["db_cpu_s"]
    ours /= max(wall, 1e-3)
    report["other_cores"] = max(0.0, busy_cores - ours)
    return report


def soak_target(target: Target, args: argparse.Namespace, conns: int) -> dict:
    """One long run; RSS sampled every few seconds. Growth = last fifth vs second fifth."""
    soak_args = argparse.Namespace(**{**vars(args), "duration": args.soak})
    samples: list[tuple[float, float]] = []
    pgid = target.proc.pid if target.proc else 0
    started = time.monotonic()
    done: dict = {}

    import threading

    def load() -> None:
        try:
            done["report"] = run_load(target, soak_args, conns, 0.0, 0.0)
        except Exception as exc:  # reported below
            done["error"] = exc

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    interval = max(1.0, args.soak / 60)
    while worker.is_alive() and time.monotonic() - started < args.soak + args.warmup + 180:
        samples.append((time.monotonic() - started, memory_mb(pgid)[1]))
        worker.join(timeout=interval)
    worker.join(timeout=150)
    if "error" in done:
        raise done["error"]
    report = done["report"]
    n = len(samples)
    early = [rss for _, rss in samples[n // 5 : 2 * n // 5]] or [samples[0][1]]
    late = [rss for _, rss in samples[4 * n // 5 :]] or [samples[-1][1]]
    report.update(
        scenario=f"soak c={conns}",
        round=0,
        rss_samples=samples,
        rss_early_mb=statistics.median(early),
        rss_late_mb=statistics.median(late),
        rss_max_mb=max(rss for _, rss in samples),
    )
    print()
    print(
        f"## Soak {target.name}: {args.soak:g} s at c={conns}, {report['rps']:.0f} req/s, "
        f"RSS {report['rss_early_mb']:.1f} MB (2nd fifth) -> {report['rss_late_mb']:.1f} MB "
        f"(last fifth), max {report['rss_max_mb']:.1f} MB, peak (VmHWM) "
        f"{report['peak_rss_mb']:.1f} MB"
    )
    return report


def _frame_key(frame: str) -> str:
    """`func (path/to/file.py:123)` -> `func (file.py)`: one entry per function."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({'/'.join(where.split('/')[-2:])})" if where else name


def profile_target(target: Target, args: argparse.Namespace, conns: int, outdir: Path) -> None:
    """One extra, unmeasured run with py-spy attached; print where the CPU goes."""
    pyspy = shutil.which("py-spy")
    if pyspy is None or target.proc is None:
        log("py-spy is not installed (pip install py-spy): --profile skipped")
        return
    outdir.mkdir(parents=True, exist_ok=True)
    raw = outdir / f"{target.name}-c{conns}.txt"
    seconds = max(1, int(args.warmup + args.duration))
    spy = subprocess.Popen(
        [pyspy, "record", "-p", str(target.proc.pid), "-d", str(seconds), "-r", "250",
         "--threads", "-f", "raw", "-o", str(raw),
         # native unwinding needs the process paused at each sample
         *(["--native"] if args.profile_native else ["--nonblocking"])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        rep = run_load(target, args, conns, 0.0, 0.0)
        spy.wait(timeout=seconds + 30)
    finally:
        Processes.stop(spy, grace=2)
    if not raw.exists():
        log(f"py-spy wrote nothing for {target.name} (needs ptrace permission)")
        return
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    threads: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        threads[frames[0]] = threads.get(frames[0], 0) + count
        keys = [_frame_key(f) for f in frames[1:]]
        for k in set(keys):
            inclusive[k] = inclusive.get(k, 0) + count
        if keys:
            own[keys[-1]] = own.get(keys[-1], 0) + count
    print()
    print(f"## Profile of {target.name} at c={conns} ({rep['rps']:.0f} req/s under py-spy, "
          f"{total} samples of busy threads; stacks in {raw.name})")  # fmt: skip
    for name, count in sorted(threads.items(), key=lambda kv: -kv[1]):
        print(f"  thread {100 * count / total:5.1f}%  {name}")
    print("  -- inclusive (share of samples with the function on the stack)")
    for name, count in sorted(inclusive.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {100 * count / total:5.1f}%  {name}")
    print("  -- self (the function itself was running)")
    for name, count in sorted(own.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {100 * count / total:5.1f}%  {name}")


def _median_of(rows: list[dict]):
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return med


def fmt_row(cols: list, widths: list[int]) -> str:
    return "  ".join(
        str(c).rjust(w) if i else str(c).ljust(w)
        for i, (c, w) in enumerate(zip(cols, widths, strict=True))
    )


def print_tables(results: list[dict], scenarios: list[tuple], targets: list[str]) -> None:
    head = [
        "scenario",
        "round",
        "target",
        "req/s",
        "p50 ms",
        "p99 ms",
        "cpu ms/req",
        "loop ms/req",
        "db ms/req",
        "rw calls/req",
        "sleeps/req",
        "peak RSS MB",
        "gen cpu s",
        "idle %",
        "other cores",
        "outcomes",
    ]
    widths = [18, 5, 15, 9, 7, 7, 10, 11, 9, 12, 10, 11, 9, 6, 11, 0]
    print()
    print("## Runs (in the order they ran)")
    print(fmt_row(head, widths))
    for r in results:
        outcomes = ", ".join(f"{k}:{v}" for k, v in sorted(r["outcomes"].items()))
        if r.get("errors"):
            outcomes += f" errors:{r['errors']}"
        print(
            fmt_row(
                [
                    r["scenario"],
                    r["round"],
                    r["target"],
                    f"{r['rps']:.0f}",
                    f"{r['p50_ms']:.2f}",
                    f"{r['p99_ms']:.2f}",
                    f"{r['cpu_ms_per_req']:.3f}",
                    f"{r['main_thread_ms_per_req']:.3f}",
                    f"{r['db_ms_per_req']:.3f}" if r.get("db_cpu_s") else "-",
                    f"{r['syscalls_per_req']:.2f}" if "syscalls_per_req" in r else "-",
                    f"{r['switches_per_req']:.2f}" if "switches_per_req" in r else "-",
                    f"{r['peak_rss_mb']:.1f}",
                    f"{r['loadgen_cpu_s']:.1f}",
                    f"{r['idle_pct']:.0f}",
                    f"{r['other_cores']:.2f}",
                    outcomes,
                ],
                widths,
            )
        )

    print()
    print("## Medians over rounds")
    head = ["scenario", "target", "req/s", "p50 ms", "p99 ms", "cpu ms/req", "peak RSS MB"]
    widths = [18, 15, 9, 7, 7, 10, 11]
    print(fmt_row(head, widths))
    for sc in scenarios:
        for t in targets:
            rows = [r for r in results if r["scenario"] == sc[0] and r["target"] == t]
            if not rows:
                continue
            med = _median_of(rows)
            print(
                fmt_row(
                    [
                        sc[0],
                        t,
                        f"{med('rps'):.0f}",
                        f"{med('p50_ms'):.2f}",
                        f"{med('p99_ms'):.2f}",
                        f"{med('cpu_ms_per_req'):.3f}",
                        f"{max(r['peak_rss_mb'] for r in rows):.1f}",
                    ],
                    widths,
                )
            )

    if "sqlite-prefill" in targets and "sqlite" in targets:
        print()
        print("## sqlite-prefill / sqlite (empty store), per round and median")
        for sc in scenarios:
            for figure, key in (("req/s", "rps"), ("p99", "p99_ms")):
                ratios = []
                for rnd in sorted({r["round"] for r in results}):
                    a = [
                        r
                        for r in results
                        if (r["scenario"], r["round"], r["target"])
                        == (sc[0], rnd, "sqlite-prefill")
                    ]
                    b = [
                        r
                        for r in results
                        if (r["scenario"], r["round"], r["target"]) == (sc[0], rnd, "sqlite")
                    ]
                    if a and b and b[0][key]:
                        ratios.append(a[0][key] / b[0][key])
                if ratios:
                    print(
                        fmt_row(
                            [
                                sc[0],
                                figure,
                                " ".join(f"{x:.2f}" for x in ratios),
                                f"{statistics.median(ratios):.2f}",
                            ],
                            [18, 8, 30, 7],
                        )
                    )

    gateways = [t for t in targets if t in GATEWAY_TARGETS]
    if "plain" not in targets or not gateways:
        return
    print()
    print("## Ratios target / plain proxy, per round (same round, side by side) and median")
    head = ["scenario", "target", "figure", "per round", "median"]
    widths = [18, 15, 12, 30, 7]
    print(fmt_row(head, widths))
    for sc in scenarios:
        for t in gateways + (["upstream"] if "upstream" in targets else []):
            for figure, key in (("req/s", "rps"), ("p99", "p99_ms"), ("cpu/req", "cpu_ms_per_req")):
                ratios = []
                for rnd in sorted({r["round"] for r in results}):
                    a = [
                        r
                        for r in results
                        if (r["scenario"], r["round"], r["target"]) == (sc[0], rnd, t)
                    ]
                    b = [
                        r
                        for r in results
                        if (r["scenario"], r["round"], r["target"]) == (sc[0], rnd, "plain")
                    ]
                    if a and b and b[0][key]:
                        ratios.append(a[0][key] / b[0][key])
                if ratios:
                    print(
                        fmt_row(
                            [
                                sc[0],
                                t,
                                figure,
                                " ".join(f"{x:.2f}" for x in ratios),
                                f"{statistics.median(ratios):.2f}",
                            ],
                            widths,
                        )
                    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="~30 s smoke run")
    p.add_argument("--targets", default="upstream,plain,sqlite,postgres")
    p.add_argument("--duration", type=float, help="measured seconds per run (default 10)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of load before measuring")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--connections", default="32,128")
    p.add_argument(
        "--mix-connections",
        type=int,
        default=32,
        help="connections for the 10%%-dup/5%%-stale mix (0: skip the mix)",
    )
    p.add_argument("--dup-rate", type=float, default=0.10)
    p.add_argument("--stale-rate", type=float, default=0.05)
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="also run target sqlite-prefill with N keys and N/10 jobs stored",
    )
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="also run target sqlite-base: the gateway of git revision REV on SQLite, "
        "side by side with the working tree's (before/after a change, same run); "
        "target postgres-base is the same on PostgreSQL (name it in --targets)",
    )
    p.add_argument("--upstream-latency-ms", type=float, default=0.0)
    p.add_argument("--engine", choices=("auto", "wrk", "aiohttp"), default="auto")
    p.add_argument("--pg-admin-url", default=PG_ADMIN_URL)
    p.add_argument("--json", help="also write all results to this file")
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the measured runs, profile each gateway target with py-spy (not timed)",
    )
    p.add_argument(
        "--profile-native",
        action="store_true",
        help="with --profile: also sample C frames (uvloop, sqlite3, the GIL)",
    )
    p.add_argument("--pause", type=float, default=0.5, help="seconds between runs")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes per target: the plain proxy and each gateway (serve --workers N)",
    )
    p.add_argument(
        "--soak",
        type=float,
        default=0.0,
        help="after the runs, load each gateway target this many seconds (e.g. 300) "
        "at the first scenario's connections, sampling its RSS: does memory grow?",
    )
    args = p.parse_args(argv)

    if args.quick:
        args.duration = args.duration or 2.0
        args.warmup = 0.0  # a smoke run: the first of 2 s includes the connection set-up
        args.pause = min(args.pause, 0.2)
    args.duration = args.duration or 10.0
    if args.duration < 1 or args.rounds < 1 or args.rounds > 20 or args.duration > 600:
        p.error("duration must be 1..600 s and rounds 1..20")

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        if t not in ALL_TARGETS:
            p.error(f"unknown target {t!r}; choose from {','.join(ALL_TARGETS)}")
    if args.prefill and "sqlite-prefill" not in targets:
        targets.insert(
            targets.index("sqlite") + 1 if "sqlite" in targets else len(targets), "sqlite-prefill"
        )
    if args.baseline and not any(t.endswith("-base") for t in targets):
        at = targets.index("sqlite") + 1 if "sqlite" in targets else len(targets)
        targets.insert(at, "sqlite-base")
    for base in ("sqlite-base", "postgres-base"):
        if base in targets and not args.baseline:
            p.error(f"target {base} needs --baseline REV")
    if any(t in GATEWAY_TARGETS for t in targets) and not gateway_available():
        log("gateway not available yet (gateway/cli.py missing): skipping gateway targets")
        targets = [t for t in targets if t not in GATEWAY_TARGETS]
    if any(t.startswith("postgres") for t in targets) and not pg_reachable(args.pg_admin_url):
        targets = [t for t in targets if not t.startswith("postgres")]
    if not targets:
        p.error("no target left to run")

    scenarios = [(f"unique c={int(c)}", int(c), 0.0, 0.0) for c in args.connections.split(",")]
    if args.mix_connections:
        scenarios.append(
            (f"mix c={args.mix_connections}", args.mix_connections, args.dup_rate, args.stale_rate)
        )

    # SIGTERM/SIGHUP -> SystemExit, so the finally below stops everything
    def _exit(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGHUP, _exit)

    procs = Processes()
    pg_dbs: list[str] = []
    results: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="sinkgate-bench-"))
    try:
        up = Target("upstream", f"http://127.0.0.1:{free_port()}", logfile=tmp / "upstream.log")
        up.proc = procs.start(
            [
                sys.executable,
                "-m",
                "bench.upstream",
                "--port",
                up.base.rsplit(":", 1)[1],
                "--latency-ms",
                str(args.upstream_latency_ms),
            ],
            up.logfile,
        )
        wait_ready(up)
        by_name: dict[str, Target] = {"upstream": up}
        if "plain" in targets:
            t = Target("plain", f"http://127.0.0.1:{free_port()}", logfile=tmp / "plain.log")
            t.proc = procs.start(
                [
                    sys.executable,
                    "-m",
                    "bench.plain_proxy",
                    "--port",
                    t.base.rsplit(":", 1)[1],
                    "--upstream",
                    up.base,
                    "--workers",
                    str(args.workers),
                ],
                t.logfile,
            )
            wait_ready(t)
            by_name["plain"] = t
        for name in [t for t in targets if t in GATEWAY_TARGETS]:
            root = tmp / name
            if name.startswith("postgres"):
                pg_db = f"sinkgate_bench_{os.getpid()}" + ("_base" if name.endswith("base") else "")
                asyncio.run(_pg(args.pg_admin_url, f'CREATE DATABASE "{pg_db}"'))
                pg_dbs.append(pg_db)
                store_url = pg_db_url(args.pg_admin_url, pg_db)
            else:
                store_url = "sqlite:///data/sinkgate.db"
            port = free_port()
            config = write_gateway_config(root, port, free_port(), store_url, up.base)
            t = Target(name, f"http://127.0.0.1:{port}", claim=True, logfile=tmp / f"{name}.log")
            if name.startswith("postgres"):
                t.extra["db_process"] = f" {pg_db} "
            cwd = REPO
            if name.endswith("-base"):
                cwd = export_revision(args.baseline, tmp / f"{name}-src")
                t.extra["revision"] = args.baseline
            try:
                t.proc = procs.start(gateway_command(config, args.workers), t.logfile, cwd=cwd)
                wait_ready(t, "/healthz")
                if name == "sqlite-prefill":
                    # the gateway created the schema; stop it, fill the file, start again
                    procs.stop(t.proc)
                    if not prefill_sqlite(root / "data" / "sinkgate.db", args.prefill):
                        log("prefill not possible: running sqlite-prefill on an empty store")
                    t.proc = procs.start(gateway_command(config, args.workers), t.logfile)
                    wait_ready(t, "/healthz")
            except RuntimeError as exc:
                log(f"skipping target {name}: {exc}")
                if t.proc is not None:
                    procs.stop(t.proc)
                continue
            by_name[name] = t
        targets = [n for n in targets if n in by_name]
        log(f"targets: {', '.join(f'{n}={by_name[n].base}' for n in targets)}")

        runs = len(scenarios) * args.rounds * len(targets)
        log(f"{runs} runs of {args.warmup:g}+{args.duration:g} s")
        for sc_name, conns, dup, stale in scenarios:
            for rnd in range(1, args.rounds + 1):
                order = targets if rnd % 2 else list(reversed(targets))
                for name in order:
                    rep = run_load(by_name[name], args, conns, dup, stale, upstream=up)
                    rep.update(scenario=sc_name, round=rnd)
                    results.append(rep)
                    log(
                        f"{sc_name} r{rnd} {name}: {rep['rps']:.0f} req/s p50 "
                        f"{rep['p50_ms']:.2f} p99 {rep['p99_ms']:.2f} ms "
                        f"cpu {rep['cpu_ms_per_req']:.3f} ms/req ({rep['engine']})"
                    )
                    time.sleep(args.pause)
        print_tables(results, scenarios, targets)
        if args.soak > 0:
            for name in [t for t in targets if t in GATEWAY_TARGETS]:
                results.append(soak_target(by_name[name], args, scenarios[0][1]))
        if args.profile:
            # the plain proxy too: its profile is the floor each part is compared with
            for name in [t for t in targets if t in GATEWAY_TARGETS or t == "plain"]:
                profile_target(by_name[name], args, scenarios[0][1], REPO / "bench" / "results")
        out = Path(args.json) if args.json else None
        if out is None:
            out = REPO / "bench" / "results" / f"run-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {"args": vars(args), "targets": targets, "results": results}, indent=1, default=str
            )
        )
        log(f"results written to {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
        return 0
    finally:
        procs.stop_all()
        for pg_db in pg_dbs:
            try:
                asyncio.run(
                    _pg(args.pg_admin_url, f'DROP DATABASE IF EXISTS "{pg_db}" WITH (FORCE)')
                )
            except Exception as exc:
                log(f"could not drop database {pg_db}: {exc}")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
