"""TOML -> frozen, validated dataclasses (SPEC 5).

`load_config` is the one loader. Every problem is a `ConfigError` whose message
names the file, the dotted key and what is wrong, on one line:

    destinations/payments.toml: timeout: expected a duration like "10s", got "ten"

Unknown keys are errors (a typo must not silently fall back to a default).
Secrets (worker tokens, upstream header values, the admin token) are named by
environment variable in the files, read here, and kept out of every repr.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from .decision import Fencing
from .errors import ConfigError

_T = TypeVar("_T")

CONFIG_ENV = "SINKGATE_CONFIG"
DEFAULT_CONFIG_PATH = "config/gateway.toml"
DEFAULT_ADMIN_TOKEN_ENV = "SINKGATE_ADMIN_TOKEN"
MiB = 1024 * 1024
DEFAULT_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
DEFAULT_RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
DEFAULT_REPLAY_HEADERS = ("Content-Type", "Location", "ETag", "Content-Location")

DESTINATION_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token (header names, methods)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")
_VISIBLE = re.compile(r"[\x21-\x7e]+")
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
# RFC 9110 7.6.1 plus the proxy-era names; never forwarded in either direction.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
    }
)
# Hop-by-hop and headers the gateway computes or owns itself: a destination may
# neither set nor replay them.
RESERVED_HEADERS = HOP_BY_HOP | frozenset(
    {
        "host",
        "content-length",
        "idempotency-key",
        "fencing-job",
        "fencing-token",
        "fencing-owner",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class DestinationConfig:
    """One `destinations/<name>.toml`: where writes go and how they are guarded."""

    name: str
    upstream: str
    fencing: Fencing = Fencing.LEASE
    require_idempotency_key: bool = True
    upstream_idempotent: bool = False
    methods: frozenset[str] = DEFAULT_METHODS
    timeout: float = 10.0
    connect_timeout: float = 2.0
    max_body: int = MiB
    max_replay_body: int = MiB
    retryable_statuses: frozenset[int] = DEFAULT_RETRYABLE_STATUSES
    replay_headers: tuple[str, ...] = DEFAULT_REPLAY_HEADERS
    forward_fencing_headers: bool = True
    worker_tokens: tuple[str, ...] | None = field(default=None, repr=False)
    upstream_headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    max_in_flight: int = 256
    source: Path

    @property
    def upstream_header_names(self) -> tuple[str, ...]:
        """The names of `upstream_headers`, safe to print (the values are secrets)."""
        return tuple(name for name, _ in self.upstream_headers)


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The gateway's whole configuration; `destinations` is read-only, by name."""

    source: Path
    listen: tuple[str, int]
    admin_listen: tuple[str, int]
    # repr=False: a postgresql URL may carry a password; see `redact_url`.
    store_url: str = field(repr=False)
    store_pool_size: int = 10
    admin_token: str | None = field(default=None, repr=False)
    admin_token_env: str = DEFAULT_ADMIN_TOKEN_ENV
    idempotency_ttl: float = 24 * 3600.0
    rejections_ttl: float = 7 * 24 * 3600.0
    destinations: Mapping[str, DestinationConfig] = field(
        default_factory=lambda: MappingProxyType({})
    )
    max_in_flight: int = 4096
    shutdown_grace: float = 30.0
    lease_tokens: tuple[str, ...] | None = field(default=None, repr=False)  # None: open lease API


# --- value parsers (raise ValueError; the loader adds file and key) ----------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = re.compile(r"(\d+)(B|KiB|MiB|GiB)")
_SIZE_UNITS = {"B": 1, "KiB": 1024, "MiB": MiB, "GiB": 1024 * MiB}


def parse_duration(value: object) -> float:
    """`"250ms"`, `"10s"`, `"5m"`, `"24h"`, `"7d"` (decimals allowed) -> seconds.

    A bare number is refused: whether `10` means seconds or milliseconds is
    exactly the ambiguity a unit removes.
    """
    if isinstance(value, str):
        match = _DURATION.fullmatch(value)
        if match:
            return float(match[1]) * _DURATION_UNITS[match[2]]
    expected = 'expected a duration like "10s" (units ms, s, m, h, d)'
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError(
            f'{expected}, got {show(value)}: a bare number has no unit, write "{value}s"'
        )
    raise ValueError(f"{expected}, got {show(value)}")


def parse_size(value: object) -> int:
    """`"10B"`, `"512KiB"`, `"1MiB"`, `"1GiB"` or a plain integer of bytes -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match:
            return int(match[1]) * _SIZE_UNITS[match[2]]
    raise ValueError(
        f'expected a size like "1MiB" (units B, KiB, MiB, GiB) or a number of bytes, '
        f"got {show(value)}"
    )


def format_duration(seconds: float) -> str:
    """The largest exact unit of `parse_duration`: 300 -> "5m", 0.25 -> "250ms"."""
    ms = round(seconds * 1000)
    if abs(ms - seconds * 1000) > 1e-6:
        return f"{seconds:g}s"
    for unit in ("d", "h", "m", "s"):
        step = round(_DURATION_UNITS[unit] * 1000)
        if ms and ms % step == 0:
            return f"{ms // step}{unit}"
    return f"{ms}ms"


def format_size(size: int) -> str:
    """The largest exact binary unit: 1048576 -> "1MiB"."""
    for unit in ("GiB", "MiB", "KiB"):
        if size and size % _SIZE_UNITS[unit] == 0:
            return f"{size // _SIZE_UNITS[unit]}{unit}"
    return f"{size}B"


def parse_listen(value: object) -> tuple[str, int]:
    """`"127.0.0.1:8480"`, `"[::1]:8480"`, `"localhost:0"` -> (host, port)."""
    expected = f'expected "host:port" like "127.0.0.1:8480" or "[::1]:8480", got {show(value)}'
    if not isinstance(value, str):
        raise ValueError(expected)
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
        if not sep or not _is_ip(host, version=6):
            raise ValueError(expected)
    else:
        host, sep, port = value.rpartition(":")
        if not sep or not host:
            raise ValueError(expected)
        if ":" in host:
            raise ValueError(f"{expected}: an IPv6 address goes in brackets")
        looks_numeric = all(c.isdigit() or c == "." for c in host)
        if not (_is_ip(host, version=4) if looks_numeric else _HOSTNAME.fullmatch(host)):
            raise ValueError(f"{expected}: {show(host)} is not an IP address or host name")
    if not (port.isascii() and port.isdigit() and int(port) <= 65535):
        raise ValueError(f"{expected}: the port must be 0..65535")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether a listen host reaches this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def redact_url(url: str) -> str:
    """`url` with any password replaced by `***`, for summaries and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))


def show(value: object) -> str:
    """A value as it would be written in TOML, for error messages."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return repr(value)


def _is_ip(host: str, *, version: int) -> bool:
    try:
        return ipaddress.ip_address(host).version == version
    except ValueError:
        return False


# --- reading tables -----------------------------------------------------------


class _Table:
    """One TOML table of one file: typed getters whose errors name file and key."""

    def __init__(
        self, data: Mapping[str, Any], file: str, prefix: str, known: Iterable[str] | None
    ) -> None:
        self.data, self.file, self.prefix = data, file, prefix
        if known is None:  # a table of free-form names, like [upstream_headers]
            return
        known = tuple(known)
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f' (did you mean "{close[0]}"?)' if close else ""
                raise self.error(key, f"unknown key{hint}")

    def key(self, key: str) -> str:
        part = key if _BARE_KEY.fullmatch(key) else json.dumps(key)
        return f"{self.prefix}.{part}" if self.prefix else part

    def error(self, key: str, what: str) -> ConfigError:
        return ConfigError(f"{self.file}: {self.key(key)}: {what}")

    def table(self, key: str, known: Iterable[str] | None) -> _Table:
        value = self.data.get(key, {})
        if not isinstance(value, dict):
            raise self.error(key, f"expected a table, got {show(value)}")
        return _Table(value, self.file, self.key(key), known)

    def string(self, key: str, default: str) -> str:
        value = self.data.get(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, got {show(value)}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {show(value)}")
        return value

    def integer(self, key: str, default: int, low: int, high: int | None = None) -> int:
        value = self.data.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(key, f"expected an integer, got {show(value)}")
        if value < low or (high is not None and value > high):
            bound = f"{low}..{high}" if high is not None else f">= {low}"
            raise self.error(key, f"must be {bound}, got {value}")
        return value

    def duration(self, key: str, default: float, *, allow_zero: bool = False) -> float:
        value = self.parsed(key, parse_duration, default)
        if value < 0 or (value == 0 and not allow_zero):
            raise self.error(
                key, f"must be {'>= 0' if allow_zero else '> 0'}, got {show(self.data[key])}"
            )
        return value

    def size(self, key: str, default: int, *, allow_zero: bool = False) -> int:
        value = self.parsed(key, parse_size, default)
        if value == 0 and not allow_zero:
            raise self.error(key, f"must be > 0, got {show(self.data[key])}")
        return value

    def parsed(self, key: str, parse: Callable[[object], _T], default: _T) -> _T:
        if key not in self.data:
            return default
        try:
            return parse(self.data[key])
        except ValueError as exc:
            raise self.error(key, str(exc)) from None

    def strings(self, key: str, default: Iterable[str]) -> list[str]:
        value = self.data.get(key, list(default))
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, f"expected an array of strings, got {show(value)}")
        return value

    def env_name(self, key: str, default: str) -> str:
        name = self.string(key, default)
        if not _ENV_NAME.fullmatch(name):
            raise self.error(key, f"expected an environment variable name, got {show(name)}")
        return name


def _read_toml(path: Path, display: str) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"{display}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{display}: not valid UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        match = re.fullmatch(r"(.*) \(at (line \d+, column \d+|end of document)\)", str(exc))
        where, what = (match[2], match[1]) if match else ("", str(exc))
        where = f" {where}:" if where else ""
        raise ConfigError(f"{display}:{where} invalid TOML: {what}") from None


# --- the gateway file ------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> Config:
    """Load and validate the gateway config and every destination file.

    `path` defaults to `$SINKGATE_CONFIG`, then `config/gateway.toml`; `environ`
    (default `os.environ`) is where secrets named by `*_env` keys are read.
    """
    env = os.environ if environ is None else environ
    given = Path(path if path is not None else env.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)
    source = given.absolute()
    file = source.name
    if not source.is_file():
        what = "is a directory" if source.is_dir() else "no such file"
        raise ConfigError(f"{given}: cannot read: {what}")
    root = _Table(
        _read_toml(source, file),
        file,
        "",
        ("server", "store", "admin", "retention", "destinations"),
    )
    server = root.table(
        "server", ("listen", "admin_listen", "max_in_flight", "shutdown_grace", "lease_tokens_env")
    )
    listen = server.parsed("listen", parse_listen, ("127.0.0.1", 8480))
    admin_listen = server.parsed("admin_listen", parse_listen, ("127.0.0.1", 8481))
    if listen == admin_listen and listen[1] != 0:
        raise server.error("admin_listen", "must differ from server.listen")

    store = root.table("store", ("url", "pool_size"))
    store_url = _store_url(store, source.parent)

    admin = root.table("admin", ("token_env",))
    token_env = admin.env_name("token_env", DEFAULT_ADMIN_TOKEN_ENV)
    admin_token = env.get(token_env) or None
    if admin_token is None and not is_loopback(admin_listen[0]):
        raise server.error(
            "admin_listen",
            f"listens beyond loopback on {show(admin_listen[0])} but no admin token is set "
            f"(environment variable {token_env} is unset or empty)",
        )

    retention = root.table("retention", ("idempotency_ttl", "rejections_ttl"))
    return Config(
        source=source,
        listen=listen,
        admin_listen=admin_listen,
        store_url=store_url,
        store_pool_size=store.integer("pool_size", 10, 1, 1000),
        admin_token=admin_token,
        admin_token_env=token_env,
        idempotency_ttl=retention.duration("idempotency_ttl", 24 * 3600.0),
        rejections_ttl=retention.duration("rejections_ttl", 7 * 24 * 3600.0),
        destinations=MappingProxyType(_destinations(root, source.parent, env)),
        max_in_flight=server.integer("max_in_flight", 4096, 1),
        shutdown_grace=server.duration("shutdown_grace", 30.0, allow_zero=True),
        lease_tokens=_worker_tokens(server, env, "lease_tokens_env"),
    )


def _store_url(store: _Table, base: Path) -> str:
    url = store.string("url", "sqlite:///data/sinkgate.db")
    scheme = url.partition(":")[0].lower()
    if scheme in ("postgresql", "postgres") and url[len(scheme) :].startswith("://"):
        return url
    if scheme != "sqlite":
        # Only the scheme is echoed: the rest may hold a password.
        raise store.error(
            "url", f"expected sqlite:///path or postgresql://..., got a {show(scheme)} URL"
        )
    if not url.startswith("sqlite:///") or len(url) == len("sqlite:///"):
        raise store.error(
            "url", f"expected sqlite:///relative/path or sqlite:////abs/path, got {show(url)}"
        )
    rest = url[len("sqlite:///") :]
    if rest == ":memory:" or rest.startswith("/"):
        return url
    return "sqlite:///" + os.path.normpath(base / rest)


def _destinations(root: _Table, base: Path, env: Mapping[str, str]) -> dict[str, DestinationConfig]:
    section = root.table("destinations", ("dir",))
    explicit = "dir" in section.data
    given = section.string("dir", "destinations")
    directory = base / given
    if not directory.is_dir():
        if explicit:
            raise section.error("dir", f"no such directory {show(given)} next to this file")
        return {}
    destinations: dict[str, DestinationConfig] = {}
    # Dot files are skipped: editors leave lock files like `.#payments.toml`.
    for path in sorted(p for p in directory.glob("*.toml") if not p.name.startswith(".")):
        destination = load_destination(path, environ=env, display=_display(path, base))
        destinations[destination.name] = destination
    return destinations


def _display(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return str(path)


# --- one destination file ----------------------------------------------------------

_DESTINATION_KEYS = (
    "upstream",
    "fencing",
    "require_idempotency_key",
    "upstream_idempotent",
    "methods",
    "timeout",
    "connect_timeout",
    "max_body",
    "max_replay_body",
    "retryable_statuses",
    "replay_headers",
    "forward_fencing_headers",
    "worker_tokens_env",
    "upstream_headers",
    "max_in_flight",
)


def load_destination(
    path: Path, *, environ: Mapping[str, str] | None = None, display: str | None = None
) -> DestinationConfig:
    """Load one destination file; its name is the file's stem."""
    env = os.environ if environ is None else environ
    display = display or str(path)
    name = path.stem
    if not DESTINATION_NAME.fullmatch(name):
        raise ConfigError(
            f"{display}: the file name gives the destination name {show(name)}: "
            "expected 1-64 characters of A-Z a-z 0-9 . _ -"
        )
    t = _Table(_read_toml(path, display), display, "", _DESTINATION_KEYS)
    if "upstream" not in t.data:
        raise t.error("upstream", 'missing: expected a URL like "https://payments.internal/api"')
    upstream = t.parsed("upstream", parse_upstream, "")
    fencing = t.string("fencing", Fencing.LEASE.value)
    if fencing not in {f.value for f in Fencing}:
        raise t.error("fencing", f'expected "lease" or "monotonic", got {show(fencing)}')
    timeout = t.duration("timeout", 10.0)
    # The 2 s default never exceeds a shorter timeout; only an explicit value can.
    connect_timeout = t.duration("connect_timeout", min(2.0, timeout))
    if connect_timeout > timeout:
        raise t.error("connect_timeout", f"must not exceed timeout ({format_duration(timeout)})")
    return DestinationConfig(
        name=name,
        upstream=upstream,
        fencing=Fencing(fencing),
        require_idempotency_key=t.boolean("require_idempotency_key", True),
        upstream_idempotent=t.boolean("upstream_idempotent", False),
        methods=_methods(t),
        timeout=timeout,
        connect_timeout=connect_timeout,
        max_body=t.size("max_body", MiB),
        max_replay_body=t.size("max_replay_body", MiB, allow_zero=True),
        retryable_statuses=_statuses(t),
        replay_headers=_replay_headers(t),
        forward_fencing_headers=t.boolean("forward_fencing_headers", True),
        worker_tokens=_worker_tokens(t, env),
        upstream_headers=_upstream_headers(t, env),
        max_in_flight=t.integer("max_in_flight", 256, 1),
        source=path.absolute(),
    )


def parse_upstream(value: object) -> str:
    """An absolute http(s) URL without query, fragment or credentials; trailing `/` dropped."""
    expected = f"expected an absolute http:// or https:// URL, got {show(value)}"
    if not isinstance(value, str) or not _VISIBLE.fullmatch(value):
        raise ValueError(expected)
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(expected) from None
    if "@" in parts.netloc:
        # Not echoed: the URL holds a credential.
        raise ValueError("must not contain user info; send credentials with [upstream_headers]")
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(expected)
    if "?" in value or "#" in value:
        raise ValueError(f"must not have a query or fragment, got {show(value)}")
    if any(seg in (".", "..") for seg in parts.path.split("/")):
        raise ValueError(f"must not contain . or .. path segments, got {show(value)}")
    return urlunsplit((parts.scheme.lower(), parts.netloc, parts.path.rstrip("/"), "", ""))


def _methods(t: _Table) -> frozenset[str]:
    methods = t.strings("methods", sorted(DEFAULT_METHODS))
    if not methods:
        raise t.error("methods", "expected at least one method")
    for method in methods:
        if not _TOKEN.fullmatch(method) or method.upper() == "CONNECT":
            raise t.error("methods", f"not a method that can be forwarded: {show(method)}")
    return frozenset(m.upper() for m in methods)


def _statuses(t: _Table) -> frozenset[int]:
    value = t.data.get("retryable_statuses", sorted(DEFAULT_RETRYABLE_STATUSES))
    if not isinstance(value, list):
        raise t.error("retryable_statuses", f"expected an array of status codes, got {show(value)}")
    for status in value:
        if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
            raise t.error(
                "retryable_statuses", f"expected status codes 100..599, got {show(status)}"
            )
    return frozenset(value)


def _replay_headers(t: _Table) -> tuple[str, ...]:
    names: dict[str, str] = {}
    for name in t.strings("replay_headers", DEFAULT_REPLAY_HEADERS):
        if not _TOKEN.fullmatch(name):
            raise t.error("replay_headers", f"not a header name: {show(name)}")
        if name.lower() in RESERVED_HEADERS:
            raise t.error("replay_headers", f"{name} is hop-by-hop or set by the gateway")
        names.setdefault(name.lower(), name)
    return tuple(names.values())


def _secret(t: _Table, key: str, var: str, env: Mapping[str, str]) -> str:
    value = env.get(var)
    if value is None:
        raise t.error(key, f"environment variable {var} is not set")
    if not value.strip():
        raise t.error(key, f"environment variable {var} is empty")
    return value.strip()


def _worker_tokens(
    t: _Table, env: Mapping[str, str], key: str = "worker_tokens_env"
) -> tuple[str, ...] | None:
    """Comma-separated bearer tokens from the variable named by `key`; key absent:
    None (no auth); key present but the variable unset or empty: an error."""
    if key not in t.data:
        return None
    var = t.env_name(key, "")
    tokens = [tok.strip() for tok in _secret(t, key, var, env).split(",")]
    tokens = [tok for tok in tokens if tok]
    if not tokens:
        raise t.error(key, f"environment variable {var} holds no tokens")
    for number, token in enumerate(tokens, 1):
        if not _VISIBLE.fullmatch(token):
            # The token itself is never echoed.
            raise t.error(
                key,
                f"environment variable {var}: token {number} has characters other than "
                "visible ASCII",
            )
    return tuple(dict.fromkeys(tokens))


def _upstream_headers(t: _Table, env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    table = t.table("upstream_headers", None)
    seen: set[str] = set()
    headers: list[tuple[str, str]] = []
    for name, spec in table.data.items():
        if not _TOKEN.fullmatch(name):
            raise table.error(name, "not a valid header name")
        if name.lower() in RESERVED_HEADERS:
            raise table.error(name, "hop-by-hop or set by the gateway; it cannot be configured")
        if name.lower() in seen:
            raise table.error(name, "given twice (header names are case-insensitive)")
        seen.add(name.lower())
        if isinstance(spec, str):
            value = spec
        elif isinstance(spec, dict):
            entry = table.table(name, ("env", "format"))
            if "env" not in entry.data:
                raise table.error(name, 'expected { env = "VAR" } with an optional format')
            fmt = entry.string("format", "{}")
            if fmt.count("{}") != 1:
                raise entry.error("format", f'must contain "{{}}" exactly once, got {show(fmt)}')
            value = fmt.replace("{}", _secret(table, name, entry.env_name("env", ""), env))
        else:
            raise table.error(name, f'expected a string or {{ env = "VAR" }}, got {show(spec)}')
        if not _HEADER_VALUE.fullmatch(value):
            # Never echo the value: it is a secret.
            raise table.error(name, "the value has control or non-ASCII characters")
        headers.append((name, value))
    return tuple(headers)
