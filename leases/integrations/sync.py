"""Task runs for synchronous code (a Celery task, a thread pool worker).

The async client runs on one private event loop per process, in a daemon thread
started on first use (and started again in a forked child, which inherits the
thread's state but not the thread). The task body runs in its own thread, as the
queue called it; while it runs, the loop thread claims the lease, renews it and
sends the writes the body hands over. A synchronous body cannot be cancelled in
the middle, so a lost lease stops it at its next write or `run.check()`: both
raise `LeaseLost`, and no write leaves under a lost lease.

    result = run_sync(gate, "order-1001", charge, 1999)   # charge(run, 1999)
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import inspect
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..hold import HeldLease
from ..writer import WriteResult
from .gate import TaskGate, TaskRun

__all__ = ["SyncRun", "SyncWriter", "close_sync", "run_sync"]

T = TypeVar("T")


class _LoopThread:
    """An event loop running in a daemon thread of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="sinkgate-leases", daemon=True
                )
                thread.start()
                self._loop, self._pid = loop, os.getpid()
            return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        loop = self.loop()
        if _running_loop() is loop:
            coro.close()
            raise RuntimeError("a synchronous task run cannot be started from its own loop")
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


_THREAD = _LoopThread()
_GATES: list[TaskGate] = []


@atexit.register
def _close_gates() -> None:
    """Close what the gates opened on the private loop, so nothing is left unclosed."""
    loop = _THREAD._loop
    if loop is None or _THREAD._pid != os.getpid() or not loop.is_running():
        return

    async def close_all() -> None:
        await asyncio.gather(*(gate.close() for gate in _GATES), return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(close_all(), loop).result(timeout=2.0)
    except (concurrent.futures.TimeoutError, RuntimeError):
        pass  # exiting anyway


class SyncWriter:
    """The run's `FencedWriter`, blocking: each call sends on the private loop."""

    def __init__(self, run: TaskRun) -> None:
        self._run = run

    def post(self, destination: str, path: str = "", **kw: Any) -> WriteResult:
        return self.request("POST", destination, path, **kw)

    def put(self, destination: str, path: str = "", **kw: Any) -> WriteResult:
        return self.request("PUT", destination, path, **kw)

    def patch(self, destination: str, path: str = "", **kw: Any) -> WriteResult:
        return self.request("PATCH", destination, path, **kw)

    def delete(self, destination: str, path: str = "", **kw: Any) -> WriteResult:
        return self.request("DELETE", destination, path, **kw)

    def request(self, method: str, destination: str, path: str = "", **kw: Any) -> WriteResult:
        """`FencedWriter.request`, waited for; `LeaseLost` if the lease is gone."""
        self._run.check()  # before the hop: a lost lease costs no round trip
        return _THREAD.call(self._run.writer.request(method, destination, path, **kw))


class SyncRun:
    """A `TaskRun` for synchronous code: same job id, lease and keys, blocking writer."""

    def __init__(self, run: TaskRun) -> None:
        self.job_id = run.job_id
        self.lease: HeldLease = run.lease
        self.writer = SyncWriter(run)
        self._run = run

    @property
    def generation(self) -> int:
        return self._run.generation

    def key(self, step: str) -> str:
        return self._run.key(step)

    def check(self) -> None:
        """Raise `LeaseLost` if the lease is lost: call it in long loops between writes."""
        self._run.check()


def close_sync(gate: TaskGate) -> None:
    """Close what `gate` opened on the private loop (done at exit in any case)."""
    if _THREAD._loop is not None and _THREAD._pid == os.getpid():
        _THREAD.call(gate.close())


class _BodyFailed(Exception):
    """Carries the body's exception into the hold, so the hold releases the lease."""


def run_sync(gate: TaskGate, job_id: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Run `fn(run, *args, **kw)` under the lease of `job_id`, blocking until done.

    A plain function runs in the calling thread and gets a `SyncRun`; an `async def`
    runs on the private loop, gets a `TaskRun`, and is cancelled when the lease goes.
    Raises what `gate.run()` raises (`LeaseHeld`, `JobCompleted`, `LeaseLost`), else
    the body's own exception.
    """
    if gate not in _GATES:
        _GATES.append(gate)
    if inspect.iscoroutinefunction(fn):

        async def whole() -> Any:
            async with gate.run(job_id) as run:
                return await fn(run, *args, **kw)

        return _THREAD.call(whole())
    return _run_blocking(gate, job_id, fn, args, kw)


def _run_blocking(gate: TaskGate, job_id: str, fn: Callable[..., Any], args: Any, kw: Any) -> Any:
    entered: concurrent.futures.Future[tuple[TaskRun, asyncio.Event]] = concurrent.futures.Future()
    outcome: list[BaseException] = []

    async def holding() -> None:
        async with gate.run(job_id) as run:
            finished = asyncio.Event()
            entered.set_result((run, finished))
            await finished.wait()
            if outcome:
                raise _BodyFailed from outcome[0]

    held = _THREAD.submit(holding())
    either: list[concurrent.futures.Future[Any]] = [entered, held]
    concurrent.futures.wait(either, return_when=concurrent.futures.FIRST_COMPLETED)
    if not entered.done():
        held.result()  # the claim failed: raises LeaseHeld, JobCompleted, ...
    run, finished = entered.result()
    loop = _THREAD.loop()
    try:
        result = fn(SyncRun(run), *args, **kw)
    except BaseException as exc:
        outcome.append(exc)
        loop.call_soon_threadsafe(finished.set)
        try:
            held.result()  # released; a lost lease outranks the body's error: LeaseLost
        except _BodyFailed:
            pass
        raise
    loop.call_soon_threadsafe(finished.set)
    held.result()  # completes the job; LeaseLost if the lease went meanwhile
    return result
