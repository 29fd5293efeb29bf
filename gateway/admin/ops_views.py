"""Query parsing and JSON shapes of the operator's routes (SPEC 4): keys, resolve,
audit, summary, and the rejection export. Shared by the JSON API (`ops_api`)
and the page (`ops_page`), like `views` is for rejections.
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from gateway.admin import models
from gateway.admin.models import CONTENT_TYPE, NOTE_MAX, ResolveRequest
from gateway.admin.views import (
    DECIMAL_ID,
    MAX_LIMIT,
    MAX_LOOKBACK_S,
    decode_cursor,
    encode_cursor,
    only_params,
    parse_time,
    parse_window,
    rejection_item,
    utc_time,
)
from gateway.http.problem import invalid_request
from gateway.http.schema import field_names, to_json
from gateway.policy.decision import KeyState
from gateway.store.admin_records import (
    AuditEntry,
    AuditQuery,
    KeyQuery,
    Resolution,
    Summary,
    summary_fits,
)
from gateway.store.records import StoredRejection
from leases.model import IDENT

KEY_FILTERS = ("destination", "state", "job_id", "since", "until", "limit", "cursor")
AUDIT_FILTERS = ("since", "until", "limit", "cursor")
SUMMARY_FILTERS = ("since", "until")
DEFAULT_SUMMARY_WINDOW_S = 86400.0
PRESETS = ("15m", "1h", "24h", "7d")  # the page's time filters
REFRESH_S = 30  # the page's auto-refresh period
RESOLVE_BODY_MAX = 1024 * 1024  # the stored answer; the request may be a little larger
RESOLVE_REQUEST_MAX = RESOLVE_BODY_MAX * 2 + 16 * 1024  # JSON escaping can double it
_RESOLVE_FIELDS = set(field_names(ResolveRequest))
_CONTENT_TYPE = re.compile(CONTENT_TYPE)
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_KEY_CURSOR_PREFIX = "k1:"
_AUDIT_CURSOR_PREFIX = "a1:"


# --- queries -------------------------------------------------------------------------------


def _limit(text: str) -> int:
    if not text:
        return 100
    if not re.fullmatch(r"[0-9]{1,7}", text) or not 1 <= int(text) <= MAX_LIMIT:
        raise invalid_request(f"limit must be an integer from 1 to {MAX_LIMIT}")
    return int(text)


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
        limit=_limit(value["limit"]),
        after=decode_key_cursor(value["cursor"]) if value["cursor"] else None,
    )


def parse_audit_query(params: Mapping[str, str], now: float) -> AuditQuery:
    only_params(params, AUDIT_FILTERS)
    value = {name: params.get(name, "") for name in AUDIT_FILTERS}
    since, until = parse_window(value["since"], value["until"], now)
    return AuditQuery(
        since=since,
        until=until,
        limit=_limit(value["limit"]),
        before_id=decode_cursor(value["cursor"], _AUDIT_CURSOR_PREFIX) if value["cursor"] else None,
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
    return Resolution(
        destination,
        key,
        attempt,
        True,
        note,
        remote,
        status=_status(body.get("status", 200)),
        body=_body(body.get("body", "")),
        content_type=_content_type(body.get("content_type", "application/json")),
    )


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


def audit_item(entry: AuditEntry) -> dict[str, Any]:
    """`models.AuditEntry`."""
    return to_json(_audit_model(entry))


def audit_page(entries: list[AuditEntry], limit: int) -> dict[str, Any]:
    """One page of `entries` (read `limit` + 1, to know whether another follows)."""
    items = [_audit_model(e) for e in entries[:limit]]
    return to_json(models.AuditPage(items=items, next_cursor=audit_cursor(entries, limit)))


def _audit_model(entry: AuditEntry) -> models.AuditEntry:
    return models.AuditEntry(
        id=entry.id,
        at=utc_time(entry.at),
        action=entry.action,
        destination=entry.destination,
        key=entry.key,
        attempt=entry.attempt,
        note=entry.note,
        remote=entry.remote,
    )


def audit_cursor(items: list[AuditEntry], limit: int) -> str | None:
    return encode_cursor(items[limit - 1].id, _AUDIT_CURSOR_PREFIX) if len(items) > limit else None


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
