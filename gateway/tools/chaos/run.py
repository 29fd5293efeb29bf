"""`sinkgate chaos`: the fault-injection run of SPEC 7.

Starts a recording destination (its own process, `chaos_destination`), N gateway
processes on one store, and many workers built on the real client
(`chaos_worker`); injects pauses past the lease, competing claims, skewed worker
clocks, upstream latency / 503 / dropped connections and, with `--kill-every`,
`kill -9` of gateway processes followed by a restart on the same store and port.
Then it checks the destination's own record and the lease store
(`chaos_judge`), prints a report and exits 1 on any violation.

`--store-faults` and `--wire-faults` (`chaos_plan`: `chaos_faults`, `chaos_proxy`)
fault the store and the network to it and to the destination, and the record
checks (`chaos_records`) read the store's key records at the end.

`--bypass-gateway` sends the writes straight to the destination (leases still
come from the gateway's lease API): the same checks must then find violations.

`--late-writes` leaves one write of each freezing worker stuck on the wire past
the gateway's timeout until a newer generation has written (SPEC 8's last
window: `no_stale_effect` violations); `--fenced-destination` makes the
destination check `leases.fence` in its own database, which closes it (see
`late.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import random
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from gateway.telemetry.logs import configure_logging
from gateway.tools.chaos import late as late_mode
from gateway.tools.chaos.context import RunContext, count_rejections, job_keys
from gateway.tools.chaos.judge import FinalLease
from gateway.tools.chaos.options import parser, settings_problem
from gateway.tools.chaos.plan import FaultPlan
from gateway.tools.chaos.processes import Destination, GatewayProcess, Ports, ProcessFailed
from gateway.tools.chaos.report import build_report, render
from gateway.tools.chaos.worker import run_worker
from leases import StoreUnavailable
from leases.http import HTTPLeaseStore

GATEWAY_TIMEOUT_S = 2.0


def main(argv: list[str]) -> int:
    """Run the chaos scenario; 0 with no violation, 1 with any, 2 if it could not run."""
    args = parser().parse_args(argv)
    # The workers' own library logs (a lost lease is the point here) stay quiet.
    configure_logging("error", json=False)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    problem = settings_problem(args)
    if problem is not None:
        print(f"sinkgate chaos: {problem}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(_interruptible(_run(args)))
    except ProcessFailed as exc:
        print(f"sinkgate chaos: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("sinkgate chaos: interrupted; every process it started is stopped", file=sys.stderr)
        return 2
    print(render(report))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            print(f"sinkgate chaos: cannot write --json {args.json}: {exc}", file=sys.stderr)
            return 1 if report["violation_count"] else 2  # a violation is never exit 2
    return 1 if report["violation_count"] else 0


async def _interruptible(run: Any) -> Any:
    """SIGTERM cancels the run like Ctrl-C does, so its `finally` stops the
    processes it started (they live in their own process groups)."""
    task = asyncio.ensure_future(run)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await task


def _store_url(given: str | None, workdir: Path) -> str:
    if given is None:
        return f"sqlite:///{workdir / 'chaos.db'}"
    scheme, sep, rest = given.partition(":///")
    if scheme.lower() == "sqlite" and sep:  # the scheme in any case, as the gateway reads it
        # Relative to where the command runs, not to the generated config file.
        return f"sqlite:///{rest if rest.startswith('/') else Path(rest).resolve()}"
    return given


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="sinkgate-chaos-"))
    started = time.monotonic()
    ports = Ports(args.ports)
    try:  # the destination takes its port here: none left, and the work dir goes too
        destination = Destination(
            workdir,
            seed=args.seed,
            fault_rate=args.upstream_faults,
            max_latency=min(0.5, GATEWAY_TIMEOUT_S / 4),
            idempotent=args.upstream_idempotent,
            ports=ports,
            extra_args=late_mode.destination_args(args, workdir, GATEWAY_TIMEOUT_S),
        )
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    gateways: list[GatewayProcess] = []
    rejections: Counter[str] = Counter()
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), trace_configs=[count_rejections(rejections)]
    )
    stores: list[HTTPLeaseStore] = []
    plan = FaultPlan(args, ports, destination_timeout=GATEWAY_TIMEOUT_S)
    try:
        await destination.start()
        store_url = await plan.store(_store_url(args.store, workdir))
        upstream = await plan.upstream(destination.url)
        gateways = [
            plan.gateway_class(
                i,
                workdir,
                store_url=store_url,
                upstream=upstream,
                timeout=f"{GATEWAY_TIMEOUT_S:g}s",
                upstream_idempotent=args.upstream_idempotent,
                ports=ports,
            )
            for i in range(args.gateways)
        ]
        await _start_gateways(gateways, session)
        stores = [await HTTPLeaseStore.open(g.url, timeout=3.0, session=session) for g in gateways]
        ctx = _context(args, gateways, upstream, stores, session, plan.extra_patience)
        ctx.tally.rejections = rejections
        plan.start(gateways, lambda: [j for j in ctx.tally.granted if j not in ctx.done])
        try:
            kills = await _work(args, ctx, gateways, session)
        finally:
            await plan.calm()
        return await _checked(args, ctx, plan, destination, kills, started, workdir)
    finally:
        await asyncio.gather(*(g.stop() for g in gateways), destination.stop())
        await plan.close()
        await session.close()
        if args.keep:
            print(f"work dir kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


async def _start_gateways(gateways: list[GatewayProcess], session: aiohttp.ClientSession) -> None:
    # One first, so that it creates the schema alone.
    await gateways[0].start(session)
    await asyncio.gather(*(g.start(session) for g in gateways[1:]))


async def _checked(
    args: argparse.Namespace,
    ctx: RunContext,
    plan: FaultPlan,
    destination: Destination,
    kills: int,
    started: float,
    workdir: Path,
) -> dict[str, Any]:
    """After the work: read the destination's record, the leases and the key
    records, and judge them into the report."""
    record = await late_mode.settled_record(lambda: destination.record(ctx.session))
    plan.explain_drops(record)
    final = await _final_leases(ctx)
    keys = {job: job_keys(job, ctx.steps) for job in ctx.jobs}
    records = await plan.records([k for ks in keys.values() for k in ks])
    report = build_report(
        args, ctx, record, final, kills, time.monotonic() - started, workdir, plan.strands
    )
    effects: Any = record["effects"]
    plan.extend_report(report, effects=effects, jobs=keys, records=records, tally=ctx.tally)
    return report


def _context(
    args: argparse.Namespace,
    gateways: list[GatewayProcess],
    upstream: str,
    stores: list[HTTPLeaseStore],
    session: aiohttp.ClientSession,
    extra_patience: float = 0.0,
) -> RunContext:
    run_id = secrets.token_hex(3)  # job ids unique per run, on a store that may be reused
    jobs = [f"chaos-{run_id}-{n:03d}" for n in range(args.jobs)]
    busy = min(args.workers, args.jobs)
    faulted = bool(args.store_faults or args.wire_faults)
    # Pace the work so that the jobs take about --duration (workers idle at the tail).
    step_work = max(0.01, args.duration * busy * 0.45 / (args.jobs * args.steps))
    loop = asyncio.get_running_loop()
    ctx = RunContext(
        jobs=jobs,
        steps=args.steps,
        ttl=args.ttl,
        pause_rate=args.pause_rate,
        max_pause=args.max_pause,
        clock_skew=min(args.clock_skew, 0.5),
        step_work=step_work,
        write_urls=[upstream] if args.bypass_gateway else [g.url for g in gateways],
        lease_stores=stores,
        session=session,
        seed=args.seed,
        # Store and wire faults stall the work now and then: more slack (the
        # deadline only matters for jobs still pending). A stalled store call
        # costs a write its whole bound (10 s, a decision up to 30 s retried),
        # and a job of three steps on a loaded machine met several: with 60 s
        # its last step missed the deadline.
        deadline=loop.time() + 2 * args.duration + 10 + faulted * (args.duration + 120),
        write_timeout=GATEWAY_TIMEOUT_S + 3 + extra_patience,
    )
    if args.late_writes:
        ctx.late_write = functools.partial(late_mode.late_write, ctx)
    return ctx


async def _work(
    args: argparse.Namespace,
    ctx: RunContext,
    gateways: list[GatewayProcess],
    session: aiohttp.ClientSession,
) -> int:
    """Run the workers (and the killer); returns how many gateways were killed."""
    stop = asyncio.Event()
    kills = [0]
    killer = None
    if args.kill_every:
        killer = asyncio.create_task(_killer(args, gateways, session, stop, kills))
    workers = [asyncio.create_task(run_worker(ctx, i)) for i in range(args.workers)]
    try:
        # Workers stop starting jobs at ctx.deadline; a job under way may need
        # a little longer (a freeze, a reservation left by a killed gateway).
        loop = asyncio.get_running_loop()
        _, late = await asyncio.wait(workers, timeout=ctx.deadline - loop.time() + 15)
        for task in late:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await asyncio.gather(*ctx.background, return_exceptions=True)  # late writes
        for task in workers:
            if not task.cancelled() and task.exception() is not None:
                ctx.tally.unexpected.append(f"worker crashed: {task.exception()!r}")
    finally:
        stop.set()
        if killer is not None:
            await killer
    return kills[0]


async def _killer(
    args: argparse.Namespace,
    gateways: list[GatewayProcess],
    session: aiohttp.ClientSession,
    stop: asyncio.Event,
    kills: list[int],
) -> None:
    """kill -9 a random gateway every --kill-every seconds, restart it on the same port."""
    rng = random.Random(f"{args.seed}:killer")
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), args.kill_every * rng.uniform(0.8, 1.2))
            return
        victim = rng.choice(gateways)
        await victim.kill()
        kills[0] += 1
        # Every gateway is up again before the checks. Under store or wire faults a
        # start-up may meet the fault (its schema check fails): try again.
        for attempt in range(5):
            try:
                await victim.start(session)
                break
            except ProcessFailed:
                if attempt == 4 or not (args.store_faults or args.wire_faults):
                    raise
                await victim.stop()
                await asyncio.sleep(1.0)


async def _final_leases(ctx: RunContext) -> dict[str, FinalLease | None]:
    final: dict[str, FinalLease | None] = {}
    for job in ctx.jobs:
        for attempt in range(20):
            store = ctx.lease_stores[attempt % len(ctx.lease_stores)]
            try:
                lease = await store.get(job)
            except StoreUnavailable:
                await asyncio.sleep(0.25)
                continue
            final[job] = (
                None if lease is None else FinalLease(lease.state, lease.generation, lease.owner)
            )
            break
        else:
            raise ProcessFailed(f"could not read the lease of {job} from any gateway")
    return final
