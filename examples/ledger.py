"""The examples' destination: a ledger that records every entry it applies.

    python3 -m examples.ledger [--port 9100] [--record ledger.jsonl] [--busy N]

`POST /entries` applies an entry (its JSON body) and answers 201 with it; each
applied entry is one line of the record file, with the fencing headers the
gateway forwarded. `GET /entries` lists them, those of earlier runs recorded in
the same file too. Nothing here deduplicates: the
record shows every effect that reached the destination. With `--busy N` the
first N entries are answered `503` and not applied, as an overloaded ledger
would: the gateway relays such an answer without storing it, and the
examples' tasks have the queue run them again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from pathlib import Path
from typing import Any

from aiohttp import web


def make_app(record: Path, busy: int = 0) -> web.Application:
    """The ledger's app, appending applied entries to `record`; the entries a
    run before this one recorded there are its first ones (numbered on). The
    first `busy` entries are refused with 503."""
    entries: list[dict[str, Any]] = _recorded(record)
    refused = 0

    async def apply(request: web.Request) -> web.Response:
        nonlocal refused
        if refused < busy:
            refused += 1
            return web.json_response({"error": "busy"}, status=503, headers={"Retry-After": "1"})
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "a JSON body is required"}, status=400)
        entry = {
            "n": len(entries) + 1,
            "entry": body,
            "job": request.headers.get("Fencing-Job"),
            "generation": request.headers.get("Fencing-Token"),
            "key": request.headers.get("Idempotency-Key"),
        }
        entries.append(entry)
        with record.open("a") as out:  # one line per effect, flushed before answering
            out.write(json.dumps(entry) + "\n")
        return web.json_response(entry, status=201)

    async def listing(request: web.Request) -> web.Response:
        return web.json_response({"entries": entries})

    app = web.Application()
    app.router.add_post("/entries", apply)
    app.router.add_get("/entries", listing)
    return app


def _recorded(record: Path) -> list[dict[str, Any]]:
    try:
        lines = record.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


async def serve(port: int, record: Path, busy: int = 0) -> None:
    runner = web.AppRunner(make_app(record, busy))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"ledger on http://127.0.0.1:{port}, recording to {record}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--record", type=Path, default=Path("ledger.jsonl"))
    parser.add_argument(
        "--busy", type=int, default=0, metavar="N", help="answer the first N entries 503"
    )
    args = parser.parse_args(argv)
    asyncio.run(serve(args.port, args.record, args.busy))


if __name__ == "__main__":
    main()
