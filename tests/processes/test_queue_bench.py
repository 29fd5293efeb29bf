"""The queue overhead benchmark runs end to end (briefly) and prints every variant.

The figures are not asserted: they are measured by `bench/`, side by side.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_short_queue_overhead_run_measures_every_variant() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.queue_overhead", "--tasks", "5", "--rounds", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = [line.split()[0] for line in done.stdout.splitlines()[1:]]
    assert rows == ["writer", "async-gate", "sync-gate"]
