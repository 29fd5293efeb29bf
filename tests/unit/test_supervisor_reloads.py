"""Which worker of `serve --workers N` records a SIGHUP's reload in the audit log
(one row per reload): the parent's choice, with the signals it sends recorded."""

from __future__ import annotations

import signal

import pytest

from gateway import supervisor
from gateway.supervisor import RELOAD_UNRECORDED, Supervisor, _Worker


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    signals: list[tuple[int, int]] = []
    monkeypatch.setattr(supervisor, "_signal", lambda pid, signum: signals.append((pid, signum)))
    return signals


def parent(workers: dict[int, int]) -> Supervisor:
    def never(slot: object) -> int:
        raise AssertionError("no fork here")

    s = Supervisor(len(workers), ("127.0.0.1", 0), ("127.0.0.1", 0), never)
    s.workers = {pid: _Worker(index, 0.0) for pid, index in workers.items()}
    return s


def reaping(monkeypatch: pytest.MonkeyPatch, reap) -> None:
    monkeypatch.setattr(Supervisor, "_reap", reap)


def test_the_first_serving_worker_records_the_others_reload_unrecorded(sent, monkeypatch) -> None:
    s = parent({101: 1, 100: 0, 102: 2})
    reaping(monkeypatch, lambda self: None)
    s._on_sighup()
    assert sent == [(100, signal.SIGHUP), (101, RELOAD_UNRECORDED), (102, RELOAD_UNRECORDED)]
    assert s.reloaded and not s.unrecorded


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
    s = parent({100: 0})

    def reap(self: Supervisor) -> None:
        del self.workers[100]  # in backoff: started again later

    reaping(monkeypatch, reap)
    s._on_sighup()
    assert sent == [] and s.reloaded and s.unrecorded


def test_a_stopping_parent_relays_no_reload(sent, monkeypatch) -> None:
    s = parent({100: 0, 101: 1})
    reaping(monkeypatch, lambda self: None)
    s.stopping = True
    s._on_sighup()
    assert sent == []
