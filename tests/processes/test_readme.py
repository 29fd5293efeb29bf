"""The "worker in 20 lines" of docs/workers-python.md runs as printed against a
live gateway."""

from __future__ import annotations

import ast
import asyncio
import re
import sys
from pathlib import Path

from tests.harness import destination, make_config, recording_upstream, running_gateway

PAGE = Path(__file__).resolve().parents[2] / "docs" / "workers-python.md"


def worker_example() -> str:
    text = PAGE.read_text(encoding="utf-8")
    marker = text.index("<!-- worker-example")
    match = re.search(r"```python\n(.*?)```", text[marker:], re.S)
    assert match is not None, "the worker example block is missing"
    return match.group(1)


async def run_worker_example(tmp_path: Path, gateway_url: str) -> tuple[int, bytes, bytes]:
    """The example as printed, against `gateway_url`: (exit status, stdout, stderr)."""
    script = tmp_path / "worker.py"
    script.write_text(worker_example().replace("http://127.0.0.1:8480", gateway_url), "utf-8")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out, err


def test_the_worker_example_is_at_most_20_lines_of_code() -> None:
    code = [line for line in worker_example().splitlines() if line.strip()]
    assert len(code) <= 20
    ast.parse(worker_example())


async def test_the_worker_example_charges_once_through_the_gateway(tmp_path: Path) -> None:
    async with recording_upstream() as upstream:
        config = make_config(tmp_path, destination("payments", upstream.url + "/api"))
        async with running_gateway(config) as gw:
            returncode, out, err = await run_worker_example(tmp_path, gw.url)
            assert returncode == 0, err.decode()
            result = ast.literal_eval(out.decode().strip().splitlines()[-1])
            assert result["status"] == 201 and result["replayed"] is False
            (charge,) = upstream.received
            assert charge.raw_path == "/api/charges"
            assert charge.headers["Fencing-Job"] == "order-1001"
            assert charge.headers["Fencing-Token"] == "1"
            lease = await gw.store.get("order-1001")
            assert lease is not None and lease.state == "done"


async def test_the_worker_example_releases_the_job_when_the_upstream_answers_retryably(
    tmp_path: Path,
) -> None:
    # A 503 is relayed, not stored (SPEC 2 step 8): completing the job would lose
    # the charge for good. The example raises, so `hold` gives the job back.
    async with recording_upstream() as upstream:
        config = make_config(tmp_path, destination("payments", upstream.url + "/x/status/503"))
        async with running_gateway(config) as gw:
            returncode, _, err = await run_worker_example(tmp_path, gw.url)
            assert returncode != 0 and b"payments answered 503" in err, err.decode()
            assert len(upstream.received) == 1
            lease = await gw.store.get("order-1001")
            assert lease is not None and lease.state == "free"
