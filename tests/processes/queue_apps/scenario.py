"""The task both queue tests run, and how its first run gets paused.

A transfer is a debit then a credit on the ledger. The first run of a job (counted
in Redis) stops its own process with SIGSTOP after the debit, exactly between
the check a writer makes (is the lease still mine?) and the send of the credit:
the worst place a pause can land, where only the gateway's fence is left. The
test lets the process go on with SIGCONT once a second run has done the job.

Configured by the environment the test gives the worker:
QUEUE_REDIS, QUEUE_PREFIX, QUEUE_GATEWAY, QUEUE_LEDGER, QUEUE_MODE (fenced | off).
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from typing import Any

import redis

from leases.writer import derive_key

REDIS = os.environ.get("QUEUE_REDIS", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("QUEUE_PREFIX", "sinkgate-test:")
GATEWAY = os.environ.get("QUEUE_GATEWAY", "http://127.0.0.1:8480")
LEDGER = os.environ.get("QUEUE_LEDGER", "http://127.0.0.1:9100")
FENCED = os.environ.get("QUEUE_MODE", "fenced") == "fenced"
TTL = 1.0

_marks = redis.Redis.from_url(REDIS)


def mark(name: str, value: object) -> None:
    _marks.rpush(f"{PREFIX}{name}", json.dumps(value))


def first_run(order: int) -> bool:
    return int(_marks.incr(f"{PREFIX}runs:{order}")) == 1


def pause_here() -> None:
    """Tell the test this process is about to stop, then stop it."""
    mark("paused", os.getpid())
    os.kill(os.getpid(), signal.SIGSTOP)


def entry(order: int, kind: str) -> dict[str, Any]:
    return {"order": order, kind: 100}


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> int:
    """A blocking POST: once it is called, the request leaves, whatever else happens."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body, sort_keys=True, separators=(",", ":")).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def late_credit(order: int, job_id: str, generation: int, owner: str) -> int:
    """The credit the writer would send under this lease, sent as it would be: the
    writer's check has passed, the pause comes, then the bytes leave."""
    headers = {
        "Fencing-Job": job_id,
        "Fencing-Token": str(generation),
        "Fencing-Owner": owner,
        "Idempotency-Key": derive_key(job_id, "credit"),
    }
    return post(f"{GATEWAY}/to/ledger/entries", entry(order, "credit"), headers)


def job_id(order: int) -> str:
    return f"{PREFIX}order-{order}"
