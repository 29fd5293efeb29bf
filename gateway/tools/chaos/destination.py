"""The chaos run's recording destination: a separate process whose own record is
the judge of SPEC 7.

It applies every effect it is sent (a write carrying `Fencing-Job`), and keeps
job, generation (the forwarded `Fencing-Token`), idempotency key and arrival
order. Before applying, with probability `--fault-rate` and its own seed, it
injects one upstream fault:

- `latency`: waits up to `--max-latency` (kept below the gateway's timeout), then
  applies and answers as usual;
- `status_503`: answers 503 without applying (a retryable status: the gateway
  releases the key);
- `drop_before_apply`: closes the connection without applying or answering;
- `drop_after_apply`: applies, then closes the connection without answering.

The two drops are the cases a gateway cannot tell apart: both leave the key's
outcome `unknown`. With `--idempotent` the destination deduplicates by
`Idempotency-Key` itself, as a destination declared `upstream_idempotent` does.

A request marked `Chaos-Late-Write` is held on the way in, as if stuck on the
wire, and skips the faults above; with `--fence-db` every effect is checked with
`leases.fence` in that database, in the effect's transaction (see `late.py`).

    python -m gateway.tools.chaos.destination --port 0 --seed 7 --fault-rate 0.2

prints `READY <port>` once listening. `GET /_chaos/record` returns the record.
It is a separate process so that `kill -9` of gateway processes never touches it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

from gateway.tools.chaos.deck import FaultDeck
from gateway.tools.chaos.late import LATE_HEADER, FencedLedger, LateWire, refusal_response
from leases.fence.gate import Refusal

FAULT_KINDS = ("latency", "status_503", "drop_before_apply", "drop_after_apply")
RECORD_PATH = "/_chaos/record"


@dataclass
class Effect:
    """One applied effect, in arrival (application) order."""

    seq: int
    job_id: str
    generation: int | None
    key: str | None
    owner: str | None
    path: str


@dataclass
class Recorder:
    """The destination's state: what it applied and which faults it injected."""

    rng: random.Random
    fault_rate: float
    max_latency: float
    idempotent: bool = False
    wire: LateWire | None = None  # holds late writes (--late-writes)
    ledger: FencedLedger | None = None  # the destination's own fence (--fenced-destination)
    effects: list[Effect] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))
    # Keys of requests dropped before they were applied: their absence is explained.
    dropped_before: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    deduplicated: int = 0
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    _deck: FaultDeck = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._deck = FaultDeck(self.rng)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == RECORD_PATH:
            return web.json_response(self.record())
        body = await request.read()
        job_id = request.headers.get("Fencing-Job")
        if not job_id:
            return web.json_response({"error": "not an effect"}, status=400)
        self.requests += 1
        # A late write is the fault under test: no second one on top of it.
        fault = None if LATE_HEADER in request.headers else self._pick_fault()
        key = request.headers.get("Idempotency-Key")
        if fault == "latency":
            await asyncio.sleep(self.rng.uniform(0.05, self.max_latency))
        elif fault == "status_503":
            return web.json_response({"error": "injected"}, status=503)
        elif fault == "drop_before_apply":
            if key is not None:
                self.dropped_before[key] = self.dropped_before.get(key, 0) + 1
            return await _drop(request)
        answer = self._apply(request, job_id, key, len(body))
        if isinstance(answer, Refusal):
            return refusal_response(answer)
        if fault == "drop_after_apply":
            return await _drop(request)
        return web.json_response(answer, status=201)

    def _pick_fault(self) -> str | None:
        kind = self._deck.draw(self.fault_rate, FAULT_KINDS)
        if kind is not None:
            self.faults[kind] += 1
        return kind

    def _apply(self, request: web.Request, job_id: str, key: str | None, size: int) -> Any:
        if self.idempotent and key is not None and key in self.answers:
            self.deduplicated += 1
            return self.answers[key]
        token = request.headers.get("Fencing-Token", "")

        def applied() -> Any:
            effect = Effect(
                seq=len(self.effects) + 1,
                job_id=job_id,
                generation=int(token) if token.isascii() and token.isdigit() else None,
                key=key,
                owner=request.headers.get("Fencing-Owner"),
                path=request.raw_path,
            )
            self.effects.append(effect)
            answer = {"applied": effect.seq, "bytes": size}
            if key is not None:
                self.answers[key] = answer
            return answer

        if self.ledger is not None:
            return self.ledger.apply(job_id, token, key, applied)
        return applied()

    def record(self) -> dict[str, Any]:
        return {
            "effects": [asdict(e) for e in self.effects],
            "faults": dict(self.faults),
            "dropped_before": dict(self.dropped_before),
            "requests": self.requests,
            "deduplicated": self.deduplicated,
            "idempotent": self.idempotent,
            "late_writes": {} if self.wire is None else self.wire.record(),
            "fence": None if self.ledger is None else self.ledger.record(),
        }


async def _drop(request: web.Request) -> web.StreamResponse:
    """Close the connection without an answer."""
    if request.transport is not None:
        request.transport.close()
    await asyncio.sleep(0)
    return web.Response(status=500)  # never reaches the client


async def run(args: argparse.Namespace) -> None:
    recorder = Recorder(
        rng=random.Random(args.seed),
        fault_rate=args.fault_rate,
        max_latency=args.max_latency,
        idempotent=args.idempotent,
        wire=LateWire(args.late_min_hold, args.late_max_hold),
        ledger=None if args.fence_db is None else FencedLedger(args.fence_db),
    )
    assert recorder.wire is not None
    app = web.Application(client_max_size=1024 * 1024, middlewares=[recorder.wire.middleware])
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"READY {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        if recorder.ledger is not None:
            recorder.ledger.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The chaos run's recording destination.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-rate", type=float, default=0.0)
    parser.add_argument("--max-latency", type=float, default=0.4)
    parser.add_argument("--idempotent", action="store_true")
    parser.add_argument("--late-min-hold", type=float, default=2.5)
    parser.add_argument("--late-max-hold", type=float, default=8.0)
    parser.add_argument("--fence-db", default=None, help="check leases.fence in this SQLite file")
    args = parser.parse_args(argv)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
