"""Celery on real Redis: a message redelivered while its first worker is paused.

Worker A takes the message and stops (SIGSTOP) after its first write, right past
the point where a writer checks its lease. `visibility_timeout` passes, worker B
starts, Celery's Redis transport hands it the unacknowledged message, and B runs
the task again. Then A goes on (SIGCONT) and sends its late write.

With the integration the ledger (the destination's own record) holds each effect
once: B's debit is a replay of A's, and A's late credit is refused by the gateway
(`stale_generation` in the rejection log). Without it, both runs' effects land.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import redis

from leases.writer import derive_key

from .queue_apps.celery_app import VISIBILITY_TIMEOUT
from .queue_stack import REDIS_URL, Stack, queue_stack, stopped

pytestmark = pytest.mark.slow

APP = "tests.processes.queue_apps.celery_app"
SEND = "tests.processes.queue_apps.send"
WORKER = (
    "-m",
    "celery",
    "-A",
    APP,
    "worker",
    "--pool",
    "solo",
    "--loglevel",
    "INFO",
    "--without-mingle",
    "--without-gossip",
    "--without-heartbeat",
)


def overdue(stack: Stack) -> bool:
    """Whether the message worker A took is past `visibility_timeout`: the test the
    Redis transport itself applies before it restores a message to the queue."""
    client = redis.Redis.from_url(REDIS_URL)
    ceiling = time.time() - VISIBILITY_TIMEOUT
    return bool(client.zrangebyscore(f"{stack.prefix}unacked_index", 0, ceiling))


def credits(stack: Stack) -> list[dict[str, object]]:
    return [e for e in stack.entries() if "credit" in e["entry"]]


async def redelivered_while_paused(stack: Stack, mode: str) -> int:
    """Run the scenario up to B's credit; return A's pid, still stopped."""
    stack.start("worker-a", *WORKER, "-n", "a@%h", mode=mode)
    stack.start("send", "-m", SEND, "celery", "1", mode=mode, lasting=False)
    paused = await stack.until(lambda: stack.marks("paused"), "worker A pausing")
    pid_a = int(paused[0])
    await stack.until(lambda: stopped(pid_a), "worker A stopped")
    # A worker starting up restores the messages left unacknowledged for longer
    # than visibility_timeout to the queue: B, once A's message is that old.
    await stack.until(lambda: overdue(stack), "A's message past visibility_timeout")
    stack.start("worker-b", *WORKER, "-n", "b@%h", mode=mode)
    await stack.until(lambda: credits(stack), "worker B's credit")
    return pid_a


async def test_a_redelivered_task_lands_its_effects_once(tmp_path: Path) -> None:
    async with queue_stack(tmp_path) as stack:
        job = f"{stack.prefix}order-1"
        pid_a = await redelivered_while_paused(stack, "fenced")
        os.kill(pid_a, signal.SIGCONT)
        late = await stack.until(lambda: stack.marks("late"), "A's late write")
        assert late == [409]
        # A's run ends without a retry: the store says the job is done (or, had the
        # completion been refused before the watchdog noticed, that a newer run has it).
        log_a = stack.tmp / "worker-a.log"
        ended = await stack.until(
            lambda: re.search(r"task_run_ended.*action=(\w+)", log_a.read_text()), "A's run ending"
        )
        assert ended.group(1) in ("done", "stop"), log_a.read_text()
        entries = stack.entries()
        assert [(sorted(e["entry"]), e["generation"]) for e in entries] == [
            (["debit", "order"], "1"),  # A's, before its pause
            (["credit", "order"], "2"),  # B's; B's debit was a replay of A's
        ], stack.logs()
        assert [m["replayed"] for m in stack.marks("debit")] == [False, True]
        refused = {r["reason"]: r for r in stack.rejections(job)}
        assert sorted(refused) == ["duplicate", "stale_generation"]  # a replay is logged too
        late_one = refused["stale_generation"]
        assert (late_one["generation"], late_one["current_generation"]) == (1, 2)
        assert late_one["idempotency_key"] == derive_key(job, "credit")
        assert refused["duplicate"]["idempotency_key"] == derive_key(job, "debit")


async def test_without_the_integration_the_redelivery_doubles_the_effects(tmp_path: Path) -> None:
    async with queue_stack(tmp_path) as stack:
        pid_a = await redelivered_while_paused(stack, "off")
        os.kill(pid_a, signal.SIGCONT)
        await stack.until(lambda: len(credits(stack)) == 2, "A's late credit")
        kinds = sorted(next(iter(set(e["entry"]) - {"order"})) for e in stack.entries())
        assert kinds == ["credit", "credit", "debit", "debit"]  # the duplicate effect
