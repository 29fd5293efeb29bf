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
import signal
import time
from pathlib import Path

import pytest

from leases.writer import derive_key

from .queue_apps.celery_app import VISIBILITY_TIMEOUT
from .queue_stack import Stack, poll, queue_stack, stopped

pytestmark = pytest.mark.slow

APP = "tests.processes.queue_apps.celery_app"
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


def redelivered_while_paused(stack: Stack, mode: str) -> int:
    """Run the scenario up to B's credit; return A's pid, still stopped."""
    stack.start("worker-a", *WORKER, "-n", "a@%h", mode=mode)
    stack.start("send", "-m", "tests.processes.queue_apps.send", "celery", "1", mode=mode)
    paused = poll(f"worker A pausing\n{stack.logs()}", lambda: stack.marks("paused") or None)
    pid_a = int(paused[0])
    poll("worker A stopped", lambda: stopped(pid_a) or None)
    # The message stays unacknowledged with A; once visibility_timeout has passed,
    # a worker starting up restores it to the queue.
    time.sleep(VISIBILITY_TIMEOUT + 0.5)
    stack.start("worker-b", *WORKER, "-n", "b@%h", mode=mode)
    poll(
        f"worker B's credit\n{stack.logs()}",
        lambda: [e for e in stack.entries() if "credit" in e["entry"]] or None,
    )
    return pid_a


def test_a_redelivered_task_lands_its_effects_once(tmp_path: Path) -> None:
    with queue_stack(tmp_path) as stack:
        job = f"{stack.prefix}order-1"
        pid_a = redelivered_while_paused(stack, "fenced")
        os.kill(pid_a, signal.SIGCONT)
        late = poll(f"A's late write\n{stack.logs()}", lambda: stack.marks("late") or None)
        assert late == [409]
        # A's run ends by asking the store: the job is done, nothing to retry.
        log_a = stack.tmp / "worker-a.log"
        ended = poll("A's run ending", lambda: "task_run_ended" in log_a.read_text() or None)
        assert ended and "action=done" in log_a.read_text()
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


def test_without_the_integration_the_redelivery_doubles_the_effects(tmp_path: Path) -> None:
    with queue_stack(tmp_path) as stack:
        pid_a = redelivered_while_paused(stack, "off")
        os.kill(pid_a, signal.SIGCONT)
        poll(
            "A's late credit",
            lambda: len([e for e in stack.entries() if "credit" in e["entry"]]) == 2 or None,
        )
        kinds = sorted(next(iter(set(e["entry"]) - {"order"})) for e in stack.entries())
        assert kinds == ["credit", "credit", "debit", "debit"]  # the duplicate effect
