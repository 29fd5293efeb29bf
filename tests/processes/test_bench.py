"""The README's benchmark command runs end to end (briefly): every target, every
scenario, the mix really mixed, and the ratio table printed.

The figures themselves are not asserted: speed is measured by `bench/`, side by
side in one run, never by timed tests on a shared machine.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.pg import PG_ADMIN_URL, pg_skip_reason, skip_or_fail

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
async def test_a_short_benchmark_run_measures_every_target(tmp_path: Path) -> None:
    reason = await pg_skip_reason()
    if reason:
        skip_or_fail(reason)
    targets = ["upstream", "plain", "sqlite", "postgres"]
    out = tmp_path / "results.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.run",
        "--targets", ",".join(targets),
        # 3 s: a connection repeats a key only after 32 sends of its own, which a
        # loaded machine may not reach in 1 s (the mix would then show no replay)
        "--duration", "3", "--warmup", "0", "--rounds", "1", "--pause", "0",
        "--connections", "4", "--mix-connections", "4",
        "--engine", "aiohttp",  # wrk may not be installed
        "--pg-admin-url", PG_ADMIN_URL,
        "--json", str(out),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    assert "## Ratios target / plain proxy" in stdout.decode()
    results = json.loads(out.read_text())["results"]
    measured = {(r["scenario"], r["target"]) for r in results}
    assert measured == {(s, t) for s in ("unique c=4", "mix c=4") for t in targets}
    for r in results:
        assert r["rps"] > 0 and r["errors"] == {}, r
        # every target reads each request and writes each answer: at least one
        # read- or write-family call per request, counted from /proc
        assert r["syscalls_per_req"] >= 1 and r["switches_per_req"] >= 0, r
        outcomes = r["outcomes"]
        if r["scenario"].startswith("mix") and r["target"] in ("sqlite", "postgres"):
            # duplicates answered by a replay, stale generations refused
            assert {"200", "200 replayed", "409 stale_generation"} <= outcomes.keys(), r
        else:
            assert set(outcomes) == {"200"}, r
    postgres = [r for r in results if r["target"] == "postgres"]
    assert all(r["db_cpu_s"] >= 0 for r in postgres)
