"""A stand-in OTLP/HTTP collector on loopback, for measuring a traced gateway.

Accepts `POST /v1/traces` (protobuf), counts the spans, answers 200 at once, and
prints the totals when stopped:

    python3 -m bench.otlp_sink --port 4318 &
    OTEL_TRACES_EXPORTER=otlp OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 \\
        python3 -m bench.run --targets sqlite --baseline REV ...
"""

from __future__ import annotations

import argparse
import signal
import sys

from aiohttp import web


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=4318)
    args = p.parse_args(argv)
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    totals = {"requests": 0, "spans": 0, "bytes": 0}

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        totals["requests"] += 1
        totals["bytes"] += len(body)
        totals["spans"] += sum(
            len(scope.spans) for rs in message.resource_spans for scope in rs.scope_spans
        )
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)

    async def report(_: web.Application) -> None:
        print(f"otlp_sink: {totals}", file=sys.stderr, flush=True)

    app.on_shutdown.append(report)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
