"""arq jobs that run under a lease and write through the gateway.

    gate = TaskGate("http://127.0.0.1:8480", ttl=10)

    @fenced_job(gate, job_id=lambda order_id, amount: f"order-{order_id}")
    async def charge(ctx, run, order_id, amount):
        result = await run.writer.post(
            "payments", "/charges", json={"amount": amount}, step="charge"
        )
        if result.status in (429, 502, 503, 504):  # relayed, not stored: nothing done
            raise Retry(defer=1)  # the lease is given back; arq runs the job again
        return result.status

    class WorkerSettings:
        functions = [charge]
        on_shutdown = gate.on_shutdown

(examples/arq has the whole worker.) What ends a run becomes arq's idiom: the
job already completed returns `{"sinkgate": "job_completed", ...}`; a lease held
by another live run raises `Retry(defer=<until it would expire>)`; a newer
generation elsewhere returns `{"sinkgate": "stale_generation", ...}` (this run
stops, no retry: the newer run answers for the job); a lease that ran out with
nobody else on it raises `Retry`.
Needs `pip install 'sinkgate[arq]'`.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from arq import Retry

from ..errors import LeaseError
from ..writer import GatewayUnavailable, StaleWrite
from .gate import TaskGate, job_id_from

__all__ = ["fenced_job", "job_job_id"]

log = structlog.get_logger("leases.integrations.arq")

Job = Callable[..., Awaitable[Any]]


def job_job_id(ctx: dict[str, Any], function: str) -> str:
    """The default job id of a run: `arq:<function>:<arq job id>`, the same for every
    try of one enqueued job (arq keeps its job id across retries)."""
    return job_id_from("arq", function, ctx["job_id"])


def fenced_job(
    gate: TaskGate, *, job_id: Callable[..., object] | None = None
) -> Callable[[Job], Job]:
    """Wrap `async fn(ctx, run, *args, **kwargs)` as an arq job run under a lease.

    `job_id(*args, **kwargs)` names the job from the job's arguments (default:
    `job_job_id`). The body is cancelled with `LeaseLost` when the lease goes.
    """

    def decorate(fn: Job) -> Job:
        @functools.wraps(fn)
        async def job(ctx: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            name = fn.__qualname__
            jid = job_id_from(job_id(*args, **kwargs)) if job_id else job_job_id(ctx, name)
            try:
                async with gate.run(jid) as run:
                    return await fn(ctx, run, *args, **kwargs)
            except (LeaseError, StaleWrite, GatewayUnavailable) as exc:
                found = await gate.verdict(exc, jid)
                if found is None:
                    raise
                log.info(
                    "job_run_ended",
                    function=name,
                    arq_job_id=ctx.get("job_id"),
                    job_try=ctx.get("job_try"),
                    job_id=jid,
                    action=found.action,
                    reason=found.reason,
                )
                if found.action == "retry":
                    raise Retry(defer=found.delay) from exc
                # The code's string, not the enum: arq pickles results, and the
                # enum would reach whoever reads them, printed as its repr.
                return {"sinkgate": str(found.reason), "job_id": jid}

        return job

    return decorate
