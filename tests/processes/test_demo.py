"""`sinkgate demo` runs the worked example end to end and says so."""

from __future__ import annotations

import subprocess
import sys

from gateway.policy import decision as decision_module
from gateway.tools.demo import run_demo


def test_demo_exits_0_and_prints_the_timeline() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "demo"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "generation 7  ok" in out and "generation 8  ok" in out
    assert "complete with generation 7" in out and "refused: stale_generation  ok" in out
    assert "409 stale_generation (rejection #" in out
    assert "201 replayed  ok" in out
    assert "destination received 1 effect(s):" in out
    assert "generation=8" in out and "generation=7 " not in out.split("destination received")[1]
    assert out.rstrip().endswith("demo passed")
    assert "UNEXPECTED" not in out


async def test_demo_reports_failure_when_the_fence_is_switched_off(monkeypatch) -> None:
    """With the gateway's fence disabled, A's stale write lands and the demo fails."""
    monkeypatch.setattr(decision_module, "check_fence", lambda facts, state, now: None)
    lines: list[str] = []
    assert await run_demo(lines.append) is False
    text = "\n".join(lines)
    assert "UNEXPECTED" in text
    applied = text.split("destination received")[1]
    assert "generation=7" in applied  # the zombie's write reached the destination
