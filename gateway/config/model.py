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
from typing import Any, NamedTuple, TypeGuard

from gateway.config import keys
from gateway.config.keys import (
    DEFAULT_ADMIN_TOKEN_ENV,
    DEFAULT_METHODS,
    DEFAULT_REPLAY_HEADERS,
    DEFAULT_RETRYABLE_STATUSES,
    DESTINATION,
    HOP_BY_HOP,
    RESERVED_HEADERS,
)
from gateway.config.reader import (
    MiB,
    Problems,
    Table,
    dotted,
    format_duration,
    format_size,
    is_loopback,
    parse_duration,
    parse_listen,
    parse_size,
    parse_upstream,
    read_toml,
    same_socket,
    show,
    shown_env,
)
from gateway.config.tls import check_destination_tls, check_server_tls, tls_digest
from gateway.errors import ConfigError, EnvironmentConfigError
from gateway.policy.decision import Fencing
from leases.model import VISIBLE
from leases.urls import redact_url

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
    "Reread",
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
    "reread_config",
    "show",
]

CONFIG_ENV = "SINKGATE_CONFIG"
DEFAULT_CONFIG_PATH = "config/gateway.toml"

DESTINATION_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")

_D = DESTINATION.defaults
_SERVER, _STORE, _RETENTION = (s.defaults for s in (keys.SERVER, keys.STORE, keys.RETENTION))


@dataclass(frozen=True, slots=True, kw_only=True)
class DestinationConfig:
    """One `destinations/<name>.toml`: where writes go and how they are guarded.
    Defaults are those declared in `gateway.config.keys.DESTINATION`."""

    name: str
    upstream: str
    fencing: Fencing = _D["fencing"]
    require_idempotency_key: bool = _D["require_idempotency_key"]
    upstream_idempotent: bool = _D["upstream_idempotent"]
    methods: frozenset[str] = _D["methods"]
    timeout: float = _D["timeout"]
    connect_timeout: float = _D["connect_timeout"]
    max_body: int = _D["max_body"]
    max_replay_body: int = _D["max_replay_body"]
    retryable_statuses: frozenset[int] = _D["retryable_statuses"]
    replay_headers: tuple[str, ...] = _D["replay_headers"]
    forward_fencing_headers: bool = _D["forward_fencing_headers"]
    worker_tokens: tuple[str, ...] | None = field(default=_D["worker_tokens_env"], repr=False)
    upstream_headers: tuple[tuple[str, str], ...] = field(
        default=_D["upstream_headers"], repr=False
    )
    max_in_flight: int = _D["max_in_flight"]
    max_wait: float = _D["max_wait"]
    ca_file: Path | None = _D["ca_file"]
    client_cert: Path | None = _D["client_cert"]
    client_key: Path | None = _D["client_key"]
    tls_verify: bool = _D["tls_verify"]
    # The contents of ca_file, client_cert and client_key when loaded: a reload
    # after a certificate was renewed in place sees the destination changed (and
    # gives it a new connection pool, which reads the new files).
    tls_digest: str = field(default="", repr=False)
    source: Path

    @property
    def upstream_header_names(self) -> tuple[str, ...]:
        """The names of `upstream_headers`, safe to print (the values are secrets)."""
        return tuple(name for name, _ in self.upstream_headers)

    @property
    def headers_named_like_keys(self) -> tuple[str, ...]:
        """`upstream_headers` names that are also destination keys: most likely a
        key written below the `[upstream_headers]` table, which TOML puts inside it."""
        return tuple(name for name in self.upstream_header_names if name in DESTINATION.names)


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The gateway's whole configuration; `destinations` is read-only, by name.
    Defaults are those declared in `gateway.config.keys`."""

    source: Path
    listen: tuple[str, int]
    admin_listen: tuple[str, int]
    # repr=False: a postgresql URL may carry a password; see `redact_url`.
    store_url: str = field(repr=False)
    store_pool_size: int = _STORE["pool_size"]
    admin_token: str | None = field(default=None, repr=False)
    admin_token_env: str = DEFAULT_ADMIN_TOKEN_ENV
    idempotency_ttl: float = _RETENTION["idempotency_ttl"]
    rejections_ttl: float = _RETENTION["rejections_ttl"]
    audit_ttl: float = _RETENTION["audit_ttl"]
    # [admin.operators]: (name, token) per person, named in the audit log.
    admin_operators: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    destinations: Mapping[str, DestinationConfig] = field(
        default_factory=lambda: MappingProxyType({})
    )
    max_in_flight: int = _SERVER["max_in_flight"]
    max_deciding: int = _SERVER["max_deciding"]
    max_body_buffer: int = _SERVER["max_body_buffer"]
    shutdown_grace: float = _SERVER["shutdown_grace"]
    # None: open lease API
    lease_tokens: tuple[str, ...] | None = field(default=_SERVER["lease_tokens_env"], repr=False)
    tls_cert: Path | None = _SERVER["tls_cert"]
    tls_key: Path | None = _SERVER["tls_key"]
    workers: int = _SERVER["workers"]
    max_waiting: int = _SERVER["max_waiting"]
    # How the gateway file is named in messages (as given on the command line):
    # a reload reports its errors exactly as check-config does.
    display: str | None = field(default=None, compare=False)
    # Fields the command line set over the file (`serve --workers`): a reload
    # neither applies nor refuses what the file says of them.
    overridden: frozenset[str] = field(default=frozenset(), compare=False)
    # Files of the destinations directory that look meant as destinations but are
    # not read (`Payments.TOML`, `pay.tml`), as shown in messages.
    unread_files: tuple[str, ...] = field(default=(), compare=False)


# --- the gateway file ------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    display: str | None = None,
) -> Config:
    """Load and validate the gateway config and every destination file.

    `path` defaults to `$SINKGATE_CONFIG`, then `config/gateway.toml`; `environ`
    (default `os.environ`) is where secrets named by `*_env` keys are read.
    Every problem found is reported in one `ConfigError`, one line each, naming
    the gateway file as `display` (default: its file name) and each destination
    file relative to that.
    """
    env = os.environ if environ is None else environ
    given = Path(path if path is not None else env.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)
    return _load(given, env, display, running=None).config


@dataclass(frozen=True, slots=True)
class Reread:
    """The files as a reload finds them (`reread_config`)."""

    config: Config
    # What this process's variables fail in the sections a reload does not apply
    # (`[server]`, `[store]`, `[admin]`): the reload refuses those keys.
    unread: tuple[EnvironmentConfigError, ...] = ()


def reread_config(running: Config, environ: Mapping[str, str] | None = None) -> Reread:
    """`running`'s files as they are now, for a reload (SPEC 5). A file error
    anywhere raises `ConfigError`, as a load does: the reload changes nothing.
    In `[server]`, `[store]` and `[admin]`, which wait for a restart anyway, an
    error of what a variable holds in this process (an operator's variable it was
    started without) is in `unread` instead: the reload refuses its key, as it
    would a change of it, and the restart that would apply it checks it."""
    env = os.environ if environ is None else environ
    return _load(running.source, env, running.display, running)


def _load(
    given: Path, env: Mapping[str, str], display: str | None, running: Config | None
) -> Reread:
    source = given.absolute()
    if not source.is_file():
        what = "is a directory" if source.is_dir() else "no such file"
        raise ConfigError(f"{given}: cannot read: {what}")
    file = display if display is not None else source.name
    problems = Problems()
    root = _gateway_table(source, file, env, problems)
    server, store, admin, retention, dirs = (s.open(root) for s in keys.GATEWAY_FILE)
    srv = keys.SERVER.read(server)
    _check_server(server, srv, resolve=running is None)
    st = keys.STORE.read(store)
    st["url"] = _absolute_sqlite(st["url"], source.parent)
    adm = keys.ADMIN.read(admin)
    admin_token = _admin_token(server, srv["admin_listen"][0], adm, env)
    ret = keys.RETENTION.read(retention)
    if "audit_ttl" not in retention.data:
        # The year by default, longer with a longer rejections_ttl: only a value
        # written can be refused for it.
        ret["audit_ttl"] = max(ret["audit_ttl"], ret["rejections_ttl"])
    elif not retention.failed & {"audit_ttl", "rejections_ttl"} and (
        ret["audit_ttl"] < ret["rejections_ttl"]
    ):  # what operators write outlives the noise, never the other way round
        retention.report(
            "audit_ttl",
            f"must be at least rejections_ttl ({format_duration(ret['rejections_ttl'])}): "
            "operators' actions outlive the rejections",
        )
    destinations, unread_files = _destinations(dirs, source.parent, os.path.dirname(file))
    # A reload refuses what only this process's variables fail where it applies
    # nothing; any other error fails it, said with every one, as check-config says.
    unread = [p for p in problems if _refusable(p, running)]
    if len(unread) < len(problems):
        problems.raise_any()
    config = Config(
        source=source,
        **keys.SERVER.fields(srv),
        **keys.STORE.fields(st),
        **keys.ADMIN.fields(adm),
        **keys.RETENTION.fields(ret),
        admin_token=admin_token,
        destinations=MappingProxyType(destinations),
        display=file,
        unread_files=unread_files,
    )
    refused = shared_tokens(config, running)
    for short in short_tokens(config, running):
        if not short.exposed:
            continue
        if short.key is not None and running is not None:  # a gateway file's: restart-only
            unread.append(EnvironmentConfigError(short.message, key=short.key))
        else:
            refused.append(short.message)
    if refused:
        raise ConfigError(*refused)
    return Reread(config, tuple(unread))


def _refusable(error: ConfigError, running: Config | None) -> TypeGuard[EnvironmentConfigError]:
    """On a reload, an error a restart-only key has in this process's variables."""
    if running is None or not isinstance(error, EnvironmentConfigError):
        return False
    return error.key.split(".")[0] in keys.RESTART_SECTIONS


def _gateway_table(source: Path, file: str, env: Mapping[str, str], problems: Problems) -> Table:
    """The gateway file's top level; a file that cannot be parsed reads as empty
    (its error is one of the problems)."""
    try:
        data = read_toml(source, file)
    except ConfigError as exc:
        problems.append(exc)
        data = {}
    return Table(
        data,
        file,
        "",
        tuple(section.name for section in keys.GATEWAY_FILE),
        env=env,
        base=source.parent,
        problems=problems,
    )


def _check_server(server: Table, srv: dict[str, Any], *, resolve: bool) -> None:
    """`resolve`: compare the listen addresses by what their names resolve to. Not
    on a reload: they wait for a restart, and a lookup would block the event loop
    (and fail the reload on a DNS change nobody made in the file)."""
    listen, admin = srv["listen"], srv["admin_listen"]
    if not server.failed & {"listen", "admin_listen"} and (
        same_socket(listen, admin) if resolve else listen == admin and listen[1] != 0
    ):
        (host, port), (admin_host, _) = srv["listen"], srv["admin_listen"]
        also = "" if host == admin_host else f" ({admin_host} and {host} share port {port})"
        server.report("admin_listen", f"must differ from server.listen{also}")
    check_server_tls(server, srv)


def _admin_token(
    server: Table, admin_host: str, admin: Mapping[str, Any], env: Mapping[str, str]
) -> str | None:
    """The admin token from the environment; none (and no operator) is a problem
    beyond loopback. Surrounding whitespace is not part of it (a bearer token is
    read without it, so a token ending in a space could never be presented):
    blank counts as unset. An operator's token may not be the shared one: the
    audit log would not know whom to name."""
    token_env = admin["token_env"]
    admin_token = env.get(token_env, "").strip() or None
    if admin_token is not None and not VISIBLE.fullmatch(admin_token):
        # As an operator's: a header cannot carry it (the CLI could never send it),
        # and the token itself is never echoed.
        server.problems.append(
            EnvironmentConfigError(
                f"{server.file}: admin.token_env: the token has characters other than "
                f"visible ASCII (environment variable {shown_env(token_env)})",
                key="admin.token_env",
            )
        )
    if admin_token is None and not admin["operators"] and not is_loopback(admin_host):
        error = server.environment_error(
            "admin_listen",
            f"listens beyond loopback on {show(admin_host)} but no admin token is "
            f"set (environment variable {shown_env(token_env)} is unset, empty or blank)",
        )
        server.problems.append(error)
    for name, token in admin["operators"]:
        if token == admin_token:
            server.problems.append(
                EnvironmentConfigError(
                    f"{server.file}: {operator_key(name)}: has the same token as "
                    f"admin.token_env ({shown_env(token_env)})",
                    key=operator_key(name),
                )
            )
    return admin_token


MIN_TOKEN_LENGTH = 16


class ShortToken(NamedTuple):
    message: str
    exposed: bool  # its listener reaches beyond loopback: refused, not only warned about
    key: str | None  # the gateway file's key naming it ([server] or [admin]); None: a destination's


def short_tokens(config: Config, running: Config | None = None) -> list[ShortToken]:
    """Each token shorter than `MIN_TOKEN_LENGTH`, said with its key, and whether
    its listener reaches beyond loopback (then it is refused: a short token can be
    guessed from the network; on loopback it is only warned about). On a reload
    (`running`), a listener reaches as far as either the running or the new
    address does: a changed address waits for the restart."""
    file = config.display or config.source.name
    admin, main = "server.admin_listen", "server.listen"
    found: list[tuple[str, str | None, str, str]] = []  # (file, key, token, listener)
    if config.admin_token is not None:
        found.append((file, "admin.token_env", config.admin_token, admin))
    found += [(file, operator_key(n), t, admin) for n, t in config.admin_operators]
    found += [(file, "server.lease_tokens_env", t, main) for t in config.lease_tokens or ()]
    for _, dest in sorted(config.destinations.items()):
        found += [(os.path.relpath(dest.source), None, t, main) for t in dest.worker_tokens or ()]
    short: list[ShortToken] = []
    for in_file, key, token, listener in dict.fromkeys(found):
        if len(token) >= MIN_TOKEN_LENGTH:
            continue
        field = "admin_listen" if listener == admin else "listen"
        hosts = [getattr(c, field)[0] for c in (config, running) if c is not None]
        exposed = not all(is_loopback(host) for host in hosts)
        reach = "reaches beyond loopback" if exposed else "is loopback-only"
        message = (
            f"{in_file}: {key or 'worker_tokens_env'}: a token is shorter than "
            f"{MIN_TOKEN_LENGTH} characters and {listener} {reach}: use a long random "
            "one (e.g. openssl rand -hex 24)"
        )
        short.append(ShortToken(message, exposed, key))
    return short


def shared_tokens(config: Config, running: Config | None = None) -> list[str]:
    """An admin or operator token that is also a lease or worker token: whoever
    holds it for the lease API or a destination could act as the operator, and the
    audit log would name the wrong one. (A worker's lease and worker tokens may be
    one.) On a reload (`running`), the running admin tokens too: a change of them
    waits for the restart."""
    file = config.display or config.source.name
    admin: list[tuple[str, str]] = []
    for c in (config, running) if running is not None else (config,):
        admin += [("admin.token_env", c.admin_token)] if c.admin_token else []
        admin += [(operator_key(n), t) for n, t in c.admin_operators]
    worker = {t: "server.lease_tokens_env" for t in config.lease_tokens or ()}
    for name, dest in sorted(config.destinations.items(), reverse=True):
        worker |= {
            t: f"destinations {show(name)}'s worker_tokens_env" for t in dest.worker_tokens or ()
        }
    said = dict.fromkeys(
        f"{file}: {key}: has the same token as {worker[token]}: whoever holds it there "
        "could act here; give each role a token of its own"
        for key, token in admin
        if token in worker
    )
    return list(said)


def operator_key(name: str) -> str:
    """The dotted key of operator `name`, as the config's own errors write it."""
    return f"admin.operators.{dotted(name)}"


def _absolute_sqlite(url: str, base: Path) -> str:
    """A relative sqlite path is relative to the config file, not the working directory."""
    if not url.startswith("sqlite:///"):
        return url
    rest = url[len("sqlite:///") :]
    if rest == ":memory:" or rest.startswith("/"):
        return url
    return "sqlite:///" + os.path.normpath(base / rest)


def _destinations(
    section: Table, base: Path, shown_dir: str
) -> tuple[dict[str, DestinationConfig], tuple[str, ...]]:
    """The destinations by name, and the files that look meant as ones but are not
    read (by the name they are shown with)."""
    given = keys.DESTINATIONS.read(section)["dir"]
    directory = base / given
    if not directory.is_dir():
        if "dir" in section.data:
            what = "a file, not a directory" if directory.exists() else "no such directory"
            section.report("dir", f"{what}: {show(given)}, next to this file")
        return {}, ()
    try:  # glob would read a directory it may not list as empty: no destinations
        names = os.listdir(directory)
    except OSError as exc:
        section.report("dir", f"cannot read {show(given)}: {exc.strerror or exc}")
        return {}, ()
    destinations: dict[str, DestinationConfig] = {}
    # Dot files are skipped: editors leave lock files like `.#payments.toml`.
    read = sorted(n for n in names if n.endswith(".toml") and not n.startswith("."))
    for name in read:
        path = directory / name
        display = os.path.join(shown_dir, _relative(path, base))
        destination = _destination(path, section.env, display, section.problems)
        if destination is not None:
            destinations[destination.name] = destination
    unread = sorted(
        os.path.join(shown_dir, _relative(directory / n, base))
        for n in names
        if n not in read and not n.startswith(".") and n.lower().endswith((".toml", ".tml"))
    )
    return destinations, tuple(unread)


def _relative(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return str(path)


# --- one destination file ----------------------------------------------------------


def load_destination(
    path: Path, *, environ: Mapping[str, str] | None = None, display: str | None = None
) -> DestinationConfig:
    """Load one destination file; its name is the file's stem."""
    env = os.environ if environ is None else environ
    problems = Problems()
    destination = _destination(path, env, display or str(path), problems)
    problems.raise_any()
    assert destination is not None
    return destination


def _destination(
    path: Path, env: Mapping[str, str], display: str, problems: Problems
) -> DestinationConfig | None:
    """The destination in `path`, or None with its errors added to `problems`."""
    found = len(problems)
    name = path.stem
    if not DESTINATION_NAME.fullmatch(name):
        problems.append(
            ConfigError(
                f"{display}: the file name gives the destination name {show(name)}: "
                "expected 1-64 characters of A-Z a-z 0-9 . _ -"
            )
        )
        return None
    try:
        data = read_toml(path, display)
    except ConfigError as exc:
        problems.append(exc)
        return None
    t = Table(data, display, "", DESTINATION.names, env=env, base=path.parent, problems=problems)
    values = DESTINATION.read(t)
    if "connect_timeout" not in t.data:
        # The 2 s default never exceeds a shorter timeout; only an explicit value can.
        values["connect_timeout"] = min(values["connect_timeout"], values["timeout"])
    elif t.failed & {"timeout", "connect_timeout"}:
        pass  # said already; the other is not compared with a default
    elif values["connect_timeout"] > values["timeout"]:
        t.report(
            "connect_timeout", f"must not exceed timeout ({format_duration(values['timeout'])})"
        )
    check_destination_tls(t, values)
    if len(problems) > found:
        return None
    digest = tls_digest(values["ca_file"], values["client_cert"], values["client_key"])
    return DestinationConfig(
        name=name, source=path.absolute(), tls_digest=digest, **DESTINATION.fields(values)
    )
