"""The whole gateway as `sinkgate serve` runs it, in this process: `serve()` with
its signal handlers, stopped with the SIGTERM an operator would send."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from gateway import app as app_module
from gateway.config.model import Config


@asynccontextmanager
async def served(config: Config) -> AsyncIterator[dict[str, Any]]:
    """Run `serve(config)`; yields what it reports once both listeners are up
    (`listen`, `admin_listen`, ...), then stops it with SIGTERM and waits."""
    ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(app_module.serve(config, started=ready.set_result))
    done, _ = await asyncio.wait({task, ready}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # serve() failed to start: raise its error here
    assert ready in done, "serve() did not start within 30 s"
    try:
        yield ready.result()
    finally:
        # serve() has its handler in place by now, so this stops it, not pytest.
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(task, 30)
