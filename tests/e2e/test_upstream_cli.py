"""`sinkgate upstream`: the recording upstream the walk and the worker example
write to, run through the real entry point."""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp

from gateway.tools.upstream import create_upstream_app
from tests.harness import free_port, serving


async def test_the_upstream_answers_logs_and_lists_every_write() -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "upstream", "--port", str(port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        banner = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert banner.decode().startswith(f"upstream on http://127.0.0.1:{port}:")
        fence = {"Fencing-Job": "order-1", "Fencing-Token": "2", "Idempotency-Key": "k-1"}
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            async with session.post("/api/charges", data=b"x" * 16, headers=fence) as resp:
                assert resp.status == 201
                assert await resp.json() == {"received": 1, "bytes": 16}
            async with session.delete("/api/charges/1") as resp:
                assert resp.status == 201
            async with session.get("/_writes") as resp:
                writes = (await resp.json())["writes"]
        assert writes == [
            {"seq": 1, "method": "POST", "path": "/api/charges", "job_id": "order-1",
             "generation": 2, "key": "k-1", "bytes": 16},
            {"seq": 2, "method": "DELETE", "path": "/api/charges/1", "job_id": None,
             "generation": None, "key": None, "bytes": 0},
        ]  # fmt: skip
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.decode() == (
            "201 POST /api/charges  job=order-1 generation=2 key=k-1  16 bytes\n"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.returncode == 0


async def test_a_taken_port_is_one_line_and_exit_1() -> None:
    async with serving(create_upstream_app()) as url:
        port = url.rsplit(":", 1)[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "upstream", "--port", port,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1
    assert err.decode().startswith(f"sinkgate: upstream: cannot listen on 127.0.0.1:{port}")
    assert "Traceback" not in err.decode()


async def test_the_answer_status_is_an_option() -> None:
    async with serving(create_upstream_app(status=200)) as url, aiohttp.ClientSession() as s:
        async with s.put(f"{url}/x", data=b"{}") as resp:
            assert resp.status == 200
        async with s.get(f"{url}/anything") as resp:  # a read is not a write
            assert (await resp.json())["writes"] == 1
