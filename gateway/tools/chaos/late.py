"""Late writes and the fenced destination: the chaos run's proof of SPEC 3.1.

The gateway's barrier keeps two generations of a job off the wire at once, but a
request the gateway gave up on (its destination `timeout` passed) may still land
later (SPEC 8). `--late-writes` makes that happen for real: a worker about to
freeze past its lease first sends one write marked with `Chaos-Late-Write`, and
the destination's wire (`LateWire`, in front of its handler) holds that request
until the gateway has timed it out and a newer generation of the job has been
handled, or `max_hold` passes. The late, older write then lands after the newer
one. Without a fence at the destination that is a `no_stale_effect` violation;
with `--fenced-destination` the destination checks `leases.fence` in its own
database, in the transaction of each effect (`FencedLedger`), and refuses it.

The mark only tells the simulated network which request to delay; it is not
part of the request's fingerprint, so the gateway treats the write as any other.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sqlite3
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from gateway.tools.chaos.context import (
    DESTINATION,
    UNKNOWN_REASONS,
    RunContext,
    Tally,
    step_name,
)
from leases import Lease
from leases.fence import Fence, StaleToken
from leases.fence.gate import Refusal, refusal, stale_refusal
from leases.model import MAX_GENERATION
from leases.reasons import Reason
from leases.writer import FencedWriter, GatewayRejected, derive_key

T = TypeVar("T")

LATE_HEADER = "Chaos-Late-Write"
HOLD_MARGIN_S = 0.5  # how long past the gateway's timeout a late write is held at least
MAX_HOLD_S = 8.0  # a late write whose job gets no newer generation lands after this


def add_options(parser: argparse.ArgumentParser) -> None:
    """The two options of this proof, on `sinkgate chaos`."""
    parser.add_argument(
        "--late-writes",
        action="store_true",
        help="a worker about to freeze sends one write that the destination's wire holds "
        "past the gateway's timeout, until a newer generation has written (SPEC 8's window)",
    )
    parser.add_argument(
        "--fenced-destination",
        action="store_true",
        help="the destination checks Fencing-Token with leases.fence in its own database, "
        "in the transaction of each effect (SPEC 3.1)",
    )


def settings_problem(args: argparse.Namespace) -> str | None:
    if args.late_writes and args.steps < 2:
        return "--late-writes needs --steps of at least 2 (a newer generation must write after)"
    return None


def destination_args(args: argparse.Namespace, workdir: Path, gateway_timeout: float) -> list[str]:
    """The destination process's extra arguments for these options."""
    extra = ["--late-min-hold", f"{gateway_timeout + HOLD_MARGIN_S:g}"]
    extra += ["--late-max-hold", f"{MAX_HOLD_S:g}"]
    if args.fenced_destination:
        extra += ["--fence-db", str(workdir / "destination.db")]
    return extra


class LateWire:
    """The destination's network: holds requests marked late, lets others through."""

    def __init__(self, min_hold: float, max_hold: float) -> None:
        self.min_hold = min_hold
        self.max_hold = max_hold
        self.handled: dict[str, int] = {}  # job -> newest generation handled
        self.counts: Counter[str] = Counter()
        self.held_now = 0
        self._changed = asyncio.Condition()

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        job = request.headers.get("Fencing-Job")
        token = request.headers.get("Fencing-Token", "")
        if not job or not (token.isascii() and token.isdigit()):
            response: web.StreamResponse = await handler(request)
            return response
        if LATE_HEADER in request.headers:
            await request.read()  # all of it is here already; keep it for the handler
            await self._hold(job, int(token))
        try:
            response = await handler(request)
        finally:
            async with self._changed:
                self.handled[job] = max(self.handled.get(job, 0), int(token))
                self._changed.notify_all()
        return response

    async def _hold(self, job: str, token: int) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.counts["held"] += 1
        self.held_now += 1
        try:
            async with self._changed:
                while True:
                    elapsed = loop.time() - start
                    if elapsed >= self.max_hold:
                        self.counts["landed_at_max_hold"] += 1
                        return
                    if elapsed >= self.min_hold and self.handled.get(job, 0) > token:
                        self.counts["landed_after_newer_generation"] += 1
                        return
                    wait = (self.min_hold if elapsed < self.min_hold else self.max_hold) - elapsed
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), max(wait, 0.001))
        finally:
            self.held_now -= 1

    def record(self) -> dict[str, Any]:
        return {**dict(self.counts), "held_now": self.held_now}


class FencedLedger:
    """The destination's own database: each effect is a row, inserted in the same
    transaction as `Fence.check` of its job and generation.

    A synchronous sqlite3 connection on purpose: it is how many destinations write,
    and a transaction that never awaits cannot interleave with another request's.
    """

    def __init__(self, path: str) -> None:
        self._conn = sqlite3.connect(path)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._fence = Fence()
        self._fence.setup_sync(self._conn)
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS effects (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
            "job_id TEXT NOT NULL, generation INTEGER NOT NULL, idempotency_key TEXT)"
        )
        self.refused: Counter[str] = Counter()  # reason -> count
        self.refused_keys: Counter[str] = Counter()  # idempotency key -> stale refusals

    def apply(
        self, job_id: str, token: str, key: str | None, applied: Callable[[], T]
    ) -> T | Refusal:
        """Check and record the effect in one transaction; `applied()` (the in-memory
        record) runs once it has committed. Returns its result, or the refusal."""
        if not (token.isascii() and token.isdigit()) or not 1 <= int(token) <= MAX_GENERATION:
            self.refused[Reason.INVALID_FENCING_TOKEN] += 1
            return refusal(Reason.INVALID_FENCING_TOKEN, "the fence needs a valid Fencing-Token")
        try:
            with self._conn:  # commits, or rolls back on any exception
                self._fence.check_sync(self._conn, job_id, int(token))
                self._conn.execute(
                    "INSERT INTO effects (job_id, generation, idempotency_key) VALUES (?, ?, ?)",
                    (job_id, int(token), key),
                )
        except StaleToken as exc:
            self.refused[Reason.STALE_GENERATION] += 1
            if key is not None:
                self.refused_keys[key] += 1
            return stale_refusal(exc)
        return applied()

    def record(self) -> dict[str, Any]:
        return {"refused": dict(self.refused), "refused_keys": dict(self.refused_keys)}

    def close(self) -> None:
        self._conn.close()


def refusal_response(answer: Refusal) -> web.Response:
    return web.Response(status=answer.status, body=answer.body, headers=answer.headers)


async def late_write(ctx: RunContext, lease: Lease, step: int, index: int) -> None:
    """One write sent just before its worker freezes, marked for the destination's
    wire to hold past the gateway's timeout (see `late.py`); its own task, so the
    freeze's cancellation of the job does not cancel the request."""
    tally = ctx.tally
    job = lease.job_id
    writer = FencedWriter(
        ctx.write_urls[index % len(ctx.write_urls)],
        lease,
        session=ctx.session,
        max_retries=0,
        timeout=ctx.write_timeout,
    )
    tally.late_writes_sent += 1
    try:
        result = await writer.post(
            DESTINATION,
            f"/effects/{job}/{step}",
            json={"job": job, "step": step},
            step=step_name(step),
            headers={LATE_HEADER: "1"},
        )
    except GatewayRejected as exc:
        tally.late_write_answers[exc.reason] += 1
        if exc.reason in UNKNOWN_REASONS | {"gateway_timeout", "gateway_unreachable"}:
            tally.unknown_keys.add(derive_key(job, step_name(step)))
    except Exception as exc:  # reported, never crashes the run
        tally.unexpected.append(f"late write {job} step {step}: {exc!r}")
    else:
        tally.late_write_answers[str(result.status)] += 1


async def settled_record(
    fetch: Callable[[], Awaitable[dict[str, Any]]], patience: float = MAX_HOLD_S + 10
) -> dict[str, Any]:
    """The destination's record once no late write is held any more (each lands
    within `MAX_HOLD_S`), so the judge sees every effect that will ever land."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    while True:
        record = await fetch()
        if not record.get("late_writes", {}).get("held_now") or loop.time() > deadline:
            return record
        await asyncio.sleep(0.2)


def fenced_keys(record: dict[str, Any]) -> dict[str, int]:
    """Keys the destination's fence refused: their absence is explained."""
    fence = record.get("fence")
    return dict(fence["refused_keys"]) if fence else {}


def fault_counts(args: argparse.Namespace, tally: Tally) -> dict[str, int]:
    """The report's `faults.late_writes`, in a run with --late-writes."""
    return {"late_writes": tally.late_writes_sent} if args.late_writes else {}


def destination_counts(
    args: argparse.Namespace, record: dict[str, Any], tally: Tally
) -> dict[str, Any]:
    """The report's `destination.late_writes…` and `destination.fence_refused`."""
    counts: dict[str, Any] = {}
    if args.late_writes:
        counts["late_writes"] = record.get("late_writes", {})
        counts["late_write_answers"] = dict(tally.late_write_answers)
    if args.fenced_destination:
        counts["fence_refused"] = (record.get("fence") or {}).get("refused", {})
    return counts


def report_lines(report: dict[str, Any]) -> list[str]:
    """What a reader must know about a run with the destination's fence."""
    if not report.get("destination_fence"):
        return []
    lines = ["  note: the destination's fence refuses stale effects (SPEC 3.1)"]
    if report["mode"] == "bypass-gateway":
        lines.append(
            "  note: without the gateway, duplicates may remain: the fence is not an "
            "idempotency store"
        )
    return lines
