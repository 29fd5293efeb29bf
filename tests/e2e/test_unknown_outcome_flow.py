"""An unknown outcome from end to end, on SQLite and PostgreSQL: the upstream reads a
write and drops the connection without answering, so the gateway cannot know
whether it was applied. The operator lists the unknown keys, settles one as
applied and one as not applied, and the worker's retries are replayed or
forwarded exactly once; the audit log holds both verdicts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from gateway.admin.app import create_admin_app
from gateway.http.appkeys import METRICS
from tests.harness import Gateway, destination, make_config, running_gateway, served_upstream

TOKEN = "flow-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class DroppingUpstream:
    """Reads each request whole, then drops the connection the first time it sees a
    key (the effect may or may not have happened: here it did not); answers 201 to
    every later request of that key."""

    seen: dict[str, int] = field(default_factory=dict)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        key = request.headers.get("Idempotency-Key", "")
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] == 1:
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0)
            return web.Response(status=200)
        return web.json_response({"id": f"applied-{key}"}, status=201)


@pytest.fixture
async def flow(store_url, tmp_path) -> AsyncIterator[tuple[Gateway, DroppingUpstream, TestClient]]:
    async with served_upstream(DroppingUpstream()) as upstream:
        config = make_config(tmp_path, destination("pay", upstream.url))
        async with running_gateway(config, backend=store_url) as gateway:
            async with _admin(gateway) as admin:
                yield gateway, upstream, admin


def _admin(gateway: Gateway) -> TestClient:
    app = create_admin_app(gateway.store, gateway.app[METRICS], token=TOKEN, gauge_interval=None)
    return TestClient(TestServer(app))


async def resolve(admin: TestClient, key: str, body: dict[str, object]) -> dict[str, object]:
    response = await admin.post(f"/admin/keys/pay/{key}/resolve", json=body, headers=AUTH)
    assert response.status == 200, await response.text()
    return dict(await response.json())


async def test_an_unknown_outcome_is_listed_resolved_both_ways_retried_and_audited(flow):
    gateway, upstream, admin = flow
    generation = await gateway.claim("job-1")
    for key in ("charge-a", "charge-b"):
        status, headers, _ = await gateway.write("/to/pay/charges", generation=generation, key=key)
        assert (status, headers["Sinkgate-Rejected"]) == (502, "upstream_disconnected")
    status, headers, _ = await gateway.write(
        "/to/pay/charges", generation=generation, key="charge-a"
    )
    assert (status, headers["Sinkgate-Rejected"]) == (409, "outcome_unknown")
    assert upstream.seen == {"charge-a": 1, "charge-b": 1}  # the retry was not forwarded

    listed = await admin.get("/admin/keys?state=unknown", headers=AUTH)
    items = {i["key"]: i for i in (await listed.json())["items"]}
    assert set(items) == {"charge-a", "charge-b"}
    assert all(i["state"] == "unknown" and i["job_id"] == "job-1" for i in items.values())

    # The operator checked the destination: charge-a went through, charge-b did not.
    applied = await resolve(
        admin,
        "charge-a",
        {
            "outcome": "applied",
            "attempt": items["charge-a"]["attempt"],
            "note": "destination shows charge ch_a",
            "status": 201,
            "body": '{"id":"ch_a"}',
        },
    )
    assert applied["state"] == "completed"
    released = await resolve(
        admin,
        "charge-b",
        {"outcome": "not_applied", "attempt": items["charge-b"]["attempt"], "note": "no ch_b"},
    )
    assert released["state"] == "released"

    status, headers, body = await gateway.write(
        "/to/pay/charges", generation=generation, key="charge-a"
    )
    assert (status, headers.get("Idempotent-Replayed"), json.loads(body)) == (
        201,
        "true",
        {"id": "ch_a"},
    )
    status, headers, body = await gateway.write(
        "/to/pay/charges", generation=generation, key="charge-b"
    )
    assert (status, json.loads(body)) == (201, {"id": "applied-charge-b"})
    assert "Idempotent-Replayed" not in headers
    status, headers, _ = await gateway.write(
        "/to/pay/charges", generation=generation, key="charge-b"
    )
    assert (status, headers.get("Idempotent-Replayed")) == (201, "true")
    # charge-a was never sent again; charge-b was forwarded exactly once more.
    assert upstream.seen == {"charge-a": 1, "charge-b": 2}

    audit = await (await admin.get("/admin/audit", headers=AUTH)).json()
    assert [(e["action"], e["key"], e["attempt"]) for e in audit["items"]] == [
        ("resolve_not_applied", "charge-b", items["charge-b"]["attempt"]),
        ("resolve_applied", "charge-a", items["charge-a"]["attempt"]),
    ]
    assert audit["items"][1]["note"] == "destination shows charge ch_a"
    metrics = await (await admin.get("/metrics")).text()
    gauge = [
        s.value
        for f in text_string_to_metric_families(metrics)
        if f.name == "sinkgate_unknown_keys"
        for s in f.samples
    ]
    assert gauge == [0.0]  # the queue is empty again
