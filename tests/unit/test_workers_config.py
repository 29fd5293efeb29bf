"""`[server] workers` and `serve --workers N` (SPEC 5 "Processes", SPEC 6): the value
is checked like every other key, on the command line too, and a worker that keeps
dying at once is restarted ever later, not in a loop."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway import cli, supervisor
from gateway.cli import main, summary
from gateway.config import keys
from gateway.config.keys import RESTART_ONLY
from gateway.config.model import Config, load_config
from gateway.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, server: str) -> Path:
    (tmp_path / "gateway.toml").write_text(f"[server]\n{server}")
    return tmp_path / "gateway.toml"


def test_the_default_is_one_process_declared_once() -> None:
    assert keys.SERVER.defaults["workers"] == 1
    assert Config.__dataclass_fields__["workers"].default == 1
    assert ("workers", "server.workers") in RESTART_ONLY


def test_the_file_sets_the_number_of_workers(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, "workers = 4\n"), environ={})
    assert config.workers == 4
    assert "workers       4 processes sharing both listeners" in summary(config).splitlines()
    one = load_config(write_config(tmp_path, "workers = 1\n"), environ={})
    assert "workers" not in summary(one)  # one process: the summary as before


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "server.workers: must be 1..64, got 0"),
        ("65", "server.workers: must be 1..64, got 65"),
        ('"2"', 'server.workers: expected an integer, got "2"'),
        ("true", "server.workers: expected an integer, got true"),
        ("1.5", "server.workers: expected an integer, got 1.5"),
    ],
)
def test_a_bad_value_is_reported_with_file_and_key(
    tmp_path: Path, value: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, f"workers = {value}\n"), environ={})
    assert info.value.errors == (f"gateway.toml: {message}",)


def test_check_config_prints_the_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, "workers = 0\n")
    assert main(["check-config", "--config", str(path)]) == 1
    assert "gateway.toml: server.workers: must be 1..64, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "65", "two"])
def test_serve_refuses_a_bad_workers_flag(tmp_path: Path, value: str) -> None:
    path = write_config(tmp_path, "")
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--workers", value],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "argument --workers" in done.stderr


def test_the_workers_flag_is_the_count_each_worker_sees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What reads `config.workers` in a worker (the waiters' poll on a shared
    SQLite file) sees `--workers N`, not the file's count."""
    path = write_config(tmp_path, 'listen = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n')
    seen: list[int] = []

    class OneRun:
        def __init__(self, workers: int, *a: Any, **kw: Any) -> None:
            self.run = a[2]

        def main(self) -> int:
            return int(self.run(supervisor.Slot(0, ("127.0.0.1", 0), ("127.0.0.1", 0))))

    monkeypatch.setattr(cli, "Supervisor", OneRun)
    monkeypatch.setattr(
        cli, "_run_gateway", lambda config, *a, **kw: seen.append(config.workers) or 0
    )
    assert main(["serve", "--config", str(path), "--workers", "3"]) == 0
    assert seen == [3]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class NoFork(supervisor.Supervisor):
    """The restart schedule without processes: `_spawn` records instead of forking."""

    def _spawn(self, index: int, ready_fd: int | None = None, failures: int = 0) -> int:
        pid = 1000 + len(self.spawned)
        self.spawned.append(index)
        self.workers[pid] = supervisor._Worker(index, self.clock(), failures)
        return pid


def no_fork(clock: Clock) -> NoFork:
    sup = NoFork(2, ("127.0.0.1", 1), ("127.0.0.1", 2), lambda slot: 0, clock=clock)
    sup.spawned = []  # type: ignore[attr-defined]
    return sup


def test_a_worker_that_keeps_dying_at_once_waits_longer_each_time() -> None:
    clock = Clock()
    sup = no_fork(clock)
    pid = sup._spawn(0)
    delays = []
    for _ in range(8):
        worker = sup.workers.pop(pid)
        sup._exited(pid, worker, 1 << 8)  # exit status 1, a second after its start
        when, _ = sup.due[0]
        delays.append(when - clock.now)
        clock.now = when
        sup._restart_due()
        (pid,) = sup.workers
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_worker_that_ran_a_while_is_restarted_at_once() -> None:
    clock = Clock()
    sup = no_fork(clock)
    pid = sup._spawn(1)
    clock.now += supervisor.STEADY_S + 1
    sup._exited(pid, sup.workers.pop(pid), signal.SIGKILL)  # killed by a signal
    assert sup.spawned == [1, 1] and not sup.due  # type: ignore[attr-defined]


def test_no_restart_while_stopping() -> None:
    clock = Clock()
    sup = no_fork(clock)
    pid = sup._spawn(0)
    sup.stopping = True
    sup._exited(pid, sup.workers.pop(pid), 0)
    assert sup.spawned == [0] and not sup.due and not sup.failed_stop  # type: ignore[attr-defined]
