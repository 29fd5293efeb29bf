"""The operator's part of the admin page: the 24-hour glance above the listing,
the unknown-outcome queue with a resolve form per key, and HTML views of a key,
a job and the audit log.

The resolve form is a plain POST (no script). It is protected twice: the session
cookie is SameSite=Strict (a cross-site form post arrives without it), and each
form carries a CSRF token, an HMAC of the session keyed by the admin token (or,
on an open loopback-only listener, by a per-process secret), checked in constant
time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import html
import json
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, urlencode

from aiohttp import web

from gateway.admin.audit import audit_cursor, audit_item, parse_audit_query
from gateway.admin.jobs import job_view
from gateway.admin.keys import (
    RESOLVE_REQUEST_MAX,
    find_key,
    key_page,
    key_view,
    parse_key_query,
    parse_resolution,
)
from gateway.admin.page.chart import FAMILY_COLOURS, rejections_chart
from gateway.admin.page.listing import PRESETS, pager
from gateway.admin.page.render import REASON_KIND, Safe, html_response, link
from gateway.admin.query import is_duration, parse_time, utc_time
from gateway.admin.session import RESOLVE_FORM_PATH, SESSION_COOKIE, operator_of
from gateway.config.reader import format_duration
from gateway.errors import TITLE_BY_REASON, Rejection
from gateway.http.bodies import read_uncoded_body
from gateway.policy.decision import KeyRecord, KeyState
from gateway.store.admin_records import Resolution, Summary, summary_fits
from gateway.telemetry.metrics import Metrics
from leases.model import IDENT, LeaseRow, State
from leases.reasons import BEFORE_THE_FENCE, Reason

if TYPE_CHECKING:
    from gateway.admin.session import SessionAuth

_AUDIT_COLUMNS = ("at", "operator", "action", "destination", "key", "attempt", "note", "remote")
_OPEN_SECRET = os.urandom(32)


class OperatorPage:
    """Handlers of the operator's HTML views; `page` renders like the listing.
    `resolve` settles a key as the JSON route does (checked, logged, audited)."""

    def __init__(
        self,
        store: Any,
        auth: SessionAuth,
        *,
        resolve: Callable[[Resolution], Awaitable[KeyRecord]],
        metrics: Metrics,
    ) -> None:
        self._store = store
        self._auth = auth
        self._resolve = resolve
        self._metrics = metrics
        self._kinds = REASON_KIND

    def _respond(
        self, request: web.Request, title: str, body: str, *, status: int = 200
    ) -> web.Response:
        """A page in the layout, with who is signed in."""
        return html_response(
            title,
            Safe(body),
            status=status,
            logout=not self._auth.open,
            who=operator_of(request),
        )

    def refused(self, request: web.Request, rejection: Rejection) -> web.Response:
        """A view's refusal as a page, with its status: an audit row's link to a key
        the janitor has since removed ends here, not in problem+json."""
        body = (
            '<p><a href="/admin/">« all rejections</a> · <a href="/admin/queue">queue</a> · '
            '<a href="/admin/audit?format=html">audit log</a></p>'
            f"<h2>{html.escape(TITLE_BY_REASON.get(rejection.reason, rejection.reason))}</h2>"
            f'<p class="error" role="alert" id="refusal">{html.escape(rejection.detail)}</p>'
        )
        return self._respond(request, rejection.reason, body, status=rejection.status)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/admin/queue", self.queue)
        app.router.add_post(RESOLVE_FORM_PATH, self.resolve)

    # --- the glance ------------------------------------------------------------------------

    async def glance(self, since_text: str, until_text: str = "") -> str:
        """Over the listing's window (default the last 24 h): rejections and replays
        apart, the queue size, the refusals before the fence, counts per reason and
        the chart."""
        window = self._window(since_text, until_text)
        summary = await self._store.summary(window.since, window.until)
        legend = "".join(
            f'<span class="swatch" style="background:{colour}"></span>{family} '
            for family, colour in FAMILY_COLOURS.items()
        )
        return (
            '<section class="glance" id="glance"><div class="tiles">'
            + self._tiles(summary, window)
            + f'<div class="chips">{self._chips(summary, window)}</div></div>'
            + await self._chart(summary, window)
            + f'<p class="legend">{legend}</p></section>'
        )

    def _window(self, since_text: str, until_text: str) -> _Window:
        """The window the glance shows, and its words: the listing's `since` and
        `until` where they can be read (else the listing shows the error, and the
        glance the last 24 hours)."""
        now = self._store.clock()
        until, until_given = now, False
        if until_text:
            try:
                until, until_given = min(now, parse_time(until_text, "until", now)), True
            except Rejection:
                pass
        since, relative = None, False
        if since_text:
            try:
                since, relative = parse_time(since_text, "since", now), is_duration(since_text)
            except Rejection:
                pass
        if since is None or since >= until or not summary_fits(since, until):
            since, relative, since_text = until - 86400.0, True, "24h"  # the default
        if until_given:
            words = f"from {_minute(since)} to {_minute(until)} UTC"
            link = {"since": utc_time(since), "until": utc_time(until)}
        elif relative:
            words, link = f"in the last {since_text}", {"since": since_text}
        else:
            words, link = f"since {_minute(since)} UTC", {"since": utc_time(since)}
        return _Window(since, until, words, link)

    def _tiles(self, summary: Summary, window: _Window) -> str:
        replays = summary.by_reason.get(Reason.DUPLICATE, 0)
        total = sum(summary.by_reason.values()) - replays
        unknown = sum(s.get("unknown", 0) for s in summary.keys_by_state.values())
        queue_class = "queue-size alert" if unknown else "queue-size"
        replay_href = "/admin/?" + urlencode({"reason": Reason.DUPLICATE, **window.link})
        early = before_the_fence(self._metrics)
        names = ", ".join(f"{n} ({c})" for n, c in self._metrics.refusals.top(3))
        return (
            f'<div class="tile"><span class="big" id="total">{total}</span>'
            f"rejections {html.escape(window.words)}</div>"
            f'<div class="tile"><a href="{html.escape(replay_href)}">'
            f'<span class="big" id="replays">{replays}</span></a>'
            "replays (answered from the store)</div>"
            f'<div class="tile"><a class="{queue_class}" href="/admin/queue">'
            f'<span class="big" id="unknown-count">{unknown}</span></a>'
            "unknown outcomes waiting for an operator</div>"
            f'<div class="tile" id="early" title="{html.escape(_early_title(early))}">'
            f'<span class="big" id="early-count">{sum(early.values())}</span>'
            "refused before the fence since start (not in the log below)"
            + (f'<br><small id="early-names">top: {html.escape(names)}</small>' if names else "")
            + "</div>"
        )

    def _chips(self, summary: Summary, window: _Window) -> str:
        chips = "".join(
            f'<a class="reason {self._kinds.get(r, "other")}" '
            f'href="/admin/?{html.escape(urlencode({"reason": r, **window.link}))}">'
            f"{html.escape(r)} <b>{c}</b></a> "
            for r, c in sorted(summary.by_reason.items(), key=lambda rc: -rc[1])
            if r != Reason.DUPLICATE
        )
        return chips or "<em>no rejections</em>"

    async def _chart(self, summary: Summary, window: _Window) -> str:
        """The chart of the window, or of where the data is when it fills under a
        quarter of the window (fresh data would be a sliver at the right edge)."""
        filled = sorted(n for n, counts in summary.series.items() if counts)
        start = summary.first_bucket + (filled[0] if filled else 0) * summary.bucket_seconds
        end = window.until
        if not filled or end - start >= (summary.until - summary.since) / 4:
            return rejections_chart(summary, self._kinds)
        # A margin of a tenth before the first bar, and at least a minute.
        since = max(summary.since, start - max(60.0, (end - start) / 10))
        zoomed: Summary = await self._store.summary(since, end)
        note = f"zoomed to the last {_rounded(end - since)} of the window, where the data is"
        return rejections_chart(zoomed, self._kinds, note=note)

    # --- the queue -------------------------------------------------------------------------

    async def queue(
        self, request: web.Request, *, message: str = "", status: int = 200
    ) -> web.Response:
        params = {k: v for k, v in request.query.items() if k not in ("format", "done", "sig")}
        query = parse_key_query({**params, "state": "unknown"}, self._store.clock())
        rows, next_cursor = await key_page(self._store, query)
        # The queue's size, not the page's: a page holds `limit` keys (100 unless set).
        counts: dict[str, int] = await self._store.unknown_counts()
        waiting = counts.get(query.destination, 0) if query.destination else sum(counts.values())
        now = self._store.clock()
        csrf = csrf_token(self._auth, request)
        forms = "".join(self._resolve_form(r, csrf, now) for r in rows)
        links = pager("/admin/queue", params, next_cursor)
        narrowed = any(params.get(k) for k in ("job_id", "since", "until"))
        empty = (
            f"No unknown outcome matches these filters ({waiting} in the queue)."
            if narrowed and waiting
            else "Nothing waits for an operator."
        )
        done = request.query.get("done", "")
        sig = request.query.get("sig", "").encode("utf-8", "surrogatepass")  # any text: bytes
        if done and not hmac.compare_digest(sig, _signed(csrf, done).encode()):
            done = ""  # a link of anybody's making: no notice of a resolve nobody did
        notice = message or (f"Resolved {done}. " if done else "")
        body = (
            '<p><a href="/admin/">« all rejections</a> · '
            '<a href="/admin/audit?format=html">audit log</a></p>'
            f'<h2>Unknown outcomes <span class="count" id="queue-count">{waiting}</span></h2>'
            + (
                f'<p class="{"error" if status != 200 else "notice"}" role="status">'
                f"{html.escape(notice)}</p>"
                if notice
                else ""
            )
            + "<p>Each key below was forwarded, and the gateway cannot tell whether the "
            "destination applied it: every retry of the key is refused with "
            "<code>outcome_unknown</code>. Check the destination, then settle it here: "
            "<b>applied</b> stores the answer you give, which retries replay; <b>not applied</b> "
            "releases the key, so the worker's retry is forwarded.</p>"
            + (forms or f'<p class="empty" id="queue-empty">{html.escape(empty)}</p>')
            + (f'<nav class="pager" id="queue-pager">{links}</nav>' if links else "")
        )
        return self._respond(request, "unknown outcomes", body, status=status)

    def _resolve_form(self, record: Any, csrf: str, now: float) -> str:
        e = html.escape
        view = key_view(record, now)
        key_link = _key_href(record.destination, record.key)
        return (
            f'<form class="resolve" method="post" action="{RESOLVE_FORM_PATH}" '
            f'data-key="{e(record.key)}">'
            f'<div class="who"><a href="{e(key_link)}"><code>{e(record.destination)} / '
            f"{e(record.key)}</code></a><br>job <code>{e(record.job_id)}</code> gen "
            f"{record.generation} · {record.attempts} attempt(s) · since "
            f"<time>{e((view['updated_at'] or '')[:19].replace('T', ' '))} UTC</time></div>"
            f'<input type="hidden" name="destination" value="{e(record.destination)}">'
            f'<input type="hidden" name="key" value="{e(record.key)}">'
            f'<input type="hidden" name="attempt" value="{e(record.attempt)}">'
            f'<input type="hidden" name="csrf" value="{e(csrf)}">'
            '<label><input type="radio" name="outcome" value="applied" required> applied</label>'
            '<label><input type="radio" name="outcome" value="not_applied"> not applied</label>'
            '<label class="status">status <input name="status" value="200" inputmode="numeric">'
            "</label>"
            '<label class="body">body <input name="body" placeholder="the answer to replay">'
            "</label>"
            '<label class="note">note <input name="note" required maxlength="1000" '
            'placeholder="what you checked at the destination"></label>'
            '<button type="submit">Resolve</button></form>'
        )

    async def resolve(self, request: web.Request) -> web.Response:
        raw = await read_uncoded_body(request, RESOLVE_REQUEST_MAX)
        try:
            form = {k: v[0] for k, v in parse_qs(raw.decode(), max_num_fields=20).items()}
        except (ValueError, UnicodeDecodeError):
            raise Rejection(Reason.INVALID_REQUEST, "the form could not be read") from None
        if not hmac.compare_digest(
            form.get("csrf", "").encode(), csrf_token(self._auth, request).encode()
        ):
            return await self.queue(
                request, message="The form had expired; nothing was changed.", status=403
            )
        destination, key = form.get("destination", ""), form.get("key", "")
        body: dict[str, Any] = {
            "outcome": form.get("outcome"),
            "attempt": form.get("attempt"),
            "note": form.get("note", ""),
        }
        if body["outcome"] == "applied":
            status = form.get("status", "") or "200"
            digits = status.isascii() and status.isdigit()  # "²" is a digit to isdigit, not to int
            body["status"] = int(status) if digits and len(status) < 4 else status
            body["body"] = form.get("body", "")
        try:
            resolution = parse_resolution(
                json.dumps(body).encode(), destination, key, request.remote
            )
            resolution = dataclasses.replace(resolution, operator=operator_of(request))
            await self._resolve(resolution)
        except Rejection as refused:
            return await self.queue(
                request, message=f"Not resolved: {refused.detail}", status=refused.status
            )
        outcome = "applied" if resolution.applied else "not applied"
        done = f"{destination}/{key} as {outcome}"
        signed = _signed(csrf_token(self._auth, request), done)
        raise web.HTTPSeeOther("/admin/queue?" + urlencode({"done": done, "sig": signed}))

    # --- key, job, audit -------------------------------------------------------------------

    async def key(self, request: web.Request) -> web.Response:
        destination, key = request.match_info["destination"], request.match_info["key"]
        record = await find_key(self._store, destination, key)
        now = self._store.clock()
        view = key_view(record, now)
        form = ""
        if record.state_at(now) is KeyState.UNKNOWN:
            form = "<h3>Resolve</h3>" + self._resolve_form(
                record, csrf_token(self._auth, request), now
            )
        links = [
            link(f"/admin/jobs/{quote(record.job_id, safe='')}?format=html", "job state"),
            link(f"/admin/?{urlencode({'job_id': record.job_id})}", "the job's rejections"),
            link(_key_href(destination, key, html_view=False), "JSON"),
        ]
        body = (
            '<p><a href="/admin/">« all rejections</a> · <a href="/admin/queue">queue</a></p>'
            f"<h2>Key <code>{html.escape(key)}</code> "
            f'<span class="state {html.escape(view["state"])}" id="key-state">'
            f"{html.escape(view['state'])}</span></h2>"
            + _fields(view)
            + f"<p>{' · '.join(links)}</p>"
            + form
        )
        return self._respond(request, f"key {key}", body)

    async def job(self, request: web.Request) -> web.Response:
        job_id = request.match_info["job_id"]
        state = await self._store.job_state(job_id) if IDENT.fullmatch(job_id) else None
        if state is None:
            raise Rejection(Reason.NOT_FOUND, "no lease, fence, attempt or rejection for this job")
        now = self._store.clock()
        view = job_view(state, now)
        lease = view.pop("lease") or {}
        if state.lease is not None:
            lease["state"] = lease_state_now(state.lease, now)
        in_flight = view.pop("in_flight")
        recent = view.pop("recent_rejections")
        rows = "".join(
            "<tr><td>" + link(f"/admin/rejections/{r['id']}?format=html", f"#{r['id']}") + "</td>"
            f"<td>{html.escape(str(r['at'])[:19])}</td>"
            f'<td><span class="reason {self._kinds.get(r["reason"], "other")}">'
            f"{html.escape(r['reason'])}</span></td><td>{html.escape(str(r['generation']))}</td>"
            f"<td><code>{html.escape(str(r['idempotency_key']))}</code></td></tr>"
            for r in recent
        )
        flying = "".join(
            f"<tr><td><code>{html.escape(str(a['attempt']))}</code></td><td>{a['generation']}</td>"
            f"<td>{html.escape(str(a['destination']))}</td>"
            f"<td><code>{html.escape(str(a['key']))}</code></td>"
            f"<td>{html.escape(str(a['deadline']))}</td></tr>"
            for a in in_flight
        )
        body = (
            '<p><a href="/admin/">« all rejections</a></p>'
            f"<h2>Job <code>{html.escape(job_id)}</code></h2>"
            + _fields({**view, **{f"lease {k}": v for k, v in lease.items()}})
            + "<h3>On the wire</h3>"
            + (
                f"<table><thead><tr><th>attempt</th><th>gen</th><th>destination</th><th>key</th>"
                f"<th>deadline</th></tr></thead><tbody>{flying}</tbody></table>"
                if flying
                else '<p class="empty">nothing</p>'
            )
            + "<h3>Recent rejections</h3>"
            + (
                '<table id="job-rejections"><thead><tr><th>rejection</th><th>when (UTC)</th>'
                "<th>reason</th><th>gen</th><th>key</th></tr></thead>"
                f"<tbody>{rows}</tbody></table>"
                if rows
                else '<p class="empty">none</p>'
            )
            + f"<p>{link('/admin/jobs/' + quote(job_id, safe=''), 'JSON')}</p>"
        )
        return self._respond(request, f"job {job_id}", body)

    async def audit(self, request: web.Request) -> web.Response:
        params = {k: v for k, v in request.query.items() if k != "format"}
        query = parse_audit_query(params, self._store.clock())
        entries = await self._store.list_audit(
            query.__class__(
                since=query.since,
                until=query.until,
                limit=query.limit + 1,
                before_id=query.before_id,
            )
        )
        cursor = audit_cursor(entries, query.limit)
        rows = "".join(
            '<tr class="audit">'
            + "".join(f"<td>{_cell(name, item)}</td>" for name in _AUDIT_COLUMNS)
            + "</tr>"
            for item in (audit_item(e) for e in entries[: query.limit])
        )
        presets = " ".join(
            link("/admin/audit?" + urlencode({"format": "html", "since": p}), p) for p in PRESETS
        )
        more = pager("/admin/audit", {**params, "format": "html"}, cursor)
        body = (
            '<p><a href="/admin/">« all rejections</a> · <a href="/admin/queue">queue</a></p>'
            f"<h2>Audit log</h2><p>since: {presets} · "
            f"{link('/admin/audit?format=html', 'all')}</p>"
            '<table id="audit"><thead><tr><th>when (UTC)</th><th>operator</th><th>action</th>'
            "<th>destination</th><th>key</th><th>attempt</th><th>note</th><th>remote</th>"
            "</tr></thead><tbody>"
            + (rows or '<tr><td colspan="8" class="empty">No operator actions.</td></tr>')
            + f'</tbody></table><nav class="pager">{more}</nav>'
        )
        return self._respond(request, "audit log", body)


@dataclasses.dataclass(frozen=True)
class _Window:
    since: float
    until: float
    words: str  # "in the last 1h", "since 2026-12-01 10:00 UTC", "from ... to ... UTC"
    link: dict[str, str]  # the listing's query for the same window


def _minute(ts: float) -> str:
    return utc_time(ts)[:16].replace("T", " ")


def _rounded(seconds: float) -> str:
    """A span in its largest unit that fits twice (2d, not 3069m), at least 1m."""
    for unit in (86400, 3600, 60):
        if seconds >= 2 * unit or unit == 60:
            return format_duration(max(1, round(seconds / unit)) * unit)
    raise AssertionError("unreachable")


def lease_state_now(lease: LeaseRow, now: float) -> str:
    """The lease's state by the store's clock: an active lease past its
    `lease_until` reads `expired, at ... (N s ago)`, not the `active` it is stored as."""
    if lease.state is State.ACTIVE and lease.lease_until <= now:
        ago = format_duration(max(1.0, round(now - lease.lease_until)))
        return f"expired at {utc_time(lease.lease_until)} ({ago} ago, by the store's clock)"
    return str(lease.state)


def before_the_fence(metrics: Metrics) -> dict[str, int]:
    """Writes refused before the fence, by reason, from `sinkgate_rejections_total`
    (this process, since it started)."""
    counts: dict[str, int] = {}
    for family in metrics.rejections.collect():
        for sample in family.samples:
            reason = sample.labels.get("reason", "")
            if sample.name.endswith("_total") and reason in BEFORE_THE_FENCE and sample.value:
                counts[reason] = int(sample.value)
    return counts


def _early_title(counts: dict[str, int]) -> str:
    return ", ".join(f"{r} {c}" for r, c in sorted(counts.items())) or "none"


def csrf_token(auth: SessionAuth, request: web.Request) -> str:
    """An HMAC of this browser's session (constant per session, unguessable without
    the admin token)."""
    secret = _OPEN_SECRET if auth.open else auth.secret
    session = request.cookies.get(SESSION_COOKIE, "")
    return hmac.new(secret, f"sinkgate-csrf:{session}".encode(), hashlib.sha256).hexdigest()


def _signed(csrf: str, notice: str) -> str:
    """The MAC that makes a `done` notice this session's own."""
    return hmac.new(csrf.encode(), f"done:{notice}".encode(), hashlib.sha256).hexdigest()


def _key_href(destination: str, key: str, *, html_view: bool = True) -> str:
    path = f"/admin/keys/{quote(destination, safe='')}/{quote(key, safe='')}"
    return path + ("?format=html" if html_view else "")


def _fields(view: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td><code>{html.escape(_shown(v))}</code></td></tr>"
        for k, v in view.items()
    )
    return f'<table class="fields">{rows}</table>'


def _shown(value: Any) -> str:
    """A field's value as the JSON view spells it (`true`, `["ETag", "\"e1\""]`),
    not as Python prints it."""
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _cell(name: str, item: dict[str, Any]) -> str:
    value = item[name]
    if value is None:
        return "—"
    if name == "at":
        return html.escape(str(value)[:19].replace("T", " "))
    if name == "key" and item.get("destination"):
        return link(_key_href(item["destination"], value), value)
    if name == "action":
        return f'<span class="action">{html.escape(value)}</span>'
    return html.escape(str(value))
