"""`sinkgate keys` and `sinkgate keys resolve`: the idempotency records of a running
gateway, and settling an unknown outcome from the terminal.

`keys resolve` reads the key first and sends the attempt it names along, so
the gateway refuses the verdict (409 `attempt_mismatch`) if a retry took the
key over in between. Every failure is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote, urlencode

from gateway.admin.cli.rejections import (
    PAGE_MAX,
    CliError,
    admin_base,
    admin_request,
    format_rows,
    to_rfc3339,
)

STATES = ("in_flight", "completed", "unknown")
BODY_FILE_MAX = 1024 * 1024
COLUMNS = ("UPDATED (UTC)", "STATE", "DESTINATION", "KEY", "JOB", "GEN", "TRIES", "STATUS")


def add_parser(commands: Any) -> None:
    """`keys` and its `resolve` subcommand, on the `sinkgate` parser."""
    keys = commands.add_parser("keys", help="list idempotency records; resolve unknown ones")
    _add_admin(keys)
    keys.add_argument("--state", choices=STATES, help="only keys in this (effective) state")
    keys.add_argument("--destination", metavar="D", help="only this destination")
    keys.add_argument("--job", metavar="J", help="only this job id")
    keys.add_argument("--since", metavar="WHEN", help="changed since: 1h, 7d or RFC 3339")
    keys.add_argument("--until", metavar="WHEN", help="changed until: 1h, 7d or RFC 3339")
    keys.add_argument("--limit", metavar="N", type=int, default=100, help="at most N rows")
    keys.add_argument("--all", action="store_true", help="every match (follows the cursor)")
    keys.add_argument("--json", action="store_true", help="one JSON object per line")
    sub = keys.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")
    resolve = sub.add_parser("resolve", help="settle an unknown outcome")
    _add_admin(resolve)
    resolve.add_argument("destination", metavar="DESTINATION")
    resolve.add_argument("key", metavar="KEY")
    verdict = resolve.add_mutually_exclusive_group(required=True)
    verdict.add_argument("--applied", action="store_true", help="the destination applied it")
    verdict.add_argument(
        "--not-applied", action="store_true", help="it did not: release the key for a retry"
    )
    resolve.add_argument("--status", type=int, help="with --applied: the status to replay (200)")
    resolve.add_argument("--body-file", metavar="F", help="with --applied: the body to replay")
    resolve.add_argument("--content-type", metavar="T", help="with --applied: application/json")
    resolve.add_argument("--note", required=True, help="what you checked at the destination")


def _add_admin(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admin",
        metavar="URL",
        help="admin listener (default: $SINKGATE_ADMIN_URL or http://127.0.0.1:8481); "
        "the token is read from $SINKGATE_ADMIN_TOKEN",
    )


def main(
    args: argparse.Namespace, *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """Run `sinkgate keys [resolve]`; returns the exit status."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    command = "keys resolve" if getattr(args, "keys_command", None) == "resolve" else "keys"
    try:
        if command == "keys resolve":
            print(resolve(args), file=out)
            return 0
        items, more = fetch(args)
    except CliError as exc:
        print(f"sinkgate {command}: {exc}", file=err)
        return 1
    if args.json:
        for item in items:
            print(json.dumps(item, separators=(",", ":")), file=out)
        return 0
    print(format_rows(COLUMNS, [_cells(i) for i in items], empty="no keys match"), file=out)
    if more:
        print("(more keys match: raise --limit, use --all, or narrow the filters)", file=out)
    return 0


def fetch(args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool]:
    """Up to `--limit` records (every one with `--all`), following cursors."""
    from datetime import UTC, datetime

    base = admin_base(args)
    limit = sys.maxsize if args.all else args.limit
    if limit < 1:
        raise CliError("--limit must be at least 1")
    now = datetime.now(UTC)
    params = {
        "state": args.state,
        "destination": args.destination,
        "job_id": args.job,
        "since": to_rfc3339(args.since, now, "--since"),
        "until": to_rfc3339(args.until, now, "--until"),
    }
    params = {k: v for k, v in params.items() if v}
    items: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        page_params = {**params, "limit": str(min(PAGE_MAX, limit - len(items)))}
        if cursor:
            page_params["cursor"] = cursor
        page = admin_request(f"{base}/admin/keys?{urlencode(page_params)}", base)
        found, cursor = page.get("items"), page.get("next_cursor")
        if not isinstance(found, list):
            raise CliError(f"{base} did not answer like a sinkgate admin listener")
        items.extend(found)
        if cursor is None or len(items) >= limit:
            return items, cursor is not None


def resolve(args: argparse.Namespace) -> str:
    """Read the key, check it is unknown, send the verdict with its attempt."""
    base = admin_base(args)
    if args.not_applied and (args.status is not None or args.body_file or args.content_type):
        raise CliError("--status, --body-file and --content-type go with --applied only")
    path = f"/admin/keys/{quote(args.destination, safe='')}/{quote(args.key, safe='')}"
    record = admin_request(base + path, base)
    if record.get("state") != "unknown":
        raise CliError(
            f"{args.destination}/{args.key} is {record.get('state')}, not unknown: "
            "nothing to resolve"
        )
    body: dict[str, Any] = {
        "outcome": "applied" if args.applied else "not_applied",
        "attempt": record.get("attempt"),
        "note": args.note,
    }
    if args.applied:
        if args.status is not None:
            body["status"] = args.status
        if args.content_type:
            body["content_type"] = args.content_type
        if args.body_file:
            body["body"] = _read_body(args.body_file)
    after = admin_request(base + path + "/resolve", base, body)
    if args.applied:
        return (
            f"resolved {args.destination}/{args.key} as applied (status {after.get('status')}): "
            "retries replay it"
        )
    return f"resolved {args.destination}/{args.key} as not applied: the next retry is forwarded"


def _read_body(name: str) -> str:
    path = Path(name)
    try:
        if path.stat().st_size > BODY_FILE_MAX:
            raise CliError(f"--body-file {name} is over {BODY_FILE_MAX} bytes")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read --body-file {name}: {exc}") from exc


def _cells(item: dict[str, Any]) -> tuple[Any, ...]:
    return (
        str(item.get("updated_at") or "")[:19].replace("T", " "),
        item.get("state"),
        item.get("destination"),
        item.get("key"),
        item.get("job_id"),
        item.get("generation"),
        item.get("attempts"),
        item.get("status"),
    )
