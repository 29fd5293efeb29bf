"""Celery tasks that run under a lease and write through the gateway.

    app = Celery("shop", broker="redis://127.0.0.1:6379/0")
    gate = TaskGate("http://127.0.0.1:8480", ttl=10)

    @fenced_task(
        app,
        gate,
        job_id=lambda order_id, amount: f"order-{order_id}",
        autoretry_for=(UpstreamBusy,),
    )
    def charge(run, order_id, amount):
        result = run.writer.post("payments", "/charges", json={"amount": amount}, step="charge")
        if result.status in (429, 502, 503, 504):  # relayed, not stored: nothing done
            raise UpstreamBusy(result.status)  # the lease is given back; Celery retries
        return result.status

(`UpstreamBusy` is an exception of the program's own; examples/celery has the
whole worker.) The task body gets a `SyncRun` (or a `TaskRun` when it is `async def`, run on the
private loop of `leases.integrations.sync`). What ends a run becomes Celery's idiom:
the job already completed returns `{"sinkgate": "job_completed", ...}` (done,
nothing redone); a lease held by another live run retries after it would expire;
a newer generation elsewhere raises `Ignore` (this run stops, the newer one
answers for the job); a lease that ran out with nobody else on it retries.
Needs `pip install 'sinkgate[celery]'`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import structlog
from celery import Celery, Task  # type: ignore[import-untyped]
from celery.exceptions import Ignore  # type: ignore[import-untyped]

from ..errors import LeaseError
from ..reasons import Reason
from ..writer import GatewayUnavailable, StaleWrite
from .gate import TaskGate, Verdict, job_id_from
from .sync import _THREAD, run_sync

__all__ = ["fenced_task", "task_job_id"]

log = structlog.get_logger("leases.integrations.celery")


def task_job_id(task: Task) -> str:
    """The default job id of a task run: `celery:<task name>:<task id>`. A redelivered
    message and a `retry()` keep the task id, so every run of one message agrees."""
    task_id = task.request.id
    if task_id is None:
        raise ValueError(f"{task.name} was called directly: give fenced_task a job_id")
    return job_id_from("celery", task.name, task_id)


def fenced_task(
    app: Celery,
    gate: TaskGate,
    *,
    job_id: Callable[..., object] | None = None,
    **options: Any,
) -> Callable[[Callable[..., Any]], Task]:
    """Register `fn(run, *args, **kwargs)` as a Celery task run under a lease.

    `job_id(*args, **kwargs)` names the job from the task's arguments (default:
    `task_job_id`, per message). `options` go to `app.task`; `acks_late` and
    `reject_on_worker_lost` default to True, so a worker that dies mid-run leaves
    the message to be redelivered and the lease decides which run may write.
    (With `acks_late` alone, Celery acknowledges the message of a pool process
    that died, killed or out of memory, and the job is never run again. The
    price: a task that kills its process every time is redelivered every time;
    docs/queues.md says how to bound it, or pass `reject_on_worker_lost=False`.)
    """
    options.setdefault("acks_late", True)
    options.setdefault("reject_on_worker_lost", True)

    def decorate(fn: Callable[..., Any]) -> Task:
        @functools.wraps(fn)
        def task(self: Task, *args: Any, **kwargs: Any) -> Any:
            jid = job_id_from(job_id(*args, **kwargs)) if job_id else task_job_id(self)
            try:
                return run_sync(gate, jid, fn, *args, **kwargs)
            except (LeaseError, StaleWrite, GatewayUnavailable) as exc:
                found = _THREAD.call(gate.verdict(exc, jid))
                if found is None:
                    raise
                return _apply(self, found, jid)

        del task.__wrapped__  # Celery checks calls against the task's own signature
        return app.task(bind=True, **options)(task)

    return decorate


def _apply(task: Task, found: Verdict, job_id: str) -> Any:
    log.info(
        "task_run_ended",
        task=task.name,
        task_id=task.request.id,
        job_id=job_id,
        action=found.action,
        reason=found.reason,
    )
    if found.action == "done":
        return {"sinkgate": str(found.reason), "job_id": job_id}
    if found.action == "stop":
        raise Ignore()
    request = task.request
    waits = waits_for_holders(request)
    options: dict[str, Any] = {}
    if request.is_eager:
        pass  # every retry counts: an eager run would otherwise spin on the spot
    elif found.reason == Reason.LEASE_HELD:
        # A held lease has a live holder that renews it: wait for it as long as it
        # takes (its run ends in done or stop), and say how many such waits there
        # were, which Celery counts in `retries` with the others.
        options["max_retries"] = request.retries + 1
        options["headers"] = {**_carried_headers(request), WAITS_HEADER: waits + 1}
    elif task.max_retries is not None and waits:
        # Other retries count against the task's own max_retries, less the waits
        # for holders: a run that waited max_retries times still has them all.
        options["max_retries"] = task.max_retries + waits
        options["headers"] = {**_carried_headers(request), WAITS_HEADER: waits}
    try:
        # No exc=: Celery would pickle it, and lease errors do not round-trip.
        raise task.retry(countdown=found.delay, **options)
    finally:
        # Celery keeps a retry's max_retries on the task object, which every run
        # in the process shares, until an autoretry_for retry reads it there:
        # another message's autoretry would then be bounded by this run's count.
        if "max_retries" in options and hasattr(task, "override_max_retries"):
            del task.override_max_retries


# How many of a message's retries waited for a lease held elsewhere, carried from
# one retry to the next in the message's headers.
WAITS_HEADER = "sinkgate_waits_for_holders"


def _carried_headers(request: Any) -> dict[str, Any]:
    """The headers Celery's own retry carries on to the next message, which leaves
    out what must not be published again (RabbitMQ's `x-death`, whose return
    makes RabbitMQ before 4.0.1 drop the message as a dead-letter cycle)."""
    options = getattr(request, "as_execution_options", None)
    headers = options().get("headers") if callable(options) else getattr(request, "headers", None)
    return dict(headers or {})


def waits_for_holders(request: Any) -> int:
    """The `WAITS_HEADER` count of a task's request (0 when it has none): Celery
    gives a message's custom header as an attribute of the request (`headers`
    holds them too on some versions)."""
    value = getattr(request, WAITS_HEADER, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(WAITS_HEADER)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
