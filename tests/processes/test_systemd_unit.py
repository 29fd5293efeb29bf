"""The systemd unit of docs/deploying.md: it pulls the network in (`Wants=`, not
only `After=`), offers the ordering after a local PostgreSQL, and systemd accepts it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "deploying.md"


def unit_text() -> str:
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("## A systemd unit") :]
    match = re.search(r"```ini\n(.*?)```", section, re.S)
    assert match is not None, "the unit's block is missing"
    return match.group(1)


def test_the_unit_waits_for_the_network_and_can_wait_for_postgresql() -> None:
    lines = unit_text().splitlines()
    assert "Wants=network-online.target" in lines and "After=network-online.target" in lines
    assert "#Wants=postgresql.service" in lines and "#After=postgresql.service" in lines


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    analyze, true = shutil.which("systemd-analyze"), shutil.which("true")
    if analyze is None or true is None:
        pytest.skip("systemd-analyze is not installed")
    # The unit as printed, its program swapped for one that exists here.
    unit = tmp_path / "sinkgate.service"
    unit.write_text(unit_text().replace("/srv/sinkgate/venv/bin/sinkgate", true))
    # As printed, then with the PostgreSQL lines uncommented one after the other.
    for variant in ("", "#Wants=postgresql.service", "#After=postgresql.service"):
        text = unit.read_text()
        if variant:
            unit.write_text(text.replace(variant, variant[1:]))
        done = subprocess.run(
            [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr
