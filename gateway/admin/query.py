"""What every admin list reads from its query string: the time filters of SPEC 4
(RFC 3339 or a duration back from now), `limit`, opaque page cursors, and the
refusal of unknown or repeated parameters. Each resource (rejections, keys,
audit) builds its own filters from these, for the JSON API and the page alike.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime

from gateway.admin.durations import seconds_back
from gateway.http.problem import invalid_request
from leases.model import MAX_GENERATION

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000

# A destination or job id as the gateway accepts it, and a positive decimal id
# (a rejection id, a cursor bound, a session expiry).
DECIMAL_ID = re.compile(r"[1-9][0-9]{0,18}")

_RFC3339 = re.compile(
    r"(\d{4}-\d{2}-\d{2})[Tt ](\d{2}:\d{2}:\d{2})(?:\.(\d{1,64}))?([Zz]|[+-]\d{2}:\d{2})",
    re.ASCII,  # `\d` is any script's digit otherwise
)
MAX_LOOKBACK_S = 100 * 365 * 86400


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


def is_duration(text: str) -> bool:
    """Whether `text` is a time filter's duration back from now (`15m`), not a date."""
    return seconds_back(text) is not None


def parse_time(text: str, name: str, now: float | None = None) -> float:
    """RFC 3339 date-time with an offset (`Z` or `+hh:mm`), or a duration back from
    `now` (`15m`, `1h`, `7d`; units ms, s, m, h, d, w) -> seconds since the epoch."""
    seconds = seconds_back(text)
    if seconds is not None:
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


def parse_limit(text: str) -> int:
    """`limit`: empty means the default."""
    if not text:
        return DEFAULT_LIMIT
    if not re.fullmatch(r"[0-9]{1,7}", text) or not 1 <= int(text) <= MAX_LIMIT:
        raise invalid_request(f"limit must be an integer from 1 to {MAX_LIMIT}")
    return int(text)


def rfc3339(ts: float | None) -> str | None:
    return None if ts is None else utc_time(ts)


def utc_time(ts: float) -> str:
    """`ts` as RFC 3339 in UTC with microseconds: `2026-11-30T13:45:00.123456Z`."""
    moment = datetime.fromtimestamp(ts, UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def encode_cursor(before_id: int, prefix: str) -> str:
    """An opaque cursor; `prefix` names the list it pages (a rejections cursor is
    refused by the audit log and the other way round)."""
    raw = f"{prefix}{before_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, prefix: str) -> int:
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
