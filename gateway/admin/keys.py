"""Idempotency keys (SPEC 4): the filters of `GET /admin/keys`, the JSON of a key
record, an operator's resolve of an unknown outcome, and the JSON routes that
serve them. The page's queue and key view (`admin.page`) resolve through
`KeysApi.apply`, so a verdict given in a browser is checked, logged and audited
exactly as one given with the CLI.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

import structlog
from aiohttp import web

from gateway.admin import models
from gateway.admin.models import CONTENT_TYPE, NOTE_MAX, ResolveRequest
from gateway.admin.query import only_params, parse_limit, parse_window, rfc3339, utc_time
from gateway.admin.session import operator_of
from gateway.config.model import DESTINATION_NAME
from gateway.errors import Rejection, StoreUnavailable
from gateway.http.bodies import read_uncoded_body
from gateway.http.problem import invalid_request
from gateway.http.schema import field_names, to_json
from gateway.policy.decision import KeyRecord, KeyState
from gateway.store.admin_records import KeyQuery, Resolution, ResolveRefused
from gateway.store.protocol import AdminOpsStore
from gateway.telemetry.unknown_keys import UnknownKeysGauge
from leases.model import IDENT, KEY
from leases.reasons import Reason

log = structlog.get_logger("gateway.admin")

KEY_FILTERS = ("destination", "state", "job_id", "since", "until", "limit", "cursor")
RESOLVE_BODY_MAX = 1024 * 1024  # the stored answer; the request may be a little larger
# JSON's escapes can make a body six times as long (`\u00e9` for `é`; a character
# outside the BMP, four UTF-8 bytes, is two of them: 12 bytes).
RESOLVE_REQUEST_MAX = RESOLVE_BODY_MAX * 6 + 16 * 1024
_RESOLVE_FIELDS = set(field_names(ResolveRequest))
_CONTENT_TYPE = re.compile(CONTENT_TYPE)
# Control characters (C0 but tab and line ends, DEL, C1) and the bidirectional
# controls, which would make a note read otherwise than it was written.
_CONTROL = re.compile(
    r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)
_KEY_CURSOR_PREFIX = "k1:"


# --- the JSON routes ---------------------------------------------------------------------


class KeysApi:
    """`GET /admin/keys`, `GET /admin/keys/{destination}/{key}` and `POST .../resolve`,
    over one store."""

    def __init__(self, store: AdminOpsStore, gauge: UnknownKeysGauge) -> None:
        self._store = store
        self.gauge = gauge

    async def list(self, request: web.Request) -> web.Response:
        now = self._store.clock()
        query = parse_key_query(request.query, now)
        rows, next_cursor = await key_page(self._store, query)
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
        resolution = parse_resolution(raw, destination, key, request.remote)
        return replace(resolution, operator=operator_of(request))

    async def apply(self, resolution: Resolution) -> KeyRecord:
        """Resolve in the store; refusals become 404/409 problems. Logged, and the
        gauge refreshed at once (the queue just got shorter)."""
        if not could_be_stored(resolution.destination, resolution.key):
            raise _refusal(ResolveRefused(Reason.NOT_FOUND, None))
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
            operator=resolution.operator,
            remote=resolution.remote,
        )
        try:
            await self.gauge.refresh()
        except StoreUnavailable as exc:  # the resolve itself is committed
            log.warning("unknown_keys_refresh_failed", error=str(exc))
        return record

    async def get(self, request: web.Request) -> web.StreamResponse:
        destination, key = request.match_info["destination"], request.match_info["key"]
        record = await find_key(self._store, destination, key)
        return web.json_response(key_view(record, self._store.clock()))


def could_be_stored(destination: str, key: str) -> bool:
    """Whether a key record can exist under these names: every one was written
    by a write whose key passed `KEY` and whose destination `DESTINATION_NAME`.
    Other names are not looked up (PostgreSQL cannot compare a NUL at all), so
    they are not found on either store, and no store error is counted for them."""
    return bool(DESTINATION_NAME.fullmatch(destination) and KEY.fullmatch(key))


async def find_key(store: AdminOpsStore, destination: str, key: str) -> KeyRecord:
    """The key's record, or the 404 problem."""
    record = await store.key_record(destination, key) if could_be_stored(destination, key) else None
    if record is None:
        raise _refusal(ResolveRefused(Reason.NOT_FOUND, None))
    return record


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


# --- query parsing -------------------------------------------------------------------------


def parse_key_query(params: Mapping[str, str], now: float) -> KeyQuery:
    """The filters of `GET /admin/keys`; empty values mean "not set"."""
    only_params(params, KEY_FILTERS)
    value = {name: params.get(name, "") for name in KEY_FILTERS}
    for name in ("destination", "job_id"):
        if value[name] and not IDENT.fullmatch(value[name]):
            raise invalid_request(f"{name} must be 1-256 visible ASCII characters")
    states = [str(s) for s in KeyState]
    if value["state"] and value["state"] not in states:
        raise invalid_request(f"state must be one of {', '.join(states)}")
    since, until = parse_window(value["since"], value["until"], now)
    return KeyQuery(
        destination=value["destination"] or None,
        state=KeyState(value["state"]) if value["state"] else None,
        job_id=value["job_id"] or None,
        since=since,
        until=until,
        limit=parse_limit(value["limit"]),
        after=decode_key_cursor(value["cursor"]) if value["cursor"] else None,
    )


async def key_page(store: AdminOpsStore, query: KeyQuery) -> tuple[list[KeyRecord], str | None]:
    """One page of keys, newest `updated_at` first, and the cursor of the next
    (None on the last page)."""
    rows: list[KeyRecord] = await store.list_keys(replace(query, limit=query.limit + 1))
    if len(rows) <= query.limit:
        return rows, None
    rows = rows[: query.limit]
    last = rows[-1]
    return rows, encode_key_cursor(last.updated_at, last.destination, last.key)


def encode_key_cursor(updated_at: float, destination: str, key: str) -> str:
    raw = _KEY_CURSOR_PREFIX + json.dumps([updated_at, destination, key], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_key_cursor(cursor: str) -> tuple[float, str, str]:
    try:
        if len(cursor) > 2048:
            raise ValueError("too long")
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
        if not raw.startswith(_KEY_CURSOR_PREFIX):
            raise ValueError("prefix")
        at, destination, key = json.loads(raw.removeprefix(_KEY_CURSOR_PREFIX))
        if not (isinstance(at, float | int) and math.isfinite(at)):
            raise ValueError("time")
        if not (isinstance(destination, str) and isinstance(key, str)):
            raise ValueError("names")
        if not could_be_stored(destination, key):  # a NUL or a lone surrogate: no store takes it
            raise ValueError("names")
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError, RecursionError):
        raise invalid_request("cursor is not one this server handed out") from None
    return float(at), destination, key


# --- resolve -------------------------------------------------------------------------------


def parse_resolution(raw: bytes, destination: str, key: str, remote: str | None) -> Resolution:
    """The body of `POST /admin/keys/{destination}/{key}/resolve`."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # nested past the parser's depth
        raise invalid_request("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise invalid_request("the body must be a JSON object")
    unknown = sorted(set(body) - _RESOLVE_FIELDS)
    if unknown:
        raise invalid_request(f"unknown field(s): {', '.join(unknown)[:200]}")
    outcome = body.get("outcome")
    if outcome not in ("applied", "not_applied"):
        raise invalid_request('outcome must be "applied" or "not_applied"', field="outcome")
    attempt = body.get("attempt")
    if not isinstance(attempt, str) or not IDENT.fullmatch(attempt):
        raise invalid_request("attempt must be the key's attempt id", field="attempt")
    note = _note(body.get("note"))
    if outcome == "not_applied":
        extra = sorted({"status", "body", "content_type"} & set(body))
        if extra:
            verb = "goes" if len(extra) == 1 else "go"
            raise invalid_request(f"{', '.join(extra)} only {verb} with applied", field=extra[0])
        return Resolution(destination, key, attempt, False, note, remote)
    status = _status(body.get("status", 200))
    replayed = _body(body.get("body", ""))
    if replayed and status in _NO_CONTENT:  # such an answer has none to replay
        raise invalid_request(f"a {status} answer has no body: leave body empty", field="body")
    return Resolution(
        destination,
        key,
        attempt,
        True,
        note,
        remote,
        status=status,
        body=replayed,
        content_type=_content_type(body.get("content_type", "application/json")),
    )


# Statuses whose answers have no content (RFC 9110 15.3.5, 15.3.6, 15.4.5): a body
# stored with one would be dropped (204, 304) or sent against the RFC (205).
_NO_CONTENT = frozenset({204, 205, 304})


def _note(note: Any) -> str:
    if not isinstance(note, str) or not 1 <= len(note) <= NOTE_MAX or not note.strip():
        raise invalid_request(f"note must say why, in 1-{NOTE_MAX} characters", field="note")
    if _CONTROL.search(note) or not _encodable(note):
        raise invalid_request("note must be printable text", field="note")
    return note


def _status(status: Any) -> int:
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        raise invalid_request("status must be an integer from 200 to 599", field="status")
    return status


def _body(text: Any) -> bytes:
    if not isinstance(text, str) or not _encodable(text):
        raise invalid_request("body must be text", field="body")
    data = text.encode()
    if len(data) > RESOLVE_BODY_MAX:
        raise invalid_request(f"body must be at most {RESOLVE_BODY_MAX} bytes", field="body")
    return data


def _content_type(value: Any) -> str:
    if not isinstance(value, str) or not _CONTENT_TYPE.fullmatch(value):
        raise invalid_request("content_type must be a media type", field="content_type")
    return value


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


# --- JSON shapes ---------------------------------------------------------------------------


def key_view(record: KeyRecord, now: float) -> dict[str, Any]:
    """The idempotency record without its stored body (`models.KeyRecord`)."""
    return to_json(key_model(record, now))


def key_model(record: KeyRecord, now: float) -> models.KeyRecord:
    """Replayed bodies can hold anything an upstream answered (tokens, personal
    data): only their size and hash are shown."""
    return models.KeyRecord(
        destination=record.destination,
        key=record.key,
        state=record.state_at(now),
        fingerprint=record.fingerprint,
        attempt=record.attempt,
        status=record.status,
        attempts=record.attempts,
        job_id=record.job_id,
        generation=record.generation,
        owner=record.owner,
        created_at=utc_time(record.created_at),
        updated_at=utc_time(record.updated_at),
        completed_at=rfc3339(record.completed_at),
        deadline=utc_time(record.deadline),
        response_headers=[[name, value] for name, value in record.headers],
        body_bytes=len(record.body),
        body_sha256=hashlib.sha256(record.body).hexdigest() if record.body else None,
        body_omitted=record.body_omitted,
    )
