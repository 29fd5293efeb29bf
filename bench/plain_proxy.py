"""A plain pass-through proxy: the floor for a Python (aiohttp) proxy.

    python3 -m bench.plain_proxy --port 9001 --upstream http://127.0.0.1:9000 [--workers N]

No checks, no store. One pooled `ClientSession` with keep-alive; forwards the
method, raw path (percent-encoding kept), query, body and end-to-end headers;
relays the status, body and end-to-end headers. The same work the gateway must
do around its decision, and nothing more. `--workers N`: N processes on the port
(SO_REUSEPORT), as `sinkgate serve --workers N` runs.
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from ._proc import install_loop, run_processes, serve_until_signalled

# RFC 9110 7.6.1 hop-by-hop headers, plus those the client/server recompute.
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Connection",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)


def make_handler(session: aiohttp.ClientSession, upstream: str):
    base = upstream.rstrip("/")

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        headers = CIMultiDict(
            (k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP
        )
        url = URL(base + request.raw_path, encoded=True)
        try:
            async with session.request(
                request.method, url, data=body, headers=headers, allow_redirects=False
            ) as resp:
                payload = await resp.read()
                out = CIMultiDict(
                    (k, v)
                    for k, v in resp.headers.items()
                    if k.lower() not in HOP_BY_HOP and k.lower() != "content-encoding"
                )
                return web.Response(status=resp.status, body=payload, headers=out)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return web.Response(status=502, text=f"upstream error: {type(exc).__name__}")

    return handler


async def main_async(host: str, port: int, upstream: str, pool: int, shared: bool = False) -> None:
    async def start():
        connector = aiohttp.TCPConnector(limit=pool, keepalive_timeout=60, ttl_dns_cache=None)
        session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=2, sock_read=10),
        )
        server = web.Server(make_handler(session, upstream), access_log=None)
        runner = web.ServerRunner(server, handle_signals=False, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True, reuse_port=shared)
        await site.start()
        print(f"plain proxy listening on {host}:{port} -> {upstream}", flush=True)

        async def cleanup() -> None:
            await runner.cleanup()
            await session.close()

        return cleanup

    await serve_until_signalled(start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:9000")
    parser.add_argument("--pool", type=int, default=0, help="upstream pool size, 0: unlimited")
    parser.add_argument("--workers", type=int, default=1, help="processes on the port")
    parser.add_argument("--no-uvloop", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.workers <= 64:
        parser.error("--workers must be 1..64")

    def run() -> None:
        install_loop(not args.no_uvloop)
        shared = args.workers > 1
        asyncio.run(main_async(args.host, args.port, args.upstream, args.pool, shared))

    run_processes(args.workers, run)


if __name__ == "__main__":
    main()
