"""Load generator: N connections, fixed duration, every write with a unique key.

    python3 -m bench.loadgen --url http://127.0.0.1:8480/to/bench/items \
        --connections 32 --duration 10 [--claim-url http://127.0.0.1:8480] \
        [--dup-rate 0.10 --stale-rate 0.05] [--engine auto|wrk|aiohttp]

Every request is a POST with a small JSON body, a unique `Idempotency-Key`
(`{run}-{worker}-{seq}`) and the fencing headers of one of `--jobs` jobs.
With `--claim-url` the jobs are first claimed through the gateway's lease API
(ttl 3600 s); with a stale rate each job is claimed, released and claimed again,
so generation 1 is the stale one and generation 2 the current one. Without
`--claim-url` (upstream, plain proxy) the same headers are sent with made-up
generations, so every target parses the same bytes.

Mix: a `--dup-rate` share repeats an earlier key with its body (a replay from
the gateway), a `--stale-rate` share carries the stale generation (409
`stale_generation`). Duplicates are drawn from requests sent long enough ago
that they have been answered.

Engines: `wrk` (Debian's wrk with a generated Lua script) when installed, else
an aiohttp client in this process. On a 2-core machine the generator shares
the CPU with the target, so the cheaper generator wins: wrk, written in C with
LuaJIT, spends a fraction of the CPU per request that an aiohttp client does,
leaving more of the machine to the process being measured. The aiohttp engine
is the portable fallback and produces the same report.

Prints one JSON object: requests, rps, p50/p90/p99/max latency (ms), status
and outcome histograms, errors, the generator's own CPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp

from ._proc import install_loop

CLAIM_TTL = 3600.0
OWNER = "bench-worker"
DUP_MIN_AGE = 256  # a duplicate repeats a request at least this many sends old
HISTORY = 2048


@dataclass
class Jobs:
    ids: list[str]
    current: list[int]
    stale: list[int]


async def claim_jobs(claim_url: str, run_id: str, count: int, two_generations: bool) -> Jobs:
    """Claim `count` jobs (twice each with `two_generations`) through the lease API."""
    base = claim_url.rstrip("/")
    ids = [f"bench-{run_id}-{i}" for i in range(count)]
    current: list[int] = []
    stale: list[int] = []
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def post(path: str, payload: dict) -> dict:
            async with session.post(base + path, json=payload) as resp:
                body = await resp.json(content_type=None)
                if resp.status != 200:
                    raise RuntimeError(f"POST {path} -> {resp.status} {body}")
                return body

        for job in ids:
            path = f"/leases/{quote(job, safe='')}"
            lease = await post(f"{path}/claim", {"owner": OWNER, "ttl": CLAIM_TTL})
            gen = int(lease["generation"])
            if two_generations:
                await post(f"{path}/release", {"owner": OWNER, "generation": gen})
                lease = await post(f"{path}/claim", {"owner": OWNER, "ttl": CLAIM_TTL})
                stale.append(gen)
                gen = int(lease["generation"])
            else:
                stale.append(max(gen - 1, 1))
            current.append(gen)
    return Jobs(ids, current, stale)


def fake_jobs(run_id: str, count: int) -> Jobs:
    return Jobs([f"bench-{run_id}-{i}" for i in range(count)], [2] * count, [1] * count)


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    idx = min(len(sorted_values) - 1, max(0, round(q / 100.0 * len(sorted_values)) - 1))
    return sorted_values[idx]


# ---------------------------------------------------------------- aiohttp engine


async def run_aiohttp(args: argparse.Namespace, jobs: Jobs, run_id: str) -> dict:
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    total = 0
    connector = aiohttp.TCPConnector(limit=args.connections, keepalive_timeout=60)
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=args.timeout),
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )
    start = time.monotonic()
    measure_from = start + args.warmup
    deadline = measure_from + args.duration
    njobs = len(jobs.ids)

    async def worker(w: int) -> None:
        nonlocal total
        rng = random.Random(f"{run_id}-{w}")
        history: list[tuple[str, bytes]] = []
        seq = 0
        job = w % njobs
        job_id = jobs.ids[job]
        while True:
            now = time.monotonic()
            if now >= deadline:
                return
            seq += 1
            gen = jobs.current[job]
            r = rng.random()
            if r < args.stale_rate:
                gen = jobs.stale[job]
                key, body = f"{run_id}-{w}-{seq}", b'{"n":%d,"w":%d}' % (seq, w)
            elif r < args.stale_rate + args.dup_rate and len(history) > DUP_MIN_AGE // 8:
                key, body = history[rng.randrange(len(history))]
            else:
                key, body = f"{run_id}-{w}-{seq}", b'{"n":%d,"w":%d}' % (seq, w)
                history.append((key, body))
                if len(history) > HISTORY:
                    del history[: HISTORY // 2]
            headers = {
                "Content-Type": "application/json",
                "Idempotency-Key": key,
                "Fencing-Job": job_id,
                "Fencing-Token": str(gen),
                "Fencing-Owner": OWNER,
            }
            t0 = time.perf_counter()
            try:
                async with session.post(args.url, data=body, headers=headers) as resp:
                    await resp.read()
                    status = resp.status
                    reason = resp.headers.get("Sinkgate-Rejected")
                    replayed = resp.headers.get("Idempotent-Replayed")
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                status, reason, replayed = 0, None, None
                if t0 >= measure_from:
                    errors[type(exc).__name__] += 1
            elapsed = time.perf_counter() - t0
            total += 1
            if t0 < measure_from or time.monotonic() > deadline:
                continue
            if status == 0:
                continue
            latencies.append(elapsed)
            statuses[str(status)] += 1
            label = str(status)
            if reason:
                label += f" {reason}"
            elif replayed:
                label += " replayed"
            outcomes[label] += 1

    try:
        await asyncio.gather(*(worker(w) for w in range(args.connections)))
    finally:
        await session.close()
    latencies.sort()
    n = len(latencies)
    return {
        "requests": n,
        "total_requests": total,
        "rps": n / args.duration,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p90_ms": percentile(latencies, 90) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "max_ms": (latencies[-1] * 1000) if latencies else 0.0,
        "statuses": dict(statuses),
        "outcomes": dict(outcomes),
        "errors": dict(errors),
    }


# -------------------------------------------------------------------- wrk engine

LUA_TEMPLATE = r"""
-- generated by bench/loadgen.py
local JOBS = {%(jobs)s}
local CUR = {%(cur)s}
local STALE = {%(stale)s}
local OWNER = "%(owner)s"
local RUN = "%(run)s"
local DUP = %(dup)f
local STALE_RATE = %(stale_rate)f
local PATH = "%(path)s"
local DUP_MIN_AGE = %(dup_min_age)d
local HISTORY = %(history)d

local counter = 1
local threads = {}

function setup(thread)
  thread:set("tid", counter)
  table.insert(threads, thread)
  counter = counter + 1
end

local seq = 0
local hist_key = {}
local hist_body = {}
local hist_n = 0
statuses = {}
outcomes = {}

function init(args)
  math.randomseed(tid * 7919 + %(seed)d)
end

function request()
  seq = seq + 1
  local j = (seq %% #JOBS) + 1
  local gen = CUR[j]
  local r = math.random()
  local key, body
  if r < STALE_RATE then
    gen = STALE[j]
    key = RUN .. "-" .. tid .. "-" .. seq
    body = '{"n":' .. seq .. ',"w":' .. tid .. '}'
  elseif r < STALE_RATE + DUP and hist_n > DUP_MIN_AGE then
    local age = math.random(DUP_MIN_AGE, math.min(hist_n, HISTORY) - 1)
    local slot = ((hist_n - age) %% HISTORY) + 1
    key = hist_key[slot]
    body = hist_body[slot]
  else
    key = RUN .. "-" .. tid .. "-" .. seq
    body = '{"n":' .. seq .. ',"w":' .. tid .. '}'
    hist_n = hist_n + 1
    local slot = (hist_n %% HISTORY) + 1
    hist_key[slot] = key
    hist_body[slot] = body
  end
  return wrk.format("POST", PATH, {
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = key,
    ["Fencing-Job"] = JOBS[j],
    ["Fencing-Token"] = tostring(gen),
    ["Fencing-Owner"] = OWNER,
  }, body)
end

function response(status, headers, body)
  local s = tostring(status)
  statuses[s] = (statuses[s] or 0) + 1
  local label = s
  local reason = headers["Sinkgate-Rejected"] or headers["sinkgate-rejected"]
  if reason then
    label = s .. " " .. reason
  elseif headers["Idempotent-Replayed"] or headers["idempotent-replayed"] then
    label = s .. " replayed"
  end
  outcomes[label] = (outcomes[label] or 0) + 1
end

local function merge(into, from)
  for k, v in pairs(from) do into[k] = (into[k] or 0) + v end
end

local function jsonmap(t)
  local parts = {}
  for k, v in pairs(t) do
    table.insert(parts, string.format("%%q:%%d", k, v))
  end
  return "{" .. table.concat(parts, ",") .. "}"
end

function done(summary, latency, requests)
  local st, oc = {}, {}
  for _, t in ipairs(threads) do
    merge(st, t:get("statuses"))
    merge(oc, t:get("outcomes"))
  end
  local e = summary.errors
  io.write("WRKJSON ", string.format(
    '{"requests":%%d,"duration_us":%%d,"p50_us":%%d,"p90_us":%%d,"p99_us":%%d,"max_us":%%d,' ..
    '"statuses":%%s,"outcomes":%%s,"errors":{"connect":%%d,"read":%%d,"write":%%d,"timeout":%%d}}',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, jsonmap(st), jsonmap(oc),
    e.connect, e.read, e.write, e.timeout), "\n")
end
"""


def lua_list(values: list) -> str:
    return ",".join(json.dumps(v) for v in values)


def write_lua(path: str, args: argparse.Namespace, jobs: Jobs, run: str, url_path: str) -> None:
    text = LUA_TEMPLATE % {
        "jobs": lua_list(jobs.ids),
        "cur": lua_list(jobs.current),
        "stale": lua_list(jobs.stale),
        "owner": OWNER,
        "run": run,
        "dup": args.dup_rate,
        "stale_rate": args.stale_rate,
        "path": url_path,
        "dup_min_age": DUP_MIN_AGE,
        "history": HISTORY,
        "seed": os.getpid() % 100000,
    }
    with open(path, "w") as f:
        f.write(text)


def run_wrk_once(args: argparse.Namespace, script: str, duration: float) -> dict:
    threads = args.threads or 1
    cmd = [
        args.wrk,
        f"-t{threads}",
        f"-c{max(args.connections, threads)}",
        f"-d{max(1, round(duration))}s",
        f"--timeout={max(1, round(args.timeout))}s",
        "-s",
        script,
        args.url,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + args.timeout + 30)
    for line in proc.stdout.splitlines():
        if line.startswith("WRKJSON "):
            return json.loads(line[len("WRKJSON ") :])
    raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stdout[-800:]} {proc.stderr[-800:]}")


def run_wrk(args: argparse.Namespace, jobs: Jobs, run_id: str) -> dict:
    from urllib.parse import urlsplit

    parts = urlsplit(args.url)
    url_path = parts.path + (f"?{parts.query}" if parts.query else "")
    with tempfile.TemporaryDirectory(prefix="sinkgate-bench-") as tmp:
        warm_total = 0
        if args.warmup > 0:
            script = os.path.join(tmp, "warm.lua")
            write_lua(script, args, jobs, f"{run_id}w", url_path)
            warm_total = run_wrk_once(args, script, args.warmup)["requests"]
        script = os.path.join(tmp, "main.lua")
        write_lua(script, args, jobs, run_id, url_path)
        res = run_wrk_once(args, script, args.duration)
    seconds = res["duration_us"] / 1e6
    errors = {k: v for k, v in res["errors"].items() if v}
    non2xx = sum(v for k, v in res["statuses"].items() if not k.startswith("2"))
    return {
        "requests": res["requests"],
        "total_requests": res["requests"] + warm_total,
        "rps": res["requests"] / seconds if seconds else 0.0,
        "p50_ms": res["p50_us"] / 1000,
        "p90_ms": res["p90_us"] / 1000,
        "p99_ms": res["p99_us"] / 1000,
        "max_ms": res["max_us"] / 1000,
        "statuses": res["statuses"],
        "outcomes": res["outcomes"],
        "errors": errors,
        "non_2xx": non2xx,
    }


# -------------------------------------------------------------------------- main


def own_cpu_seconds() -> float:
    """CPU of this process and its waited-for children (wrk)."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="full write URL, e.g. .../to/bench/items")
    p.add_argument("--connections", "-c", type=int, default=32)
    p.add_argument("--duration", "-d", type=float, default=10.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds sent before measuring")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--claim-url", help="gateway base URL: claim the jobs through its lease API")
    p.add_argument("--jobs", type=int, default=64)
    p.add_argument("--dup-rate", type=float, default=0.0)
    p.add_argument("--stale-rate", type=float, default=0.0)
    p.add_argument("--engine", choices=("auto", "wrk", "aiohttp"), default="auto")
    p.add_argument("--threads", type=int, default=1, help="wrk threads")
    p.add_argument("--no-uvloop", action="store_true")
    args = p.parse_args(argv)
    if not (0 <= args.dup_rate + args.stale_rate <= 1):
        p.error("dup-rate + stale-rate must be within [0, 1]")

    args.wrk = shutil.which("wrk")
    engine = args.engine
    if engine == "auto":
        engine = "wrk" if args.wrk else "aiohttp"
    if engine == "wrk" and not args.wrk:
        p.error("wrk is not installed (apt-get install wrk), use --engine aiohttp")

    loop_name = install_loop(not args.no_uvloop)
    run_id = f"{os.getpid()}{random.randrange(1 << 20):05x}"
    if args.claim_url:
        jobs = asyncio.run(
            claim_jobs(args.claim_url, run_id, args.jobs, two_generations=args.stale_rate > 0)
        )
    else:
        jobs = fake_jobs(run_id, args.jobs)

    cpu0 = own_cpu_seconds()
    if engine == "wrk":
        report = run_wrk(args, jobs, run_id)
    else:
        report = asyncio.run(run_aiohttp(args, jobs, run_id))
    report.update(
        engine=engine if engine == "wrk" else f"aiohttp/{loop_name}",
        url=args.url,
        connections=args.connections,
        duration=args.duration,
        dup_rate=args.dup_rate,
        stale_rate=args.stale_rate,
        jobs=len(jobs.ids),
        loadgen_cpu_s=round(own_cpu_seconds() - cpu0, 3),
    )
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
