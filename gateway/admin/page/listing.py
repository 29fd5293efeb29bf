"""The admin listener's HTML page: the rejected-writes listing and one rejection.

Markup is filled by `render` (see `render`). The page reads rejections through
the same parsing and shapes as the JSON API (`admin.rejections`).
"""

from __future__ import annotations

import html
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import quote, urlencode

import structlog
from aiohttp import web
from multidict import MultiDict

from gateway.admin.page.render import REASON_KIND, Safe, html_response, link, render
from gateway.admin.query import rfc3339
from gateway.admin.rejections import (
    FILTERS,
    fetch_page,
    find_rejection,
    parse_rejection_query,
    rejection_item,
)
from gateway.admin.session import SessionAuth, operator_of
from gateway.errors import Rejection
from gateway.store.protocol import AdminOpsStore
from gateway.store.records import StoredRejection
from leases.reasons import REASONS, RECORDED_REASONS, Family, Reason

# Rejections of a write by its key's record (and its replays): the record exists.
_KEYED = frozenset(r for r, info in REASONS.items() if info.family is Family.IDEMPOTENCY)

PRESETS = ("15m", "1h", "24h", "7d")  # the page's time filters
REFRESH_S = 30  # the page's auto-refresh period
log = structlog.get_logger("gateway.admin")


# --- the handlers ----------------------------------------------------------------------------


class Page:
    """The page's routes: the listing and one rejection."""

    def __init__(
        self,
        store: AdminOpsStore,
        auth: SessionAuth,
        glance: Callable[[str, str], Awaitable[str]] | None = None,
    ) -> None:
        self._store = store
        self._auth = auth
        self._glance = glance  # the day at a glance above the listing (`operator`)

    async def redirect_to_page(self, request: web.Request) -> web.Response:
        query = request.query_string
        raise web.HTTPFound("/admin/" + (f"?{query}" if query else ""))

    async def listing(self, request: web.Request) -> web.Response:
        refresh = request.query.get("refresh") == str(REFRESH_S)
        params = MultiDict(
            (k, v) for k, v in request.query.items() if k not in ("format", "refresh")
        )
        error: str | None = None
        rows: list[StoredRejection] = []
        next_cursor: str | None = None
        try:
            query = parse_rejection_query(params, self._store.clock())
            rows, next_cursor = await fetch_page(self._store, query)
        except Rejection as rejection:
            if rejection.reason != Reason.INVALID_REQUEST:
                raise
            error = rejection.detail
        shown = {k: params.get(k, "") for k in FILTERS if params.get(k)}
        body = render(
            "admin_rejections.html",
            glance=Safe(
                await self._glance(shown.get("since", ""), shown.get("until", ""))
                if self._glance
                else ""
            ),
            presets=Safe(_presets(shown, refresh)),
            filters=Safe(_filter_form(shown)),
            error=Safe(f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""),
            count=f"{len(rows)} rejection{'s' * (len(rows) != 1)}",
            rows=Safe("".join(_row(r) for r in rows) or _EMPTY_ROW),
            pager=Safe(pager("/admin/", shown, next_cursor)),
        )
        return html_response(
            "rejected writes",
            body,
            status=400 if error else 200,
            logout=not self._auth.open,
            who=operator_of(request),
            refresh=REFRESH_S if refresh else 0,
        )

    async def detail(self, request: web.Request) -> web.Response:
        found = await find_rejection(self._store, request.match_info["id"])
        item = rejection_item(found)
        fields = "".join(
            f"<tr><th>{html.escape(k)}</th><td><code>{html.escape(_text(v))}</code></td></tr>"
            for k, v in item.items()
        )
        links = []
        if found.record.job_id:
            links.append(
                link("/admin/jobs/" + _quote(found.record.job_id) + "?format=html", "job state")
            )
        if (
            found.record.destination
            and found.record.idempotency_key
            and found.record.reason in _KEYED
        ):  # a key's own refusal or replay: a record to see (a fence's refusal has none)
            path = f"/admin/keys/{_quote(found.record.destination)}/"
            path += _quote(found.record.idempotency_key)
            links.append(link(path + "?format=html", "idempotency record"))
        links.append(link(f"/admin/rejections/{found.id}", "this rejection (JSON)"))
        body = render(
            "admin_rejection.html",
            id=found.id,
            reason=found.record.reason,
            fields=Safe(fields),
            links=Safe(" · ".join(links)),
        )
        return html_response(
            f"rejection {found.id}", body, logout=not self._auth.open, who=operator_of(request)
        )


# --- pieces of the listing -------------------------------------------------------------------

_EMPTY_ROW = '<tr><td colspan="9" class="empty">No rejected writes match these filters.</td></tr>'


def _filter_form(shown: Mapping[str, str]) -> str:
    options = ['<option value="">any reason</option>']
    for reason in RECORDED_REASONS:
        selected = " selected" if shown.get("reason") == reason else ""
        options.append(f'<option value="{reason}"{selected}>{reason}</option>')
    return render(
        "admin_filters.html",
        destination=shown.get("destination", ""),
        job_id=shown.get("job_id", ""),
        reasons=Safe("".join(options)),
        since=shown.get("since", ""),
        until=shown.get("until", ""),
        limit=shown.get("limit", ""),
    )


def _presets(shown: Mapping[str, str], refresh: bool) -> str:
    """Links that set `since` to 15m, 1h, 24h or 7d (other filters kept), and the
    auto-refresh toggle."""
    base = {k: v for k, v in shown.items() if k not in ("since", "until", "cursor")}
    if refresh:
        base["refresh"] = str(REFRESH_S)
    links = []
    for preset in PRESETS:
        current = ' class="current"' if shown.get("since") == preset else ""
        href = "/admin/?" + urlencode({**base, "since": preset})
        links.append(f'<a{current} href="{html.escape(href)}">{preset}</a>')
    toggle = {k: v for k, v in shown.items() if k != "cursor"}
    if not refresh:
        toggle["refresh"] = str(REFRESH_S)
    label = f"auto-refresh: on ({REFRESH_S} s), turn off" if refresh else "auto-refresh: off"
    refresh_link = (
        f'<a id="refresh" href="{html.escape("/admin/?" + urlencode(toggle))}">{label}</a>'
    )
    return (
        '<nav class="presets" id="presets">last: '
        + " ".join(links)
        + " · "
        + link("/admin/queue", "unknown outcomes")
        + " · "
        + link("/admin/audit?format=html", "audit log")
        + " · "
        + refresh_link
        + "</nav>"
    )


def _row(row: StoredRejection) -> str:
    r = row.record
    current = r.current_generation if r.current_generation is not None else r.highest_generation
    stale = r.generation is not None and current is not None and r.generation < current
    when = rfc3339(row.at) or ""
    job = link("/admin/?job_id=" + _quote(r.job_id), r.job_id) if r.job_id else ""
    cells = [
        f'<time datetime="{html.escape(when)}">{html.escape(when[:19].replace("T", " "))}</time>',
        f'<span class="reason {REASON_KIND.get(r.reason, "other")}">{html.escape(r.reason)}</span>',
        job,
        f'<span class="{"stale" if stale else "gen"}">'
        f"{_text(r.generation)} / {_text(current)}</span>",
        html.escape(_text(r.destination)),
        f"<code>{html.escape(_text(r.method))} {html.escape(_text(r.path))}</code>",
        f"<code>{html.escape(_text(r.idempotency_key))}</code>",
        html.escape(_text(r.remote)),
        link(f"/admin/rejections/{row.id}?format=html", f"#{row.id}"),
    ]
    tds = "".join(f"<td>{cell}</td>" for cell in cells)
    return f'<tr class="rejection" data-reason="{html.escape(r.reason)}">{tds}</tr>'


def pager(path: str, shown: Mapping[str, str], next_cursor: str | None) -> str:
    """The links of a page of `path` filtered by `shown`: back to the newest when
    `shown` has a cursor, on to the older rows when there are more."""
    base = {k: v for k, v in shown.items() if k != "cursor"}
    links = []
    if "cursor" in shown:
        links.append(link(f"{path}?{urlencode(base)}".rstrip("?"), "« newest"))
    if next_cursor is not None:
        links.append(link(f"{path}?" + urlencode({**base, "cursor": next_cursor}), "older »"))
    return " ".join(links)


def _quote(text: str) -> str:
    return quote(text, safe="")


def _text(value: object) -> str:
    return "—" if value is None else str(value)
