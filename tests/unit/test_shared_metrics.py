"""What the parent of `serve --workers N` does with a reaped worker's metric files
(the sums across live workers are tested in tests/processes/test_workers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.telemetry.metrics import forget_process


def test_a_dead_workers_gauges_go_and_its_counters_stay(tmp_path: Path) -> None:
    for name in ("gauge_livesum_41.db", "gauge_livemostrecent_41.db", "counter_41.db",
                 "histogram_41.db", "gauge_livesum_42.db"):  # fmt: skip
        (tmp_path / name).write_bytes(b"")
    forget_process(41, str(tmp_path))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["counter_41.db", "gauge_livesum_42.db", "histogram_41.db"]


def test_forgetting_never_raises_into_the_supervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "gauge_livesum_41.db").write_bytes(b"")

    def vanished(path: str) -> None:
        raise FileNotFoundError(path)

    monkeypatch.setattr(os, "remove", vanished)
    forget_process(41, str(tmp_path))  # a file removed meanwhile: nothing to do
    forget_process(41, str(tmp_path / "gone"))
