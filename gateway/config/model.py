"""TOML -> frozen, validated dataclasses (SPEC 5).

`load_config` is the one loader. Every problem is a `ConfigError` whose message
names the file, the dotted key and what is wrong, on one line:

    destinations/payments.toml: timeout: expected a duration like "10s", got "ten"

Unknown keys are errors (a typo must not silently fall back to a default).
Secrets (worker tokens, upstream header values, the admin token) are named by
environment variable in the files, read here, and kept out of every repr.

The typed reading of values and tables (durations, sizes, addresses, "did you
mean" hints, secrets) lives in `config_reader`; its public parsers are
re-exported here, so `gateway.config.model` stays the one import for callers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from gateway.config.reader import (
    MiB,
    Table,
    bearer_tokens,
    format_duration,
    format_size,
    is_loopback,
    parse_duration,
    parse_listen,
    parse_size,
    parse_upstream,
    read_toml,
    redact_url,
    secret,
    show,
)
from gateway.errors import ConfigError
from gateway.write.decision import Fencing

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_ADMIN_TOKEN_ENV",
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_METHODS",
    "DEFAULT_REPLAY_HEADERS",
    "DEFAULT_RETRYABLE_STATUSES",
    "DESTINATION_NAME",
    "HOP_BY_HOP",
    "RESERVED_HEADERS",
    "Config",
    "DestinationConfig",
    "MiB",
    "format_duration",
    "format_size",
    "is_loopback",
    "load_config",
    "load_destination",
    "parse_duration",
    "parse_listen",
    "parse_size",
    "parse_upstream",
    "redact_url",
    "show",
]

CONFIG_ENV = "SINKGATE_CONFIG"
DEFAULT_CONFIG_PATH = "config/gateway.toml"
DEFAULT_ADMIN_TOKEN_ENV = "SINKGATE_ADMIN_TOKEN"
DEFAULT_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
DEFAULT_RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
DEFAULT_REPLAY_HEADERS = ("Content-Type", "Location", "ETag", "Content-Location")

DESTINATION_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token (header names, methods)
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")
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
    root = Table(
        read_toml(source, file),
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
        lease_tokens=bearer_tokens(server, env, "lease_tokens_env"),
    )


def _store_url(store: Table, base: Path) -> str:
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


def _destinations(root: Table, base: Path, env: Mapping[str, str]) -> dict[str, DestinationConfig]:
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
    t = Table(read_toml(path, display), display, "", _DESTINATION_KEYS)
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
        worker_tokens=bearer_tokens(t, env),
        upstream_headers=_upstream_headers(t, env),
        max_in_flight=t.integer("max_in_flight", 256, 1),
        source=path.absolute(),
    )


def _methods(t: Table) -> frozenset[str]:
    methods = t.strings("methods", sorted(DEFAULT_METHODS))
    if not methods:
        raise t.error("methods", "expected at least one method")
    for method in methods:
        if not _TOKEN.fullmatch(method) or method.upper() == "CONNECT":
            raise t.error("methods", f"not a method that can be forwarded: {show(method)}")
    return frozenset(m.upper() for m in methods)


def _statuses(t: Table) -> frozenset[int]:
    value = t.data.get("retryable_statuses", sorted(DEFAULT_RETRYABLE_STATUSES))
    if not isinstance(value, list):
        raise t.error("retryable_statuses", f"expected an array of status codes, got {show(value)}")
    for status in value:
        if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
            raise t.error(
                "retryable_statuses", f"expected status codes 100..599, got {show(status)}"
            )
    return frozenset(value)


def _replay_headers(t: Table) -> tuple[str, ...]:
    names: dict[str, str] = {}
    for name in t.strings("replay_headers", DEFAULT_REPLAY_HEADERS):
        if not _TOKEN.fullmatch(name):
            raise t.error("replay_headers", f"not a header name: {show(name)}")
        if name.lower() in RESERVED_HEADERS:
            raise t.error("replay_headers", f"{name} is hop-by-hop or set by the gateway")
        names.setdefault(name.lower(), name)
    return tuple(names.values())


def _upstream_headers(t: Table, env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
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
            value = fmt.replace("{}", secret(table, name, entry.env_name("env", ""), env))
        else:
            raise table.error(name, f'expected a string or {{ env = "VAR" }}, got {show(spec)}')
        if not _HEADER_VALUE.fullmatch(value):
            # Never echo the value: it is a secret.
            raise table.error(name, "the value has control or non-ASCII characters")
        headers.append((name, value))
    return tuple(headers)
