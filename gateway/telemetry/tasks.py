"""Background tasks that cannot die unseen (STYLE 15).

A task started beside the app is created through `watched`: when it ends with an
error, the error is logged once, with the task's name, and counted. The janitor
goes further (its crash stops the gateway, see `gateway.app`); a task whose work
is only an aid (a gauge, a wake-up feed) is logged and counted so that an alert
can say it is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

log = structlog.get_logger("gateway.telemetry")


def watched(job: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """Start `job` as a task named `name` whose failure is logged (`side_task_failed`)."""
    task = asyncio.create_task(job, name=name)
    task.add_done_callback(_report)
    return task


def _report(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("side_task_failed", task=task.get_name(), error=repr(exc))
