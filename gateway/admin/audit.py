"""The audit log (SPEC 4): operator actions, newest first, and `GET /admin/audit`.
The page's audit view (`admin.page`) reads it through the same filters."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from aiohttp import web

from gateway.admin import models
from gateway.admin.query import (
    decode_cursor,
    encode_cursor,
    only_params,
    parse_limit,
    parse_window,
    utc_time,
)
from gateway.http.schema import to_json
from gateway.store.admin_records import AuditEntry, AuditQuery
from gateway.store.protocol import AdminOpsStore

AUDIT_FILTERS = ("since", "until", "limit", "cursor")
_AUDIT_CURSOR_PREFIX = "a1:"


class AuditApi:
    """`GET /admin/audit`."""

    def __init__(self, store: AdminOpsStore) -> None:
        self._store = store

    async def list(self, request: web.Request) -> web.StreamResponse:
        query = parse_audit_query(request.query, self._store.clock())
        rows = await self._store.list_audit(replace(query, limit=query.limit + 1))
        return web.json_response(audit_page(rows, query.limit))


def parse_audit_query(params: Mapping[str, str], now: float) -> AuditQuery:
    only_params(params, AUDIT_FILTERS, formats=("html",))  # html: the page's (`_or_page`)
    value = {name: params.get(name, "") for name in AUDIT_FILTERS}
    since, until = parse_window(value["since"], value["until"], now)
    return AuditQuery(
        since=since,
        until=until,
        limit=parse_limit(value["limit"]),
        before_id=decode_cursor(value["cursor"], _AUDIT_CURSOR_PREFIX) if value["cursor"] else None,
    )


def audit_item(entry: AuditEntry) -> dict[str, Any]:
    """`models.AuditEntry`."""
    return to_json(_audit_model(entry))


def audit_page(entries: list[AuditEntry], limit: int) -> dict[str, Any]:
    """One page of `entries` (read `limit` + 1, to know whether another follows)."""
    items = [_audit_model(e) for e in entries[:limit]]
    return to_json(models.AuditPage(items=items, next_cursor=audit_cursor(entries, limit)))


def _audit_model(entry: AuditEntry) -> Any:
    """`models.AuditEntry`: the same fields, `at` as RFC 3339."""
    fields = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
    return models.AuditEntry(**{**fields, "at": utc_time(entry.at)})


def audit_cursor(items: list[AuditEntry], limit: int) -> str | None:
    return encode_cursor(items[limit - 1].id, _AUDIT_CURSOR_PREFIX) if len(items) > limit else None
