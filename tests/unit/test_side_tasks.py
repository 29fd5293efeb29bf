"""A background task started through `watched` cannot die unseen (STYLE 15)."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from gateway.telemetry.tasks import watched


async def test_a_crashing_side_task_is_logged_with_its_name() -> None:
    """Checked by hand: without the done-callback, nothing is logged."""

    async def crash() -> None:
        raise RuntimeError("boom")

    with capture_logs() as logs:
        task = watched(crash(), "unknown-keys-gauge")
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # the done-callbacks run on the next turn
    assert [(e["event"], e["task"]) for e in logs] == [("side_task_failed", "unknown-keys-gauge")]
    assert "boom" in logs[0]["error"]


async def test_a_cancelled_side_task_is_not_a_failure() -> None:
    with capture_logs() as logs:
        task = watched(asyncio.sleep(10), "gauge")
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
    assert logs == []
