"""Named operators (SPEC 4 `[admin.operators]`): each token names its person on the
audit row, in the log and on the page; failed admin authentication is throttled
per remote address (issue 36.3), on a clock the test moves."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from gateway.admin.app import create_admin_app
from gateway.admin.throttle import FailureThrottle
from gateway.policy.records import Outcome
from gateway.store.admin_records import AuditQuery
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.metrics import Metrics
from tests.conftest import FakeClock
from tests.e2e.test_admin import CONTEXT, facts

SHARED = "shared-admin-token-0123456789"
OPERATORS = (("alice", "alice-token-0123456789"), ("bob", "bob-token-0123456789abc"))
ALICE = {"Authorization": f"Bearer {OPERATORS[0][1]}"}
BOB = {"Authorization": f"Bearer {OPERATORS[1][1]}"}


@web.middleware
async def remote_from_header(request: web.Request, handler: Any) -> web.StreamResponse:
    """Tests speak from loopback only: `X-Test-Remote` stands for another address."""
    remote = request.headers.get("X-Test-Remote")
    return await handler(request.clone(remote=remote) if remote else request)


@pytest.fixture
async def store(tmp_path, fake_clock: FakeClock) -> AsyncIterator[SQLiteStore]:
    s = await SQLiteStore.open("sqlite:///" + str(tmp_path / "o.db"), clock=fake_clock)
    yield s
    await s.close()


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
async def client(store, metrics, fake_clock) -> AsyncIterator[TestClient]:
    app = create_admin_app(
        store,
        metrics,
        token=SHARED,
        operators=OPERATORS,
        clock=fake_clock,
        gauge_interval=None,
        throttle=FailureThrottle(limit=10, window_s=60),
    )
    app.middlewares.insert(0, remote_from_header)
    async with TestClient(TestServer(app)) as c:
        yield c


async def unknown(store: SQLiteStore, key: str) -> str:
    f = facts("job-1", 1, key)
    verdict = await store.decide_write(f, CONTEXT)
    assert await store.record_outcome(f, verdict.attempt, Outcome("unknown"))
    return str(verdict.attempt)


async def resolve(client: TestClient, key: str, attempt: str, headers: dict[str, str]) -> Any:
    body = {"outcome": "not_applied", "attempt": attempt, "note": f"checked {key}"}
    return await client.post(
        f"/admin/keys/payments/{key}/resolve",
        data=json.dumps(body),
        headers={"Content-Type": "application/json", **headers},
    )


def auth_failures(text: str) -> dict[str, float]:
    return {
        s.labels["result"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "sinkgate_admin_auth_failures"
        for s in family.samples
        if s.name.endswith("_total")
    }


async def test_each_token_names_its_operator_on_the_audit_row_and_the_log(client, store):
    keys = {name: await unknown(store, f"k-{name}") for name in ("alice", "bob", "shared")}
    with capture_logs() as logs:
        for name, headers in (("alice", ALICE), ("bob", BOB)):
            assert (await resolve(client, f"k-{name}", keys[name], headers)).status == 200
        shared = {"Authorization": f"Bearer {SHARED}"}
        assert (await resolve(client, "k-shared", keys["shared"], shared)).status == 200
    entries = await store.list_audit(AuditQuery())
    assert [(e.key, e.operator) for e in entries] == [
        ("k-shared", "admin"),
        ("k-bob", "bob"),
        ("k-alice", "alice"),
    ]
    resolved = [line for line in logs if line["event"] == "key_resolved"]
    assert [line["operator"] for line in resolved] == ["alice", "bob", "admin"]
    answer = await (await client.get("/admin/audit", headers=BOB)).json()
    assert [item["operator"] for item in answer["items"]] == ["admin", "bob", "alice"]


async def test_the_page_says_who_is_signed_in_and_the_audit_view_names_them(client, store):
    attempt = await unknown(store, "k-1")
    signed = await client.post(
        "/admin/login",
        data={"token": OPERATORS[1][1], "next": "/admin/queue"},
        allow_redirects=False,
    )
    assert signed.status == 303
    queue = await (await client.get("/admin/queue")).text()
    assert '<span class="who" id="signed-in">bob</span>' in queue
    assert (await resolve(client, "k-1", attempt, ALICE)).status == 200
    audit = await (await client.get("/admin/audit?format=html")).text()
    assert "<th>operator</th>" in audit and "<td>alice</td>" in audit


async def test_a_session_is_refused_once_its_operator_is_no_longer_configured(
    client, store, metrics, fake_clock
):
    """A cookie names its operator and is signed with a key of every token: the
    same cookie presented to a gateway without that operator is refused."""
    await client.post("/admin/login", data={"token": OPERATORS[0][1]}, allow_redirects=False)
    cookie = client.session.cookie_jar.filter_cookies(client.make_url("/admin/"))
    assert (await client.get("/admin/keys")).status == 200
    without_alice = create_admin_app(
        store, metrics, token=SHARED, operators=OPERATORS[1:], clock=fake_clock, gauge_interval=None
    )
    async with TestClient(TestServer(without_alice)) as other:
        other.session.cookie_jar.update_cookies(cookie)
        assert (await other.get("/admin/keys")).status == 401


async def test_failed_bearer_tokens_are_throttled_per_address(client, metrics, fake_clock):
    wrong = {"Authorization": "Bearer not-the-token", "X-Test-Remote": "203.0.113.9"}
    for _ in range(10):
        assert (await client.get("/admin/keys", headers=wrong)).status == 401
    throttled = await client.get("/admin/keys", headers=wrong)
    assert throttled.status == 429
    assert throttled.headers["Retry-After"] == "60"
    assert (await throttled.json())["reason"] == "unauthorized"
    # Even the right token from that address waits: the window is for guessing.
    right_there = {**ALICE, "X-Test-Remote": "203.0.113.9"}
    assert (await client.get("/admin/keys", headers=right_there)).status == 429
    # The right token from another address is not affected.
    assert (
        await client.get("/admin/keys", headers={**ALICE, "X-Test-Remote": "::1"})
    ).status == 200
    fake_clock.advance(30)
    assert (await client.get("/admin/keys", headers=right_there)).headers["Retry-After"] == "30"
    fake_clock.advance(30)  # the window has passed
    assert (await client.get("/admin/keys", headers=right_there)).status == 200
    counts = auth_failures(metrics.render()[0].decode())
    assert counts == {"refused": 10.0, "throttled": 3.0}


async def test_refused_admin_requests_are_warned_of_at_a_bounded_rate(client):
    """Each refused request was a warning, unthrottled, with the whole path: 500
    random paths, 500 lines; a 7000-character path, a 7 KB line."""
    with capture_logs() as logs:
        for n in range(150):
            assert (await client.get(f"/admin/{n}{'x' * 500}")).status == 401
    warned = [e for e in logs if e["event"] == "admin_unauthorized"]
    assert 100 <= len(warned) < 150  # the burst of 100, then 10 a second
    assert all(len(e["path"]) == 200 for e in warned)


async def test_failed_sign_ins_are_throttled_too(client, fake_clock):
    there = {"X-Test-Remote": "198.51.100.4"}
    for n in range(10):
        refused = await client.post("/admin/login", data={"token": f"guess-{n}"}, headers=there)
        assert refused.status == 401
    throttled = await client.post(
        "/admin/login", data={"token": OPERATORS[0][1]}, headers=there, allow_redirects=False
    )
    assert throttled.status == 429 and throttled.headers["Retry-After"] == "60"
    assert throttled.content_type == "text/html"  # the form again, not a problem document
    assert "try again in 60 s" in await throttled.text()
    fake_clock.advance(60)
    signed = await client.post(
        "/admin/login", data={"token": OPERATORS[0][1]}, headers=there, allow_redirects=False
    )
    assert signed.status == 303
