"""`sinkgate upstream`: a small recording upstream to point a destination at.

    sinkgate upstream --port 9000

Every request but a GET or HEAD is a write: it is answered (201 by default)
with `{"received": <n>, "bytes": <body length>}` and logged as one line on
stdout (method, path, the fencing headers, the idempotency key, the body's
size). `GET /_writes` returns every write received so far, oldest first, as
JSON. It is what the five-minute walk and the worker example write to before
there is a real service; it keeps nothing across restarts.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from dataclasses import asdict, dataclass

from aiohttp import web

RECORD_PATH = "/_writes"
_READS = frozenset({"GET", "HEAD"})


@dataclass(frozen=True, slots=True)
class Write:
    """One write as the upstream received it."""

    seq: int
    method: str
    path: str
    job_id: str | None
    generation: int | str | None
    key: str | None
    bytes: int


def _generation(token: str | None) -> int | str | None:
    """`Fencing-Token` as a number when it is one (it always is from the gateway)."""
    return int(token) if token is not None and token.isdigit() else token


def _line(write: Write, status: int) -> str:
    fence = f"job={write.job_id} generation={write.generation} key={write.key}"
    return f"{status} {write.method} {write.path}  {fence}  {write.bytes} bytes"


def create_upstream_app(status: int = 201) -> web.Application:
    """The recording upstream: writes answered with `status`, listed at /_writes."""
    writes: list[Write] = []

    async def record(request: web.Request) -> web.Response:
        return web.json_response({"writes": [asdict(w) for w in writes]})

    async def any_request(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method in _READS:
            return web.json_response({"writes": len(writes), "record": RECORD_PATH})
        write = Write(
            seq=len(writes) + 1,
            method=request.method,
            path=request.raw_path,
            job_id=request.headers.get("Fencing-Job"),
            generation=_generation(request.headers.get("Fencing-Token")),
            key=request.headers.get("Idempotency-Key"),
            bytes=len(body),
        )
        writes.append(write)
        print(_line(write, status), flush=True)
        return web.json_response({"received": write.seq, "bytes": write.bytes}, status=status)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get(RECORD_PATH, record)
    app.router.add_route("*", "/{tail:.*}", any_request)
    return app


async def serve_upstream(host: str, port: int, status: int) -> None:
    """Listen until SIGINT or SIGTERM."""
    runner = web.AppRunner(create_upstream_app(status), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        shown = f"[{host}]" if ":" in host else host
        print(f"upstream on http://{shown}:{port}: writes answered {status}, "
              f"listed at {RECORD_PATH}", flush=True)  # fmt: skip
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(args: argparse.Namespace) -> int:
    """Entry point of `sinkgate upstream`."""
    try:
        asyncio.run(serve_upstream(args.host, args.port, args.status))
    except OSError as exc:  # the port is taken, the address is not ours
        print(f"sinkgate: upstream: cannot listen on {args.host}:{args.port}: {exc.strerror}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0
