"""arq on real Redis: a job run again while its first worker is paused.

Two workers serve the queue. The one that takes the job first stops (SIGSTOP)
after its first write, right past the point where a writer checks its lease;
its in-progress mark expires, so arq takes it for dead and the other worker runs
the job again. Then the paused one goes on (SIGCONT) and sends its late write.

With the integration the ledger (the destination's own record) holds each effect
once: the second debit is a replay, and the late credit is refused by the
gateway (`stale_generation` in the rejection log). Without it, both runs' effects land.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from leases.writer import derive_key

from .queue_stack import Stack, queue_stack, stopped

pytestmark = pytest.mark.slow

WORKER = ("-m", "tests.processes.queue_apps.arq_app")
SEND = "tests.processes.queue_apps.send"


def credits(stack: Stack) -> list[dict[str, object]]:
    return [e for e in stack.entries() if "credit" in e["entry"]]


async def run_again_while_paused(stack: Stack, mode: str) -> tuple[int, Path]:
    """Run the scenario up to the second run's credit; return the paused worker's
    pid and log."""
    workers = {stack.start(f"worker-{n}", *WORKER, mode=mode).pid: n for n in "ab"}
    stack.start("send", "-m", SEND, "arq", "1", mode=mode, lasting=False)
    paused = await stack.until(lambda: stack.marks("paused"), "a worker pausing")
    pid = int(paused[0])
    assert pid in workers
    await stack.until(lambda: stopped(pid), "the worker stopped")
    await stack.until(lambda: credits(stack), "the second run's credit")
    return pid, stack.tmp / f"worker-{workers[pid]}.log"


async def test_a_job_run_again_lands_its_effects_once(tmp_path: Path) -> None:
    async with queue_stack(tmp_path) as stack:
        job = f"{stack.prefix}order-1"
        paused, log = await run_again_while_paused(stack, "fenced")
        os.kill(paused, signal.SIGCONT)
        late = await stack.until(lambda: stack.marks("late"), "the late write")
        assert late == [409]
        ended = await stack.until(
            lambda: re.search(r"job_run_ended.*action=(\w+).*job_try=1", log.read_text()),
            "the paused run ending",
        )
        assert ended.group(1) in ("done", "stop"), log.read_text()  # not retried
        entries = stack.entries()
        assert [(sorted(e["entry"]), e["generation"]) for e in entries] == [
            (["debit", "order"], "1"),  # the first run's, before its pause
            (["credit", "order"], "2"),  # the second run's; its debit was a replay
        ], stack.logs()
        assert [m["replayed"] for m in stack.marks("debit")] == [False, True]
        refused = {r["reason"]: r for r in stack.rejections(job)}
        assert sorted(refused) == ["duplicate", "stale_generation"]  # a replay is logged too
        late_one = refused["stale_generation"]
        assert (late_one["generation"], late_one["current_generation"]) == (1, 2)
        assert late_one["idempotency_key"] == derive_key(job, "credit")


async def test_without_the_integration_the_second_run_doubles_the_effects(tmp_path: Path) -> None:
    async with queue_stack(tmp_path) as stack:
        paused, _ = await run_again_while_paused(stack, "off")
        os.kill(paused, signal.SIGCONT)
        await stack.until(lambda: len(credits(stack)) == 2, "the late credit")
        kinds = sorted(next(iter(set(e["entry"]) - {"order"})) for e in stack.entries())
        assert kinds == ["credit", "credit", "debit", "debit"]  # the duplicate effect
