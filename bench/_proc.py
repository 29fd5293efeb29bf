"""Shared helpers for the bench processes: event loop choice and readiness."""

from __future__ import annotations

import asyncio
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
