"""The operator's admin routes over HTTP (SPEC 4 v3): keys, resolve, audit, summary,
relative time filters, the export, the unknown-keys gauge; against a real SQLite
store on a moved clock."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from gateway.admin.app import create_admin_app
from gateway.admin.keys import encode_key_cursor
from gateway.policy.decision import RESERVATION_GRACE_S
from gateway.policy.records import Outcome, RejectionRecord
from gateway.store.admin_records import AuditQuery
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.metrics import Metrics
from tests.conftest import FakeClock
from tests.e2e.test_admin import AUTH, CONTEXT, TOKEN, facts, get_json
from tests.harness import eventually

KEY_FIELDS = {
    "destination", "key", "state", "fingerprint", "attempt", "attempts", "job_id",
    "generation", "owner", "status", "created_at", "updated_at", "deadline", "completed_at",
}  # fmt: skip


@pytest.fixture
async def store(tmp_path, fake_clock: FakeClock) -> AsyncIterator[SQLiteStore]:
    s = await SQLiteStore.open("sqlite:///" + str(tmp_path / "ops.db"), clock=fake_clock)
    yield s
    await s.close()


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
async def client(store: SQLiteStore, metrics: Metrics) -> AsyncIterator[TestClient]:
    app = create_admin_app(store, metrics, token=TOKEN, gauge_interval=None)
    async with TestClient(TestServer(app)) as c:
        yield c


async def unknown(store: SQLiteStore, key: str, job: str = "job-1") -> str:
    f = facts(job, 1, key)
    verdict = await store.decide_write(f, CONTEXT)
    assert await store.record_outcome(f, verdict.attempt, Outcome("unknown"))
    return str(verdict.attempt)


async def post_resolve(client: TestClient, key: str, body: Any, **kw: Any) -> Any:
    headers = {**AUTH, **kw.pop("headers", {})}
    return await client.post(
        f"/admin/keys/payments/{key}/resolve",
        data=body if isinstance(body, bytes | str) else json.dumps(body),
        headers={"Content-Type": "application/json", **headers},
    )


def unknown_gauge(text: str) -> dict[str, float]:
    return {
        s.labels["destination"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "sinkgate_unknown_keys"
        for s in family.samples
    }


# --- keys ------------------------------------------------------------------------------------


async def test_keys_list_with_spec_fields_filters_and_cursor(client, store, fake_clock):
    attempts = []
    for n in range(3):
        attempts.append(await unknown(store, f"k-{n}", job=f"job-{n}"))
        fake_clock.advance(1)
    page = await get_json(client, "/admin/keys?limit=2")
    assert [i["key"] for i in page["items"]] == ["k-2", "k-1"]
    assert KEY_FIELDS <= page["items"][0].keys()
    assert page["items"][0]["attempt"] == attempts[2] and page["items"][0]["state"] == "unknown"
    rest = await get_json(client, f"/admin/keys?limit=2&cursor={page['next_cursor']}")
    assert [i["key"] for i in rest["items"]] == ["k-0"] and rest["next_cursor"] is None
    assert [i["key"] for i in (await get_json(client, "/admin/keys?job_id=job-1"))["items"]] == [
        "k-1"
    ]
    assert (await get_json(client, "/admin/keys?state=in_flight"))["items"] == []
    # Relative times, by the store's clock: updated 1.x s and 2.x s ago.
    recent = await get_json(client, "/admin/keys?since=1.5s")
    assert [i["key"] for i in recent["items"]] == ["k-2"]
    single = await get_json(client, "/admin/keys/payments/k-0")
    assert single["attempt"] == attempts[0]


async def test_a_reservation_past_its_deadline_is_listed_as_unknown(client, store, fake_clock):
    await store.decide_write(facts("job-1", 1, "dead"), CONTEXT)  # its gateway dies
    assert (await get_json(client, "/admin/keys?state=unknown"))["items"] == []
    fake_clock.advance(10 + RESERVATION_GRACE_S + 1)
    [item] = (await get_json(client, "/admin/keys?state=unknown"))["items"]
    assert (item["key"], item["state"]) == ("dead", "unknown")


@pytest.mark.parametrize(
    "query",
    [
        "state=lost",
        "limit=1001",
        "limit=0",
        "cursor=nonsense",
        "since=1y",
        "since=soon",
        "since=1h&until=2h",
        "destination=%20",
        "frobnicate=1",
        "state=unknown&state=completed",
    ],
)
async def test_bad_key_filters_are_400(client, query):
    response = await client.get(f"/admin/keys?{query}", headers=AUTH)
    assert response.status == 400
    assert (await response.json(content_type=None))["reason"] == "invalid_request"


# --- resolve --------------------------------------------------------------------------------


async def test_resolve_applied_then_replayed_and_audited(client, store):
    attempt = await unknown(store, "k-1")
    response = await post_resolve(
        client,
        "k-1",
        {
            "outcome": "applied",
            "attempt": attempt,
            "note": "ledger shows charge ch_9",
            "status": 201,
            "body": '{"id":"ch_9"}',
        },
    )
    assert response.status == 200, await response.text()
    record = await response.json()
    assert (record["state"], record["status"], record["key"]) == ("completed", 201, "k-1")
    assert record["attempt"] != attempt
    [entry] = (await get_json(client, "/admin/audit"))["items"]
    assert (entry["action"], entry["key"], entry["attempt"], entry["note"]) == (
        "resolve_applied",
        "k-1",
        attempt,
        "ledger shows charge ch_9",
    )
    assert entry["remote"] == "127.0.0.1" and entry["at"].endswith("Z")
    again = await post_resolve(
        client, "k-1", {"outcome": "not_applied", "attempt": attempt, "note": "second look"}
    )
    assert again.status == 409
    assert again.headers["Sinkgate-Rejected"] == "key_not_unknown"
    assert (await again.json(content_type=None))["state"] == "completed"


async def test_resolve_not_applied_releases_the_key(client, store):
    attempt = await unknown(store, "k-1")
    body = {"outcome": "not_applied", "attempt": attempt, "note": "no such charge"}
    response = await post_resolve(client, "k-1", body)
    assert response.status == 200
    assert (await response.json())["state"] == "released"
    assert (await client.get("/admin/keys/payments/k-1", headers=AUTH)).status == 404
    missing = await post_resolve(client, "k-1", body)
    assert missing.status == 404


async def test_resolve_of_another_attempt_is_409_attempt_mismatch(client, store):
    attempt = await unknown(store, "k-1")
    response = await post_resolve(
        client, "k-1", {"outcome": "not_applied", "attempt": "0" * 32, "note": "x"}
    )
    assert response.status == 409
    problem = await response.json(content_type=None)
    assert (problem["reason"], problem["attempt"]) == ("attempt_mismatch", attempt)


@pytest.mark.parametrize(
    "path",
    [
        "/admin/keys/payments/a%00b",
        "/admin/keys/%00/k-1",
        "/admin/keys/payments/%00",
        "/admin/keys/pay%20ments/k-1",
        "/admin/keys/payments/k%C3%A9",
    ],
)
async def test_a_key_no_write_could_have_stored_is_not_found_on_every_store(store_backend, path):
    """Looked up, a NUL was a 503 `store_unavailable` on PostgreSQL (its text
    cannot hold one), with the driver's error as the detail and counted as a
    store failure: bad input, not an outage. Now 404 on both stores, as any key
    that no write's checks would have let in."""
    metrics = Metrics()
    app = create_admin_app(store_backend.store, metrics, token=TOKEN, gauge_interval=None)
    resolve = {"outcome": "not_applied", "attempt": "0" * 32, "note": "checked"}
    async with TestClient(TestServer(app)) as client:
        answers = [
            await client.get(path, headers=AUTH),
            await client.get(path + "?format=html", headers=AUTH),
            await client.post(path + "/resolve", json=resolve, headers=AUTH),
        ]
        problem = await answers[0].json(content_type=None)
        scraped = await (await client.get("/metrics")).text()
    assert [a.status for a in answers] == [404, 404, 404]
    assert problem["reason"] == "not_found"
    errors = [
        s.value
        for family in text_string_to_metric_families(scraped)
        if family.name == "sinkgate_store_errors"
        for s in family.samples
        if s.name == "sinkgate_store_errors_total"
    ]
    assert not any(errors)


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        {"outcome": "maybe", "attempt": "A", "note": "x"},
        {"outcome": "applied", "note": "x"},
        {"outcome": "applied", "attempt": "A", "note": ""},
        {"outcome": "applied", "attempt": "A", "note": " "},
        {"outcome": "applied", "attempt": "A", "note": "x" * 1001},
        {"outcome": "applied", "attempt": "A", "note": "bell\x07"},
        {"outcome": "applied", "attempt": "A", "note": "x", "status": 99},
        {"outcome": "applied", "attempt": "A", "note": "x", "status": True},
        {"outcome": "applied", "attempt": "A", "note": "x", "status": "200"},
        {"outcome": "applied", "attempt": "A", "note": "x", "body": 5},
        {"outcome": "applied", "attempt": "A", "note": "x", "status": 204, "body": "x"},
        {"outcome": "applied", "attempt": "A", "note": "x", "status": 304, "body": "{}"},
        {"outcome": "applied", "attempt": "A", "note": "x", "content_type": "a\nb"},
        {"outcome": "not_applied", "attempt": "A", "note": "x", "status": 200},
        {"outcome": "applied", "attempt": "A", "note": "x", "extra": 1},
        '{"outcome": "applied", "attempt": "A", "note": "\\ud800"}',
        b"[" * 5000 + b"]" * 5000,  # deeper than the JSON parser recurses
    ],
)
async def test_bad_resolve_bodies_are_400_and_change_nothing(client, store, body):
    attempt = await unknown(store, "k-1")
    if isinstance(body, dict):
        body = {**body, "attempt": attempt} if "attempt" in body else body
    response = await post_resolve(client, "k-1", body)
    assert response.status == 400, await response.text()
    assert (await response.json(content_type=None))["reason"] == "invalid_request"
    assert (await store.key_record("payments", "k-1")).attempt == attempt
    assert await store.list_audit(AuditQuery()) == []


async def test_fields_that_only_go_with_applied_are_named(client, store):
    attempt = await unknown(store, "k-1")
    for extra, detail in (
        ({"status": 200}, "status only goes with applied"),
        ({"status": 200, "body": "x"}, "body, status only go with applied"),
    ):
        body = {"outcome": "not_applied", "attempt": attempt, "note": "x", **extra}
        response = await post_resolve(client, "k-1", body)
        assert (response.status, (await response.json())["detail"]) == (400, detail)


async def test_a_status_without_content_is_resolved_with_an_empty_body(client, store):
    """A 204 replays no body, so one given with it would be stored and never sent."""
    attempt = await unknown(store, "k-1")
    body = {"outcome": "applied", "attempt": attempt, "note": "x", "status": 204, "body": "x"}
    refused = await post_resolve(client, "k-1", body)
    assert (await refused.json())["detail"] == "a 204 answer has no body: leave body empty"
    response = await post_resolve(client, "k-1", {**body, "body": ""})
    assert (response.status, (await response.json())["status"]) == (200, 204)


async def test_resolve_wants_json(client, store):
    attempt = await unknown(store, "k-1")
    body = json.dumps({"outcome": "not_applied", "attempt": attempt, "note": "x"})
    response = await post_resolve(client, "k-1", body, headers={"Content-Type": "text/plain"})
    assert response.status == 400
    assert await store.key_record("payments", "k-1") is not None


async def test_a_resolve_body_in_a_content_coding_is_refused(client, store):
    attempt = await unknown(store, "k-1")
    body = json.dumps({"outcome": "not_applied", "attempt": attempt, "note": "x"})
    response = await post_resolve(client, "k-1", body, headers={"Content-Encoding": "gzip"})
    assert response.status == 400
    assert "content coding" in (await response.json())["detail"]
    assert await store.key_record("payments", "k-1") is not None
    assert await store.list_audit(AuditQuery()) == []


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/keys"),
        ("POST", "/admin/keys/payments/k-1/resolve"),
        ("GET", "/admin/audit"),
        ("GET", "/admin/summary"),
        ("GET", "/admin/rejections?format=csv"),
        ("GET", "/admin/queue"),
        ("POST", "/admin/queue/resolve"),
    ],
)
async def test_every_new_route_needs_the_token(client, store, method, path):
    attempt = await unknown(store, "k-1")
    body = json.dumps({"outcome": "not_applied", "attempt": attempt, "note": "x"})
    response = await client.request(
        method, path, data=body, headers={"Content-Type": "application/json"}
    )
    assert response.status == 401
    assert await store.key_record("payments", "k-1") is not None


@pytest.mark.parametrize(
    "browser_headers",
    [
        {"Origin": "http://evil.example"},  # a browser without Sec-Fetch-Site
        {"Origin": "null", "Sec-Fetch-Site": "cross-site"},
        {"Origin": "null"},  # a sandboxed frame in a browser without Sec-Fetch-Site
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},  # another port of the same host
    ],
)
async def test_a_cross_site_browser_request_changes_nothing_even_with_credentials(
    client, store, browser_headers
):
    """CSRF: the cookie's SameSite=Strict does not cover another port of the same
    host, and a listener without a token needs no cookie at all; what a browser
    says about where the request comes from does. Refused before anything runs."""
    attempt = await unknown(store, "k-1")
    body = {"outcome": "not_applied", "attempt": attempt, "note": "x"}
    response = await post_resolve(client, "k-1", body, headers=browser_headers)
    assert response.status == 403
    assert (await response.json())["reason"] == "unauthorized"
    assert (await store.key_record("payments", "k-1")).attempt == attempt
    assert await store.list_audit(AuditQuery()) == []


async def test_origin_null_is_the_pages_own_only_where_its_forms_post(client):
    """A browser without Sec-Fetch-Site sends `Origin: null` from the page's own
    forms (no-referrer) and from a sandboxed frame: only the form routes take it."""
    null = {"Origin": "null", **AUTH}
    reload = await client.post("/admin/reload", headers=null)
    assert reload.status == 403
    signed_out = await client.post("/admin/logout", headers=null, allow_redirects=False)
    assert signed_out.status == 303
    login = await client.post("/admin/login", data={"token": "wrong"}, headers={"Origin": "null"})
    assert login.status == 401  # refused for its token, not for where it came from


async def test_the_admin_listeners_own_pages_and_programs_may_post(client, store):
    origin = str(client.make_url("")).rstrip("/")
    for n, headers in enumerate(
        (
            {},  # the CLI, curl: no browser headers
            {"Origin": origin, "Sec-Fetch-Site": "same-origin"},
            # the page's own form under Referrer-Policy: no-referrer (as Chromium sends it)
            {"Origin": "null", "Sec-Fetch-Site": "same-origin"},
            {"Origin": origin},  # a browser without Sec-Fetch-Site
        )
    ):
        attempt = await unknown(store, f"k-{n}")
        body = {"outcome": "not_applied", "attempt": attempt, "note": "x"}
        response = await post_resolve(client, f"k-{n}", body, headers=headers)
        assert response.status == 200, (headers, await response.text())


# --- audit, summary, export, gauge -----------------------------------------------------------


async def test_audit_pages_and_time_filters(client, store, fake_clock):
    for n in range(3):
        await store.record_audit(action="reload", note=f"reload {n}")
        fake_clock.advance(3600)
    page = await get_json(client, "/admin/audit?limit=2")
    assert [e["note"] for e in page["items"]] == ["reload 2", "reload 1"]
    rest = await get_json(client, f"/admin/audit?limit=2&cursor={page['next_cursor']}")
    assert [e["note"] for e in rest["items"]] == ["reload 0"]
    recent = await get_json(client, "/admin/audit?since=90m")
    assert [e["note"] for e in recent["items"]] == ["reload 2"]
    assert (await client.get("/admin/audit?since=later", headers=AUTH)).status == 400
    # each list's cursors are its own: a rejections cursor does not page the audit log
    for n in range(3):
        await store.record_rejection(RejectionRecord(reason="duplicate", detail=f"r{n}"))
    other = (await get_json(client, "/admin/rejections?limit=1"))["next_cursor"]
    assert other is not None
    crossed = await client.get(f"/admin/audit?cursor={other}", headers=AUTH)
    assert crossed.status == 400
    back = await client.get(f"/admin/rejections?cursor={page['next_cursor']}", headers=AUTH)
    assert back.status == 400


async def test_summary_of_the_last_day(client, store, fake_clock):
    for reason in ("stale_generation", "stale_generation", "duplicate"):
        await store.record_rejection(RejectionRecord(reason=reason, detail="", destination="pay"))
        fake_clock.advance(600)
    await unknown(store, "k-1")
    summary = await get_json(client, "/admin/summary")
    assert summary["rejections_by_reason"] == {"duplicate": 1, "stale_generation": 2}
    assert summary["rejections_by_destination"] == {"pay": 3}
    assert summary["keys_by_state"] == {"payments": {"unknown": 1}}
    series = summary["series"]
    assert series["bucket_seconds"] == 600 and len(series["buckets"]) <= 200
    assert sum(sum(b["counts"].values()) for b in series["buckets"]) == 3
    assert series["buckets"][0]["at"] < series["buckets"][-1]["at"]  # oldest first
    assert any(b["counts"] == {} for b in series["buckets"])  # empty buckets included
    hour = await get_json(client, "/admin/summary?since=1h")
    assert sum(hour["rejections_by_reason"].values()) == 3
    assert len(hour["series"]["buckets"]) <= 200
    assert (await client.get("/admin/summary?since=1h&until=2h", headers=AUTH)).status == 400
    for window in ("since=0001-01-01T00:00:00Z", "since=1h&until=9999-12-31T23:59:59Z"):
        answer = await client.get(f"/admin/summary?{window}", headers=AUTH)
        assert answer.status == 400  # was a 500: buckets before year 1 or after 9999
        assert "longer than 100 years" in (await answer.json())["detail"]
    for window in (  # short windows at the edges of the dates that can be named
        "until=0001-01-01T23:59:59Z",
        "until=0001-01-01T00:00:00%2B23:59",
        "since=9999-12-31T00:00:00Z&until=9999-12-31T23:59:59-01:00",
    ):
        answer = await client.get(f"/admin/summary?{window}", headers=AUTH)
        assert answer.status == 400, window  # was a 500: year 0 / year 10000
        assert "outside the years 0001-9999" in (await answer.json())["detail"]
    century = await get_json(client, "/admin/summary?since=1930-01-01T00:00:00Z")
    assert sum(century["rejections_by_reason"].values()) == 3


async def test_rejections_take_relative_times(client, store, fake_clock):
    await store.record_rejection(RejectionRecord(reason="duplicate", detail="old"))
    fake_clock.advance(7200)
    await store.record_rejection(RejectionRecord(reason="duplicate", detail="new"))
    items = (await get_json(client, "/admin/rejections?since=1h"))["items"]
    assert [i["detail"] for i in items] == ["new"]
    items = (await get_json(client, "/admin/rejections?until=1h"))["items"]
    assert [i["detail"] for i in items] == ["old"]
    fake_clock.advance(0.5)
    items = (await get_json(client, "/admin/rejections?since=750ms"))["items"]
    assert [i["detail"] for i in items] == ["new"]  # the config's units, ms too
    assert (await get_json(client, "/admin/rejections?since=250ms"))["items"] == []


async def test_export_streams_every_row_past_1000(client, store):
    for n in range(2100):
        await store.record_rejection(
            RejectionRecord(
                reason="duplicate" if n % 2 else "stale_generation",
                detail=f"row {n}",
                path="=HYPERLINK(1)" if n == 0 else "/x",
            )
        )
    response = await client.get("/admin/rejections?format=csv&reason=duplicate", headers=AUTH)
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(await response.text())))
    assert len(rows) == 1050 and {r["reason"] for r in rows} == {"duplicate"}
    assert rows[0]["detail"] == "row 2099"  # newest first
    everything = await client.get("/admin/rejections?format=ndjson", headers=AUTH)
    lines = (await everything.text()).splitlines()
    assert len(lines) == 2100
    assert json.loads(lines[-1])["detail"] == "row 0"
    one = await client.get("/admin/rejections?format=csv&limit=1", headers=AUTH)
    capped = list(csv.DictReader(io.StringIO(await one.text())))
    assert len(capped) == 1
    oldest = await client.get("/admin/rejections?format=csv", headers=AUTH)
    last = list(csv.DictReader(io.StringIO(await oldest.text())))[-1]
    assert last["path"] == "'=HYPERLINK(1)"  # a spreadsheet shows it as text
    bad = await client.get("/admin/rejections?format=xml", headers=AUTH)
    assert bad.status == 400
    assert (await bad.json())["detail"] == "format must be one of json, csv, ndjson"
    # html only where a page answers it; an empty format is unset, as forms send it
    listed = await client.get("/admin/rejections?format=html", headers=AUTH)
    assert listed.status == 400
    assert (await client.get("/admin/rejections?format=", headers=AUTH)).status == 200
    for path in ("/admin/keys?format=html", "/admin/summary?format=html"):
        answer = await client.get(path, headers=AUTH)
        assert (answer.status, (await answer.json())["detail"]) == (
            400,
            "format must be one of json",
        ), path
    audit = await client.get("/admin/audit?format=csv", headers=AUTH)  # it has a page
    assert (await audit.json())["detail"] == "format must be one of json, html"


async def test_unknown_keys_gauge_follows_the_queue(client, store, metrics):
    attempt = await unknown(store, "k-1")
    await unknown(store, "k-2")
    # The fixture's app has no timer: the resolve itself refreshes the gauge.
    response = await post_resolve(
        client, "k-1", {"outcome": "not_applied", "attempt": attempt, "note": "x"}
    )
    assert response.status == 200
    text = await (await client.get("/metrics")).text()
    assert unknown_gauge(text) == {"payments": 1.0}


async def test_the_gauge_refreshes_on_its_own(tmp_path, fake_clock):
    store = await SQLiteStore.open("sqlite:///" + str(tmp_path / "g.db"), clock=fake_clock)
    metrics = Metrics()
    metrics.destination("emails")  # configured, no unknown key: 0, not "no data"
    try:
        await unknown(store, "k-1")
        app = create_admin_app(store, metrics, token=TOKEN, gauge_interval=0.01)
        async with TestClient(TestServer(app)) as c:

            async def refreshed() -> bool:
                text = await (await c.get("/metrics")).text()
                return unknown_gauge(text) == {"payments": 1.0, "emails": 0.0}

            # The refresher runs every 10 ms; nothing else sets the gauge.
            await eventually(refreshed, what="the unknown-keys gauge to count the key")
    finally:
        await store.close()


@pytest.mark.parametrize(
    "cursor",
    [
        encode_key_cursor(1.0, "payments", "a\x00b"),
        encode_key_cursor(1.0, "payments", "\ud800"),
        encode_key_cursor(1.0, "pay ments", "k-1"),
    ],
    ids=["nul", "lone-surrogate", "space"],
)
async def test_a_cursor_naming_a_key_no_write_could_have_stored_is_400_on_every_store(
    store_backend, cursor
):
    """Such a cursor was a 500 with a traceback on SQLite and a 503 with the
    driver's words on PostgreSQL: no server hands one out."""
    app = create_admin_app(store_backend.store, Metrics(), token=TOKEN, gauge_interval=None)
    async with TestClient(TestServer(app)) as client:
        response = await client.get(f"/admin/keys?cursor={cursor}", headers=AUTH)
        problem = await response.json(content_type=None)
    assert response.status == 400, problem
    assert problem["detail"] == "cursor is not one this server handed out"


@pytest.mark.parametrize(
    "body",
    [
        {"outcome": "applied", "attempt": "A", "note": "x", "content_type": "not a type"},
        {"outcome": "applied", "attempt": "A", "note": "x", "content_type": "json"},
        {"outcome": "applied", "attempt": "A", "note": "checked PSP \u202eEVITAGEN\u202c ok"},
        {"outcome": "applied", "attempt": "A", "note": "next line\x85here"},
        {"outcome": "applied", "attempt": "A", "note": "isolate \u2066x\u2069"},
    ],
    ids=["content-type-words", "content-type-no-slash", "bidi-override", "c1", "bidi-isolate"],
)
async def test_a_content_type_no_header_could_mean_or_a_note_that_reads_otherwise_is_400(
    client, store, body
):
    attempt = await unknown(store, "k-1")
    response = await post_resolve(client, "k-1", {**body, "attempt": attempt})
    assert response.status == 400, await response.text()
    assert (await store.key_record("payments", "k-1")).attempt == attempt
    assert await store.list_audit(AuditQuery()) == []


async def test_a_body_of_a_megabyte_of_non_ascii_text_is_taken_however_it_is_escaped(client, store):
    """`\\u00e9` is six bytes of JSON for two of UTF-8: a body under the limit,
    escaped as the standard library escapes it, was refused 413."""
    attempt = await unknown(store, "k-1")
    body = "é" * (1024 * 1024 // 2)  # 1 MiB of UTF-8
    response = await post_resolve(
        client,
        "k-1",
        json.dumps({"outcome": "applied", "attempt": attempt, "note": "x", "body": body}),
    )
    assert response.status == 200, await response.text()
    assert (await store.key_record("payments", "k-1")).body == body.encode()
