"""The operator's page over HTTP with a signed-in session: the glance, presets and
auto-refresh, the queue's resolve form (CSRF token + SameSite cookie), and the
HTML views of a key, a job and the audit log."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.admin.app import create_admin_app
from gateway.admin.page.operator import _rounded
from gateway.admin.query import utc_time
from gateway.policy.decision import KeyState
from gateway.policy.records import Outcome, RejectionRecord
from gateway.store.admin_records import AuditQuery
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.metrics import Metrics
from tests.e2e.test_admin import CONTEXT, TOKEN, facts

HOSTILE_KEY = '<script>alert("k")</script>'


@pytest.fixture
async def store(tmp_path, fake_clock) -> AsyncIterator[SQLiteStore]:
    s = await SQLiteStore.open("sqlite:///" + str(tmp_path / "p.db"), clock=fake_clock)
    for key in ("lost-1", HOSTILE_KEY):
        f = facts("job-1", 1, key)
        verdict = await s.decide_write(f, CONTEXT)
        await s.record_outcome(f, verdict.attempt, Outcome("unknown"))
    for reason in ("stale_generation", "stale_generation", "duplicate"):
        await s.record_rejection(RejectionRecord(reason=reason, detail="", job_id="job-1"))
        fake_clock.advance(120)
    yield s
    await s.close()


@pytest.fixture
async def browser(store) -> AsyncIterator[TestClient]:
    """A client holding the session cookie, as a signed-in browser does."""
    app = create_admin_app(store, Metrics(), token=TOKEN, gauge_interval=None)
    async with TestClient(TestServer(app)) as client:
        signed = await client.post(
            "/admin/login", data={"token": TOKEN, "next": "/admin/"}, allow_redirects=False
        )
        assert signed.status == 303
        cookie = signed.headers["Set-Cookie"]
        assert "SameSite=Strict" in cookie and "HttpOnly" in cookie
        yield client


def form_fields(page: str, key: str) -> dict[str, str]:
    """The hidden fields of the resolve form of `key` (as the page escaped it)."""
    start = page.index(f'data-key="{key}"')
    form = page[start : page.index("</form>", start)]
    return dict(re.findall(r'type="hidden" name="(\w+)" value="([^"]*)"', form))


async def test_the_glance_presets_and_auto_refresh(browser):
    page = await (await browser.get("/admin/")).text()
    assert '<svg id="chart"' in page and "<script" not in page
    # A replay (duplicate) is an answer from the store, not a rejection: apart.
    assert re.search(r'id="total">2<', page) and re.search(r'id="replays">1<', page)
    assert re.search(r'id="unknown-count">2<', page)
    assert "stale_generation <b>2</b>" in page
    for preset in ("15m", "1h", "24h", "7d"):
        assert f"since={preset}" in page
    assert 'http-equiv="refresh"' not in page
    refreshing = await (await browser.get("/admin/?since=5m&refresh=30")).text()
    assert '<meta http-equiv="refresh" content="30">' in refreshing
    assert re.search(r'id="total">1<', refreshing)  # the last 5 minutes only
    assert re.search(r'id="replays">1<', refreshing)
    assert "auto-refresh: on" in refreshing


async def test_a_since_at_the_edge_of_the_dates_still_draws_the_page(browser):
    """An offset that puts `since` before year 1 in UTC: the chart falls back to the
    last 24 hours instead of failing to name its first bucket (a 500 before)."""
    answer = await browser.get("/admin/?since=0001-01-01T00:00:00%2B01:00")
    assert answer.status == 200
    assert '<svg id="chart"' in await answer.text()


async def test_the_glance_says_which_window_it_counts(browser, fake_clock):
    """The glance counted the last 24 hours under the words of whatever `since` the
    listing was given (`in the last 100000d`, `in the last "><b>`), and ignored
    `until`; it now counts the listing's window and says which."""

    def total(page: str) -> int:
        return int(re.search(r'id="total">(\d+)<', page).group(1))

    day = await (await browser.get("/admin/")).text()
    assert "rejections in the last 24h<" in day and total(day) == 2
    for unread in ("100000d", "%22%3E%3Cb%3E"):
        page = await (await browser.get(f"/admin/?since={unread}")).text()
        assert "rejections in the last 24h<" in page and total(page) == 2
    start = fake_clock() - 360  # the fixture's rejections: at start, +120 s and +240 s
    until = start + 60  # the first stale_generation only
    since_text = utc_time(start - 10).replace("+00:00", "Z")
    until_text = utc_time(until)
    both = await (
        await browser.get("/admin/", params={"since": since_text, "until": until_text})
    ).text()
    assert re.search(r"rejections from \d{4}-\d\d-\d\d \d\d:\d\d to [^<]+ UTC<", both)
    assert total(both) == 1
    since_only = await (await browser.get("/admin/", params={"since": since_text})).text()
    assert re.search(r"rejections since \d{4}-\d\d-\d\d \d\d:\d\d UTC<", since_only)
    assert total(since_only) == 2


def test_a_zoomed_span_reads_in_its_largest_unit():
    assert [_rounded(s) for s in (30, 600, 7300, 3069 * 60, 3 * 86400)] == [
        "1m", "10m", "2h", "2d", "3d",
    ]  # fmt: skip


async def test_the_queue_escapes_what_workers_sent(browser):
    page = await (await browser.get("/admin/queue")).text()
    assert HOSTILE_KEY not in page
    assert "&lt;script&gt;" in page
    assert 'id="queue-count">2<' in page


async def test_the_queue_counts_every_unknown_key_and_links_to_the_rest(browser, store):
    """130 unknown keys: the count says 130 (it said 100, the page's size), the
    page holds 100 forms and an "older" link, which shows the other 30."""
    for n in range(128):  # and the fixture's 2
        f = facts("job-1", 1, f"lost-many-{n:03}")
        verdict = await store.decide_write(f, CONTEXT)
        await store.record_outcome(f, verdict.attempt, Outcome("unknown"))
    page = await (await browser.get("/admin/queue")).text()
    assert 'id="queue-count">130<' in page
    first = re.findall(r'<form class="resolve"[^>]*data-key="([^"]*)"', page)
    assert len(first) == 100
    older = re.search(r'<a href="(/admin/queue\?cursor=[^"]+)">older »</a>', page)
    assert older is not None and "« newest" not in page
    rest = await (await browser.get(older.group(1).replace("&amp;", "&"))).text()
    second = re.findall(r'<form class="resolve"[^>]*data-key="([^"]*)"', rest)
    assert len(second) == 30 and not set(first) & set(second)
    assert 'id="queue-count">130<' in rest
    assert '<a href="/admin/queue">« newest</a>' in rest and "older »" not in rest
    only = await (await browser.get("/admin/queue?destination=elsewhere")).text()
    assert 'id="queue-count">0<' in only and 'id="queue-empty"' in only


async def test_resolve_form_needs_its_csrf_token(browser, store):
    page = await (await browser.get("/admin/queue")).text()
    fields = form_fields(page, "lost-1")
    assert len(fields["csrf"]) == 64
    form = {**fields, "outcome": "not_applied", "note": "no such charge"}
    for csrf in ("", "0" * 64):
        refused = await browser.post(
            "/admin/queue/resolve", data={**form, "csrf": csrf}, allow_redirects=False
        )
        assert refused.status == 403
        assert "nothing was changed" in await refused.text()
    assert (await store.key_record("payments", "lost-1")).state is KeyState.UNKNOWN
    assert await store.list_audit(AuditQuery()) == []
    # as a browser without Sec-Fetch-Site posts the page's own form (no-referrer)
    done = await browser.post(
        "/admin/queue/resolve", data=form, allow_redirects=False, headers={"Origin": "null"}
    )
    assert done.status == 303 and done.headers["Location"].startswith("/admin/queue?done=")
    assert await store.key_record("payments", "lost-1") is None
    [entry] = await store.list_audit(AuditQuery())
    assert (entry.action, entry.note) == ("resolve_not_applied", "no such charge")
    shown = await (await browser.get(done.headers["Location"])).text()
    assert "Resolved payments/lost-1 as not applied." in shown


async def test_a_notice_of_a_resolve_is_the_sessions_own(browser):
    """`?done=` printed any text as a success notice: a link of anybody's making
    could tell an operator that a key was settled."""
    forged = await (await browser.get("/admin/queue?done=payments/inv-46+as+applied")).text()
    assert "Resolved" not in forged
    signed = await (await browser.get("/admin/queue?done=x&sig=" + "0" * 64)).text()
    assert "Resolved" not in signed


async def test_a_signature_of_any_text_is_only_not_ours(browser):
    """A `sig` with non-ASCII text was compared as a str: a 500 and a traceback."""
    for sig in ("%C3%A9", "%ED%A0%80", "%00"):
        page = await browser.get(f"/admin/queue?done=x&sig={sig}")
        assert page.status == 200, sig
        assert "Resolved" not in await page.text()


async def test_a_filtered_queue_says_what_the_filter_left_out(browser):
    """The heading counts the whole queue; under a job_id that matches nothing the
    list said "Nothing waits for an operator" below "Unknown outcomes 2"."""
    page = await (await browser.get("/admin/queue?job_id=nosuch")).text()
    assert 'id="queue-count">2<' in page
    assert "No unknown outcome matches these filters (2 in the queue)." in page
    assert "Nothing waits" not in page


async def test_a_refused_form_says_why_and_changes_nothing(browser, store):
    page = await (await browser.get("/admin/queue")).text()
    for status in ("abc", "²"):  # a digit to str.isdigit, not to int(): it was a 500
        form = {**form_fields(page, "lost-1"), "outcome": "applied", "note": "x", "status": status}
        refused = await browser.post("/admin/queue/resolve", data=form)
        assert refused.status == 400
        assert "Not resolved: status must be an integer" in await refused.text()
    stale = {**form_fields(page, "lost-1"), "outcome": "applied", "note": "x", "attempt": "old"}
    conflict = await browser.post("/admin/queue/resolve", data=stale)
    assert conflict.status == 409 and "another attempt holds the key" in await conflict.text()
    assert (await store.key_record("payments", "lost-1")).state is KeyState.UNKNOWN


async def test_without_a_session_the_form_cannot_be_posted(browser, store):
    page = await (await browser.get("/admin/queue")).text()
    form = {**form_fields(page, "lost-1"), "outcome": "not_applied", "note": "x"}
    browser.session.cookie_jar.clear()
    response = await browser.post("/admin/queue/resolve", data=form, allow_redirects=False)
    assert response.status == 401  # no session: the sign-in page, nothing changed
    assert (await store.key_record("payments", "lost-1")).state is KeyState.UNKNOWN


async def test_key_job_and_audit_views(browser, store):
    key = await browser.get("/admin/keys/payments/lost-1?format=html")
    text = await key.text()
    assert key.status == 200 and 'id="key-state">unknown<' in text
    assert 'data-key="lost-1"' in text  # an unknown key's view carries its resolve form
    assert 'href="/admin/jobs/job-1?format=html"' in text
    job = await browser.get("/admin/jobs/job-1?format=html")
    job_text = await job.text()
    assert job.status == 200 and "Job <code>job-1</code>" in job_text
    assert job_text.count('class="reason fence"') == 2
    await store.record_audit(action="reload", note="destinations: payments")
    audit = await (await browser.get("/admin/audit?format=html&since=1h")).text()
    assert '<td><span class="action">reload</span></td>' in audit
    assert "destinations: payments" in audit
    missing = await browser.get("/admin/keys/payments/nope?format=html")
    assert missing.status == 404


@pytest.mark.parametrize(
    ("path", "status", "said"),
    [
        ("/admin/keys/payments/gone-1?format=html", 404, "no idempotency record"),
        ("/admin/jobs/job-gone?format=html", 404, "no lease, fence, attempt or rejection"),
        ("/admin/rejections/99999?format=html", 404, ""),
        ("/admin/rejections/x1?format=html", 404, "no rejection with id"),
        (f"/admin/keys/payments/{HOSTILE_KEY}x?format=html", 404, ""),
    ],
)
async def test_a_view_of_what_is_not_there_is_a_page(browser, path, status, said):
    """An audit row outlives the key and job it links to: following the link gives
    the layout with the refusal, not a problem+json document in the browser."""
    answer = await browser.get(path)
    text = await answer.text()
    assert answer.status == status
    assert answer.content_type == "text/html"
    assert 'id="refusal"' in text and said in text
    assert 'href="/admin/queue"' in text and "<script>" not in text
    json_view = await browser.get(path.removesuffix("?format=html"))
    assert json_view.status == status and json_view.content_type == "application/problem+json"


async def test_the_key_view_spells_values_as_the_json_does(browser, store):
    f = facts("job-1", 1, "done-1")
    verdict = await store.decide_write(f, CONTEXT)
    answer = Outcome("completed", status=201, headers=(("ETag", '"e1"'),), body=b"{}")
    assert await store.record_outcome(f, verdict.attempt, answer)
    text = await (await browser.get("/admin/keys/payments/done-1?format=html")).text()
    assert "[[&quot;ETag&quot;, &quot;\\&quot;e1\\&quot;&quot;]]" in text
    assert "<code>false</code>" in text and "False" not in text  # body_omitted


# --- the job view, the chart, the tiles (issue 34) ------------------------------------------


async def test_the_job_page_says_a_lease_past_its_time_is_expired(browser, store, fake_clock):
    """Stored as `active`, read by the store's clock: the page said `active` with
    `expires_in 0.0` a minute after the lease ended."""
    await store.claim("job-9", owner="worker-a", ttl=30)
    page = await (await browser.get("/admin/jobs/job-9?format=html")).text()
    assert "<code>active</code>" in page
    fake_clock.advance(90)
    page = await (await browser.get("/admin/jobs/job-9?format=html")).text()
    assert "<code>active</code>" not in page
    assert re.search(r"<code>expired at \S+Z \(1m ago, by the store&#x27;s clock\)</code>", page)


async def test_every_table_of_the_job_page_has_headers(browser):
    page = await (await browser.get("/admin/jobs/job-1?format=html")).text()
    table = page[page.index('<table id="job-rejections">') :]
    assert table.index("<thead>") < table.index("<tbody>")
    assert "<th>reason</th>" in table


async def test_the_chart_zooms_to_fresh_data_with_ticks_and_a_title_per_bar(browser):
    """Six minutes of data in a 24-hour window drew a one-pixel sliver: the chart
    now draws where the data is, in buckets of seconds, not of 7 minutes."""
    page = await (await browser.get("/admin/")).text()
    chart = page[page.index('<svg id="chart"') : page.index("</svg>")]
    width = int(re.search(r"per (\d+) (s|min)<", chart).group(1))
    assert re.search(r"per \d+ s<", chart) and width < 60
    titles = re.findall(r"<title>([^<]*)</title>", chart)
    assert len(titles) == 3  # one per bar with data
    assert all(re.fullmatch(r"\d\d:\d\d(:\d\d)? to \d\d:\d\d(:\d\d)? \(\S+Z\): 1 — \w+ 1", t)
               for t in titles)  # fmt: skip
    assert len(re.findall(r'class="axis tick"', chart)) >= 2  # readable round times
    assert re.search(
        r'id="chart-note">zoomed to the last \d+m of the window, where the data is<', chart
    )
    assert "time: " in chart and "<script" not in page


async def test_the_tile_of_refusals_before_the_fence_reads_the_metrics(store):
    metrics = Metrics()
    for _ in range(3):
        metrics.rejections.labels("unknown_destination").inc()
        metrics.refusals.note("unknown_destination", "exampel", "POST", "10.0.0.7")
    metrics.rejections.labels("method_not_allowed").inc()
    metrics.refusals.note("method_not_allowed", "payments", "GET", "10.0.0.7")
    metrics.rejections.labels("stale_generation").inc()  # past the fence: in the log
    app = create_admin_app(store, metrics, token=None, gauge_interval=None)
    async with TestClient(TestServer(app)) as client:
        page = await (await client.get("/admin/")).text()
    assert re.search(r'id="early-count">4<', page)
    assert "top: exampel (3), payments (1)" in page
    assert 'title="method_not_allowed 1, unknown_destination 3"' in page
