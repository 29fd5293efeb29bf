"""A minimal, fast upstream: any method, any path -> 200 and a small JSON body.

    python3 -m bench.upstream --port 9000 [--latency-ms 0]

Uses aiohttp's low-level server (no router, no access log) so that it costs as
little CPU per request as an aiohttp server can; the request body is read so the
connection stays reusable.
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web

from ._proc import install_loop, serve_until_signalled

BODY = b'{"ok":true,"id":"bench"}'


def make_handler(latency_ms: float):
    delay = latency_ms / 1000.0

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        if delay > 0:
            await asyncio.sleep(delay)
        return web.Response(body=BODY, content_type="application/json")

    return handler


async def main_async(host: str, port: int, latency_ms: float) -> None:
    async def start():
        server = web.Server(make_handler(latency_ms), access_log=None)
        runner = web.ServerRunner(server, handle_signals=False, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
        await site.start()
        print(f"upstream listening on {host}:{port}", flush=True)
        return runner.cleanup

    await serve_until_signalled(start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--no-uvloop", action="store_true")
    args = parser.parse_args(argv)
    install_loop(not args.no_uvloop)
    asyncio.run(main_async(args.host, args.port, args.latency_ms))


if __name__ == "__main__":
    main()
