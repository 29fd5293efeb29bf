"""The floor under `bench.waiting --waiters N`: an aiohttp application that holds
every write carrying `Prefer` until the one without it is answered, then answers
them all with one fixed, precomputed body, deciding nothing.

    python3 -m bench.held_floor --port 9001 --hold-s 6

Same server stack as the gateway (`web.Application`, uvloop when installed, no
access log), same path and the same answer headers as a replay; what is left out
is everything the gateway does for a woken write: its decision in the store,
its replay built from the stored answer, its log line and metrics. `GET
/metrics` says how many are held, in the gateway's metric name, so the bench
waits for them the same way.
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web

from ._proc import install_loop, serve_until_signalled
from .upstream import BODY

HEADERS = {
    "Content-Type": "application/json",
    "Idempotent-Replayed": "true",
    "Preference-Applied": "wait=30",
}


def make_app(hold_s: float) -> web.Application:
    settled = asyncio.Event()
    held = 0

    async def write(request: web.Request) -> web.Response:
        nonlocal held
        await request.read()
        if "Prefer" not in request.headers:  # the original: the slow upstream
            await asyncio.sleep(hold_s)
            settled.set()
            return web.Response(body=BODY, content_type="application/json")
        held += 1
        try:
            await settled.wait()
        finally:
            held -= 1
        return web.Response(body=BODY, headers=HEADERS)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=f"sinkgate_waiting_writes {held}\n")

    app = web.Application()
    app.router.add_post("/to/bench/items", write)
    app.router.add_get("/metrics", metrics)
    return app


async def main_async(host: str, port: int, hold_s: float) -> None:
    async def start():
        runner = web.AppRunner(make_app(hold_s), handle_signals=False, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        print(f"held floor listening on {host}:{port}", flush=True)
        return runner.cleanup

    await serve_until_signalled(start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--hold-s", type=float, default=6.0)
    args = parser.parse_args(argv)
    install_loop()
    asyncio.run(main_async(args.host, args.port, args.hold_s))


if __name__ == "__main__":
    main()
