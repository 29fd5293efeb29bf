"""Every config key, declared once: its name in the file, how it is read (type and
bounds), its default, and what it is for (SPEC 5).

`model` builds the dataclasses from these sections, taking their defaults from
here too, and adds the rules that tie keys together (a connect timeout within
the timeout, TLS keys in pairs); `reader` holds the typed getters. Unknown keys
are derived from the same declarations, so a key cannot be known to the
"did you mean" hint and missing from the loader, or the other way round.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gateway.config.reader import (
    MiB,
    Table,
    bearer_tokens,
    host_name_problem,
    parse_listen,
    parse_upstream,
    secret,
    show,
)
from gateway.errors import ConfigError
from gateway.policy.decision import Fencing
from leases.model import VISIBLE
from leases.urls import postgres_hosts, shown_url, url_problem

DEFAULT_ADMIN_TOKEN_ENV = "SINKGATE_ADMIN_TOKEN"
DEFAULT_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
DEFAULT_RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
DEFAULT_REPLAY_HEADERS = ("Content-Type", "Location", "ETag", "Content-Location")
MAX_WORKERS = 64  # [server] workers and serve --workers: more than any one host's cores pays

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
        # the gateway answers it itself; sent on, the client would write the head
        # and wait for a 100 before the body (and before the late-verdict check)
        "expect",
        "idempotency-key",
        "fencing-job",
        "fencing-token",
        "fencing-owner",
    }
)

Reader = Callable[[Table, str], Any]


@dataclass(frozen=True, slots=True)
class Key:
    """One config key: its name in the file, how it is read (type and bounds),
    its default, and what it is for. A `required` key has no default."""

    name: str
    read: Reader
    default: Any
    help: str
    required: str | None = None  # the "missing: ..." message
    # The `Config` field it sets: None, the key's own name; "", none of its own.
    field: str | None = None
    # Whether a reload leaves a change of it for a restart; None: as its section.
    restart: bool | None = None

    @property
    def config_field(self) -> str:
        return self.name if self.field is None else self.field


class Section:
    """The keys of one table, each declared once; `name` is "" for a file's top.
    `restart`: a reload applies none of its keys (unless a key says otherwise)."""

    def __init__(self, name: str, *keys: Key, restart: bool = False) -> None:
        self.name = name
        self.keys = {key.name: key for key in keys}
        self.restart = restart

    def restarts(self, key: Key) -> bool:
        """Whether a change of `key` waits for a restart (a reload refuses it)."""
        return self.restart if key.restart is None else key.restart

    def fields(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """`Config`'s fields from this section's values, as `read` returns them."""
        return {k.config_field: values[n] for n, k in self.keys.items() if k.config_field}

    @property
    def names(self) -> tuple[str, ...]:
        """The keys a file may set here (anything else is an unknown key)."""
        return tuple(self.keys)

    @property
    def defaults(self) -> Mapping[str, Any]:
        """The value each key has when the file does not set it."""
        return MappingProxyType({name: key.default for name, key in self.keys.items()})

    def open(self, parent: Table) -> Table:
        """This section's table under `parent`."""
        return parent.table(self.name, self.names)

    def read(self, t: Table) -> dict[str, Any]:
        """Every key's value; a key that fails is reported and gets its default."""
        values: dict[str, Any] = {}
        for name, key in self.keys.items():
            values[name] = key.default
            if name not in t.data:
                if key.required is not None:
                    t.report(name, f"missing: {key.required}")
                    t.failed.add(name)
                continue
            try:
                values[name] = key.read(t, name)
            except ConfigError as exc:
                t.problems.append(exc)
                t.failed.add(name)
        return values


def integer(low: int, high: int | None = None) -> Reader:
    """An integer in `low..high` (no upper bound if None)."""
    return lambda t, name: t.integer(name, 0, low, high)


def duration(*, allow_zero: bool = False, floor: tuple[float, str] | None = None) -> Reader:
    """A duration like "10s", > 0 (or >= 0). `floor`: (least, words): a value
    above 0 and below `least` is refused, "must be <words>"."""
    if floor is None:
        return lambda t, name: t.duration(name, 0.0, allow_zero=allow_zero)
    least, words = floor

    def read(t: Table, name: str) -> float:
        value = t.duration(name, 0.0, allow_zero=allow_zero)
        if 0 < value < least:
            raise t.error(name, f"must be {words}, got {show(t.data[name])}")
        return value

    return read


# A wait counts whole seconds (SPEC 2): a cap below one would turn waiting off unsaid.
_WAIT_FLOOR = (1.0, '"0s" (never wait) or at least 1s: a wait is whole seconds')


def size(*, allow_zero: bool = False) -> Reader:
    """A size like "1MiB", > 0 (or >= 0)."""
    return lambda t, name: t.size(name, 0, allow_zero=allow_zero)


def parsed(parse: Callable[[object], Any]) -> Reader:
    """A value read by one of the parsers above."""
    return lambda t, name: t.parsed(name, parse, None)


def string(t: Table, name: str) -> str:
    return t.string(name)


def boolean(t: Table, name: str) -> bool:
    return t.boolean(name)


def env_name(t: Table, name: str) -> str:
    return t.env_name(name)


SHARED_OPERATOR = "admin"  # the name the shared token_env token acts under (SPEC 4)
_OPERATOR_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def operators(t: Table, name: str) -> tuple[tuple[str, str], ...]:
    """`[admin.operators]`: name = the variable holding that person's token ->
    ((name, token), ...). Names 1-64 of `[A-Za-z0-9._-]`, unique whatever their
    case; a variable unset or empty, or two operators with one token, is an
    error (a token must say who)."""
    table = t.table(name, None)
    found: dict[str, str] = {}  # token -> name
    spelled: dict[str, str] = {}  # name lower-cased -> name
    for person in table.data:  # every operator's error is said, not only the first
        try:
            token = _operator_token(table, person, t.env)
        except ConfigError as exc:
            table.problems.append(exc)
            continue
        if person.lower() in spelled:  # `Alice` beside `alice` in the audit log: who?
            error = table.error(person, f"is operator {spelled[person.lower()]!r} in other case")
            table.problems.append(error)
            continue
        spelled[person.lower()] = person
        if token in found:
            error = table.environment_error(
                person, f"has the same token as operator {found[token]!r}"
            )
            table.problems.append(error)
            continue
        found[token] = person
    return tuple((person, token) for token, person in found.items())


def _operator_token(table: Table, person: str, env: Mapping[str, str]) -> str:
    if not _OPERATOR_NAME.fullmatch(person):
        raise table.error(person, "an operator's name is 1-64 characters of A-Za-z0-9._-")
    if person.lower() == SHARED_OPERATOR:  # `Admin` beside `admin` in the audit log: who?
        raise table.error(person, f"{person!r} is the name of the shared admin.token_env token")
    token = secret(table, person, table.env_name(person), env)
    if not VISIBLE.fullmatch(token):  # the token itself is never echoed
        raise table.environment_error(person, "the token has characters other than visible ASCII")
    return token


def tokens(t: Table, name: str) -> tuple[str, ...] | None:
    return bearer_tokens(t, t.env, name)


def pem_file(t: Table, name: str) -> Path:
    """A PEM file, relative to the directory of the file that names it."""
    given = t.string(name)
    path = t.base / given
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise t.error(name, f"cannot read {show(given)}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in text:
        raise t.error(name, f"{show(given)} is not a PEM file")
    return path.absolute()


# --- readers of one key's own rules -------------------------------------------


def store_url(t: Table, name: str) -> str:
    """A sqlite:/// or postgresql:// URL; never echoed whole (it may hold a password)."""
    url = t.string(name)
    written, sep, _ = url.partition("://")
    has_scheme = bool(sep) and _SCHEME.fullmatch(written) is not None  # echoed below
    scheme = written.lower() if has_scheme else ""
    if scheme in ("postgresql", "postgres"):
        # asyncpg would fail on these only at start-up, with a traceback
        problem = url_problem(url)  # as asyncpg reads it: its errors quote the password
        if problem is not None:
            raise t.error(name, f"the URL cannot be read: {problem}")
        for host, _ in postgres_hosts(url):
            problem = host_name_problem(host)
            if problem is not None:  # the host alone: the rest may hold a password
                raise t.error(name, f"{show(host)} in the URL is not a host name: {problem}")
        return url
    if not has_scheme and url.startswith("sqlite:"):
        scheme = "sqlite"  # sqlite:relative: refused below with the sqlite:/// forms
    if scheme != "sqlite":
        # Only the scheme is echoed: the rest may hold a password.
        got = f"a {show(written)} URL" if has_scheme else "a value without scheme://"
        raise t.error(name, f"expected sqlite:///path or postgresql://..., got {got}")
    if url[: len("sqlite:///")].lower() == "sqlite:///":
        url = "sqlite:///" + url[len("sqlite:///") :]  # the scheme in any case, as RFC 3986
    if not url.startswith("sqlite:///") or len(url) == len("sqlite:///"):
        got = shown_url(url, show)
        raise t.error(name, f"expected sqlite:///relative/path or sqlite:////abs/path, got {got}")
    if url == "sqlite:///:memory:":
        # Each connection would have a database of its own (the reads would find
        # no tables), each process too, and nothing would outlive a restart.
        raise t.error(name, "an in-memory SQLite database cannot be the store: name a file")
    return url


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,31}")  # RFC 3986 3.1


def fencing(t: Table, name: str) -> Fencing:
    value = t.string(name)
    if value not in {f.value for f in Fencing}:
        raise t.error(name, f'expected "lease" or "monotonic", got {show(value)}')
    return Fencing(value)


def methods(t: Table, name: str) -> frozenset[str]:
    given = t.strings(name)
    if not given:
        raise t.error(name, "expected at least one method")
    errors = []
    for method in given:
        # CONNECT asks for a tunnel; TRACE echoes the request back, with the
        # secrets of [upstream_headers] the gateway added to it.
        if not _TOKEN.fullmatch(method) or method.upper() in ("CONNECT", "TRACE"):
            errors.append(t.error(name, f"not a method that can be forwarded: {show(method)}"))
    _raise_all(t, errors)
    return frozenset(m.upper() for m in given)


def statuses(t: Table, name: str) -> frozenset[int]:
    value = t.data[name]
    if not isinstance(value, list):
        raise t.error(name, f"expected an array of status codes, got {show(value)}")
    errors = []
    for status in value:
        if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
            errors.append(t.error(name, f"expected status codes 100..599, got {show(status)}"))
        elif 200 <= status <= 299:
            # A 2xx is the upstream saying it did it: releasing the key would
            # let a retry do it twice.
            errors.append(t.error(name, f"{status} is a success, not a status to retry"))
    _raise_all(t, errors)
    return frozenset(value)


def replay_headers(t: Table, name: str) -> tuple[str, ...]:
    names: dict[str, str] = {}
    errors = []
    for header in t.strings(name):
        if not _TOKEN.fullmatch(header):
            errors.append(t.error(name, f"not a header name: {show(header)}"))
        elif header.lower() in RESERVED_HEADERS:
            errors.append(t.error(name, f"{header} is hop-by-hop or set by the gateway"))
        else:
            names.setdefault(header.lower(), header)
    _raise_all(t, errors)
    return tuple(names.values())


def upstream_headers(t: Table, name: str) -> tuple[tuple[str, str], ...]:
    table = t.table(name, None)
    seen: set[str] = set()
    headers: list[tuple[str, str]] = []
    errors = []
    for header, spec in table.data.items():
        try:
            headers.append((header, _upstream_header(t, table, header, spec, seen)))
        except ConfigError as exc:
            errors.append(exc)
    _raise_all(t, errors)
    return tuple(headers)


def _upstream_header(t: Table, table: Table, header: str, spec: Any, seen: set[str]) -> str:
    """One entry of [upstream_headers]: its value (a secret: never in a message)."""
    if not _TOKEN.fullmatch(header):
        raise table.error(header, "not a valid header name")
    if header.lower() in RESERVED_HEADERS:
        raise table.error(header, "hop-by-hop or set by the gateway; it cannot be configured")
    if header.lower() in seen:
        raise table.error(header, "given twice (header names are case-insensitive)")
    seen.add(header.lower())
    if isinstance(spec, str):
        value = spec
    elif isinstance(spec, dict):
        entry = table.table(header, ("env", "format"))
        if "env" not in entry.data:
            raise table.error(header, 'expected { env = "VAR" } with an optional format')
        fmt = entry.string("format", "{}")
        if fmt.count("{}") != 1:
            raise entry.error("format", f'must contain "{{}}" exactly once, got {show(fmt)}')
        value = fmt.replace("{}", secret(table, header, entry.env_name("env"), t.env))
    else:
        raise table.error(header, f'expected a string or {{ env = "VAR" }}, got {show(spec)}')
    if not _HEADER_VALUE.fullmatch(value):
        # Never echo the value: it is a secret.
        raise table.error(header, "the value has control or non-ASCII characters")
    return value


def _raise_all(t: Table, errors: list[ConfigError]) -> None:
    """Every error of a list or table's entries, not only its first: all but the
    last are collected with the load's others, the last raised (as one would be)."""
    if errors:
        t.problems.extend(errors[:-1])
        raise errors[-1]


# --- the declarations -------------------------------------------------------------

SERVER = Section(
    "server",
    Key("listen", parsed(parse_listen), ("127.0.0.1", 8480), "writes, the lease API, /healthz"),
    Key(
        "admin_listen",
        parsed(parse_listen),
        ("127.0.0.1", 8481),
        "/admin, /metrics, /healthz, /readyz",
    ),
    Key("max_in_flight", integer(1), 4096, "writes on the wire at once, all destinations"),
    Key("max_deciding", integer(1), 4096, "writes waiting for their store decision at once"),
    Key("max_body_buffer", size(), 64 * MiB, "request bodies still arriving, all writes"),
    Key("shutdown_grace", duration(allow_zero=True), 30.0, "time in-flight writes get on stop"),
    Key(
        "lease_tokens_env",
        tokens,
        None,
        "variable with the lease API's bearer tokens",
        field="lease_tokens",
    ),
    Key("tls_cert", pem_file, None, "PEM certificate chain: both listeners serve HTTPS only"),
    Key("tls_key", pem_file, None, "PEM private key of tls_cert"),
    Key("workers", integer(1, MAX_WORKERS), 1, "gateway processes sharing both listeners"),
    Key("max_waiting", integer(0), 1024, "writes held under Prefer: wait at once, per process"),
    restart=True,
)
STORE = Section(
    "store",
    Key(
        "url",
        store_url,
        "sqlite:///data/sinkgate.db",
        "sqlite:///relative/path or postgresql://",
        field="store_url",
    ),
    Key("pool_size", integer(1, 1000), 10, "connections to the store", field="store_pool_size"),
    restart=True,
)
ADMIN = Section(
    "admin",
    Key(
        "token_env",
        env_name,
        DEFAULT_ADMIN_TOKEN_ENV,
        "variable holding the admin token",
        field="admin_token_env",
    ),
    Key(
        "operators",
        operators,
        (),
        "name = variable holding that operator's token (named in the audit log; "
        "not also a lease, worker or admin token)",
        field="admin_operators",
    ),
    restart=True,
)
RETENTION = Section(
    "retention",
    Key("idempotency_ttl", duration(), 24 * 3600.0, "how long a completed key is kept"),
    Key("rejections_ttl", duration(), 7 * 24 * 3600.0, "how long a rejection is kept"),
    Key(
        "audit_ttl",
        duration(floor=(86400.0, "at least 1d: it is what operators answer for")),
        365 * 24 * 3600.0,
        "how long an operator action is kept (at least 1d, and rejections_ttl)",
    ),
)
DESTINATIONS = Section(
    "destinations",
    Key(
        "dir", string, "destinations", "directory of destination files, next to this file", field=""
    ),
)
GATEWAY_FILE = (SERVER, STORE, ADMIN, RETENTION, DESTINATIONS)
# The sections a reload applies none of (their changes wait for a restart).
RESTART_SECTIONS = frozenset(section.name for section in GATEWAY_FILE if section.restart)

# `Config` fields a reload does not apply, by the key that sets them; the admin
# token is read from the variable `admin.token_env` names.
RESTART_ONLY: tuple[tuple[str, str], ...] = (
    *(
        (key.config_field, f"{section.name}.{key.name}")
        for section in GATEWAY_FILE
        for key in section.keys.values()
        if key.config_field and section.restarts(key)
    ),
    ("admin_token", "admin.token_env"),
)
# `Config` fields of the gateway file a reload applies (the destinations apart).
RELOADED: tuple[str, ...] = tuple(
    key.config_field
    for section in GATEWAY_FILE
    for key in section.keys.values()
    if key.config_field and not section.restarts(key)
)

DESTINATION = Section(
    "",
    Key(
        "upstream",
        parsed(parse_upstream),
        "",
        "the URL writes are forwarded under",
        required='expected a URL like "https://payments.internal/api"',
    ),
    Key("fencing", fencing, Fencing.LEASE, '"lease" or "monotonic"'),
    Key("require_idempotency_key", boolean, True, "refuse writes without Idempotency-Key"),
    Key("upstream_idempotent", boolean, False, "the upstream dedups Idempotency-Key itself"),
    Key("methods", methods, DEFAULT_METHODS, "methods forwarded"),
    Key(
        "timeout",
        duration(),
        10.0,
        "for the whole upstream request, counted from when the gateway asked the store for "
        "the write's verdict (with under 50 ms of it left, or half of a timeout under "
        "100 ms, it is not sent: 503 store_unavailable)",
    ),
    Key("connect_timeout", duration(), 2.0, "for the connection; at most timeout"),
    Key("max_body", size(), MiB, "largest request body"),
    Key("max_replay_body", size(allow_zero=True), MiB, "largest answer body stored for replays"),
    Key("retryable_statuses", statuses, DEFAULT_RETRYABLE_STATUSES, "answers that release the key"),
    Key("replay_headers", replay_headers, DEFAULT_REPLAY_HEADERS, "headers stored for replays"),
    Key("forward_fencing_headers", boolean, True, "pass Fencing-* on to the upstream"),
    Key(
        "worker_tokens_env",
        tokens,
        None,
        "variable with the workers' bearer tokens",
        field="worker_tokens",
    ),
    Key("upstream_headers", upstream_headers, (), "headers set on every forwarded request"),
    Key("max_in_flight", integer(1), 256, "writes on the wire at once to this destination"),
    Key(
        "max_wait",
        duration(allow_zero=True, floor=_WAIT_FLOOR),
        30.0,
        'longest Prefer: wait honoured, 1s or more; "0s": never',
    ),
    Key("ca_file", pem_file, None, "PEM bundle the upstream's certificate must chain to"),
    Key("client_cert", pem_file, None, "PEM certificate for mutual TLS to the upstream"),
    Key("client_key", pem_file, None, "PEM private key of client_cert"),
    Key("tls_verify", boolean, True, "false only for an https:// upstream on loopback"),
)
