"""The README's example commands work: examples/celery and examples/arq, each a
worker and a producer sending one order twice, against a gateway and the ledger.

The examples take no key prefix (they are meant to be read), so each test uses
a Redis database of its own, emptied of the examples' keys afterwards.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis

from .queue_stack import REDIS_URL, REPO, Stack, queue_stack

pytestmark = pytest.mark.slow


def broker(db: int) -> str:
    return REDIS_URL.rsplit("/", 1)[0] + f"/{db}"


def produce(stack: Stack, module: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", module, "7", "100", "--twice"],
        cwd=REPO,
        env={**stack.env("fenced"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr + stack.logs()
    return done.stdout


def charged_once(stack: Stack, out: str) -> None:
    assert "'charge': 201" in out and "job_completed" in out, out
    assert [sorted(e["entry"]) for e in stack.entries()] == [
        ["charge", "order"],
        ["order", "receipt"],
    ]


def forget(db: int, patterns: tuple[str, ...]) -> None:
    client = redis.Redis.from_url(broker(db))
    for pattern in patterns:
        keys = list(client.scan_iter(match=pattern, count=500))
        if keys:
            client.delete(*keys)


# busy=1: the ledger answers the first charge 503, relayed and not stored; a task
# that returned then would complete the job with nothing charged.
@pytest.mark.parametrize("busy", [0, 1], ids=["ledger-ok", "ledger-busy-once"])
async def test_the_celery_example_charges_an_order_sent_twice_once(
    tmp_path: Path, busy: int
) -> None:
    async with queue_stack(tmp_path, busy=busy) as stack:
        env = {"EXAMPLE_BROKER": broker(14), "EXAMPLE_GATEWAY": stack.gateway}
        try:
            stack.start(
                "celery-example",
                *("-m", "celery", "-A", "examples.celery.tasks", "worker", "--pool", "solo"),
                *("--without-mingle", "--without-gossip", "--without-heartbeat"),
                env=env,
            )
            charged_once(stack, produce(stack, "examples.celery.producer", env))
        finally:
            forget(14, ("celery*", "_kombu*", "unacked*"))


@pytest.mark.parametrize("busy", [0, 1], ids=["ledger-ok", "ledger-busy-once"])
async def test_the_arq_example_charges_an_order_enqueued_twice_once(
    tmp_path: Path, busy: int
) -> None:
    async with queue_stack(tmp_path, busy=busy) as stack:
        env = {"EXAMPLE_BROKER": broker(15), "EXAMPLE_GATEWAY": stack.gateway}
        try:
            stack.start("arq-example", "-m", "arq", "examples.arq.jobs.WorkerSettings", env=env)
            charged_once(stack, produce(stack, "examples.arq.producer", env))
        finally:
            forget(15, ("arq:*",))
