"""The arq worker of the queue tests: `python -m tests.processes.queue_apps.arq_app`,
configured by the environment (see scenario.py).

arq runs a job again once its in-progress mark has expired (the worker is taken
for dead). The mark normally lives the job timeout plus 10 s; here it lives 2 s
so that a paused worker is given up on soon.
"""

from __future__ import annotations

import os
from typing import Any

from arq import Worker
from arq.connections import RedisSettings

from leases.integrations import TaskGate, TaskRun
from leases.integrations.arq import fenced_job

from . import scenario

IN_PROGRESS_S = 2.0
QUEUE = f"{scenario.PREFIX}arq"

gate = TaskGate(scenario.GATEWAY, ttl=scenario.TTL)


async def transfer_fenced(ctx: dict[str, Any], run: TaskRun, order: int) -> str:
    debit = await run.writer.post(
        "ledger", "/entries", json=scenario.entry(order, "debit"), step="debit"
    )
    scenario.mark("debit", {"pid": os.getpid(), "replayed": debit.replayed})
    if scenario.first_run(order):
        run.check()  # the lease is still ours ...
        scenario.pause_here()  # ... and here the worker stops, past its lease
        lease = run.lease
        # Blocking on purpose: the pause came after the check, the bytes leave now.
        status = scenario.late_credit(order, run.job_id, lease.generation, lease.owner)
        scenario.mark("late", status)
        return "late"
    await run.writer.post("ledger", "/entries", json=scenario.entry(order, "credit"), step="credit")
    return "credited"


async def transfer_plain(ctx: dict[str, Any], order: int) -> str:
    scenario.post(f"{scenario.LEDGER}/entries", scenario.entry(order, "debit"))
    if scenario.first_run(order):
        scenario.pause_here()
    scenario.post(f"{scenario.LEDGER}/entries", scenario.entry(order, "credit"))
    return "credited"


async def transfer(ctx: dict[str, Any], order: int) -> str:
    """The job the test enqueues (arq names it by this function)."""
    if scenario.FENCED:
        return str(await _fenced(ctx, order))
    return await transfer_plain(ctx, order)


_fenced = fenced_job(gate, job_id=scenario.job_id)(transfer_fenced)


def main() -> None:
    worker = Worker(
        functions=[transfer],
        redis_settings=RedisSettings.from_dsn(scenario.REDIS),
        queue_name=QUEUE,
        poll_delay=0.1,
        on_shutdown=gate.on_shutdown,
    )
    worker.in_progress_timeout_s = IN_PROGRESS_S
    worker.run()


if __name__ == "__main__":
    main()
