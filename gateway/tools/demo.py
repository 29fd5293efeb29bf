"""`sinkgate demo`: the worked example of SPEC 1, end to end, in one process.

A temporary SQLite store, the real gateway on a free loopback port, a real
recording destination, and two workers using the real client (the HTTP lease
store and `FencedWriter`) with real short TTLs:

  A claims generation 7 and pauses past its lease; B claims generation 8;
  A's late completion is refused; A's delayed write is refused by the gateway
  and never reaches the destination; B's write lands; B's duplicate is replayed
  and the destination sees it once. Last, A's write arrives late straight at the
  destination (as a request the gateway timed out could): the destination's own
  fence (`leases.fence`) refuses it.

Each step states what the contract expects; the exit code is 0 only if every
step behaved.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import aiohttp
from aiohttp import web

from gateway.app import create_app, write_front
from gateway.config.model import Config, DestinationConfig
from gateway.http.server import GatewayRunner
from gateway.telemetry.logs import configure_logging
from leases import JobCompleted, Lease, LeaseLost, LeaseStore, open_store
from leases.fence import Fence, StaleToken
from leases.fence.gate import stale_refusal
from leases.reasons import Reason
from leases.writer import FencedWriter, GatewayRejected

JOB = "job-42"
PAUSE_S = 0.6
TTL_A = 0.3


@dataclass
class Effect:
    job_id: str
    generation: str
    key: str
    path: str
    body: bytes


@dataclass
class Recorder:
    """The destination: applies every request it receives and remembers it, after
    checking its own fence (in its own database) on the forwarded Fencing-Token."""

    effects: list[Effect] = field(default_factory=list)
    db: sqlite3.Connection = field(default_factory=lambda: sqlite3.connect(":memory:"))
    fence: Fence = field(default_factory=Fence)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        token = request.headers.get("Fencing-Token", "")
        if token.isascii() and token.isdigit():
            try:
                with self.db:  # the effect's transaction: here only the fence's mark
                    self.fence.setup_sync(self.db)
                    self.fence.check_sync(self.db, request.headers["Fencing-Job"], int(token))
            except StaleToken as exc:
                refused = stale_refusal(exc)
                return web.Response(status=409, body=refused.body, headers=refused.headers)
        effect = Effect(
            request.headers.get("Fencing-Job", "?"),
            request.headers.get("Fencing-Token", "?"),
            request.headers.get("Idempotency-Key", "?"),
            request.raw_path,
            body,
        )
        self.effects.append(effect)
        return web.json_response(
            {"charge_id": f"ch_{len(self.effects)}", "applied_by_generation": effect.generation},
            status=201,
        )


@asynccontextmanager
async def _serve(app: web.Application) -> AsyncIterator[str]:
    runner = GatewayRunner(app, front=write_front(app), access_log=None, shutdown_timeout=2)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


class Timeline:
    def __init__(self, out: Callable[[str], None]) -> None:
        self.out = out
        self.started = time.monotonic()
        self.results: list[bool] = []

    def say(self, who: str, what: str, outcome: str = "", ok: bool | None = None) -> None:
        mark = "" if ok is None else ("  ok" if ok else "  UNEXPECTED")
        if ok is not None:
            self.results.append(ok)
        elapsed = time.monotonic() - self.started
        self.out(f"{elapsed:7.3f}s  {who:<11} {what:<52} {outcome}{mark}")


async def run_demo(out: Callable[[str], None] = print) -> bool:
    """Run the worked example; True when every step behaved as the contract says."""
    recorder = Recorder()
    upstream_app = web.Application()
    upstream_app.router.add_route("*", "/{tail:.*}", recorder.handle)
    with tempfile.TemporaryDirectory(prefix="sinkgate-demo-") as tmp:
        async with _serve(upstream_app) as upstream_url:
            config = _config(Path(tmp), upstream_url)
            async with _serve(create_app(config)) as gateway_url:
                out(f"gateway      {gateway_url}   (store: temporary SQLite, lease fencing)")
                out(f"destination  {upstream_url}/payments   (records every effect it applies)")
                out("")
                timeline = Timeline(out)
                await _worked_example(gateway_url, recorder, timeline)
                await _late_at_destination(upstream_url, timeline)
                out("")
                out(f"destination received {len(recorder.effects)} effect(s):")
                for e in recorder.effects:
                    out(f"  job={e.job_id} generation={e.generation} key={e.key} {e.path}")
                behaved = sum(timeline.results)
                out("")
                out(f"{behaved}/{len(timeline.results)} steps behaved as the contract says")
                return all(timeline.results) and bool(timeline.results)


CHARGE = {"amount": 1999, "currency": "EUR", "customer": "c_1"}


async def _worked_example(gateway_url: str, recorder: Recorder, t: Timeline) -> None:
    """SPEC 1's worked example, in three acts: two claims across a pause, A's late
    attempts refused, B's write applied once."""
    store = await open_store(gateway_url)
    async with store:
        a, b = await _a_pauses_and_b_claims(store, t)
        async with FencedWriter(gateway_url, a, max_retries=0) as writer_a:
            await _a_wakes_up_stale(store, a, writer_a, recorder, t)
        async with FencedWriter(gateway_url, b) as writer_b:
            await _b_writes_once(store, b, writer_b, t)
        applied = [(e.generation, e.key) for e in recorder.effects]
        t.say(
            "destination",
            "effects applied for the job",
            ", ".join(f"gen {g}" for g, _ in applied) or "none",
            applied == [("8", applied[0][1])] if applied else False,
        )


async def _a_pauses_and_b_claims(store: LeaseStore, t: Timeline) -> tuple[Lease, Lease]:
    for _ in range(6):  # earlier attempts of the job, so that A gets generation 7
        earlier = await store.claim(JOB, owner="setup", ttl=5)
        await store.release(earlier)
    t.say("setup", f"{JOB} claimed and released 6 times", f"generation {earlier.generation}")
    a = await store.claim(JOB, owner="worker-a", ttl=TTL_A)
    t.say(
        "worker A", f"claim {JOB} (ttl {TTL_A}s)", f"generation {a.generation}", a.generation == 7
    )
    t.say("worker A", f"pauses {PAUSE_S}s (GC, VM freeze): no renewals")
    await asyncio.sleep(PAUSE_S)
    b = await store.claim(JOB, owner="worker-b", ttl=10)
    t.say(
        "worker B",
        f"claim {JOB} after A's lease expired",
        f"generation {b.generation}",
        b.generation == 8,
    )
    return a, b


async def _a_wakes_up_stale(
    store: LeaseStore, a: Lease, writer_a: FencedWriter, recorder: Recorder, t: Timeline
) -> None:
    try:
        await store.complete(a)
        t.say("worker A", "complete with generation 7", "accepted", False)
    except LeaseLost as exc:
        t.say(
            "worker A",
            "complete with generation 7",
            f"refused: {exc.reason}",
            exc.reason == Reason.STALE_GENERATION,
        )
    what = "POST /to/payments/charges (generation 7)"
    try:
        result = await writer_a.post("payments", "/charges", json=CHARGE, step="charge")
        t.say("worker A", what, f"{result.status} forwarded", False)
    except GatewayRejected as exc:
        t.say(
            "worker A",
            what,
            f"{exc.status} {exc.reason} (rejection #{exc.rejection_id})",
            exc.reason == Reason.STALE_GENERATION and not recorder.effects,
        )


async def _b_writes_once(store: LeaseStore, b: Lease, writer_b: FencedWriter, t: Timeline) -> None:
    first = await writer_b.post("payments", "/charges", json=CHARGE, step="charge")
    t.say(
        "worker B",
        "POST /to/payments/charges (generation 8)",
        f"{first.status} applied",
        first.status == 201 and not first.replayed,
    )
    again = await writer_b.post("payments", "/charges", json=CHARGE, step="charge")
    t.say(
        "worker B",
        "same write again (a retry after a lost answer)",
        f"{again.status} replayed" if again.replayed else f"{again.status} forwarded",
        again.replayed and again.body == first.body,
    )
    done = await store.complete(b)
    t.say("worker B", "complete with generation 8", f"state {done.state}", done.state == "done")
    try:
        await store.claim(JOB, owner="worker-c", ttl=5)
        t.say("worker C", f"claim {JOB}", "claimed", False)
    except JobCompleted as exc:
        t.say("worker C", f"claim {JOB}", f"refused: {exc.reason}", True)


async def _late_at_destination(upstream_url: str, t: Timeline) -> None:
    """A's generation-7 write landing after B's, as a request the gateway timed out
    could: the destination's own fence refuses it (SPEC 3.1)."""
    headers = {"Fencing-Job": JOB, "Fencing-Token": "7", "Idempotency-Key": "late-a"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{upstream_url}/payments/charges", headers=headers) as resp:
            reason = resp.headers.get("Sinkgate-Rejected", "applied")
            t.say(
                "destination",
                "A's write arrives late, not via the gateway (gen 7)",
                f"{resp.status} {reason} (leases.fence)",
                resp.status == 409 and reason == Reason.STALE_GENERATION,
            )


def _config(tmp: Path, upstream_url: str) -> Config:
    payments = DestinationConfig(
        name="payments",
        upstream=f"{upstream_url}/payments",
        timeout=5.0,
        connect_timeout=1.0,
        source=tmp / "destinations" / "payments.toml",
    )
    return Config(
        source=tmp / "gateway.toml",
        listen=("127.0.0.1", 0),
        admin_listen=("127.0.0.1", 0),
        store_url=f"sqlite:///{tmp / 'sinkgate.db'}",
        destinations=MappingProxyType({"payments": payments}),
        shutdown_grace=2.0,
    )


def main(args: argparse.Namespace | None = None) -> int:
    """Entry point of `sinkgate demo`."""
    del args
    configure_logging("warning")  # the timeline is the output; decisions are in it
    ok = asyncio.run(run_demo())
    print("demo passed" if ok else "demo FAILED: a step did not behave", file=sys.stdout)
    return 0 if ok else 1
