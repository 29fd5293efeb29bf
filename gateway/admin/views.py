"""What the admin listener reads from the store and the JSON it shows it as.

The rejection filters of SPEC 4 (query parsing, RFC 3339 times, page cursors),
the reads that fetch one page or one rejection, and the JSON shapes of a
rejection, a job and an idempotency key. Both the JSON API in `admin` and the
HTML page in `admin_page` use them, so they live apart from either: a filter
or a field reads the same whichever way it is asked for. Nothing here knows
about routes, auth or the page's markup.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from gateway.admin import models
from gateway.errors import STATUS_BY_REASON, Rejection
from gateway.http.problem import invalid_request
from gateway.http.schema import to_json
from gateway.policy.decision import KeyRecord
from gateway.store.protocol import AdminStore
from gateway.store.records import JobState, RejectionQuery, StoredRejection
from leases.model import IDENT, MAX_GENERATION, expires_in
from leases.reasons import Reason

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
FILTERS = ("destination", "job_id", "reason", "since", "until", "limit", "cursor")

# A destination or job id as the gateway accepts it, and a positive decimal id
# (a rejection id, a cursor bound, a session expiry).
DECIMAL_ID = re.compile(r"[1-9][0-9]{0,18}")

_RFC3339 = re.compile(
    r"(\d{4}-\d{2}-\d{2})[Tt ](\d{2}:\d{2}:\d{2})(?:\.(\d{1,64}))?([Zz]|[+-]\d{2}:\d{2})"
)
_CURSOR_PREFIX = "r1:"
_RELATIVE = re.compile(r"([0-9]{1,9}(?:\.[0-9]{1,6})?)(ms|s|m|h|d|w)")
# The config's duration units (ms too), and weeks.
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_LOOKBACK_S = 100 * 365 * 86400


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
    return rows, encode_cursor(rows[-1].id)


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
    limit = DEFAULT_LIMIT
    if value["limit"]:
        if not re.fullmatch(r"[0-9]{1,7}", value["limit"]) or not (
            1 <= int(value["limit"]) <= MAX_LIMIT
        ):
            raise invalid_request(f"limit must be an integer from 1 to {MAX_LIMIT}")
        limit = int(value["limit"])
    return RejectionQuery(
        destination=value["destination"] or None,
        job_id=value["job_id"] or None,
        reason=value["reason"] or None,
        since=since,
        until=until,
        limit=limit,
        before_id=decode_cursor(value["cursor"]) if value["cursor"] else None,
    )


def only_params(
    params: Mapping[str, str], allowed: tuple[str, ...], *, formats: tuple[str, ...] = ()
) -> None:
    """Refuse unknown or repeated query parameters; `format` (json, or one of the
    route's own `formats`; empty counts as unset, as a form sends it) is always
    allowed."""
    names = [name for name, _ in params.items()]
    unknown = sorted({n for n in names if n not in allowed and n != "format"})
    if unknown:
        raise invalid_request(f"unknown query parameter(s): {', '.join(unknown)[:200]}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise invalid_request(f"query parameter(s) given twice: {', '.join(repeated)}")
    known = ("json", *formats)
    if (params.get("format") or "json") not in known:
        raise invalid_request(f"format must be one of {', '.join(known)}")


def parse_window(
    since_text: str, until_text: str, now: float | None
) -> tuple[float | None, float | None]:
    """`since` and `until` (either may be empty: not set), in epoch seconds."""
    since = parse_time(since_text, "since", now) if since_text else None
    until = parse_time(until_text, "until", now) if until_text else None
    if since is not None and until is not None and since > until:
        raise invalid_request("since is after until")
    return since, until


def parse_time(text: str, name: str, now: float | None = None) -> float:
    """RFC 3339 date-time with an offset (`Z` or `+hh:mm`), or a duration back from
    `now` (`15m`, `1h`, `7d`; units ms, s, m, h, d, w) -> seconds since the epoch."""
    relative = _RELATIVE.fullmatch(text)
    if relative is not None:
        seconds = float(relative.group(1)) * _UNITS[relative.group(2)]
        if seconds > MAX_LOOKBACK_S:
            raise invalid_request(f"{name} reaches back more than 100 years")
        return (time.time() if now is None else now) - seconds
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise invalid_request(
            f"{name} must be a duration back from now (15m, 1h, 7d) or an RFC 3339 "
            "date-time, e.g. 2024-05-01T12:00:00Z"
        )
    day, clock, fraction, offset = match.groups()
    offset = "+00:00" if offset in ("Z", "z") else offset
    # RFC 3339 allows a leap second (:60); Python's datetime does not: read it as
    # the first instant of the next minute. Fraction digits past microseconds are
    # dropped.
    leap = clock.endswith(":60")
    if leap:
        clock = clock[:-2] + "59"
    iso = f"{day}T{clock}{'.' + (fraction + '00000')[:6] if fraction and not leap else ''}{offset}"
    try:
        return datetime.fromisoformat(iso).timestamp() + (1.0 if leap else 0.0)
    except (ValueError, OverflowError):
        raise invalid_request(
            f"{name} is not a valid date-time: check the day of the month, hours "
            "00-23, minutes 00-59 and an offset of at most 23:59"
        ) from None


def rfc3339(ts: float | None) -> str | None:
    return None if ts is None else utc_time(ts)


def utc_time(ts: float) -> str:
    """`ts` as RFC 3339 in UTC with microseconds: `2026-11-30T13:45:00.123456Z`."""
    moment = datetime.fromtimestamp(ts, UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def encode_cursor(before_id: int, prefix: str = _CURSOR_PREFIX) -> str:
    """An opaque cursor; `prefix` names the list it pages (a rejections cursor is
    refused by the audit log and the other way round)."""
    raw = f"{prefix}{before_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, prefix: str = _CURSOR_PREFIX) -> int:
    try:
        if len(cursor) > 64:
            raise ValueError("too long")
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raw = ""
    number = raw.removeprefix(prefix)
    if not raw.startswith(prefix) or not DECIMAL_ID.fullmatch(number):
        raise invalid_request("cursor is not one this server handed out")
    if int(number) > MAX_GENERATION:
        raise invalid_request("cursor is not one this server handed out")
    return int(number)


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


def job_view(state: JobState, now: float) -> dict[str, Any]:
    """`models.JobState`: the lease, the fence mark, attempts on the wire."""
    lease = state.lease
    return to_json(
        models.JobState(
            job_id=state.job_id,
            server_time=utc_time(now),
            lease=None
            if lease is None
            else models.JobLease(
                job_id=lease.job_id,
                owner=lease.owner,
                generation=lease.generation,
                state=str(lease.state),
                lease_until=utc_time(lease.lease_until),
                expires_in=expires_in(lease, now),
            ),
            highest_generation=state.highest_generation,
            in_flight=[
                models.InFlightAttempt(
                    attempt=a.get("attempt"),
                    generation=a.get("generation"),
                    destination=a.get("destination"),
                    key=a.get("key"),
                    started_at=rfc3339(a.get("started_at")),
                    deadline=rfc3339(a.get("deadline")),
                )
                for a in state.in_flight
            ],
            recent_rejections=[rejection_model(r) for r in state.recent_rejections],
        )
    )


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
