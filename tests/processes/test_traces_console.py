"""Traces from a real `sinkgate serve` process configured only by OTEL_* variables:
`OTEL_TRACES_EXPORTER=console` prints each finished span as JSON on stdout."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.harness import RecordingUpstream, free_port, recording_upstream, wait_until_ok

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
WORKER_SPAN = "b7ad6b7169203331"


def write_config(root: Path, upstream: str) -> tuple[Path, int]:
    port, admin_port = free_port(), free_port()
    (root / "destinations").mkdir()
    (root / "gateway.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\nadmin_listen = "127.0.0.1:{admin_port}"\n\n'
        '[store]\nurl = "sqlite:///sinkgate.db"\n\n[destinations]\ndir = "destinations"\n'
    )
    (root / "destinations" / "pay.toml").write_text(f'upstream = "{upstream}"\nfencing = "lease"\n')
    return root / "gateway.toml", port


def console_spans(text: str) -> list[dict[str, Any]]:
    """The console exporter's output: JSON objects one after another."""
    decoder = json.JSONDecoder()
    spans, at = [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at >= len(text):
            return spans
        span, at = decoder.raw_decode(text, at)
        spans.append(span)


async def run_gateway(tmp_path: Path, upstream: RecordingUpstream) -> tuple[str, str, int]:
    config, port = write_config(tmp_path, upstream.url)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SINKGATE_"))}
    env.update(OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="sinkgate-e2e")
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once
            [sys.executable, "-m", "gateway", "serve", "--config", str(config)],
            cwd=tmp_path,
            env=env,
            stdout=stdout,
            stderr=stderr,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            await wait_until_ok(session, f"{url}/healthz", exited=lambda: _gone(proc, err))
            async with session.post(
                f"{url}/leases/job-1/claim", json={"owner": "w", "ttl": 30}
            ) as resp:
                assert resp.status == 200
            headers = {
                "Fencing-Job": "job-1",
                "Fencing-Token": "1",
                "Idempotency-Key": "k-1",
                "traceparent": f"00-{TRACE_ID}-{WORKER_SPAN}-01",
            }
            async with session.post(f"{url}/to/pay/charges", data=b"{}", headers=headers) as resp:
                assert resp.status == 201
    finally:
        proc.send_signal(signal.SIGTERM)  # shutdown flushes the batch of spans
        code = await asyncio.to_thread(proc.wait, 30)
    return out.read_text(), err.read_text(), code


def _gone(proc: subprocess.Popen[bytes], err: Path) -> str | None:
    if proc.poll() is None:
        return None
    return f"gateway exited {proc.returncode}: {err.read_text()[-2000:]}"


async def test_console_exporter_on_a_real_gateway(tmp_path: Path) -> None:
    async with recording_upstream() as upstream:
        stdout, stderr, code = await run_gateway(tmp_path, upstream)
    assert code == 0, stderr[-2000:]
    spans = {s["name"]: s for s in console_spans(stdout)}
    assert {"sinkgate.lease.claim", "sinkgate.write", "sinkgate.store.decide", "POST"} <= set(
        spans
    ), sorted(spans)
    write = spans["sinkgate.write"]
    assert write["context"]["trace_id"] == f"0x{TRACE_ID}"
    assert write["parent_id"] == f"0x{WORKER_SPAN}"
    assert write["kind"] == "SpanKind.SERVER"
    assert write["attributes"]["sinkgate.decision"] == "forwarded"
    assert write["attributes"]["sinkgate.job_id"] == "job-1"
    assert write["resource"]["attributes"]["service.name"] == "sinkgate-e2e"
    forward = spans["POST"]
    assert forward["parent_id"] == write["context"]["span_id"]
    received = upstream.received[0].headers["traceparent"]
    assert received == f"00-{TRACE_ID}-{forward['context']['span_id'][2:]}-01"
    decision = next(json.loads(line) for line in stderr.splitlines() if '"write_decision"' in line)
    assert decision["trace_id"] == TRACE_ID
    assert f"0x{decision['span_id']}" == write["context"]["span_id"]
