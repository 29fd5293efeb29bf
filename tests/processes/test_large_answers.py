"""Memory bounded by configuration, not by the upstream: a real gateway process
relays 8 concurrent 100 MB answers with a peak RSS (`VmHWM`) under 150 MB, every
byte arrives intact, and each key is stored `completed` without its body, so a
replay says `Sinkgate-Replay-Body: omitted`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import zlib
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.harness import free_port, serving, wait_until_ok

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BLOCK = bytes(range(256)) * 4096  # 1 MiB
BLOCKS = 100
WRITES = 8
PEAK_LIMIT_MB = 150


async def huge_answer(request: web.Request) -> web.StreamResponse:
    """100 MiB, written a block at a time (never held whole by the upstream)."""
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = len(BLOCK) * BLOCKS
    await response.prepare(request)
    for _ in range(BLOCKS):
        await response.write(BLOCK)
    await response.write_eof()
    return response


def write_config(root: Path, upstream: str) -> tuple[Path, int]:
    port, admin_port = free_port(), free_port()
    (root / "destinations").mkdir(parents=True, exist_ok=True)
    (root / "gateway.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\nadmin_listen = "127.0.0.1:{admin_port}"\n\n'
        '[store]\nurl = "sqlite:///sinkgate.db"\n\n[destinations]\ndir = "destinations"\n'
    )
    (root / "destinations" / "big.toml").write_text(
        f'upstream = "{upstream}"\nfencing = "monotonic"\ntimeout = "120s"\n'
    )
    return root / "gateway.toml", port


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc status")


async def fetch(session: aiohttp.ClientSession, url: str, n: int) -> tuple[int, int, int]:
    """Status, bytes and CRC-32 of the answer to write `n`, read in chunks."""
    headers = {"Fencing-Job": f"job-{n}", "Fencing-Token": "1", "Idempotency-Key": f"k{n}"}
    crc, size = 0, 0
    async with session.post(f"{url}/to/big/blob", data=b"{}", headers=headers) as resp:
        async for chunk in resp.content.iter_chunked(256 * 1024):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
        return resp.status, size, crc


async def test_eight_100_mb_answers_keep_the_gateway_under_150_mb(tmp_path: Path) -> None:
    expected_crc = 0
    for _ in range(BLOCKS):
        expected_crc = zlib.crc32(BLOCK, expected_crc)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", huge_answer)
    async with serving(app) as upstream_url:
        config, port = write_config(tmp_path, upstream_url)
        url = f"http://127.0.0.1:{port}"
        log = (tmp_path / "gateway.log").open("ab")
        env = {k: v for k, v in os.environ.items() if k != "SINKGATE_ADMIN_TOKEN"}
        proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once
            [sys.executable, "-m", "gateway", "serve", "--config", str(config)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=log,
        )
        try:
            timeout = aiohttp.ClientTimeout(total=300)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                await wait_until_ok(
                    session,
                    f"{url}/healthz",
                    exited=lambda: None if proc.poll() is None else "gateway exited",
                )
                answers = await asyncio.gather(*(fetch(session, url, n) for n in range(WRITES)))
                assert answers == [(200, len(BLOCK) * BLOCKS, expected_crc)] * WRITES
                peak = peak_rss_mb(proc.pid)
                assert peak < PEAK_LIMIT_MB, f"peak RSS {peak:.0f} MB"
                headers = {"Fencing-Job": "job-0", "Fencing-Token": "1", "Idempotency-Key": "k0"}
                async with session.post(f"{url}/to/big/blob", data=b"{}", headers=headers) as r:
                    assert (r.status, await r.read()) == (200, b"")
                    assert r.headers["Idempotent-Replayed"] == "true"
                    assert r.headers["Sinkgate-Replay-Body"] == "omitted"
        finally:
            proc.kill()
            proc.wait(timeout=10)
            log.close()
