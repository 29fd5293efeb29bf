"""The arq example: an order is charged and its receipt booked, under a lease.

    arq examples.arq.jobs.WorkerSettings                       # the worker
    python3 -m examples.arq.producer 1001 1999                 # send one order

arq runs a job again when it believes its worker dead (the job's in-progress
mark expired) and after `Retry`; the lease lets one run write at a time, and the
step keys make a second run's writes replays of the first's.
"""

from __future__ import annotations

import os
from typing import Any

from arq import Retry
from arq.connections import RedisSettings

from leases.integrations import TaskGate, TaskRun
from leases.integrations.arq import fenced_job
from leases.writer import WriteResult

BROKER = os.environ.get("EXAMPLE_BROKER", "redis://127.0.0.1:6379/0")
GATEWAY = os.environ.get("EXAMPLE_GATEWAY", "http://127.0.0.1:8480")

gate = TaskGate(GATEWAY, ttl=10)


# The destination's `retryable_statuses`: such an answer is relayed, not stored.
RETRYABLE = (429, 502, 503, 504)


def booked(result: WriteResult) -> WriteResult:
    # Returning would complete the job with the entry never booked: `Retry` gives
    # the lease back and has arq run the job again (within `max_tries`).
    if result.status in RETRYABLE:
        raise Retry(defer=1)
    return result


@fenced_job(gate, job_id=lambda order_id, amount: f"order-{order_id}")
async def ship_order(ctx: dict[str, Any], run: TaskRun, order_id: int, amount: int) -> dict:
    """Charge the order, then book its receipt: two effects, each at most once."""
    charge = booked(
        await run.writer.post(
            "ledger", "/entries", json={"order": order_id, "charge": amount}, step="charge"
        )
    )
    receipt = booked(
        await run.writer.post(
            "ledger", "/entries", json={"order": order_id, "receipt": True}, step="receipt"
        )
    )
    return {"charge": charge.status, "receipt": receipt.status, "replayed": charge.replayed}


class WorkerSettings:
    """`arq examples.arq.jobs.WorkerSettings`"""

    functions = [ship_order]
    redis_settings = RedisSettings.from_dsn(BROKER)
    on_shutdown = gate.on_shutdown
