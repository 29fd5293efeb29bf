"""`sinkgate rejections`: the rejection log of a running gateway, in the terminal.

Reads `GET /admin/rejections` of the admin listener (see `client` for where it
is and the token) and prints an aligned table, or JSON lines with --json.
Every failure is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

from gateway.admin.cli.client import (
    CliError,
    connect,
    dash,
    follow_pages,
    format_rows,
    page_hint,
    page_limit,
    passed_over_config,
    to_rfc3339,
)

COLUMNS = ("WHEN (UTC)", "REASON", "JOB", "GEN/CUR", "DESTINATION", "REQUEST", "KEY")


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
    if notice := passed_over_config(args):
        print(f"sinkgate rejections: {notice}", file=err)
    try:
        check_reason(args.reason)
        items, more = fetch(args, now or datetime.now(UTC))
    except CliError as exc:
        print(f"sinkgate rejections: {exc}", file=err)
        return 1
    if args.json:
        for item in items:
            print(json.dumps(item, separators=(",", ":")), file=out)
        return 0
    print(format_table(items), file=out)
    if more:
        print(f"(more rejections match: {more_hint(len(items))})", file=out)
    return 0


def more_hint(shown: int) -> str:
    return page_hint(shown, "--reason, --job, --destination, --since or --until")


def fetch(args: argparse.Namespace, now: datetime) -> tuple[list[dict[str, Any]], bool]:
    """Up to `--limit` items (every one with `--all`), following cursors; and
    whether more matched."""
    params = {
        "reason": args.reason,
        "job_id": args.job,
        "destination": args.destination,
        "since": to_rfc3339(args.since, now, "--since"),
        "until": to_rfc3339(args.until, now, "--until"),
    }
    return follow_pages(connect(args), "/admin/rejections", params, limit=page_limit(args))


def format_table(items: list[dict[str, Any]]) -> str:
    """An aligned, plain-text table; control characters are shown as `?`."""
    return format_rows(COLUMNS, [_cells(item) for item in items], empty="no rejections match")


def _cells(item: dict[str, Any]) -> tuple[Any, ...]:
    current = item.get("current_generation")
    if current is None:
        current = item.get("highest_generation")
    when = str(item.get("at") or "")[:19].replace("T", " ")
    request = f"{item.get('method') or ''} {item.get('path') or ''}".strip()
    return (  # format_rows cleans and cuts them, the key and the job never
        when,
        item.get("reason"),
        item.get("job_id"),
        f"{dash(item.get('generation'))}/{dash(current)}",
        item.get("destination"),
        request,
        item.get("idempotency_key"),
    )
