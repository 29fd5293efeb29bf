"""`Prefer: wait` end to end on both stores (SPEC 2 "Waiting"): a write refused for
what is still in flight is held, and decided again as soon as that settles."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web

from gateway.app import WRITES
from gateway.http.appkeys import METRICS
from gateway.policy.decision import Fencing
from gateway.store.records import RejectionQuery
from gateway.write import route as route_module
from gateway.write.line import Decided
from gateway.write.route import WriteGateway
from leases.errors import StoreUnavailable
from tests.harness import (
    Gateway,
    destination,
    eventually,
    make_config,
    running_gateway,
    served_upstream,
)


@dataclass
class HeldUpstream:
    """Holds every request to /hold/NNN until `release` is set, then answers NNN;
    anything else is answered 201 at once (saying it applied `return=minimal`
    when asked). Records the paths and the fencing tokens
    in the order the requests arrived."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    received: list[tuple[str, str]] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.received.append((request.raw_path, request.headers.get("Fencing-Token", "")))
        parts = request.path.split("/")
        if len(parts) > 3 and parts[2] == "hold":
            await asyncio.wait_for(self.release.wait(), 30)
            return web.Response(status=int(parts[3]), text=f"held {len(self.received)}")
        answer = web.json_response({"n": len(self.received)}, status=201)
        if "return=minimal" in request.headers.get("Prefer", ""):
            answer.headers["Preference-Applied"] = "return=minimal"
        if request.path.endswith("/applies-wait"):  # an upstream that reads `wait` too
            answer.headers["Preference-Applied"] = "return=minimal, WAIT=7"
        return answer


@pytest.fixture
async def upstream() -> AsyncIterator[HeldUpstream]:
    async with served_upstream(HeldUpstream()) as up:
        yield up


@pytest.fixture
async def gw(store_url: str, tmp_path: Path, upstream: HeldUpstream) -> AsyncIterator[Gateway]:
    config = make_config(
        tmp_path,
        destination("pay", upstream.url + "/api"),
        destination("mono", upstream.url + "/api", fencing=Fencing.MONOTONIC),
        destination("short", upstream.url + "/api", max_wait=1.0),
        destination("never", upstream.url + "/api", max_wait=0.0),
        max_waiting=2,
    )
    async with running_gateway(config, backend=store_url) as gateway:
        yield gateway
        upstream.release.set()  # held originals end before the gateway stops


def waiting(gw: Gateway) -> int:
    return gw.app[WRITES].waiters.count


async def holding_original(gw: Gateway, upstream: HeldUpstream, path: str) -> asyncio.Task:
    """The original write, forwarded and held by the upstream."""
    original = asyncio.create_task(gw.write(path))
    await eventually(lambda: upstream.received, what="the original's arrival")
    return original


def metric(gw: Gateway, name: str, **labels: str) -> float:
    value = gw.app[METRICS].registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


WAIT = {"Prefer": "wait=10"}


async def test_a_duplicate_waits_for_the_original_and_gets_its_replay(
    gw: Gateway, upstream: HeldUpstream
) -> None:
    await gw.claim("job-1")
    original = await holding_original(gw, upstream, "/to/pay/hold/200")
    with structlog.testing.capture_logs() as logs:
        duplicate = asyncio.create_task(gw.write("/to/pay/hold/200", headers=WAIT))
        await eventually(lambda: waiting(gw) == 1, what="the duplicate waiting")
        upstream.release.set()
        first, second = await original, await duplicate
    assert first[0] == 200 and "Preference-Applied" not in first[1]
    status, headers, body = second
    assert (status, body) == (200, first[2])
    assert headers["Idempotent-Replayed"] == "true"
    assert headers["Preference-Applied"] == "wait=10"
    assert len(upstream.received) == 1  # one request reached the upstream, not two
    assert metric(gw, "sinkgate_waits_total", result="replayed") == 1
    assert metric(gw, "sinkgate_waiting_writes") == 0
    line = next(e for e in logs if e["event"] == "write_decision" and e.get("wait"))
    assert line["decision"] == "replayed" and line["wait"] == "replayed"
    assert line["waited_ms"] > 0 and line["prefer_wait"] == 10


async def test_a_duplicate_of_a_released_original_is_forwarded(
    gw: Gateway, upstream: HeldUpstream
) -> None:
    """The original's 503 releases the key: the waiter is forwarded as if it had
    just arrived (and is relayed the upstream's own answer, not a 409)."""
    await gw.claim("job-1")
    original = await holding_original(gw, upstream, "/to/pay/hold/503")
    duplicate = asyncio.create_task(gw.write("/to/pay/hold/503", headers=WAIT))
    await eventually(lambda: waiting(gw) == 1, what="the duplicate waiting")
    upstream.release.set()
    assert (await original)[0] == 503
    status, headers, _ = await duplicate
    assert status == 503 and "Sinkgate-Rejected" not in headers
    assert headers["Preference-Applied"] == "wait=10"
    assert len(upstream.received) == 2
    assert metric(gw, "sinkgate_waits_total", result="forwarded") == 1


async def test_a_newer_generation_waits_for_the_barrier_then_is_forwarded(
    gw: Gateway, upstream: HeldUpstream
) -> None:
    """The upstream never sees two generations of one job overlap: generation 2
    reaches it only once generation 1's answer is back."""
    original = asyncio.create_task(gw.write("/to/mono/hold/200", generation=1, key="k1"))
    await eventually(lambda: upstream.received, what="generation 1's arrival")
    newer = asyncio.create_task(gw.write("/to/mono/x", generation=2, key="k2", headers=WAIT))
    await eventually(lambda: waiting(gw) == 1, what="generation 2 waiting")
    assert len(upstream.received) == 1
    upstream.release.set()
    assert (await original)[0] == 200
    status, headers, _ = await newer
    assert status == 201 and headers["Preference-Applied"] == "wait=10"
    assert [token for _, token in upstream.received] == ["1", "2"]


async def test_the_wait_ends_at_its_cap_with_the_409(gw: Gateway, upstream: HeldUpstream) -> None:
    await gw.claim("job-1")
    await holding_original(gw, upstream, "/to/pay/hold/200")
    status, headers, body = await gw.write("/to/pay/hold/200", headers={"Prefer": "wait=1"})
    assert status == 409 and headers["Sinkgate-Rejected"] == "request_in_progress"
    assert int(headers["Retry-After"]) >= 1
    assert headers["Preference-Applied"] == "wait=1"
    assert json.loads(body)["rejection_id"] is not None
    assert metric(gw, "sinkgate_waits_total", result="timed_out") == 1
    assert len(upstream.received) == 1


async def test_max_wait_caps_the_preference(gw: Gateway, upstream: HeldUpstream) -> None:
    await gw.claim("job-1")
    await holding_original(gw, upstream, "/to/short/hold/200")
    status, headers, _ = await gw.write("/to/short/hold/200", headers={"Prefer": "wait=600"})
    assert status == 409 and headers["Preference-Applied"] == "wait=1"
    assert metric(gw, "sinkgate_waits_total", result="timed_out") == 1


@pytest.mark.parametrize(
    ("path", "prefer"),
    [
        ("/to/never/hold/200", "wait=10"),  # max_wait = "0s": never waits
        ("/to/pay/hold/200", "wait=0"),
        ("/to/pay/hold/200", "wait=1.5"),
        ("/to/pay/hold/200", "wait=soon"),
        ("/to/pay/hold/200", "respond-async"),
    ],
)
async def test_no_wait_applied_answers_at_once_as_without_the_header(
    gw: Gateway, upstream: HeldUpstream, path: str, prefer: str
) -> None:
    await gw.claim("job-1")
    await holding_original(gw, upstream, path)
    status, headers, _ = await gw.write(path, headers={"Prefer": prefer})
    assert status == 409 and headers["Sinkgate-Rejected"] == "request_in_progress"
    assert "Preference-Applied" not in headers
    assert metric(gw, "sinkgate_waits_total", result="timed_out") == 0


async def test_one_more_than_max_waiting_gets_the_409_at_once(
    gw: Gateway, upstream: HeldUpstream
) -> None:
    await gw.claim("job-1")
    original = await holding_original(gw, upstream, "/to/pay/hold/200")
    held = [asyncio.create_task(gw.write("/to/pay/hold/200", headers=WAIT)) for _ in range(2)]
    await eventually(lambda: waiting(gw) == 2, what="max_waiting writes waiting")
    status, headers, _ = await gw.write("/to/pay/hold/200", headers=WAIT)
    assert status == 409 and headers["Sinkgate-Rejected"] == "request_in_progress"
    assert "Preference-Applied" not in headers  # not applied: the worker's own retry decides
    upstream.release.set()
    await original
    for task in held:
        status, headers, _ = await task
        assert status == 200 and headers["Idempotent-Replayed"] == "true"


async def test_the_woken_writes_of_a_key_are_decided_each_with_its_own_row(
    gw: Gateway, upstream: HeldUpstream, store_url: str
) -> None:
    """Woken together, the held duplicates are decided again together where the
    store can (SQLite: one transaction), each still getting its replay and its
    own `duplicate` row, as if each had just arrived."""
    await gw.claim("job-1")
    original = await holding_original(gw, upstream, "/to/pay/hold/200")
    held = [asyncio.create_task(gw.write("/to/pay/hold/200", headers=WAIT)) for _ in range(2)]
    await eventually(lambda: waiting(gw) == 2, what="both duplicates waiting")
    upstream.release.set()
    first = await original
    for task in held:
        status, headers, body = await task
        assert (status, body) == (200, first[2]) and headers["Idempotent-Replayed"] == "true"
    rows = await gw.store.list_rejections(RejectionQuery(job_id="job-1"))
    assert sorted(r.record.reason for r in rows) == ["duplicate"] * 2 + ["request_in_progress"] * 2
    woken = gw.app[WRITES].woken
    if store_url == "sqlite":
        assert woken is not None and woken.transactions == 1
    else:  # on PostgreSQL every decision rides a batch of the group commit already
        assert woken is None
    assert len(upstream.received) == 1


async def test_the_wake_starts_the_woken_writes_decisions(
    gw: Gateway, upstream: HeldUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settlement itself starts the held writes' decisions (SQLite: in their
    key's group; PostgreSQL: in the next batch), so each held write's own call
    decides it once, before it was held, and it resumes with its verdict."""
    calls = 0
    decide = WriteGateway._decide

    async def counted(self: WriteGateway, *args: Any, **kwargs: Any) -> Decided:
        nonlocal calls
        calls += 1
        return await decide(self, *args, **kwargs)

    monkeypatch.setattr(WriteGateway, "_decide", counted)
    await gw.claim("job-1")
    original = await holding_original(gw, upstream, "/to/pay/hold/200")
    held = [asyncio.create_task(gw.write("/to/pay/hold/200", headers=WAIT)) for _ in range(2)]
    await eventually(lambda: waiting(gw) == 2, what="both duplicates waiting")
    upstream.release.set()
    await original
    for task in held:
        status, headers, _ = await task
        assert status == 200 and headers["Idempotent-Replayed"] == "true"
    assert calls == 1 + 2  # the original, and each held write's first look
    assert gw.app[WRITES].deciding == 0  # each started decision counted out
    assert metric(gw, "sinkgate_store_latency_seconds_count", op="decide") == 5  # each timed


async def test_a_waiter_whose_worker_goes_away_stops_and_changes_nothing(
    gw: Gateway, upstream: HeldUpstream
) -> None:
    await gw.claim("job-1")
    original = await holding_original(gw, upstream, "/to/pay/hold/200")
    async with aiohttp.ClientSession() as session:
        waiter = asyncio.create_task(
            session.post(
                f"{gw.url}/to/pay/hold/200",
                data=b'{"amount": 100}',
                headers={
                    "Content-Type": "application/json",
                    "Fencing-Job": "job-1",
                    "Fencing-Token": "1",
                    "Idempotency-Key": "key-1",
                    **WAIT,
                },
            )
        )
        await eventually(lambda: waiting(gw) == 1, what="the write waiting")
        waiter.cancel()  # the worker goes away: its connection is closed
        await asyncio.gather(waiter, return_exceptions=True)
    await eventually(lambda: waiting(gw) == 0, what="the waiter to stop")
    assert metric(gw, "sinkgate_waits_total", result="disconnected") == 1
    rejections = await gw.store.list_rejections(RejectionQuery(job_id="job-1"))
    assert [r.record.reason for r in rejections] == ["request_in_progress"]  # the first look
    upstream.release.set()
    assert (await original)[0] == 200
    record = await gw.store.key_record("pay", "key-1")
    assert record is not None and record.state == "completed" and record.attempts == 1
    assert len(upstream.received) == 1


async def test_every_answer_to_a_write_whose_wait_applies_says_so(
    gw: Gateway, upstream: HeldUpstream
) -> None:
    """Forwarded at once, replayed, or refused for another reason: the header is there."""
    await gw.claim("job-1")
    forwarded = await gw.write("/to/pay/x", headers=WAIT)
    replayed = await gw.write("/to/pay/x", headers=WAIT)
    stale = await gw.write("/to/pay/x", generation=7, key="other", headers=WAIT)
    assert [r[0] for r in (forwarded, replayed, stale)] == [201, 201, 409]
    assert stale[1]["Sinkgate-Rejected"] == "unknown_generation"
    for _, headers, _ in (forwarded, replayed, stale):
        assert headers["Preference-Applied"] == "wait=10"
    assert metric(gw, "sinkgate_waits_total", result="replayed") == 0  # nothing waited


async def test_the_destinations_own_applied_preferences_are_kept(gw: Gateway) -> None:
    """`Preference-Applied: wait=M` is added after what the destination applied;
    a replay has the destination's only where its `replay_headers` keep it."""
    await gw.claim("job-1")
    prefer = {"Prefer": "return=minimal, wait=10"}
    status, headers, _ = await gw.write("/to/pay/x", key="k", headers=prefer)
    assert status == 201 and headers["Preference-Applied"] == "return=minimal, wait=10"
    status, headers, _ = await gw.write("/to/pay/x", key="k", headers=prefer)
    assert status == 201 and headers["Idempotent-Replayed"] == "true"
    assert headers["Preference-Applied"] == "wait=10"


async def test_a_wait_the_destination_applied_gives_way_to_the_gateways(gw: Gateway) -> None:
    """`Prefer` goes on to the upstream, which may apply a `wait` of its own: the
    answer says the gateway's, once, not `wait=7, wait=10`, whose first a worker
    would read."""
    await gw.claim("job-1")
    prefer = {"Prefer": "return=minimal, wait=10"}
    status, headers, _ = await gw.write("/to/pay/applies-wait", key="k", headers=prefer)
    assert status == 201 and headers["Preference-Applied"] == "return=minimal, wait=10"


async def test_a_store_failure_deciding_a_waiting_write_says_the_wait_applied(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPEC 2: every answer to a write whose `Prefer: wait` is honoured says so,
    the 503 of a store that failed while deciding it too; a write without the
    header gets none."""
    await gw.claim("job-1")

    async def down(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("the store is down")

    monkeypatch.setattr(gw.app[WRITES].store, "decide_write", down)
    status, headers, _ = await gw.write("/to/pay/x", headers=WAIT)
    assert status == 503 and headers["Sinkgate-Rejected"] == "store_unavailable"
    assert headers["Preference-Applied"] == "wait=10"
    status, headers, _ = await gw.write("/to/pay/x", key="key-2")
    assert status == 503 and "Preference-Applied" not in headers


async def test_the_line_of_a_waiting_write_the_store_failed_says_its_wait(
    gw: Gateway, upstream: HeldUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 503 of a store failing while deciding a write under `Prefer: wait` is
    one line like any other decision's: the wait applied, and for a held write
    how its wait ended (`failed`) after how long."""
    await gw.claim("job-1")
    original = await holding_original(gw, upstream, "/to/short/hold/200")

    async def down(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("the store is down")

    with structlog.testing.capture_logs() as logs:
        held = asyncio.create_task(gw.write("/to/short/hold/200", headers=WAIT))
        await eventually(lambda: waiting(gw) == 1, what="the duplicate waiting")
        for verb in ("decide_write", "decide_group"):  # a woken write's goes by either
            monkeypatch.setattr(gw.app[WRITES].store, verb, down, raising=False)
        status, headers, _ = await held  # decided again at its 1 s cap: the store fails
        fresh, _, _ = await gw.write("/to/pay/x", key="key-2", headers=WAIT)
    upstream.release.set()
    await original
    assert (status, headers["Preference-Applied"], fresh) == (503, "wait=1", 503)
    lines = [e for e in logs if e["event"] == "write_decision"]
    assert [e["reason"] for e in lines] == ["store_unavailable"] * 2
    assert lines[0]["prefer_wait"] == 1 and lines[0]["wait"] == "failed"
    assert lines[0]["waited_ms"] >= 1000
    assert lines[1]["prefer_wait"] == 10 and "wait" not in lines[1]


async def test_a_wire_full_after_the_decision_of_a_waiting_write_says_the_wait_applied(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The destination's wire filled while the write was decided (free before, full
    after): its 503 comes after the fence check, and says the wait like the rest."""
    await gw.claim("job-1")
    looks = iter([False, True])
    monkeypatch.setattr(WriteGateway, "_full", lambda self, destination: next(looks))
    status, headers, _ = await gw.write("/to/pay/x", headers=WAIT)
    assert status == 503 and headers["Sinkgate-Rejected"] == "overloaded"
    assert headers["Preference-Applied"] == "wait=10"
    # never sent: no forward's outcome (its reservation was released unsent)
    outcomes = gw.app[METRICS].upstream_outcomes.collect()[0].samples
    assert [s for s in outcomes if s.name.endswith("_total") and s.value] == []


async def test_a_woken_write_counts_its_timeout_from_its_woken_decision(
    gw: Gateway, upstream: HeldUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write held longer than its destination's timeout, then woken to be
    forwarded, is sent: its forward is bounded from the decision the wake
    started, not from its first one (which, counted from, would leave it no time
    and answer it 503). The gateway's clock jumps 30 s while it is held."""
    real = time.perf_counter
    jump = [0.0]
    monkeypatch.setattr(
        route_module, "time", SimpleNamespace(perf_counter=lambda: real() + jump[0])
    )
    await gw.claim("job-1")
    original = await holding_original(gw, upstream, "/to/pay/hold/503")
    duplicate = asyncio.create_task(gw.write("/to/pay/hold/503", headers=WAIT))
    await eventually(lambda: waiting(gw) == 1, what="the duplicate waiting")
    jump[0] = 30.0  # past "pay"'s 5 s since the duplicate's first decision
    upstream.release.set()
    assert (await original)[0] == 503
    status, headers, _ = await duplicate
    assert status == 503 and "Sinkgate-Rejected" not in headers  # the upstream's own
    assert len(upstream.received) == 2
