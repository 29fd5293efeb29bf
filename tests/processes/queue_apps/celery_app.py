"""The Celery worker of the queue tests: `celery -A tests.processes.queue_apps.celery_app
worker --pool solo`, configured by the environment (see scenario.py).

`visibility_timeout` is short so that a message a paused worker took is handed to
another worker soon: the redelivery Celery's Redis transport is known for.
"""

from __future__ import annotations

import os

from celery import Celery

from leases.integrations import SyncRun, TaskGate
from leases.integrations.celery import fenced_task

from . import scenario

VISIBILITY_TIMEOUT = 2

app = Celery("queue-test", broker=scenario.REDIS)
app.conf.update(
    broker_transport_options={
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "global_keyprefix": scenario.PREFIX,
    },
    task_default_queue=f"{scenario.PREFIX}celery",
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
gate = TaskGate(scenario.GATEWAY, ttl=scenario.TTL)


def transfer_fenced(run: SyncRun, order: int) -> str:
    debit = run.writer.post("ledger", "/entries", json=scenario.entry(order, "debit"), step="debit")
    scenario.mark("debit", {"pid": os.getpid(), "replayed": debit.replayed})
    if scenario.first_run(order):
        run.check()  # the lease is still ours ...
        scenario.pause_here()  # ... and here the worker stops, past its lease
        lease = run.lease
        status = scenario.late_credit(order, run.job_id, lease.generation, lease.owner)
        scenario.mark("late", status)
        return "late"
    run.writer.post("ledger", "/entries", json=scenario.entry(order, "credit"), step="credit")
    return "credited"


def transfer_plain(order: int) -> str:
    scenario.post(f"{scenario.LEDGER}/entries", scenario.entry(order, "debit"))
    if scenario.first_run(order):
        scenario.pause_here()
    scenario.post(f"{scenario.LEDGER}/entries", scenario.entry(order, "credit"))
    return "credited"


if scenario.FENCED:
    transfer = fenced_task(app, gate, job_id=scenario.job_id, name="transfer")(transfer_fenced)
else:
    transfer = app.task(name="transfer", acks_late=True)(transfer_plain)
