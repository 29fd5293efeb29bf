"""How the admin commands reach a running gateway's admin listener.

Where it is (SPEC 6): `--admin URL`, else `$SINKGATE_ADMIN_URL`, else the config
file (`--config`, `$SINKGATE_CONFIG`, or `config/gateway.toml` when it exists):
its `admin_listen`, with `https://` when the listeners serve TLS; last,
`http://127.0.0.1:8481`. Only `[server]` is read from the file, without the
rest of the validation `serve` does: an operator's terminal need not hold the
upstreams' secrets. `--cacert FILE` names the CA bundle an `https://` listener's
certificate must chain to. Every failure is a `CliError`, one line that says
what to check (an `http://` URL against a TLS listener says it speaks HTTPS).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import ssl
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from gateway.admin.cli import PAGE_MAX
from gateway.admin.durations import seconds_back
from gateway.errors import GatewayError
from leases.model import VISIBLE
from leases.urls import redact_url

DEFAULT_ADMIN_URL = "http://127.0.0.1:8481"
TOKEN_ENV = "SINKGATE_ADMIN_TOKEN"
ADMIN_URL_ENV = "SINKGATE_ADMIN_URL"
CONFIG_ENV = "SINKGATE_CONFIG"
DEFAULT_CONFIG = "config/gateway.toml"
TIMEOUT_S = 15.0
PROBE_TIMEOUT_S = 3.0
CELL_MAX = 48

_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class CliError(GatewayError):
    """A failure worth one line on stderr."""


@dataclass(frozen=True, slots=True)
class Admin:
    """One admin listener: its base URL, where that came from (for messages), and
    the TLS context of an `https://` one."""

    base: str
    source: str
    tls: ssl.SSLContext | None = None

    def request(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """GET `path` (or POST `body` as JSON) with the admin token; the JSON answer."""
        return admin_request(self, path, body)


def connect(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Admin:
    """The admin listener named by the options, the environment or the config."""
    env = os.environ if environ is None else environ
    given = getattr(args, "admin", None)
    if given:
        base, source = str(given), "--admin"
    elif env.get(ADMIN_URL_ENV):
        base, source = env[ADMIN_URL_ENV], ADMIN_URL_ENV
    else:
        base, source = _from_config(getattr(args, "config", None), env)
    base = base.rstrip("/")
    try:
        parts = urlsplit(base)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        raise CliError(f"{source} {base!r} is not a valid URL: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CliError(f"{source} must be an http:// or https:// URL, not {base!r}")
    tls = _tls_context(getattr(args, "cacert", None)) if parts.scheme == "https" else None
    return Admin(base, source, tls)


def passed_over_config(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> str | None:
    """A line for stderr when `--config` was given but `$SINKGATE_ADMIN_URL` wins
    (SPEC 6's order): a --config typed now losing to a variable set long ago would
    otherwise ask another gateway without a word."""
    env = os.environ if environ is None else environ
    if getattr(args, "admin", None) or not getattr(args, "config", None):
        return None
    if not env.get(ADMIN_URL_ENV):
        return None
    return (
        f"asking ${ADMIN_URL_ENV} ({redact_url(env[ADMIN_URL_ENV])}), not --config's "
        "admin_listen: unset it, or pass --admin"
    )


def _from_config(option: str | None, env: Mapping[str, str]) -> tuple[str, str]:
    """(URL, where it came from): the config's `admin_listen`, or the default."""
    named = option or env.get(CONFIG_ENV)
    path = Path(named or DEFAULT_CONFIG)
    if not named and not path.is_file():
        return DEFAULT_ADMIN_URL, "the default admin URL"
    where = "--config" if option else (CONFIG_ENV if named else str(path))
    try:
        with path.open("rb") as fh:
            server = tomllib.load(fh).get("server", {})
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read the config {path} ({where}): {exc}") from exc
    if not isinstance(server, dict):
        raise CliError(f"{path}: [server] is not a table")
    listen = server.get("admin_listen", "127.0.0.1:8481")
    from gateway.config.reader import parse_listen  # the loader's own rule

    try:
        host, port = parse_listen(listen)
    except ValueError as exc:
        raise CliError(f"{path}: server.admin_listen: {exc}") from exc
    host = _WILDCARDS.get(host, host)  # listening everywhere: reach it on loopback
    scheme = "https" if server.get("tls_cert") else "http"
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}", f"server.admin_listen in {path}"


def _tls_context(cacert: str | None) -> ssl.SSLContext:
    if not cacert:
        return ssl.create_default_context()  # the system's CAs (and $SSL_CERT_FILE)
    try:
        return ssl.create_default_context(cafile=cacert)
    except (OSError, ssl.SSLError) as exc:
        raise CliError(f"cannot use --cacert {cacert}: {exc}") from exc


def admin_request(admin: Admin, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """GET `admin.base + path` (or POST `body` as JSON) with the admin token."""
    base = admin.base
    request = urllib.request.Request(base + path, headers={"Accept": "application/json"})
    if body is not None:
        request.data = json.dumps(body, ensure_ascii=False).encode()  # é: 2 bytes, not 6
        request.add_header("Content-Type", "application/json")
        request.method = "POST"
    # Stripped as the gateway strips the variable it reads (a token file's newline).
    token = os.environ.get(TOKEN_ENV, "").strip() or None
    if token:
        if not VISIBLE.fullmatch(token):
            raise CliError(f"{TOKEN_ENV} holds characters a header cannot carry")
        request.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(
        _NoRedirects(), urllib.request.HTTPSHandler(context=admin.tls)
    )
    try:
        with opener.open(request, timeout=TIMEOUT_S) as response:
            answer: dict[str, Any] = json.load(response)
            return answer
    except urllib.error.HTTPError as exc:
        raise _refused(exc, base, token) from exc
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise CliError(
            f"cannot reach the admin listener at {base} (from {admin.source}): {_why(admin, exc)}"
        ) from exc
    except ValueError as exc:
        raise CliError(f"{base} did not answer JSON: {exc}") from exc


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """The admin listener never redirects an API call: a redirect is some other
    server, and following it would send it the admin token (urllib copies the
    header to the new host) and turn a POST into a GET."""

    def redirect_request(self, *args: Any) -> None:
        return None  # urllib then raises the 3xx as an HTTPError


def _refused(exc: urllib.error.HTTPError, base: str, token: str | None) -> CliError:
    if 300 <= exc.code < 400:
        where = _UNPRINTABLE.sub("?", exc.headers.get("Location", "") if exc.headers else "")[:200]
        return CliError(
            f"{base} answered {exc.code}, a redirect{f' to {where}' if where else ''}: "
            "not followed, the admin listener never redirects; check the admin URL"
        )
    detail = _problem_detail(exc)
    if exc.code == 401:
        hint = (
            "the admin token was refused; check " + TOKEN_ENV
            if token
            else f"the admin listener needs a token: set {TOKEN_ENV}"
        )
        return CliError(f"unauthorized at {base}: {hint}")
    if exc.code == 429:
        wait = exc.headers.get("Retry-After", "")
        return CliError(f"too many failed sign-ins from here; try again in {wait or 'a'} s")
    if exc.code == 404 and detail.startswith("no route /admin"):
        # every route the CLI asks for is the admin listener's: likely another one
        return CliError(
            f"{base}: {detail}: is --admin the write listener (give [server] "
            "admin_listen), or a gateway of a release without this route?"
        )
    if exc.code in (404, 409):
        return CliError(f"{detail} ({exc.code})")
    return CliError(f"{base} answered {exc.code}: {detail}")


def _why(admin: Admin, exc: BaseException) -> str:
    """What went wrong, and what to check."""
    reason = getattr(exc, "reason", exc)
    parts = urlsplit(admin.base)
    if isinstance(reason, ssl.SSLCertVerificationError):
        if "hostname mismatch" in str(reason.verify_message).lower():
            # The chain was trusted: another CA would not help, another name would.
            return (
                f"its certificate does not name {parts.hostname} ({reason.verify_message}): "
                "use an admin URL with a name the certificate has (--admin)"
            )
        return (
            f"its certificate was not accepted ({reason.verify_message}): "
            "name the CA it chains to with --cacert FILE"
        )
    if isinstance(reason, ssl.SSLError) and "WRONG_VERSION_NUMBER" in str(reason):
        return "this listener speaks plain HTTP: use http://"
    refused = isinstance(reason, ConnectionRefusedError | socket.timeout | TimeoutError)
    if parts.scheme == "http" and not refused and _speaks_tls(parts.hostname, parts.port):
        secure = admin.base.replace("http://", "https://", 1)
        return f"this listener speaks HTTPS: use {secure} (and --cacert FILE for its CA)"
    return str(reason)


def _speaks_tls(host: str | None, port: int | None) -> bool:
    """Whether a TLS handshake succeeds at host:port (the certificate unchecked: this
    only tells which protocol to use)."""
    probe = ssl.create_default_context()
    probe.check_hostname = False
    probe.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host or "", port or 80), timeout=PROBE_TIMEOUT_S) as raw:
            with probe.wrap_socket(raw, server_hostname=host):
                return True
    except (OSError, ssl.SSLError):
        return False


def _problem_detail(exc: urllib.error.HTTPError) -> str:
    try:
        problem = json.loads(exc.read(64 * 1024))
        return str(problem.get("detail") or problem.get("reason") or exc.reason)
    except (ValueError, AttributeError, OSError):
        return str(exc.reason)


def follow_pages(
    admin: Admin, path: str, params: Mapping[str, str | None], *, limit: int
) -> tuple[list[dict[str, Any]], bool]:
    """Up to `limit` items of a paged admin list (`{"items", "next_cursor"}`),
    following cursors; and whether more matched. Unset filters are not sent."""
    sent = {k: v for k, v in params.items() if v}
    items: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        page_params = {**sent, "limit": str(min(PAGE_MAX, limit - len(items)))}
        if cursor:
            page_params["cursor"] = cursor
        page = admin.request(f"{path}?{urlencode(page_params)}")
        found = page.get("items") if isinstance(page, dict) else None
        cursor = page.get("next_cursor") if isinstance(page, dict) else None
        if not isinstance(found, list) or not (cursor is None or isinstance(cursor, str)):
            raise CliError(f"{admin.base} did not answer like a sinkgate admin listener")
        items.extend(found)
        if cursor is None or len(items) >= limit:
            return items, cursor is not None


def page_hint(shown: int, filters: str) -> str:
    """What to do when more rows matched than the `shown` ones: a larger
    `--limit` only while it can still grow."""
    narrow = f"narrow them with {filters}"
    if shown < PAGE_MAX:
        return f"raise --limit (up to {PAGE_MAX}), show them all with --all, or {narrow}"
    return f"show them all with --all, or {narrow}"


def page_limit(args: argparse.Namespace) -> int:
    """`--limit`, or no limit with `--all`."""
    return sys.maxsize if getattr(args, "all", False) else int(args.limit)


def to_rfc3339(value: str | None, now: datetime, option: str) -> str | None:
    """`250ms`, `30m`, `1h`, `7d`, `2w` ago -> RFC 3339 UTC; anything else is sent as
    it is."""
    if not value:
        return None
    seconds = seconds_back(value.strip())
    if seconds is None:
        return value
    try:
        moment = now.astimezone(UTC) - timedelta(seconds=seconds)
    except OverflowError as exc:
        raise CliError(f"{option} {value!r} reaches too far back") from exc
    precision = "seconds" if moment.microsecond == 0 else "milliseconds"
    return moment.isoformat(timespec=precision).replace("+00:00", "Z")


# Columns shown whole however long: an operator copies them into `--job`, `keys
# resolve` or a query, and a derived key is longer than a cell (`job:step:<32 hex>`).
WHOLE = frozenset({"KEY", "JOB", "DESTINATION"})


def format_rows(columns: tuple[str, ...], cells: list[tuple[Any, ...]], *, empty: str) -> str:
    """Aligned columns under a header; control characters are shown as `?`; a
    cell longer than `CELL_MAX` is cut, but never in a `WHOLE` column."""
    if not cells:
        return empty
    whole = tuple(name in WHOLE for name in columns)
    rows = [columns, *(tuple(map(cell, row, whole)) for row in cells)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def cell(value: object, whole: bool = False) -> str:
    text = _UNPRINTABLE.sub("?", dash(value))
    return text if whole or len(text) <= CELL_MAX else text[: CELL_MAX - 1] + "…"


def dash(value: object) -> str:
    return "-" if value is None or value == "" else str(value)
