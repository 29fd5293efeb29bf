"""Rejections (SPEC 4): the filters, the reads, the JSON of one item and of a page,
the summary over a window, the streamed CSV/NDJSON export, and the JSON routes
that serve them. The page (`admin.page`) reads rejections through the same
parsing and shapes, so a filter or a field reads the same whichever way it is
asked for.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import structlog
from aiohttp import web
from multidict import MultiDict

from gateway.admin import models
from gateway.admin.query import (
    DECIMAL_ID,
    MAX_LOOKBACK_S,
    decode_cursor,
    encode_cursor,
    only_params,
    parse_limit,
    parse_time,
    parse_window,
    utc_time,
)
from gateway.errors import STATUS_BY_REASON, Rejection, StoreUnavailable
from gateway.http.problem import invalid_request
from gateway.http.schema import to_json
from gateway.store.admin_records import Summary, summary_fits
from gateway.store.protocol import AdminOpsStore, AdminStore
from gateway.store.records import RejectionQuery, StoredRejection
from leases.model import IDENT, MAX_GENERATION
from leases.reasons import Reason

log = structlog.get_logger("gateway.admin")

FILTERS = ("destination", "job_id", "reason", "since", "until", "limit", "cursor")
SUMMARY_FILTERS = ("since", "until")
DEFAULT_SUMMARY_WINDOW_S = 86400.0
EXPORT_PAGE = 1000
EXPORT_TYPES = {"csv": "text/csv", "ndjson": "application/x-ndjson"}
_CURSOR_PREFIX = "r1:"


# --- the JSON routes ---------------------------------------------------------------------


class RejectionsApi:
    """`GET /admin/rejections` (JSON, or an export), `/admin/rejections/{id}` and
    `/admin/summary`."""

    def __init__(self, store: AdminOpsStore) -> None:
        self._store = store

    async def list(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("format") in EXPORT_TYPES:
            return await self.export(request)
        # Any other format is refused naming all this route takes, the exports too.
        formats = tuple(EXPORT_TYPES)
        query = parse_rejection_query(request.query, self._store.clock(), formats=formats)
        items, next_cursor = await fetch_page(self._store, query)
        return web.json_response(rejection_page(items, next_cursor))

    async def get(self, request: web.Request) -> web.StreamResponse:
        found = await find_rejection(self._store, request.match_info["id"])
        return web.json_response(rejection_item(found))

    async def summary(self, request: web.Request) -> web.Response:
        since, until = parse_summary_window(request.query, self._store.clock())
        return web.json_response(summary_view(await self._store.summary(since, until)))

    async def export(self, request: web.Request) -> web.StreamResponse:
        """`GET /admin/rejections?format=csv|ndjson`: every matching row, newest first,
        read a page at a time and streamed (memory stays one page)."""
        fmt = request.query["format"]
        params = MultiDict((k, v) for k, v in request.query.items() if k != "limit")
        query = parse_rejection_query(params, self._store.clock(), formats=tuple(EXPORT_TYPES))
        cap = export_limit(request.query.get("limit", ""))
        response = web.StreamResponse(
            headers={
                "Content-Type": f"{EXPORT_TYPES[fmt]}; charset=utf-8",
                "Content-Disposition": f'attachment; filename="rejections.{fmt}"',
                "Cache-Control": "no-store",
            }
        )
        first = await self._store.list_rejections(replace(query, limit=_page(cap, 0)))
        await response.prepare(request)  # after the first read: an outage is still a 503
        await response.write(export_header(fmt).encode())
        sent, rows = 0, first
        while rows:
            await response.write(export_rows(fmt, rows).encode())
            sent += len(rows)
            if len(rows) < EXPORT_PAGE or (cap is not None and sent >= cap):
                break
            try:
                rows = await self._store.list_rejections(
                    replace(query, before_id=rows[-1].id, limit=_page(cap, sent))
                )
            except StoreUnavailable as exc:
                # The status line is gone: end the stream short, and say so in the log.
                log.warning("export_cut_short", rows=sent, error=str(exc))
                break
        await response.write_eof()
        return response


def _page(cap: int | None, sent: int) -> int:
    return EXPORT_PAGE if cap is None else max(1, min(EXPORT_PAGE, cap - sent))


# --- reading rejections --------------------------------------------------------------------


async def fetch_page(
    store: AdminStore, query: RejectionQuery
) -> tuple[list[StoredRejection], str | None]:
    """One page, newest first, and the cursor of the next (None on the last page).

    The cursor is an id bound: rows that arrive later have higher ids, so they
    never shift the pages after the first.
    """
    rows = await store.list_rejections(replace(query, limit=query.limit + 1))
    if len(rows) <= query.limit:
        return rows, None
    rows = rows[: query.limit]
    return rows, encode_cursor(rows[-1].id, _CURSOR_PREFIX)


async def find_rejection(store: AdminStore, raw_id: str) -> StoredRejection:
    found = None
    if DECIMAL_ID.fullmatch(raw_id) and int(raw_id) <= MAX_GENERATION:
        found = await store.get_rejection(int(raw_id))
    if found is None:
        raise Rejection(Reason.NOT_FOUND, f"no rejection with id {raw_id[:40]!r}")
    return found


# --- query parsing -------------------------------------------------------------------------


def parse_rejection_query(
    params: Mapping[str, str], now: float | None = None, *, formats: tuple[str, ...] = ()
) -> RejectionQuery:
    """The filters of SPEC 4; an empty value means "not set" (as a form sends it).
    `now` (the store's clock) anchors relative times such as `since=1h`."""
    only_params(params, FILTERS, formats=formats)
    value = {name: params.get(name, "") for name in FILTERS}
    for name in ("destination", "job_id"):
        if value[name] and not IDENT.fullmatch(value[name]):
            raise invalid_request(f"{name} must be 1-256 visible ASCII characters")
    if value["reason"] and value["reason"] not in STATUS_BY_REASON:
        raise invalid_request(f"unknown reason {value['reason'][:60]!r}")
    since, until = parse_window(value["since"], value["until"], now)
    return RejectionQuery(
        destination=value["destination"] or None,
        job_id=value["job_id"] or None,
        reason=value["reason"] or None,
        since=since,
        until=until,
        limit=parse_limit(value["limit"]),
        before_id=decode_cursor(value["cursor"], _CURSOR_PREFIX) if value["cursor"] else None,
    )


def parse_summary_window(params: Mapping[str, str], now: float) -> tuple[float, float]:
    """[since, until]: by default the last 24 hours."""
    only_params(params, SUMMARY_FILTERS)
    since_text, until_text = params.get("since", ""), params.get("until", "")
    until = parse_time(until_text, "until", now) if until_text else now
    since = parse_time(since_text, "since", now) if since_text else until - DEFAULT_SUMMARY_WINDOW_S
    if since >= until:
        raise invalid_request("since must be before until")
    if until - since > MAX_LOOKBACK_S:
        raise invalid_request("the summary's window is longer than 100 years")
    if not summary_fits(since, until):
        # Its buckets, aligned on their width, would start or end outside the years
        # a date can name (0001-9999).
        raise invalid_request("the summary's buckets would fall outside the years 0001-9999")
    return since, until


# --- JSON shapes ---------------------------------------------------------------------------


def rejection_item(row: StoredRejection) -> dict[str, Any]:
    """An item of SPEC 4, field for field (`models.Rejection`)."""
    return to_json(rejection_model(row))


def rejection_page(rows: list[StoredRejection], next_cursor: str | None) -> dict[str, Any]:
    items = [rejection_model(r) for r in rows]
    return to_json(models.RejectionPage(items=items, next_cursor=next_cursor))


def rejection_model(row: StoredRejection) -> models.Rejection:
    r = row.record
    return models.Rejection(
        id=row.id,
        at=utc_time(row.at),
        destination=r.destination,
        method=r.method,
        path=r.path,
        job_id=r.job_id,
        generation=r.generation,
        owner=r.owner,
        idempotency_key=r.idempotency_key,
        reason=r.reason,
        detail=r.detail,
        current_generation=r.current_generation,
        highest_generation=r.highest_generation,
        remote=r.remote,
        body_sha256=r.body_sha256,
        body_bytes=r.body_bytes,
    )


def summary_view(summary: Summary) -> dict[str, Any]:
    """SPEC 4 `GET /admin/summary`: every bucket, empty ones included, oldest first."""
    width = summary.bucket_seconds
    buckets = [
        models.SummaryBucket(
            at=utc_time(summary.first_bucket + n * width), counts=summary.series.get(n, {})
        )
        for n in range(summary.bucket_count)
    ]
    return to_json(
        models.Summary(
            since=utc_time(summary.since),
            until=utc_time(summary.until),
            rejections_by_reason=dict(sorted(summary.by_reason.items())),
            rejections_by_destination=dict(sorted(summary.by_destination.items())),
            keys_by_state=summary.keys_by_state,
            bucket_seconds=width,
            series=models.SummarySeries(bucket_seconds=width, buckets=buckets),
        )
    )


# --- export --------------------------------------------------------------------------------

# The columns of an exported rejection: the fields of a rejection item, in order.
_EXPORT_FIELDS = (
    "id", "at", "destination", "method", "path", "job_id", "generation", "owner",
    "idempotency_key", "reason", "detail", "current_generation", "highest_generation",
    "remote", "body_sha256", "body_bytes",
)  # fmt: skip

_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def export_header(fmt: str) -> str:
    return _csv_line(_EXPORT_FIELDS) if fmt == "csv" else ""


def export_rows(fmt: str, rows: list[StoredRejection]) -> str:
    """One chunk of the export: CSV lines or NDJSON lines."""
    items = [rejection_item(r) for r in rows]
    if fmt == "ndjson":
        return "".join(json.dumps(item, separators=(",", ":")) + "\n" for item in items)
    return "".join(_csv_line([_csv_cell(item[f]) for f in _EXPORT_FIELDS]) for item in items)


def _csv_cell(value: Any) -> str:
    """A cell a spreadsheet shows as text: a value a worker sent (a path, a key) that
    starts like a formula gets a leading `'`."""
    text = "" if value is None else str(value)
    return "'" + text if text.startswith(_FORMULA) else text


def _csv_line(cells: Any) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\r\n").writerow(cells)
    return buffer.getvalue()


def export_limit(text: str) -> int | None:
    """An export's optional row cap (no 1000 maximum)."""
    if not text:
        return None
    if not DECIMAL_ID.fullmatch(text) or int(text) > 10**12:
        raise invalid_request("limit must be a positive integer")
    return int(text)
