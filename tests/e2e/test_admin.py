"""The admin listener over HTTP: the rejection log API, job and key views, auth,
health, metrics and the HTML page, against a real SQLite store on a moved clock."""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from gateway.admin.app import admin_bind_allowed, create_admin_app
from gateway.admin.query import encode_cursor
from gateway.policy.decision import Fencing, WriteFacts
from gateway.policy.records import Outcome, RejectionRecord, WriteContext
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.metrics import Metrics
from tests.conftest import FakeClock

TOKEN = "admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ITEM_FIELDS = {
    "id",
    "at",
    "destination",
    "method",
    "path",
    "job_id",
    "generation",
    "owner",
    "idempotency_key",
    "reason",
    "detail",
    "current_generation",
    "highest_generation",
    "remote",
    "body_sha256",
    "body_bytes",
}


def rejection(
    reason: str = "stale_generation",
    *,
    job: str = "job-1",
    destination: str = "payments",
    generation: int = 7,
    current: int | None = 8,
    key: str | None = "key-1",
    path: str = "/charge",
) -> RejectionRecord:
    return RejectionRecord(
        reason=reason,
        detail=f"{reason} for tests",
        destination=destination,
        method="POST",
        path=path,
        job_id=job,
        generation=generation,
        owner="worker-a",
        idempotency_key=key,
        current_generation=current,
        highest_generation=current,
        remote="127.0.0.1",
        body_sha256="ab" * 32,
        body_bytes=12,
    )


def facts(job: str, generation: int, key: str | None, *, fencing: Fencing = Fencing.MONOTONIC):
    return WriteFacts(
        destination="payments",
        method="POST",
        path="/charge",
        query="",
        job_id=job,
        generation=generation,
        owner=None,
        key=key,
        fingerprint="fp-" + (key or ""),
        fencing=fencing,
        upstream_idempotent=False,
        timeout=10.0,
    )


CONTEXT = WriteContext(remote="127.0.0.1", body_sha256="cd" * 32, body_bytes=3)


@pytest.fixture
async def store(tmp_path, fake_clock: FakeClock) -> AsyncIterator[SQLiteStore]:
    s = await SQLiteStore.open("sqlite:///" + str(tmp_path / "g.db"), clock=fake_clock)
    yield s
    if not s._executor._closed:
        await s.close()


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
async def client(store: SQLiteStore, metrics: Metrics) -> AsyncIterator[TestClient]:
    app = create_admin_app(store, metrics, token=TOKEN)
    async with TestClient(TestServer(app)) as c:
        yield c


async def get_json(client: TestClient, url: str, status: int = 200) -> Any:
    response = await client.get(url, headers=AUTH)
    assert response.status == status, await response.text()
    return await response.json(content_type=None)


async def assert_invalid(client: TestClient, url: str) -> dict[str, Any]:
    response = await client.get(url, headers=AUTH)
    assert response.status == 400, await response.text()
    assert response.content_type == "application/problem+json"
    problem = await response.json(content_type=None)
    assert problem["reason"] == "invalid_request"
    assert problem["status"] == 400
    return problem


# --- the list -------------------------------------------------------------------------------


async def test_items_have_exactly_the_spec_fields_newest_first(client, store, fake_clock):
    ids = []
    for reason in ("stale_generation", "lease_expired", "duplicate"):
        ids.append(await store.record_rejection(rejection(reason)))
        fake_clock.advance(1.5)
    page = await get_json(client, "/admin/rejections")
    assert [item["id"] for item in page["items"]] == ids[::-1]
    assert page["next_cursor"] is None
    newest = page["items"][0]
    assert set(newest) == ITEM_FIELDS
    assert newest["reason"] == "duplicate"
    assert newest["at"].endswith("Z")
    at = datetime.fromisoformat(newest["at"].replace("Z", "+00:00"))
    assert at.tzinfo is not None and at.utcoffset().total_seconds() == 0
    assert at.timestamp() == pytest.approx(fake_clock.now - 1.5)
    assert newest["generation"] == 7 and newest["current_generation"] == 8
    assert newest["remote"] == "127.0.0.1" and newest["body_bytes"] == 12


@pytest.fixture
async def mixed(store, fake_clock) -> dict[str, int]:
    """Five rejections a minute apart; returns name -> id."""
    rows = {
        "a": rejection("stale_generation", job="job-a", destination="payments"),
        "b": rejection("lease_expired", job="job-b", destination="payments"),
        "c": rejection("stale_generation", job="job-a", destination="emails"),
        "d": rejection("idempotency_key_reused", job="job-c", destination="emails"),
        "e": rejection("duplicate", job="job-b", destination="payments"),
    }
    ids = {}
    for name, row in rows.items():
        ids[name] = await store.record_rejection(row)
        fake_clock.advance(60)
    return ids


def at(clock_start: float, minute: int) -> str:
    moment = datetime.fromtimestamp(clock_start + 60 * minute, UTC)
    return moment.isoformat().replace("+00:00", "Z")


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("destination=emails", "dc"),
        ("job_id=job-a", "ca"),
        ("reason=stale_generation", "ca"),
        ("reason=duplicate", "e"),
        ("destination=payments&job_id=job-b", "eb"),
        ("since={m2}", "edc"),
        ("until={m1}", "ba"),
        ("since={m1}&until={m3}", "dcb"),
        ("since={m1}&until={m3}&reason=stale_generation", "c"),
        ("job_id=nobody", ""),
    ],
)
async def test_each_filter_narrows_the_list(client, mixed, query, expected):
    start = 1_700_000_000.0
    url = "/admin/rejections?" + query.format(m1=at(start, 1), m2=at(start, 2), m3=at(start, 3))
    page = await get_json(client, url)
    assert [item["id"] for item in page["items"]] == [mixed[name] for name in expected]


async def test_since_accepts_offsets_and_fractions(client, mixed):
    # 2023-11-14T22:13:20Z is the clock's start (minute 0): +01:00 names the same instant.
    page = await get_json(client, "/admin/rejections?since=2023-11-14T23:14:20.000001%2B01:00")
    assert [item["id"] for item in page["items"]] == [mixed["e"], mixed["d"], mixed["c"]]


@pytest.mark.parametrize("limit", ["1", "2", "1000"])
async def test_limit_bounds_accepted(client, mixed, limit):
    page = await get_json(client, f"/admin/rejections?limit={limit}")
    assert len(page["items"]) == min(int(limit), 5)
    assert (page["next_cursor"] is None) == (int(limit) >= 5)


async def test_limit_defaults_to_100(client, store):
    for _ in range(101):
        await store.record_rejection(rejection())
    page = await get_json(client, "/admin/rejections")
    assert len(page["items"]) == 100
    assert page["next_cursor"] is not None


@pytest.mark.parametrize(
    "query",
    [
        "limit=0",
        "limit=1001",
        "limit=-1",
        "limit=abc",
        "limit=1.5",
        "limit=%2B5",
        "limit=99999999999999999999",
        "since=yesterday",
        "since=2024-13-01T00:00:00Z",
        "since=2024-05-01T12:00:00",  # no offset: not RFC 3339
        "since=2024-05-01",
        # Digits of another script: `\d` read them, and datetime took them as ASCII.
        "since=" + quote("٢٠٢٤-05-01T12:00:00Z"),
        "since=" + quote("٣h"),
        "until=2024-02-30T00:00:00Z",
        "until=2024-05-01T25:00:00Z",
        "since=2024-05-02T00:00:00Z&until=2024-05-01T00:00:00Z",
        "cursor=garbage!!",
        "cursor=" + base64.urlsafe_b64encode(b"r1:abc").decode(),
        "cursor=" + base64.urlsafe_b64encode(b"r1:0").decode(),
        "cursor=" + base64.urlsafe_b64encode(b"r1:99999999999999999999").decode(),
        "cursor=" + base64.urlsafe_b64encode(b"42").decode(),
        "cursor=" + "A" * 200,
        "reason=no_such_reason",
        "job_id=has%20space",
        "destination=" + "d" * 300,
        "color=red",
        "limit=5&limit=6",
    ],
)
async def test_malformed_filters_are_400_invalid_request(client, query):
    await assert_invalid(client, "/admin/rejections?" + query)


async def test_rfc3339_leap_seconds_and_long_fractions_are_read(client):
    """RFC 3339 allows second 60 and any number of fraction digits; an offset of
    24 hours is refused without Python's own wording in the detail."""
    for query in ("since=2016-12-31T23:59:60Z", "since=2026-12-01T00:00:00.1234567891Z"):
        response = await client.get("/admin/rejections?" + query, headers=AUTH)
        assert response.status == 200, (query, await response.text())
    bad = await client.get("/admin/rejections?since=2026-12-01T00:00:00%2B24:00", headers=AUTH)
    assert bad.status == 400
    assert "timedelta" not in (await bad.json())["detail"]


async def test_unknown_parameter_is_named_in_the_detail(client):
    problem = await assert_invalid(client, "/admin/rejections?job=job-1")
    assert "job" in problem["detail"]


async def test_empty_values_mean_not_set(client, mixed):
    page = await get_json(client, "/admin/rejections?destination=&job_id=&reason=&since=&limit=")
    assert len(page["items"]) == 5


async def test_pages_stay_consistent_while_rejections_arrive(client, store, fake_clock):
    """Rows that arrive while paging are newer than page one: no row twice, none skipped."""
    for i in range(23):
        await store.record_rejection(rejection(job=f"job-{i}"))
        fake_clock.advance(0.01)
    first = await get_json(client, "/admin/rejections?limit=5")
    top = first["items"][0]["id"]
    seen = [item["id"] for item in first["items"]]
    cursor = first["next_cursor"]
    while cursor is not None:
        # New rejections land concurrently with every page request.
        inserts = [store.record_rejection(rejection("lease_expired")) for _ in range(3)]
        results = await asyncio.gather(
            get_json(client, f"/admin/rejections?limit=5&cursor={cursor}"), *inserts
        )
        page = results[0]
        seen.extend(item["id"] for item in page["items"])
        cursor = page["next_cursor"]
    assert seen == sorted(set(seen), reverse=True)  # newest first, no duplicates
    assert seen == list(range(top, 0, -1))  # nothing older than page one skipped
    assert len(seen) == 23
    newest = await get_json(client, "/admin/rejections?limit=1")
    assert newest["items"][0]["id"] > top  # the concurrent inserts really happened


async def test_cursor_keeps_filters_applied(client, mixed):
    first = await get_json(client, "/admin/rejections?destination=payments&limit=2")
    assert [i["id"] for i in first["items"]] == [mixed["e"], mixed["b"]]
    rest = await get_json(
        client, f"/admin/rejections?destination=payments&limit=2&cursor={first['next_cursor']}"
    )
    assert [i["id"] for i in rest["items"]] == [mixed["a"]]
    assert rest["next_cursor"] is None


# --- one rejection, jobs, keys ------------------------------------------------------------


async def test_one_rejection_by_id(client, mixed):
    item = await get_json(client, f"/admin/rejections/{mixed['d']}")
    assert set(item) == ITEM_FIELDS
    assert item["id"] == mixed["d"] and item["reason"] == "idempotency_key_reused"


@pytest.mark.parametrize("raw", ["999", "0", "abc", "-1", "1.0", "99999999999999999999999"])
async def test_unknown_or_malformed_rejection_id_is_404(client, mixed, raw):
    response = await client.get(f"/admin/rejections/{raw}", headers=AUTH)
    assert response.status == 404
    assert response.content_type == "application/problem+json"
    assert (await response.json(content_type=None))["reason"] == "not_found"


async def test_job_view_shows_lease_mark_in_flight_and_recent_rejections(client, store, fake_clock):
    lease = await store.claim("job-9", owner="worker-a", ttl=30)
    forwarded = await store.decide_write(facts("job-9", 1, "k-1", fencing=Fencing.LEASE), CONTEXT)
    assert forwarded.attempt is not None
    refused = await store.decide_write(facts("job-9", 2, "k-2", fencing=Fencing.LEASE), CONTEXT)
    assert refused.rejection_id is not None
    fake_clock.advance(5)  # the forward's timeout (10 s) has not run out
    job = await get_json(client, "/admin/jobs/job-9")
    assert job["job_id"] == "job-9"
    assert job["lease"] == {
        "job_id": "job-9",
        "owner": "worker-a",
        "generation": lease.generation,
        "state": "active",
        "lease_until": datetime.fromtimestamp(1_700_000_030, UTC)
        .isoformat(timespec="microseconds")
        .replace("+00:00", "Z"),
        "expires_in": 25.0,
    }
    assert job["highest_generation"] == 1
    assert [a["generation"] for a in job["in_flight"]] == [1]
    assert job["in_flight"][0]["key"] == "k-1"
    assert job["in_flight"][0]["deadline"].endswith("Z")
    assert [r["id"] for r in job["recent_rejections"]] == [refused.rejection_id]
    assert job["recent_rejections"][0]["reason"] == "unknown_generation"


async def test_job_known_only_from_rejections_is_shown(client, mixed):
    job = await get_json(client, "/admin/jobs/job-c")
    assert job["lease"] is None and job["highest_generation"] is None
    assert [r["id"] for r in job["recent_rejections"]] == [mixed["d"]]


async def test_a_job_id_with_braces_has_its_view(client, store):
    """aiohttp's default segment pattern left `{` and `}` out of the route: 404."""
    await store.claim("job{7}", owner="w", ttl=30)
    job = await get_json(client, "/admin/jobs/job%7B7%7D")
    assert job["lease"]["job_id"] == "job{7}"


@pytest.mark.parametrize("job", ["never-seen", "%20"])
async def test_unknown_job_is_404(client, job):
    response = await client.get(f"/admin/jobs/{job}", headers=AUTH)
    assert response.status == 404
    assert (await response.json(content_type=None))["reason"] == "not_found"


async def test_key_view_of_a_completed_record_omits_the_body(client, store, fake_clock):
    f = facts("job-1", 1, "order/42")  # a key may hold a slash
    verdict = await store.decide_write(f, CONTEXT)
    fake_clock.advance(2)
    outcome = Outcome(
        "completed", status=201, headers=(("Content-Type", "application/json"),), body=b"{}"
    )
    assert await store.record_outcome(f, verdict.attempt, outcome)
    key = await get_json(client, "/admin/keys/payments/order%2F42")
    assert key == {
        "destination": "payments",
        "key": "order/42",
        "attempt": verdict.attempt,  # SPEC v3: the attempt that holds the key
        "state": "completed",
        "fingerprint": "fp-order/42",
        "status": 201,
        "attempts": 1,
        "job_id": "job-1",
        "generation": 1,
        "owner": None,
        "created_at": "2023-11-14T22:13:20.000000Z",
        "updated_at": "2023-11-14T22:13:22.000000Z",
        "completed_at": "2023-11-14T22:13:22.000000Z",
        "deadline": "2023-11-14T22:13:35.000000Z",
        "response_headers": [["Content-Type", "application/json"]],
        "body_bytes": 2,
        "body_sha256": "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
        "body_omitted": False,
    }
    assert (await get_json(client, "/admin/keys/payments/order/42"))["key"] == "order/42"


async def test_in_flight_key_past_its_deadline_reads_unknown(client, store, fake_clock):
    await store.decide_write(facts("job-1", 1, "k-late"), CONTEXT)
    assert (await get_json(client, "/admin/keys/payments/k-late"))["state"] == "in_flight"
    fake_clock.advance(16)  # timeout 10 s + 5 s grace
    assert (await get_json(client, "/admin/keys/payments/k-late"))["state"] == "unknown"


async def test_unknown_key_is_404(client):
    response = await client.get("/admin/keys/payments/nope", headers=AUTH)
    assert response.status == 404
    assert (await response.json(content_type=None))["reason"] == "not_found"


# --- auth -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": "Bearer tökén"},
    ],
)
@pytest.mark.parametrize(
    "url", ["/admin/rejections", "/admin/rejections/1", "/admin/jobs/j", "/admin/keys/d/k"]
)
async def test_admin_routes_refuse_missing_or_wrong_token(client, mixed, headers, url):
    response = await client.get(url, headers=headers)
    assert response.status == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert response.content_type == "application/problem+json"
    assert (await response.json(content_type=None))["reason"] == "unauthorized"


async def test_right_token_is_accepted_whatever_the_scheme_case(client, mixed):
    response = await client.get("/admin/rejections", headers={"Authorization": f"bearer {TOKEN}"})
    assert response.status == 200


async def test_token_in_query_string_is_not_accepted(client, mixed):
    response = await client.get(f"/admin/rejections?token={TOKEN}")
    assert response.status == 401


@pytest.mark.parametrize("url", ["/healthz", "/readyz", "/metrics"])
async def test_health_and_metrics_need_no_token(client, url):
    response = await client.get(url)
    assert response.status == 200


async def test_the_browsers_icon_request_is_no_error(client):
    response = await client.get("/favicon.ico")
    assert response.status == 204 and await response.read() == b""


async def test_without_a_token_admin_is_open(store, metrics, mixed):
    async with TestClient(TestServer(create_admin_app(store, metrics, token=None))) as c:
        response = await c.get("/admin/rejections")
        assert response.status == 200
        assert len((await response.json())["items"]) == 5


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("evil.example:8481", 403),  # a page whose name was rebound to 127.0.0.1
        ("10.0.0.5:8481", 403),
        ("127.0.0.1:8481", 200),
        ("localhost:8481", 200),
        ("[::1]:8481", 200),
    ],
)
async def test_without_a_token_only_a_loopback_host_name_is_served(
    store, metrics, mixed, host, status
):
    """DNS rebinding: a browser on this machine sends a hostile page's own name as
    Host to the loopback listener; without a token nothing else would stop it (its
    requests are same-origin to the browser)."""
    async with TestClient(TestServer(create_admin_app(store, metrics, token=None))) as c:
        response = await c.get("/admin/rejections", headers={"Host": host})
        assert response.status == status
        response = await c.post("/admin/reload", headers={"Host": host})
        assert (response.status == 403) == (status == 403)
        for path in ("/metrics", "/readyz", "/healthz"):  # a rebound page reads no label
            response = await c.get(path, headers={"Host": host})
            assert response.status == status, path
    async with TestClient(TestServer(create_admin_app(store, metrics, token="t"))) as c:
        response = await c.get(
            "/admin/rejections", headers={"Host": host, "Authorization": "Bearer t"}
        )
        assert response.status == 200  # with a token the name does not matter


@pytest.mark.parametrize(
    ("host", "token", "allowed"),
    [
        ("127.0.0.1", None, True),
        ("127.1.2.3", None, True),
        ("::1", None, True),
        ("[::1]", None, True),
        ("localhost", None, True),
        ("0.0.0.0", None, False),
        ("::", None, False),
        ("10.0.0.5", None, False),
        ("admin.example", None, False),
        ("", None, False),
        ("0.0.0.0", "", False),
        ("0.0.0.0", "t", True),
    ],
)
def test_admin_bind_allowed_only_on_loopback_without_token(host, token, allowed):
    assert admin_bind_allowed(host, token) is allowed


# --- health, metrics, store failures ------------------------------------------------------


async def test_healthz_body(client):
    response = await client.get("/healthz")
    assert await response.json() == {"status": "ok"}


async def test_readyz_and_admin_answer_503_when_the_store_is_closed(client, store, metrics):
    assert (await client.get("/readyz")).status == 200
    await store.close()
    response = await client.get("/readyz")
    assert response.status == 503
    assert response.content_type == "application/problem+json"
    ready = await response.json(content_type=None)
    assert ready["reason"] == "store_unavailable"
    # no token guards it: the store's own words ("store is closed", a driver's
    # naming the database) are logged, not answered
    assert ready["detail"] == "the store does not answer"
    listing = await client.get("/admin/rejections", headers=AUTH)
    assert listing.status == 503
    assert (await listing.json(content_type=None))["reason"] == "store_unavailable"
    assert (await client.get("/healthz")).status == 200  # liveness does not need the store
    assert metrics.store_errors.labels(op="admin")._value.get() == 1


async def test_metrics_after_a_known_sequence(client, metrics, store):
    from gateway.store.janitor import purge_once

    for decision in ("forwarded", "forwarded", "rejected", "replayed"):
        metrics.writes.labels(destination="payments", decision=decision).inc()
    metrics.rejections.labels(reason="stale_generation").inc()
    metrics.upstream_latency.labels(destination="payments").observe(0.02)
    metrics.in_flight.labels(destination="payments").set(3)
    await store.record_rejection(rejection())
    store.clock.advance(8 * 86400)
    assert await purge_once(
        store, metrics, idempotency_ttl=3600, rejections_ttl=86400, audit_ttl=86400
    ) == (0, 1)
    response = await client.get("/metrics")
    assert response.headers["Content-Type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(await response.text())
        for s in family.samples
    }
    writes = "sinkgate_writes_total"
    assert samples[(writes, (("decision", "forwarded"), ("destination", "payments")))] == 2
    assert samples[(writes, (("decision", "rejected"), ("destination", "payments")))] == 1
    assert samples[("sinkgate_rejections_total", (("reason", "stale_generation"),))] == 1
    assert samples[("sinkgate_purged_total", (("kind", "rejections"),))] == 1
    assert samples[("sinkgate_purged_total", (("kind", "idempotency"),))] == 0
    assert samples[("sinkgate_in_flight_writes", (("destination", "payments"),))] == 3
    latency = ("sinkgate_upstream_latency_seconds_count", (("destination", "payments"),))
    assert samples[latency] == 1
    # Known label values are series from the start, at 0: Prometheus' increase()
    # and rate() miss a series' first count when it appears with it (the first
    # failed reload then never fired its alert).
    for name, label, value in [
        ("sinkgate_reloads_total", "result", "failed"),
        ("sinkgate_admin_auth_failures_total", "result", "refused"),
        ("sinkgate_store_retries_total", "op", "decide"),
        ("sinkgate_store_errors_total", "op", "lease_claim"),
        ("sinkgate_rejections_total", "reason", "overloaded"),
        ("sinkgate_rejections_total", "reason", "outcome_unknown"),
        ("sinkgate_waits_total", "result", "timed_out"),
    ]:
        assert samples[(name, ((label, value),))] == 0, (name, value)
    assert ("sinkgate_rejections_total", (("reason", "lease_held"),)) not in samples


@pytest.mark.parametrize(
    "url",
    [
        "/admin/rejections?since=%00",
        "/admin/rejections?cursor=%FF%FE",
        "/admin/rejections?limit=%F0%9F%98%80",
        "/admin/rejections/%00",
        "/admin/rejections/" + "9" * 400,
        "/admin/jobs/" + "j" * 5000,
        "/admin/keys/%00/%00",
        "/admin/keys/payments/" + "k" * 3000,
        "/admin/nothing-here",
        "/admin/?since=bad",
        "/admin/rejections/1?format=pdf",
        "/admin/rejections/abc?format=html",
    ],
)
async def test_no_input_gives_a_500(client, url):
    response = await client.get(url, headers=AUTH)
    assert 400 <= response.status < 500, await response.text()


async def test_wrong_method_is_405_problem(client):
    response = await client.post("/admin/rejections", headers=AUTH)
    assert response.status == 405
    assert (await response.json(content_type=None))["reason"] == "method_not_allowed"


# --- the page, without a browser --------------------------------------------------------------


async def login(client: TestClient, token: str = TOKEN):
    return await client.post(
        "/admin/login", data={"token": token, "next": "/admin/"}, allow_redirects=False
    )


async def test_page_without_token_answers_401_with_a_login_form(client):
    response = await client.get("/admin/")
    assert response.status == 401
    assert response.content_type == "text/html"
    text = await response.text()
    assert 'action="/admin/login"' in text and 'type="password"' in text


async def test_a_token_pasted_with_a_newline_signs_in_as_a_bearer_would(client):
    assert (await login(client, f" {TOKEN}\n")).status == 303
    assert (await login(client, f"{TOKEN}x")).status == 401


async def test_login_sets_a_strict_httponly_cookie_that_opens_the_page(client, mixed):
    response = await login(client)
    assert response.status == 303
    assert response.headers["Location"] == "/admin/"
    cookie = response.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/admin" in cookie
    assert TOKEN not in cookie  # the cookie is a MAC, not the token
    page = await client.get("/admin/")
    assert page.status == 200
    text = await page.text()
    assert text.count('class="rejection"') == 5
    assert "idempotency_key_reused" in text
    assert page.headers["Content-Security-Policy"].startswith("default-src 'none'")
    api = await client.get("/admin/rejections")  # the cookie also opens the JSON a page links to
    assert api.status == 200


async def test_wrong_login_is_refused(client):
    response = await login(client, "not-it")
    assert response.status == 401
    assert "not accepted" in await response.text()
    assert "Set-Cookie" not in response.headers
    assert (await client.get("/admin/")).status == 401


async def test_oversized_or_crowded_login_forms_are_refused_without_a_cookie(client):
    big = await client.post(
        "/admin/login",
        data=b"token=" + b"x" * 9000,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        allow_redirects=False,
    )
    assert big.status == 413 and "Set-Cookie" not in big.headers
    crowded = await client.post(
        "/admin/login",
        data="&".join(f"f{i}=1" for i in range(20)),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        allow_redirects=False,
    )
    assert crowded.status == 400 and "Set-Cookie" not in crowded.headers


async def test_session_cookie_expires(store, metrics, fake_clock, mixed):
    app = create_admin_app(store, metrics, token=TOKEN, clock=fake_clock)
    async with TestClient(TestServer(app)) as c:
        assert (await login(c)).status == 303
        assert (await c.get("/admin/")).status == 200
        fake_clock.advance(12 * 3600 + 1)
        assert (await c.get("/admin/")).status == 401


async def test_forged_cookie_is_refused(client):
    client.session.cookie_jar.update_cookies({"sinkgate_admin": "99999999999.deadbeef"})
    assert (await client.get("/admin/")).status == 401
    nonce = "0123456789abcdef"  # a well-formed session whose MAC is not the token's
    forged = f"99999999999.{nonce}.{'0' * 64}"
    client.session.cookie_jar.update_cookies({"sinkgate_admin": forged})
    assert (await client.get("/admin/")).status == 401


async def test_two_sign_ins_in_one_second_get_sessions_of_their_own(client, mixed):
    """A random nonce in each session: two sign-ins never share a cookie, and so
    never a CSRF token."""
    cookies = set()
    for _ in range(2):
        response = await login(client)
        cookies.add(response.cookies["sinkgate_admin"].value)
    assert len(cookies) == 2


async def test_login_next_cannot_redirect_off_site(client):
    response = await client.post(
        "/admin/login",
        data={"token": TOKEN, "next": "//evil.example/"},
        allow_redirects=False,
    )
    assert response.headers["Location"] == "/admin/"


async def test_signing_in_from_the_sign_in_page_lands_on_the_page(client):
    """The form's `next` is the page it was shown on: on /admin/login itself (where
    signing out leads) it sent a signed-in browser back to the form."""
    form = await (await client.get("/admin/login")).text()
    next_url = re.search(r'name="next" value="([^"]*)"', form).group(1)
    for shown in (next_url, "/admin/logout", "/admin/login?x=1"):
        signed = await client.post(
            "/admin/login", data={"token": TOKEN, "next": shown}, allow_redirects=False
        )
        assert signed.headers["Location"] == "/admin/"
    again = await client.get("/admin/login", allow_redirects=False)
    assert again.status == 303 and again.headers["Location"] == "/admin/"


async def test_a_wrong_token_keeps_the_page_asked_for(client):
    refused = await client.post(
        "/admin/login", data={"token": "no", "next": "/admin/queue?limit=2"}
    )
    assert refused.status == 401
    assert 'name="next" value="/admin/queue?limit=2"' in await refused.text()


async def test_no_admin_answer_is_kept_by_a_cache(client, store):
    """The JSON routes take the page's cookie too: none of their answers is stored
    by a browser or a proxy; the metrics are not operators' data."""
    await store.record_rejection(rejection())
    for path in ("/admin/rejections", "/admin/rejections/1", "/admin/keys", "/admin/audit",
                 "/admin/summary", "/admin/jobs/nosuch", "/admin/"):  # fmt: skip
        answer = await client.get(path, headers=AUTH)
        assert answer.headers.get("Cache-Control") == "no-store", path
    assert "Cache-Control" not in (await client.get("/metrics")).headers


async def test_page_escapes_everything_it_shows(client, store):
    await store.record_rejection(rejection(job="<script>alert(1)</script>", path='/x"><b>'))
    text = await (await client.get("/admin/", headers=AUTH)).text()
    assert "<script>alert" not in text and '"><b>' not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text


async def test_page_filters_and_links(client, mixed):
    response = await client.get("/admin/?reason=stale_generation&limit=1", headers=AUTH)
    text = await response.text()
    assert text.count('class="rejection"') == 1
    assert f'href="/admin/rejections/{mixed["c"]}?format=html"' in text
    assert '<option value="stale_generation" selected>' in text
    cursor = encode_cursor(mixed["c"], "r1:")
    assert f"cursor={cursor}" in text  # the "older" link keeps the filters
    assert re.search(r'href="/admin/\?reason=stale_generation&amp;limit=1&amp;cursor=', text)


async def test_page_shows_a_bad_filter_as_a_400_message(client, mixed):
    response = await client.get("/admin/?since=yesterday", headers=AUTH)
    assert response.status == 400
    assert "RFC 3339" in await response.text()


async def test_detail_page(client, mixed):
    response = await client.get(f"/admin/rejections/{mixed['a']}?format=html", headers=AUTH)
    assert response.status == 200
    text = await response.text()
    assert "stale_generation" in text and 'href="/admin/jobs/job-a?format=html"' in text
    # a fence's refusal reserved nothing: no link to a key record that is not there
    assert "/admin/keys/" not in text
    response = await client.get(f"/admin/rejections/{mixed['e']}?format=html", headers=AUTH)
    assert 'href="/admin/keys/payments/key-1?format=html"' in await response.text()  # a replay


async def test_page_refuses_repeated_filters_like_the_api(client, mixed):
    response = await client.get("/admin/?reason=duplicate&reason=lease_expired", headers=AUTH)
    assert response.status == 400
    assert "given twice" in await response.text()


async def test_open_admin_skips_the_login_form(store, metrics):
    async with TestClient(TestServer(create_admin_app(store, metrics, token=None))) as c:
        response = await c.get("/admin/login", allow_redirects=False)
        assert response.status == 303 and response.headers["Location"] == "/admin/"
        page = await c.get("/admin/")
        assert page.status == 200 and "Sign out" not in await page.text()


async def test_logout_clears_the_session(client, mixed):
    await login(client)
    assert (await client.get("/admin/")).status == 200
    response = await client.post("/admin/logout", allow_redirects=False)
    assert response.status == 303
    assert (await client.get("/admin/")).status == 401
