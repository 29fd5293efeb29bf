"""Which worker of `serve --workers N` records a SIGHUP's reload in the audit log
(one row per reload): the parent's choice, with the signals it sends recorded;
and the parent's copy of the config the workers serve, which a worker started
again is forked with."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from gateway import supervisor
from gateway.cli import _Applied
from gateway.config.model import load_config
from gateway.supervisor import RELOAD_UNRECORDED, Supervisor, _Worker
from tests.unit.test_config import UPSTREAM, write_config


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    signals: list[tuple[int, int]] = []
    monkeypatch.setattr(supervisor, "_signal", lambda pid, signum: signals.append((pid, signum)))
    return signals


def parent(workers: dict[int, int], rereads: list[tuple[bool, bool]] | None = None) -> Supervisor:
    def never(slot: object) -> int:
        raise AssertionError("no fork here")

    told = [] if rereads is None else rereads
    s = Supervisor(
        len(workers),
        ("127.0.0.1", 0),
        ("127.0.0.1", 0),
        never,
        reread=lambda alone, earlier: told.append((alone, earlier)),
    )
    s.workers = {pid: _Worker(index, 0.0) for pid, index in workers.items()}
    return s


def reaping(monkeypatch: pytest.MonkeyPatch, reap) -> None:
    monkeypatch.setattr(Supervisor, "_reap", reap)


def test_the_first_serving_worker_records_the_others_reload_unrecorded(sent, monkeypatch) -> None:
    rereads: list[tuple[bool, bool]] = []
    s = parent({101: 1, 100: 0, 102: 2}, rereads)
    reaping(monkeypatch, lambda self: None)
    s._on_sighup()
    assert sent == [(100, signal.SIGHUP), (101, RELOAD_UNRECORDED), (102, RELOAD_UNRECORDED)]
    assert rereads == [(False, False)] and not s.unrecorded


def test_a_worker_dead_and_started_again_meanwhile_is_not_the_one(sent, monkeypatch) -> None:
    """sigtimedwait takes SIGHUP before SIGCHLD: worker 0 died, and reaping it
    started it again at once. The row is the serving worker 1's to write."""
    s = parent({100: 0, 101: 1})

    def reap(self: Supervisor) -> None:
        del self.workers[100]
        self.workers[103] = _Worker(0, 0.0)

    reaping(monkeypatch, reap)
    s._on_sighup()
    assert sent == [(101, signal.SIGHUP), (103, RELOAD_UNRECORDED)]


def test_with_no_worker_to_take_it_the_next_to_start_records_it(sent, monkeypatch) -> None:
    rereads: list[tuple[bool, bool]] = []
    s = parent({100: 0}, rereads)

    def reap(self: Supervisor) -> None:
        self.workers.pop(100, None)  # in backoff: started again later

    reaping(monkeypatch, reap)
    s._on_sighup()
    assert sent == [] and rereads == [(True, False)] and s.unrecorded
    s._on_sighup()  # another one before a worker is there: it adds to the first
    assert rereads == [(True, False), (True, True)]


def test_a_stopping_parent_relays_no_reload(sent, monkeypatch) -> None:
    rereads: list[tuple[bool, bool]] = []
    s = parent({100: 0, 101: 1}, rereads)
    reaping(monkeypatch, lambda self: None)
    s.stopping = True
    s._on_sighup()
    assert sent == [] and rereads == []


# --- the parent's copy of the config (serve --workers N) ----------------------------


def test_the_parents_copy_follows_the_reloads_not_the_files(tmp_path: Path) -> None:
    """What a worker started again is forked with: each reload as the workers apply
    it, not a failed one, and not an edit nobody reloaded."""
    path = write_config(tmp_path, pay=UPSTREAM)
    applied = _Applied(load_config(path, {}))
    (tmp_path / "destinations" / "refunds.toml").write_text(UPSTREAM)
    applied.reread(False, False)
    assert sorted(applied.config.destinations) == ["pay", "refunds"]
    assert applied.unrecorded is None  # a worker took it and records it
    (tmp_path / "destinations" / "broken.toml").write_text("upstream = \n")
    applied.reread(False, False)  # failed: the workers keep what they serve
    assert sorted(applied.config.destinations) == ["pay", "refunds"]
    (tmp_path / "destinations" / "broken.toml").unlink()
    (tmp_path / "destinations" / "refunds.toml").unlink()  # not reloaded
    assert sorted(applied.config.destinations) == ["pay", "refunds"]


def test_sighups_no_worker_took_are_one_row_for_the_next_worker(tmp_path: Path) -> None:
    path = write_config(tmp_path, pay=UPSTREAM)
    applied = _Applied(load_config(path, {}))
    (tmp_path / "destinations" / "refunds.toml").write_text(UPSTREAM)
    applied.reread(True, False)
    (tmp_path / "destinations" / "ledger.toml").write_text(UPSTREAM)
    applied.reread(True, True)  # before a worker was there to record the first
    assert applied.unrecorded is not None
    assert applied.unrecorded.result.added == ("ledger", "refunds")
    assert sorted(applied.config.destinations) == ["ledger", "pay", "refunds"]


def test_a_row_once_recorded_is_not_handed_on_again(tmp_path: Path) -> None:
    """A SIGHUP no worker took was kept for the next worker; after that worker had
    recorded it, a later one nobody took (the workers down again) handed the old
    row on a second time, or counted its changes again."""
    path = write_config(tmp_path, pay=UPSTREAM)
    applied = _Applied(load_config(path, {}))
    (tmp_path / "destinations" / "refunds.toml").write_text(UPSTREAM)
    applied.reread(True, False)
    assert applied.unrecorded is not None  # handed to the next worker, which records it
    (tmp_path / "destinations" / "ledger.toml").write_text(UPSTREAM)
    applied.reread(True, False)  # a new run: the workers were up in between
    assert applied.unrecorded is not None and applied.unrecorded.result.added == ("ledger",)
    (tmp_path / "destinations" / "broken.toml").write_text("upstream = \n")
    applied.reread(True, False)  # failed: nothing of this run to record
    assert applied.unrecorded is None
