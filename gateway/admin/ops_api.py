"""The operator's JSON routes (SPEC 4): keys, resolve, audit, summary, and the
streamed export of rejections. Registered by `admin.create_admin_app`; auth and
error answers come from that app's middlewares.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import fields, replace
from typing import Any

import structlog
from aiohttp import web
from multidict import MultiDict

from gateway.admin import models
from gateway.admin.ops_views import (
    RESOLVE_REQUEST_MAX,
    audit_page,
    encode_key_cursor,
    export_header,
    export_limit,
    export_rows,
    parse_audit_query,
    parse_key_query,
    parse_resolution,
    parse_summary_window,
    summary_view,
)
from gateway.admin.views import key_model, parse_rejection_query
from gateway.errors import Rejection, StoreUnavailable
from gateway.http.bodies import read_uncoded_body
from gateway.http.problem import invalid_request
from gateway.http.schema import to_json
from gateway.policy.decision import KeyRecord
from gateway.store.admin_records import Resolution, ResolveRefused
from gateway.telemetry.unknown_keys import UnknownKeysGauge
from leases.reasons import Reason

log = structlog.get_logger("sinkgate.admin")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
EXPORT_PAGE = 1000
EXPORT_TYPES = {"csv": "text/csv", "ndjson": "application/x-ndjson"}


class OpsApi:
    """Handlers of the operator's routes over one store."""

    def __init__(self, store: Any, gauge: UnknownKeysGauge) -> None:
        self._store = store
        self.gauge = gauge

    async def list_keys(self, request: web.Request) -> web.Response:
        now = self._store.clock()
        query = parse_key_query(request.query, now)
        rows: list[KeyRecord] = await self._store.list_keys(replace(query, limit=query.limit + 1))
        next_cursor = None
        if len(rows) > query.limit:
            rows = rows[: query.limit]
            last = rows[-1]
            next_cursor = encode_key_cursor(last.updated_at, last.destination, last.key)
        items = [key_model(r, now) for r in rows]
        return web.json_response(to_json(models.KeyPage(items=items, next_cursor=next_cursor)))

    async def resolve(self, request: web.Request) -> web.Response:
        resolution = await self.read_resolution(request)
        record = await self.apply(resolution)
        return web.json_response(resolved_view(record, resolution, self._store.clock()))

    async def read_resolution(self, request: web.Request) -> Resolution:
        if request.query:
            raise invalid_request("this route takes no query parameters")
        if request.content_type != "application/json":
            raise invalid_request("the body must be application/json")
        raw = await read_uncoded_body(request, RESOLVE_REQUEST_MAX)
        destination, key = request.match_info["destination"], request.match_info["key"]
        return parse_resolution(raw, destination, key, request.remote)

    async def apply(self, resolution: Resolution) -> KeyRecord:
        """Resolve in the store; refusals become 404/409 problems. Logged, and the
        gauge refreshed at once (the queue just got shorter)."""
        try:
            record: KeyRecord = await self._store.resolve_key(resolution)
        except ResolveRefused as refused:
            raise _refusal(refused) from None
        log.info(
            "key_resolved",
            destination=resolution.destination,
            key=resolution.key,
            attempt=resolution.attempt,
            outcome="applied" if resolution.applied else "not_applied",
            remote=resolution.remote,
        )
        try:
            await self.gauge.refresh()
        except StoreUnavailable as exc:  # the resolve itself is committed
            log.warning("unknown_keys_refresh_failed", error=str(exc))
        return record

    async def list_audit(self, request: web.Request) -> web.Response:
        query = parse_audit_query(request.query, self._store.clock())
        rows = await self._store.list_audit(replace(query, limit=query.limit + 1))
        return web.json_response(audit_page(rows, query.limit))

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


def _refusal(refused: ResolveRefused) -> Rejection:
    record = refused.record
    if refused.reason == Reason.NOT_FOUND:
        return Rejection(Reason.NOT_FOUND, "no idempotency record for this destination and key")
    assert record is not None
    if refused.reason == Reason.KEY_NOT_UNKNOWN:
        return Rejection(
            Reason.KEY_NOT_UNKNOWN,
            f"the key's outcome is {record.state}, not unknown: nothing to resolve",
            destination=record.destination,
            state=str(record.state),
            attempt=record.attempt,
        )
    return Rejection(
        Reason.ATTEMPT_MISMATCH,
        "another attempt holds the key now; read the key again and check that one",
        destination=record.destination,
        attempt=record.attempt,
    )


def resolved_view(record: KeyRecord, resolution: Resolution, now: float) -> dict[str, Any]:
    """The key after the change; a released key (not_applied) no longer exists, so it
    is shown as it was with state `released`."""
    view = key_model(record, now)
    members = {f.name: getattr(view, f.name) for f in fields(view)}
    if not resolution.applied:
        members["state"] = "released"
    return to_json(models.ResolvedKey(**members))


def add_ops_routes(app: web.Application, api: OpsApi, *, audit_page: Handler) -> None:
    """The JSON routes; `GET /admin/audit?format=html` is answered by `audit_page`."""

    async def audit(request: web.Request) -> web.StreamResponse:
        if request.query.get("format") == "html":
            return await audit_page(request)
        return await api.list_audit(request)

    app.router.add_get("/admin/keys", api.list_keys)
    app.router.add_post("/admin/keys/{destination}/{key:.+}/resolve", api.resolve)
    app.router.add_get("/admin/audit", audit)
    app.router.add_get("/admin/summary", api.summary)
