"""`sinkgate rejections`: the rejection log of a running gateway, in the terminal.

Reads `GET /admin/rejections` of the admin listener with the token from
`SINKGATE_ADMIN_TOKEN`, and prints an aligned table (or JSON lines with --json).
Every failure is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO
from urllib.parse import urlencode, urlsplit

from leases.model import VISIBLE

DEFAULT_ADMIN_URL = "http://127.0.0.1:8481"
TOKEN_ENV = "SINKGATE_ADMIN_TOKEN"
ADMIN_URL_ENV = "SINKGATE_ADMIN_URL"
PAGE_MAX = 1000
DEFAULT_LIMIT = 100
TIMEOUT_S = 15.0
CELL_MAX = 48

_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
COLUMNS = ("WHEN (UTC)", "REASON", "JOB", "GEN/CUR", "DESTINATION", "REQUEST", "KEY")


class CliError(Exception):
    """A failure worth one line on stderr."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `sinkgate rejections`, for the command line module to reuse."""
    parser.add_argument("--admin", help="admin listener URL (default: $SINKGATE_ADMIN_URL)")
    parser.add_argument("--reason", help="only this reason, e.g. stale_generation")
    parser.add_argument("--job", help="only this job id")
    parser.add_argument("--destination", help="only this destination")
    parser.add_argument("--since", help="newer than: 30m, 1h, 7d or an RFC 3339 time")
    parser.add_argument("--until", help="older than: 30m, 1h, 7d or an RFC 3339 time")
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="rows to show")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--all", action="store_true", help="every match (follows the cursor)")


def admin_url_default() -> str:
    """`$SINKGATE_ADMIN_URL`, else the admin listener's default address."""
    return os.environ.get(ADMIN_URL_ENV) or DEFAULT_ADMIN_URL


def check_reason(reason: str | None) -> None:
    """An unknown reason is refused here, naming the valid ones (the server would
    only say it is unknown)."""
    if not reason:
        return
    from leases.reasons import REASONS, RECORDED_REASONS  # the one table, lazily

    if reason not in RECORDED_REASONS:
        what = "is never in the rejection log" if reason in REASONS else "is not a reason"
        raise CliError(f"{reason!r} {what}; the log's reasons: {', '.join(RECORDED_REASONS)}")


def main(
    args: argparse.Namespace,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    now: datetime | None = None,
) -> int:
    """Run `sinkgate rejections`; returns the exit status."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    try:
        check_reason(getattr(args, "reason", None))
        items, more = fetch(args, now or datetime.now(UTC))
    except CliError as exc:
        print(f"sinkgate rejections: {exc}", file=err)
        return 1
    if getattr(args, "json", False):
        for item in items:
            print(json.dumps(item, separators=(",", ":")), file=out)
        return 0
    print(format_table(items), file=out)
    if more:
        print(f"(more rejections match: {_more_hint(len(items))})", file=out)
    return 0


def _more_hint(shown: int) -> str:
    narrow = "narrow them with --reason, --job, --destination, --since or --until"
    if shown < PAGE_MAX:
        return f"raise --limit (up to {PAGE_MAX}), show them all with --all, or {narrow}"
    return f"show them all with --all, or {narrow}"


def fetch(args: argparse.Namespace, now: datetime) -> tuple[list[dict[str, Any]], bool]:
    """Up to `--limit` items, following cursors; and whether more matched."""
    base = admin_base(args)
    limit = getattr(args, "limit", None) or DEFAULT_LIMIT
    if limit < 1:
        raise CliError("--limit must be at least 1")
    if getattr(args, "all", False):
        limit = sys.maxsize
    params = {
        "reason": getattr(args, "reason", None),
        "job_id": getattr(args, "job", None),
        "destination": getattr(args, "destination", None),
        "since": to_rfc3339(getattr(args, "since", None), now, "--since"),
        "until": to_rfc3339(getattr(args, "until", None), now, "--until"),
    }
    params = {k: v for k, v in params.items() if v}
    items: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        page_params = {**params, "limit": str(min(PAGE_MAX, limit - len(items)))}
        if cursor:
            page_params["cursor"] = cursor
        page = admin_request(f"{base}/admin/rejections?{urlencode(page_params)}", base)
        found = page.get("items") if isinstance(page, dict) else None
        cursor = page.get("next_cursor") if isinstance(page, dict) else None
        if not isinstance(found, list) or not (cursor is None or isinstance(cursor, str)):
            raise CliError(f"{base} did not answer like a sinkgate admin listener")
        items.extend(found)
        if cursor is None or len(items) >= limit:
            return items, cursor is not None


def to_rfc3339(value: str | None, now: datetime, option: str) -> str | None:
    """`250ms`, `30m`, `1h`, `7d`, `2w` ago -> RFC 3339 UTC; anything else is sent as
    it is."""
    if not value:
        return None
    match = _RELATIVE.fullmatch(value.strip())
    if match is None:
        return value
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    try:
        moment = now.astimezone(UTC) - timedelta(seconds=seconds)
    except OverflowError as exc:
        raise CliError(f"{option} {value!r} reaches too far back") from exc
    precision = "seconds" if moment.microsecond == 0 else "milliseconds"
    return moment.isoformat(timespec=precision).replace("+00:00", "Z")


def admin_base(args: argparse.Namespace) -> str:
    """The admin listener's base URL from `--admin` (or its default), checked; an
    error names where the URL came from."""
    given = getattr(args, "admin", None)
    source = "--admin" if given else ADMIN_URL_ENV
    base = str(given or admin_url_default()).rstrip("/")
    try:
        parts = urlsplit(base)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        raise CliError(f"{source} {base!r} is not a valid URL: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CliError(f"{source} must be an http:// or https:// URL, not {base!r}")
    return base


def admin_request(url: str, base: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """GET `url` (or POST `body` as JSON) with the admin token; the JSON answer."""
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if body is not None:
        request.data = json.dumps(body).encode()
        request.add_header("Content-Type", "application/json")
        request.method = "POST"
    token = os.environ.get(TOKEN_ENV)
    if token:
        if not VISIBLE.fullmatch(token):
            raise CliError(f"{TOKEN_ENV} holds characters a header cannot carry")
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            answer: dict[str, Any] = json.load(response)
            return answer
    except urllib.error.HTTPError as exc:
        detail = _problem_detail(exc)
        if exc.code == 401:
            hint = (
                "the admin token was refused; check " + TOKEN_ENV
                if token
                else f"the admin listener needs a token: set {TOKEN_ENV}"
            )
            raise CliError(f"unauthorized at {base}: {hint}") from exc
        if exc.code in (404, 409):
            raise CliError(f"{detail} ({exc.code})") from exc
        raise CliError(f"{base} answered {exc.code}: {detail}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CliError(f"cannot reach the admin listener at {base}: {reason}") from exc
    except ValueError as exc:
        raise CliError(f"{base} did not answer JSON: {exc}") from exc


def _problem_detail(exc: urllib.error.HTTPError) -> str:
    try:
        problem = json.loads(exc.read(64 * 1024))
        return str(problem.get("detail") or problem.get("reason") or exc.reason)
    except (ValueError, AttributeError, OSError):
        return str(exc.reason)


def format_table(items: list[dict[str, Any]]) -> str:
    """An aligned, plain-text table; control characters are shown as `?`."""
    return format_rows(COLUMNS, [_cells(item) for item in items], empty="no rejections match")


def format_rows(columns: tuple[str, ...], cells: list[tuple[Any, ...]], *, empty: str) -> str:
    """Aligned columns under a header; values through `_cell` (no control characters)."""
    if not cells:
        return empty
    rows = [columns, *(tuple(_cell(v) for v in row) for row in cells)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def _cells(item: dict[str, Any]) -> tuple[str, ...]:
    current = item.get("current_generation")
    if current is None:
        current = item.get("highest_generation")
    when = str(item.get("at") or "")[:19].replace("T", " ")
    request = f"{item.get('method') or ''} {item.get('path') or ''}".strip()
    return tuple(
        _cell(v)
        for v in (
            when,
            item.get("reason"),
            item.get("job_id"),
            f"{_dash(item.get('generation'))}/{_dash(current)}",
            item.get("destination"),
            request,
            item.get("idempotency_key"),
        )
    )


def _cell(value: object) -> str:
    text = _UNPRINTABLE.sub("?", _dash(value))
    return text if len(text) <= CELL_MAX else text[: CELL_MAX - 1] + "…"


def _dash(value: object) -> str:
    return "-" if value is None or value == "" else str(value)
