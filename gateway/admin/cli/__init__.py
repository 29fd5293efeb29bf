"""The admin commands (`sinkgate rejections`, `sinkgate keys [resolve]`): clients of
a running gateway's admin listener.

`add_parsers` declares their options once, on the `sinkgate` parser that users
run and the tests drive; `client` is how they reach the listener (its URL from
`--admin`, `$SINKGATE_ADMIN_URL` or the config file, TLS, the token, cursors);
`rejections` and `keys` print what it reads. This module imports only argparse,
so `sinkgate --help` stays cheap.
"""

from __future__ import annotations

import argparse
from typing import Any

PAGE_MAX = 1000  # the most rows one admin page holds
DEFAULT_LIMIT = 100
STATES = ("in_flight", "completed", "unknown")


def add_parsers(commands: Any) -> None:
    """`rejections` and `keys` (with `keys resolve`) on the `sinkgate` parser."""
    rejections = commands.add_parser("rejections", help="list rejected writes")
    _add_connection(rejections)
    rejections.add_argument("--reason", metavar="R", help="only this rejection reason")
    rejections.add_argument("--job", metavar="J", help="only this job id")
    rejections.add_argument("--destination", metavar="D", help="only this destination")
    _add_window(rejections, "newer", "older")
    _add_listing(rejections)

    keys = commands.add_parser("keys", help="list idempotency records; resolve unknown ones")
    _add_connection(keys)
    keys.add_argument("--state", choices=STATES, help="only keys in this (effective) state")
    keys.add_argument("--destination", metavar="D", help="only this destination")
    keys.add_argument("--job", metavar="J", help="only this job id")
    _add_window(keys, "changed since", "changed until")
    _add_listing(keys)
    sub = keys.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")
    resolve = sub.add_parser("resolve", help="settle an unknown outcome")
    _add_connection(resolve)
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


def _add_connection(parser: argparse.ArgumentParser) -> None:
    """Where the admin listener is, and how to trust it. A subcommand repeats them
    (`keys resolve --admin URL`); given before it, they are kept (SUPPRESS)."""
    default = argparse.SUPPRESS if parser.prog.endswith("resolve") else None
    parser.add_argument(
        "--admin",
        metavar="URL",
        default=default,
        help="admin listener (default: $SINKGATE_ADMIN_URL, else admin_listen in the "
        "config, else http://127.0.0.1:8481); the token is read from $SINKGATE_ADMIN_TOKEN",
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=default,
        help="gateway config to find the admin listener in "
        "(default: $SINKGATE_CONFIG or config/gateway.toml when it exists)",
    )
    parser.add_argument(
        "--cacert",
        metavar="FILE",
        default=default,
        help="PEM bundle the admin listener's certificate must chain to (https://)",
    )


def _add_window(parser: argparse.ArgumentParser, since: str, until: str) -> None:
    parser.add_argument("--since", metavar="WHEN", help=f"{since}: 30m, 1h, 7d or RFC 3339")
    parser.add_argument("--until", metavar="WHEN", help=f"{until}: 30m, 1h, 7d or RFC 3339")


def _add_listing(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--limit",
        metavar="N",
        type=_limit,
        default=DEFAULT_LIMIT,
        help=f"at most N rows (1..{PAGE_MAX}; default {DEFAULT_LIMIT})",
    )
    parser.add_argument("--all", action="store_true", help="every match (follows the cursor)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")


def _limit(text: str) -> int:
    """An argparse type: a whole number in 1..PAGE_MAX."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 1 <= value <= PAGE_MAX:
        raise argparse.ArgumentTypeError(f"must be 1..{PAGE_MAX}, got {value}")
    return value
