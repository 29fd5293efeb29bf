"""The metrics directory of `serve --workers`: one whose parent was killed (-9),
which could not remove its own, is removed by the next start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gateway.telemetry.metrics import (
    METRICS_DIR_PREFIX,
    claim_metrics_directory,
    sweep_metrics_directories,
)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_a_directory_whose_owner_is_gone_is_removed(tmp_path: Path) -> None:
    gone, alive, unnamed, other = (
        tmp_path / f"{METRICS_DIR_PREFIX}gone",
        tmp_path / f"{METRICS_DIR_PREFIX}alive",
        tmp_path / f"{METRICS_DIR_PREFIX}unnamed",  # a release before this one's
        tmp_path / "something-else",
    )
    for directory in (gone, alive, unnamed, other):
        directory.mkdir()
        (directory / "counter_1.db").write_bytes(b"x")
    namespace = os.readlink("/proc/self/ns/pid")
    (gone / "owner.pid").write_text(f"{dead_pid()} {namespace}")
    claim_metrics_directory(str(alive))
    (other / "owner.pid").write_text(f"{dead_pid()} {namespace}")
    elsewhere = tmp_path / f"{METRICS_DIR_PREFIX}another-container"
    elsewhere.mkdir()  # a pid of another namespace means nothing here
    (elsewhere / "owner.pid").write_text(f"{dead_pid()} pid:[1]")
    assert (alive / "owner.pid").read_text() == f"{os.getpid()} {namespace}"
    assert sweep_metrics_directories(str(tmp_path)) == [str(gone)]
    assert not gone.exists()
    assert alive.exists() and unnamed.exists() and other.exists() and elsewhere.exists()


def test_a_parent_it_cannot_list_is_nothing_to_sweep(tmp_path: Path) -> None:
    assert sweep_metrics_directories(str(tmp_path / "missing")) == []
