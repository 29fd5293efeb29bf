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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

from gateway.admin.cli.client import (
    CliError,
    connect,
    follow_pages,
    format_rows,
    page_hint,
    page_limit,
    passed_over_config,
    to_rfc3339,
)

BODY_FILE_MAX = 1024 * 1024
COLUMNS = ("UPDATED (UTC)", "STATE", "DESTINATION", "KEY", "JOB", "GEN", "TRIES", "STATUS")


def main(
    args: argparse.Namespace, *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """Run `sinkgate keys [resolve]`; returns the exit status."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    command = "keys resolve" if getattr(args, "keys_command", None) == "resolve" else "keys"
    if notice := passed_over_config(args):
        print(f"sinkgate {command}: {notice}", file=err)
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
        print(f"(more keys match: {more_hint(len(items))})", file=out)
    return 0


def fetch(args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool]:
    """Up to `--limit` records (every one with `--all`), following cursors."""
    now = datetime.now(UTC)
    params = {
        "state": args.state,
        "destination": args.destination,
        "job_id": args.job,
        "since": to_rfc3339(args.since, now, "--since"),
        "until": to_rfc3339(args.until, now, "--until"),
    }
    return follow_pages(connect(args), "/admin/keys", params, limit=page_limit(args))


def resolve(args: argparse.Namespace) -> str:
    """Read the key, check it is unknown, send the verdict with its attempt."""
    admin = connect(args)
    if args.not_applied and (args.status is not None or args.body_file or args.content_type):
        raise CliError("--status, --body-file and --content-type go with --applied only")
    path = f"/admin/keys/{quote(args.destination, safe='')}/{quote(args.key, safe='')}"
    record = admin.request(path)
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
    after = admin.request(path + "/resolve", body)
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


def more_hint(shown: int) -> str:
    return page_hint(shown, "--state, --destination, --job, --since or --until")
