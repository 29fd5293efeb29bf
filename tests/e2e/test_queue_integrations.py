"""leases.integrations against a real gateway: one task run under a lease, sync and
async, and what ends a run turned into the queue's idiom (Celery run eagerly,
arq's job function called as its worker would)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from leases import JobCompleted, LeaseHeld, LeaseLost, StoreUnavailable
from leases.integrations import (
    SyncRun,
    TaskGate,
    TaskRun,
    close_sync,
    job_id_from,
    run_sync,
    verdict,
)
from leases.writer import DuplicateWrite, GatewayUnavailable, StaleWrite, derive_key
from tests.harness import (
    Gateway,
    RecordingUpstream,
    destination,
    free_port,
    make_config,
    recording_upstream,
    running_gateway,
)


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[tuple[Gateway, RecordingUpstream]]:
    async with recording_upstream() as upstream:
        config = make_config(tmp_path, destination("ledger", upstream.url + "/api"))
        async with running_gateway(config) as gateway:
            yield gateway, upstream


async def state_of(gateway: Gateway, job_id: str) -> tuple[str, int] | None:
    async with gateway.session.get(f"{gateway.url}/leases/{job_id}") as resp:
        doc = await resp.json()
        return (doc["state"], doc["generation"]) if resp.status == 200 else None


def test_job_ids_stay_readable_when_valid_and_are_hashed_when_not() -> None:
    assert job_id_from("celery", "shop.charge", "ab-12") == "celery:shop.charge:ab-12"
    odd = job_id_from("order", "naïve name")
    assert odd == job_id_from("order", "naïve name")  # stable
    assert odd.startswith("order:na_ve_name:") and odd.isascii() and " " not in odd
    assert len(job_id_from("x" * 300)) <= 256
    assert job_id_from("order", 42) == "order:42"
    order = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert job_id_from("order", order) == f"order:{order}"  # a primary key as it prints
    for nothing in (None, True, 4.2, b"x", ["a"]):  # None was the one job "None"
        with pytest.raises(ValueError, match="strings, integers and UUIDs"):
            job_id_from(nothing)
    assert job_id_from("x" * 300) != job_id_from("x" * 301)


def test_lone_surrogates_are_hashed_as_their_own_bytes_not_refused() -> None:
    """JSON may carry `\\ud800` alone: such an id is hashed (as the TypeScript
    `jobIdFrom` does), and two of them stay two ids."""
    a, b = job_id_from("order", "\ud800"), job_id_from("order", "\udbff")
    assert a.startswith("order:_:") and b.startswith("order:_:") and a != b
    assert a != job_id_from("order", "\ufffd")  # not what a replacement would give
    # A pair built of its halves is the character, as in a JavaScript string.
    assert job_id_from("order", "\ud83d\ude00") == job_id_from("order", "😀")
    assert job_id_from("order", "\ude00\ud83d").startswith("order:__:")  # two lone ones


def test_the_integrations_import_no_gateway_and_no_queue_they_are_not_asked_for() -> None:
    code = (
        "import sys, leases.integrations;"
        "assert not {'celery', 'arq'} & set(sys.modules), 'a queue library was imported';"
        "import leases.integrations.celery, leases.integrations.arq;"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'gateway'], 'gateway imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_verdicts_map_each_end_of_a_run_to_one_idiom() -> None:
    assert verdict(JobCompleted("j")).action == "done"  # type: ignore[union-attr]
    held = verdict(LeaseHeld("j", "other", 4.0))
    assert held is not None and (held.action, held.delay) == ("retry", 4.0)
    assert verdict(LeaseLost("j", 1, "stale_generation")).action == "stop"  # type: ignore[union-attr]
    assert verdict(LeaseLost("j", 1, "job_completed")).action == "done"  # type: ignore[union-attr]
    assert verdict(LeaseLost("j", 1, "lease_expired")).action == "retry"  # type: ignore[union-attr]
    assert verdict(StaleWrite("owner_mismatch", 409)).action == "stop"  # type: ignore[union-attr]
    assert verdict(StoreUnavailable("down")).action == "retry"  # type: ignore[union-attr]
    # The writer's "retry later with the same key": the run again, replayed by key.
    for reason in ("gateway_unreachable", "upstream_unreachable", "overloaded"):
        found = verdict(GatewayUnavailable(reason, None))
        assert found is not None and (found.action, found.reason) == ("retry", reason)
    assert verdict(DuplicateWrite("outcome_unknown", 409)) is None  # an operator's
    assert verdict(ValueError("the task's own")) is None


async def test_a_sync_run_writes_fenced_then_completes_the_job(gw: Any) -> None:
    gateway, upstream = gw
    gate = TaskGate(gateway.url, ttl=5)

    def body(run: SyncRun, amount: int) -> tuple[int, str, int]:
        result = run.writer.post("ledger", "/entries", json={"amount": amount}, step="charge")
        return result.status, run.key("charge"), run.generation

    assert await asyncio.to_thread(run_sync, gate, "order-1", body, 5) == (
        201,
        derive_key("order-1", "charge"),
        1,
    )
    sent = upstream.received[0].headers
    assert (sent["Fencing-Token"], sent["Idempotency-Key"]) == (
        "1",
        derive_key("order-1", "charge"),
    )
    assert await state_of(gateway, "order-1") == ("done", 1)
    with pytest.raises(JobCompleted):  # a second run of the job: nothing to redo
        await asyncio.to_thread(run_sync, gate, "order-1", body, 5)
    assert len(upstream.received) == 1
    await asyncio.to_thread(close_sync, gate)


async def test_a_failing_sync_body_releases_the_lease_and_raises_its_error(gw: Any) -> None:
    gateway, _ = gw
    gate = TaskGate(gateway.url, ttl=5)

    def body(run: SyncRun) -> None:
        raise KeyError("the task's own bug")

    with pytest.raises(KeyError):
        await asyncio.to_thread(run_sync, gate, "order-2", body)
    assert await state_of(gateway, "order-2") == ("free", 1)  # another run may take it now


async def test_a_sync_body_is_stopped_at_its_next_write_once_the_lease_is_lost(gw: Any) -> None:
    gateway, upstream = gw
    gate = TaskGate(gateway.url, ttl=5)
    lost = threading.Event()

    def body(run: SyncRun) -> None:
        run.writer.post("ledger", "/entries", json={"n": 1}, step="one")
        run.lease.hold.deadline = 0.0  # the worker's own clock says: run out
        for _ in range(200):  # the watchdog notices within one tick; bounded wait
            if run.lease.hold.lost is not None:
                lost.set()
                break
            threading.Event().wait(0.01)
        run.writer.post("ledger", "/entries", json={"n": 2}, step="two")

    with pytest.raises(LeaseLost) as raised:
        await asyncio.to_thread(run_sync, gate, "order-3", body)
    assert raised.value.reason == "lease_expired"
    assert lost.is_set()
    assert upstream.paths() == ["/api/entries"]  # the second write never left


async def test_an_async_body_on_the_private_loop_is_cancelled_when_the_lease_goes(gw: Any) -> None:
    gateway, _ = gw
    gate = TaskGate(gateway.url, ttl=5)
    reached: list[str] = []

    async def body(run: TaskRun) -> None:
        run.lease.hold.deadline = 0.0
        try:
            await asyncio.sleep(30)
        finally:
            reached.append("cancelled")

    with pytest.raises(LeaseLost):
        await asyncio.to_thread(run_sync, gate, "order-4", body)
    assert reached == ["cancelled"]


async def test_a_locally_expired_lease_taken_over_by_a_newer_run_is_a_stop(gw: Any) -> None:
    gateway, _ = gw
    gate = TaskGate(gateway.url, ttl=5)
    await gateway.claim("order-5", owner="first", ttl=1)
    gateway.clock.advance(2)
    await gateway.claim("order-5", owner="second", ttl=30)
    found = await gate.verdict(LeaseLost("order-5", 1, "lease_expired"), "order-5")
    assert found is not None and (found.action, found.reason) == ("stop", "stale_generation")
    nobody = await gate.verdict(LeaseLost("order-6", 1, "lease_expired"), "order-6")
    assert nobody is not None and nobody.action == "retry"  # nobody took it: try again
    await gate.close()


async def test_celery_maps_completed_held_and_superseded_runs(gw: Any) -> None:
    pytest.importorskip("celery")
    from celery import Celery
    from celery.exceptions import MaxRetriesExceededError

    from leases.integrations.celery import fenced_task

    gateway, upstream = gw
    app = Celery("t", broker="memory://")
    gate = TaskGate(gateway.url, ttl=5)
    test_loop = asyncio.get_running_loop()

    def taken_over(job_id: str) -> None:  # from the task's thread: a newer run claims
        gateway.clock.advance(10)
        asyncio.run_coroutine_threadsafe(gateway.claim(job_id, owner="newer"), test_loop).result()

    @fenced_task(app, gate, job_id=lambda order: f"c-order-{order}", max_retries=0)
    def charge(run: SyncRun, order: int) -> int:
        if order == 3:
            taken_over(run.job_id)
        return run.writer.post("ledger", "/entries", json={"o": order}, step="charge").status

    # A message whose worker died mid-run is redelivered, a killed pool process's
    # too (Celery acknowledges that one under acks_late alone): the lease decides.
    assert (charge.acks_late, charge.reject_on_worker_lost) == (True, True)
    first = await asyncio.to_thread(lambda: charge.apply(args=(1,)))
    again = await asyncio.to_thread(lambda: charge.apply(args=(1,)))
    assert (first.state, first.result) == ("SUCCESS", 201)
    assert (again.state, again.result) == (
        "SUCCESS",
        {"sinkgate": "job_completed", "job_id": "c-order-1"},
    )
    assert type(again.result["sinkgate"]) is str  # the code, not the enum
    await gateway.claim("c-order-2", owner="someone-else", ttl=30)
    held = await asyncio.to_thread(lambda: charge.apply(args=(2,)))
    # eagerly, a retry is run on the spot, and max_retries=0 ends it: it took that path
    assert (held.state, type(held.result)) == ("FAILURE", MaxRetriesExceededError)
    superseded = await asyncio.to_thread(lambda: charge.apply(args=(3,)))
    assert superseded.state == "IGNORED"  # stop: the newer run answers for the job
    assert len(upstream.received) == 1
    await asyncio.to_thread(close_sync, gate)


async def test_arq_maps_completed_and_held_runs(gw: Any) -> None:
    pytest.importorskip("arq")
    from arq import Retry

    from leases.integrations.arq import fenced_job

    gateway, upstream = gw
    gate = TaskGate(gateway.url, ttl=5)

    @fenced_job(gate)
    async def charge(ctx: dict[str, Any], run: TaskRun, order: int) -> int:
        return (await run.writer.post("ledger", "/entries", json={"o": order}, step="c")).status

    ctx = {"job_id": "abc", "job_try": 1}
    name = charge.__qualname__  # how arq names the function, too
    assert await charge(ctx, 1) == 201
    done = await charge(ctx, 1)
    assert done == {"sinkgate": "job_completed", "job_id": f"arq:{name}:abc"}
    # arq pickles results: a plain string, not the enum, is what a reader then sees
    assert type(done["sinkgate"]) is str and repr(done["sinkgate"]) == "'job_completed'"
    await gateway.claim(f"arq:{name}:def", owner="someone-else", ttl=30)
    with pytest.raises(Retry):
        await charge({"job_id": "def", "job_try": 1}, 2)
    assert len(upstream.received) == 1
    await gate.close()


async def test_a_write_the_gateway_could_not_make_is_a_retry_in_both_adapters(
    tmp_path: Path,
) -> None:
    """GatewayUnavailable from a write (here: an upstream that is not there, 502
    upstream_unreachable) is the writer's "retry later with the same key": the
    run again, not the task failed for good."""
    pytest.importorskip("celery")
    pytest.importorskip("arq")
    config = make_config(tmp_path, destination("nowhere", f"http://127.0.0.1:{free_port()}"))
    async with running_gateway(config) as gateway:
        await _retried_in_both(gateway)


async def _retried_in_both(gateway: Gateway) -> None:
    from arq import Retry
    from celery import Celery
    from celery.exceptions import MaxRetriesExceededError

    from leases.integrations.arq import fenced_job
    from leases.integrations.celery import fenced_task

    gate = TaskGate(gateway.url, ttl=5)

    @fenced_job(gate)
    async def book(ctx: dict[str, Any], run: TaskRun) -> int:
        return (await run.writer.post("nowhere", "/x", json={}, step="book")).status

    with pytest.raises(Retry):
        await book({"job_id": "gu", "job_try": 1})
    app = Celery("t", broker="memory://")

    @fenced_task(app, gate, job_id=lambda: "c-gu", max_retries=0)
    def charge(run: SyncRun) -> int:
        return run.writer.post("nowhere", "/x", json={}, step="charge").status

    failed = await asyncio.to_thread(lambda: charge.apply())
    # eagerly a retry runs on the spot, and max_retries=0 ends it: it took that path
    assert (failed.state, type(failed.result)) == ("FAILURE", MaxRetriesExceededError)
    assert (await gateway.store.get("c-gu")).state == "free"  # its lease given back
    await gate.close()
    await asyncio.to_thread(close_sync, gate)


def readme_celery_example() -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "queues.md").read_text(encoding="utf-8")
    marker = text.index("<!-- celery-example")
    match = re.search(r"```python\n(.*?)```", text[marker:], re.S)
    assert match is not None, "the Celery example block is missing"
    return match.group(1)


async def test_the_readme_celery_example_is_a_dozen_lines_and_charges_once(
    tmp_path: Path,
) -> None:
    pytest.importorskip("celery")
    source = readme_celery_example()
    assert len([line for line in source.splitlines() if line.strip()]) <= 12
    async with recording_upstream() as upstream:
        config = make_config(tmp_path, destination("payments", upstream.url + "/api"))
        async with running_gateway(config) as gateway:
            namespace: dict[str, Any] = {"__name__": "readme_example"}
            exec(source.replace("http://127.0.0.1:8480", gateway.url), namespace)
            charge = namespace["charge"]
            for _ in range(2):  # the same order twice: one charge
                await asyncio.to_thread(lambda: charge.apply(args=(1001, 1999)).get())
            assert upstream.paths() == ["/api/charges"]
            await asyncio.to_thread(close_sync, namespace["gate"])


async def test_an_unreachable_gateway_is_a_retry() -> None:
    gate = TaskGate(f"http://127.0.0.1:{free_port()}", ttl=5)  # nothing listens there
    with pytest.raises(StoreUnavailable) as raised:
        async with gate.run("order-9"):
            pytest.fail("the body ran without a lease")
    found = await gate.verdict(raised.value, "order-9")
    assert found is not None and (found.action, found.reason) == ("retry", "store_unavailable")
    await gate.close()


@pytest.mark.parametrize(
    "options",
    [
        {"ttl": True},
        {"ttl": 0.01},
        {"ttl": 10**6},
        {"owner": "bad owner"},
        {"token": "a b"},
        {"lease_token": "\u00e9"},
        {"retry_delay": "1"},
        {"retry_delay": -5},
        {"retry_delay": float("nan")},
    ],
)
def test_a_gates_bad_arguments_are_refused_where_it_is_made(options: dict[str, Any]) -> None:
    """Not at each task's run, where the queue's wrappers would fail every task."""
    with pytest.raises(ValueError):
        TaskGate("http://127.0.0.1:8480", **options)


@pytest.mark.parametrize("store", ["postgresql://postgres@127.0.0.1:{port}/nope", "ftp://x"])
async def test_closing_a_gate_whose_store_never_opened_does_not_raise(store: str) -> None:
    """The worker's shutdown hook raised the opening's error again."""
    gate = TaskGate("http://127.0.0.1:8480", store=store.format(port=free_port()), ttl=5)
    with pytest.raises((StoreUnavailable, ValueError)):
        async with gate.run("order-1"):
            pytest.fail("the body ran without a lease")
    await gate.on_shutdown({})
