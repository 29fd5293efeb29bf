"""The `sinkgate` entry point: Ctrl-C while the CLI's modules load is one line."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from gateway import entry


class _Interrupting:
    """An import of `gateway.cli` interrupted, as Ctrl-C during it would."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "gateway.cli":
            raise KeyboardInterrupt


def test_ctrl_c_while_the_cli_loads_is_one_line_and_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delitem(sys.modules, "gateway.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Interrupting(), *sys.meta_path])
    assert entry.main() == 130
    assert capsys.readouterr().err == "\nsinkgate: interrupted\n"


def test_the_entry_point_runs_the_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["sinkgate", "--version"])
    with pytest.raises(SystemExit) as exited:
        entry.main()
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("sinkgate ")
