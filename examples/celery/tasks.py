"""The Celery example: an order is charged and its receipt booked, under a lease.

    celery -A examples.celery.tasks worker --loglevel INFO      # the worker
    python3 -m examples.celery.producer 1001 1999               # send one order

A redelivered message (a worker that outlived `visibility_timeout`, or died)
runs the task again; the lease lets one run write at a time, and the step keys
make the second run's writes replays of the first's.
"""

from __future__ import annotations

import os

from celery import Celery

from leases.integrations import SyncRun, TaskGate
from leases.integrations.celery import fenced_task
from leases.writer import WriteResult

BROKER = os.environ.get("EXAMPLE_BROKER", "redis://127.0.0.1:6379/0")
GATEWAY = os.environ.get("EXAMPLE_GATEWAY", "http://127.0.0.1:8480")

app = Celery("shop", broker=BROKER, backend=BROKER)  # results: the producer prints them
app.conf.broker_transport_options = {"visibility_timeout": 60}  # redelivery after 60 s
# The adapter's lines (structlog, on standard output unless configured) at their own
# level: Celery re-logs a task's standard output as WARNING by default.
app.conf.worker_redirect_stdouts_level = "INFO"
gate = TaskGate(GATEWAY, ttl=10)


# The destination's `retryable_statuses`: such an answer is relayed, not stored.
RETRYABLE = (429, 502, 503, 504)


class LedgerBusy(Exception):
    """The ledger's answer was relayed but not stored: nothing was booked."""


def booked(result: WriteResult) -> WriteResult:
    # Returning would complete the job with the entry never booked: raise, so the
    # lease is given back and Celery runs the task again (`autoretry_for`).
    if result.status in RETRYABLE:
        raise LedgerBusy(f"the ledger answered {result.status}")
    return result


@fenced_task(
    app,
    gate,
    job_id=lambda order_id, amount: f"order-{order_id}",
    autoretry_for=(LedgerBusy,),
    retry_backoff=True,
    max_retries=5,
)
def ship_order(run: SyncRun, order_id: int, amount: int) -> dict[str, object]:
    """Charge the order, then book its receipt: two effects, each at most once."""
    charge = booked(
        run.writer.post(
            "ledger", "/entries", json={"order": order_id, "charge": amount}, step="charge"
        )
    )
    receipt = booked(
        run.writer.post(
            "ledger", "/entries", json={"order": order_id, "receipt": True}, step="receipt"
        )
    )
    return {"charge": charge.status, "receipt": receipt.status, "replayed": charge.replayed}
