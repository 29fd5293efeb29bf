"""Shared helpers for the bench processes: event loop choice, readiness, and N
processes on one port."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable


def install_loop(use_uvloop: bool = True) -> str:
    """Use uvloop when installed and wanted (like the gateway); return the loop's name."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            return "asyncio"
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        return "uvloop"
    return "asyncio"


Cleanup = Callable[[], Awaitable[None]]


async def serve_until_signalled(start: Callable[[], Awaitable[Cleanup]]) -> None:
    """Run `start()` (returns an async cleanup) until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cleanup = await start()
    try:
        await stop.wait()
    finally:
        await cleanup()


def run_processes(count: int, run: Callable[[], None]) -> None:
    """`run()` in `count` forked processes (each binds its port with SO_REUSEPORT),
    until SIGTERM/SIGINT, which is passed on; with 1, in this process."""
    if count <= 1:
        run()
        return
    handled = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, handled)
    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
            try:
                run()
            finally:
                os._exit(0)
        pids.append(pid)
    signum = signal.sigwait(handled)
    for pid in pids:
        os.kill(pid, signum)
    for pid in pids:
        os.waitpid(pid, 0)
