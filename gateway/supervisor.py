"""`serve --workers N` (SPEC 5 "Processes"): a parent that runs N gateway processes.

The parent reserves both listening addresses (bound with SO_REUSEPORT, never
listening, so port 0 resolves once and no other user can take the port), then
forks the workers. Each worker binds its own listening sockets to those
addresses with SO_REUSEPORT, so the kernel spreads connections over them, and
runs the gateway as `serve` does: its own event loop, store pool, janitor and
metrics.

The parent starts no event loop and no thread (it forks): it blocks the
signals it handles and takes them one at a time with `sigtimedwait`.

- SIGTERM/SIGINT: passed to every worker, which drains; the parent returns 0
  once all have exited 0.
- SIGHUP: every worker reloads for itself. One that was serving gets the
  SIGHUP and records the reload in the audit log; the others get SIGUSR2
  (`RELOAD_UNRECORDED`): one reload, one audit row, whatever N is (see
  `_on_sighup`). Nothing is relayed while the parent stops.
- SIGUSR1 from a worker: that worker applied `POST /admin/reload` and recorded
  it with the operator who asked; the parent sends SIGUSR2 to every other one.
  A worker holds SIGHUP and SIGUSR2 until its handlers are in place, so one
  that starts meanwhile reloads then instead of dying of the signal.
- At each of both, the parent works out the same reload (`reread`), so that
  it holds the config the workers serve: not the one it started with, and not
  the files as they are later (broken, or edited and not reloaded).
- SIGCHLD: a worker that died is logged (exit code or signal) and started
  again, forked with that config; one that dies within `STEADY_S` of its
  start waits before the next try, twice as long each time up to
  `BACKOFF_MAX_S`, so a broken store does not spin.

On the first start the workers start one after another; one that fails before
it is serving fails the whole start: the others are stopped and the parent
returns 1, as one process would.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger("gateway.supervisor")

HANDLED = frozenset({signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1})
RELOAD_ALL = signal.SIGUSR1  # a worker to the parent: "I reloaded, reload the others"
# The parent to a worker: "reload; another worker records it in the audit log".
RELOAD_UNRECORDED = signal.SIGUSR2
# A worker holds these until its handlers are in place (`take_reloads`): one sent
# while it starts is taken then, instead of ending it (their default action).
RELOADS = frozenset({signal.SIGHUP, RELOAD_UNRECORDED})
STEADY_S = 5.0  # a worker up this long had a good start: its next restart is immediate
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class Slot:
    """What one worker is told: its index and the addresses both listeners bind
    (with SO_REUSEPORT); `ready()` reports it serving to the parent."""

    index: int
    listen: tuple[str, int]
    admin_listen: tuple[str, int]
    ready_fd: int | None = None
    # A SIGHUP came while no worker was there to take it: the parent applied it
    # (`Supervisor.reread`), this worker records it in the audit log.
    record_reload_at_start: bool = False

    def ready(self, info: object = None) -> None:
        """The `started` callback of `serve` (called once): tells the parent."""
        if self.ready_fd is not None:
            os.write(self.ready_fd, b"1")
            os.close(self.ready_fd)


def take_reloads() -> None:
    """From a worker whose reload handlers are in place: let the reload signals in,
    a pending one first."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELOADS)


def announce_reload() -> None:
    """From a worker: ask the parent to reload every other worker."""
    os.kill(os.getppid(), RELOAD_ALL)


class ListenError(OSError):
    """An address that cannot be listened on, said in its own words (an OSError
    prints `[Errno 98]` before them)."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def bind_error(exc: OSError, host: str, port: int, key: str) -> OSError:
    """`exc` from binding (host, port), the address of config key `key`, in words
    that say which key and what to do."""
    shown = f"[{host}]" if ":" in host else host
    if isinstance(exc, socket.gaierror):  # its errno is the resolver's, not the system's
        words = exc.strerror or str(exc)
        hint = f" (check the host in {key})"
        return ListenError(exc.errno, f"cannot listen on {shown}:{port}: {words}{hint}")
    hint = (
        f": another process listens there; stop it, or set another address in {key}"
        if exc.errno == errno.EADDRINUSE
        else f" (check {key})"
    )
    # The system's words: asyncio's strerror repeats the address in its own.
    words = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror or str(exc)
    return ListenError(exc.errno, f"cannot listen on {shown}:{port}: {words}{hint}")


def reserve(host: str, port: int, key: str) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT that never listens: it holds
    the port (resolving 0) for the workers' listening sockets. A first bind without
    SO_REUSEPORT makes sure no one listens there yet: another `serve --workers` on
    the same port would otherwise join the same group silently."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError as exc:
        raise bind_error(exc, host, port, key) from None
    with _socket(family, kind, proto, reuse_port=False) as probe:
        _bind(probe, address, host, port, key)
        address = (address[0], probe.getsockname()[1], *address[2:])
    sock = _socket(family, kind, proto, reuse_port=True)
    try:
        _bind(sock, address, host, port, key)
    except OSError:
        sock.close()
        raise
    return sock


def _socket(family: int, kind: int, proto: int, *, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio binds
    return sock


def _bind(sock: socket.socket, address: tuple[object, ...], host: str, port: int, key: str) -> None:
    try:
        sock.bind(address)
    except OSError as exc:
        raise bind_error(exc, host, port, key) from None


@dataclass(slots=True)
class _Worker:
    index: int
    started: float
    failures: int = 0  # quick deaths in a row


@dataclass(slots=True)
class Supervisor:
    """Runs `run(slot)` (returns an exit status) in `count` forked workers."""

    count: int
    listen: tuple[str, int]
    admin_listen: tuple[str, int]
    run: Callable[[Slot], int]
    exited: Callable[[int], None] = lambda pid: None  # told each worker's pid once it is reaped
    # Called at each reload the workers are told of, before a worker is started
    # again, so that the config it forks with is what the workers apply; with
    # (no worker takes this one, an earlier one no worker took is still to record).
    reread: Callable[[bool, bool], None] = lambda alone, earlier: None
    clock: Callable[[], float] = time.monotonic
    workers: dict[int, _Worker] = field(default_factory=dict)  # by pid
    due: dict[int, tuple[float, int]] = field(default_factory=dict)  # index -> (when, failures)
    stopping: bool = False
    failed_stop: bool = False
    unrecorded: bool = False  # a SIGHUP no worker took: the next to start records it

    def main(self) -> int:
        signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED | RELOADS)  # the workers inherit it
        if not self._start_all():
            return 1
        log.info("workers_serving", workers=self.count, pids=sorted(self.workers))
        while self.workers or (self.due and not self.stopping):
            wait = self._until_due()
            info = (
                signal.sigwaitinfo(HANDLED) if wait is None else signal.sigtimedwait(HANDLED, wait)
            )
            if info is None:
                self._restart_due()
            else:
                self._on_signal(info)
        log.info("workers_stopped", workers=self.count)
        return 1 if self.failed_stop else 0

    def _start_all(self) -> bool:
        """Fork the workers one after another, each once the one before serves (two
        processes creating one new SQLite file at once can find it locked); False,
        with every worker stopped, if one fails to start."""
        for index in range(self.count):
            read_fd, write_fd = os.pipe()
            self._spawn(index, write_fd)
            if not _read_ready(read_fd):
                break
        else:
            return True
        self.stopping = True
        self._send(signal.SIGTERM)
        while self.workers:
            self._reap()
            if self.workers:
                signal.sigtimedwait({signal.SIGCHLD}, 1.0)
        return False

    def _spawn(self, index: int, ready_fd: int | None = None, failures: int = 0) -> int:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            slot = Slot(index, self.listen, self.admin_listen, ready_fd, self.unrecorded)
            _child(parent, slot, self.run)
        self.unrecorded = False
        if ready_fd is not None:
            os.close(ready_fd)
        self.workers[pid] = _Worker(index, self.clock(), failures)
        return pid

    def _on_signal(self, info: signal.struct_siginfo) -> None:
        signum = info.si_signo
        if signum == signal.SIGCHLD:
            self._reap()
        elif signum in (signal.SIGTERM, signal.SIGINT):
            log.info("workers_stopping", signal=signal.Signals(signum).name)
            self.stopping = True
            self.due.clear()
            self._send(signum)
        elif signum == signal.SIGHUP:
            self._on_sighup()
        elif signum == RELOAD_ALL and info.si_pid in self.workers:
            if not self.stopping:  # a draining worker has no reload to do
                self.reread(False, False)
                self._send(RELOAD_UNRECORDED, but=info.si_pid)

    def _on_sighup(self) -> None:
        """Every worker reloads, and one records it: one that was serving, or else
        one just started again (its start reload came before this one), or else the
        next to start. A worker dead but not reaped yet is never the one."""
        serving = set(self.workers)
        self._reap()  # it may start again at once, with the config as it was
        if self.stopping:
            return
        candidates = [pid for pid in self.workers if pid in serving] or list(self.workers)
        self.reread(not candidates, self.unrecorded)
        if not candidates:
            self.unrecorded = True
            return
        recorder = min(candidates, key=lambda pid: self.workers[pid].index)
        _signal(recorder, signal.SIGHUP)
        self._send(RELOAD_UNRECORDED, but=recorder)

    def _send(self, signum: int, *, but: int | None = None) -> None:
        for pid in list(self.workers):
            if pid != but:
                _signal(pid, signum)

    def _reap(self) -> None:
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            worker = self.workers.pop(pid, None)
            if worker is not None:
                self._exited(pid, worker, status)

    def _exited(self, pid: int, worker: _Worker, status: int) -> None:
        self.exited(pid)
        how = _how(status)
        if self.stopping:
            self.failed_stop |= status != 0
            log.info("worker_stopped", worker=worker.index, pid=pid, **how)
            return
        quick = self.clock() - worker.started < STEADY_S
        failures = worker.failures + 1 if quick else 0
        delay = min(BACKOFF_FIRST_S * 2 ** (failures - 1), BACKOFF_MAX_S) if failures else 0.0
        log.error("worker_died", worker=worker.index, pid=pid, restart_in_s=delay, **how)
        self.due[worker.index] = (self.clock() + delay, failures)
        self._restart_due()

    def _until_due(self) -> float | None:
        if not self.due:
            return None
        return max(0.0, min(when for when, _ in self.due.values()) - self.clock())

    def _restart_due(self) -> None:
        now = self.clock()
        for index, (when, failures) in list(self.due.items()):
            if when <= now:
                del self.due[index]
                pid = self._spawn(index, failures=failures)
                log.info("worker_restarted", worker=index, pid=pid)


def _child(parent: int, slot: Slot, run: Callable[[Slot], int]) -> None:
    """In a forked worker: never returns."""
    code = 1
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED - RELOADS)
        _die_with_parent(parent)
        structlog.contextvars.bind_contextvars(worker=slot.index)
        code = run(slot)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # a worker must exit, never return into the parent's loop
        log.exception("worker_crashed", worker=slot.index)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _die_with_parent(parent: int) -> None:
    """SIGTERM (a drain) for this worker if the parent dies first (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _read_ready(fd: int) -> bool:
    """True once the worker wrote its byte; False on EOF (it exited first)."""
    try:
        return os.read(fd, 1) == b"1"
    finally:
        os.close(fd)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # exited already; its SIGCHLD is on its way


def _how(status: int) -> dict[str, object]:
    if os.WIFSIGNALED(status):
        return {"signal": signal.Signals(os.WTERMSIG(status)).name}
    return {"exit_code": os.waitstatus_to_exitcode(status)}
