"""How one raw TOML value becomes a checked Python value, with errors that say where.

`config.py` says what the configuration is: the dataclasses, their defaults and
the rules of the gateway and destination files. This module is the machinery
those rules are written with, kept apart so that each rule there reads as one
line and every error has the same shape:

    destinations/payments.toml: timeout: expected a duration like "10s", got "ten"

The value parsers (durations, sizes, listen addresses, upstream URLs) raise
`ValueError` saying only what is wrong; `Table` adds the file and the dotted key
and raises `ConfigError`, suggesting the closest known key for an unknown one.
Secrets are read from the environment variable a file names, never echoed.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
import socket
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from gateway.errors import ConfigError, EnvironmentConfigError
from leases.model import VISIBLE

_T = TypeVar("_T")

MiB = 1024 * 1024

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


# --- value parsers (raise ValueError; the loader adds file and key) ----------

_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)")  # ASCII digits: \d takes "٣"
MAX_DURATION_S = 36500 * 86400.0
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = re.compile(r"([0-9]+)(B|KiB|MiB|GiB)")
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


def parse_upstream(value: object) -> str:
    """An absolute http(s) URL without query, fragment or credentials; trailing `/` dropped."""
    # A value with an `@` may hold a credential: never echoed.
    shown = "a URL with user info" if isinstance(value, str) and "@" in value else show(value)
    expected = f"expected an absolute http:// or https:// URL, got {shown}"
    if not isinstance(value, str) or not VISIBLE.fullmatch(value):
        raise ValueError(expected)
    try:
        parts = urlsplit(value)
    except ValueError:
        raise ValueError(expected) from None
    try:
        port = parts.port  # raises ValueError on a port out of range
    except ValueError:
        port = 0
    if port == 0:  # 0 names no port to connect to
        raise ValueError(f"{expected}: the port must be 1..65535")
    if "@" in parts.netloc:
        # Not echoed: the URL holds a credential.
        raise ValueError("must not contain user info; send credentials with [upstream_headers]")
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(expected)
    problem = host_name_problem(parts.hostname)
    if problem is not None:
        raise ValueError(f"{show(parts.hostname)} is not a host name: {problem}")
    if "?" in value or "#" in value:
        # Named without them: a query is where an API key would be put.
        bare = value.split("?", 1)[0].split("#", 1)[0]
        raise ValueError(f"must not have a query or fragment, got {show(bare)} with one")
    if any(seg in (".", "..") for seg in parts.path.split("/")):
        raise ValueError(f"must not contain . or .. path segments, got {show(value)}")
    return urlunsplit((parts.scheme.lower(), parts.netloc, parts.path.rstrip("/"), "", ""))


def host_name_problem(host: str) -> str | None:
    """Why `host` cannot be looked up at all, or None. Python encodes a name with
    the IDNA codec before resolving it, and what the codec refuses (an empty
    label, as in `a..b`, or one over 63 characters) fails there with a
    UnicodeError, not as a name that does not resolve."""
    try:
        host.encode("idna")
    except UnicodeError as exc:
        why = str(exc.__cause__ or exc)
        if "label" in why:
            return "a label between dots is empty or longer than 63 characters"
        return why
    return None


def is_loopback(host: str) -> bool:
    """Whether a listen host reaches this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def same_socket(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether two listen addresses would take one socket: one port (not 0) and
    one host however spelled (`localhost` and `127.0.0.1`), or a wildcard on
    either side. A name that does not resolve is said by `serve`, not here."""
    (host_a, port_a), (host_b, port_b) = a, b
    if port_a != port_b or port_a == 0:
        return False
    if host_a.lower() == host_b.lower() or {host_a, host_b} & _WILDCARDS:
        return True
    try:
        found = [
            {info[4][0] for info in socket.getaddrinfo(host, port_a, type=socket.SOCK_STREAM)}
            for host in (host_a, host_b)
        ]
    except (OSError, UnicodeError):
        return False
    return bool(found[0] & found[1])


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


class Problems(list[ConfigError]):
    """Every error found while loading, in the order found (check-config shows them all)."""

    def raise_any(self) -> None:
        """Raise one `ConfigError` carrying every problem, if there is any."""
        if self:
            raise ConfigError.of(self)


class Table:
    """One TOML table of one file: typed getters whose errors name file and key.

    A Table shares `problems` with the tables made from it: an error found by
    `Section.read` or `report` is collected there rather than raised, so one
    load reports every bad key. `env` is where secrets are read; `base` is the
    directory relative file names (PEM files) are resolved against.
    """

    def __init__(
        self,
        data: Mapping[str, Any],
        file: str,
        prefix: str,
        known: Iterable[str] | None,
        *,
        env: Mapping[str, str] | None = None,
        base: Path | None = None,
        problems: Problems | None = None,
    ) -> None:
        self.data, self.file, self.prefix = data, file, prefix
        self.env: Mapping[str, str] = env if env is not None else {}
        self.base = base if base is not None else Path()
        self.problems = problems if problems is not None else Problems()
        # Keys `Section.read` could not read: a check across keys skips them (it
        # would compare with the default the failed key was given).
        self.failed: set[str] = set()
        if known is None:  # a table of free-form names, like [upstream_headers]
            return
        known = tuple(known)
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f' (did you mean "{close[0]}"?)' if close else ""
                self.report(key, f"unknown key{hint}")

    def key(self, key: str) -> str:
        part = dotted(key)
        return f"{self.prefix}.{part}" if self.prefix else part

    def error(self, key: str, what: str) -> ConfigError:
        return ConfigError(f"{self.file}: {self.key(key)}: {what}")

    def environment_error(self, key: str, what: str) -> EnvironmentConfigError:
        """An error of what a variable named at `key` holds, not of the file."""
        where = self.key(key)
        return EnvironmentConfigError(f"{self.file}: {where}: {what}", key=where)

    def report(self, key: str, what: str) -> None:
        """Collect an error at `key` and go on reading."""
        self.problems.append(self.error(key, what))

    def table(self, key: str, known: Iterable[str] | None) -> Table:
        value = self.data.get(key, {})
        if not isinstance(value, dict):
            self.report(key, f"expected a table, got {show(value)}")
            value = {}
        return Table(
            value,
            self.file,
            self.key(key),
            known,
            env=self.env,
            base=self.base,
            problems=self.problems,
        )

    def string(self, key: str, default: str = "") -> str:
        value = self.data.get(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, got {show(value)}")
        return value

    def boolean(self, key: str, default: bool = False) -> bool:
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
        if value > MAX_DURATION_S:
            # Deadlines and ages are dates the admin views show: keep them in the calendar.
            raise self.error(key, f"must be at most 36500d (100 years), got {show(self.data[key])}")
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

    def strings(self, key: str, default: Iterable[str] = ()) -> list[str]:
        value = self.data.get(key, list(default))
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, f"expected an array of strings, got {show(value)}")
        return value

    def env_name(self, key: str, default: str = "") -> str:
        name = self.string(key, default)
        if not _ENV_NAME.fullmatch(name):
            # Not quoted: a `*_env` holding something else most often holds the
            # token itself, pasted in, and errors reach logs and reload answers.
            raise self.error(
                key,
                "expected an environment variable name (letters, digits and _, not "
                "starting with a digit); the value is not shown: the variable's "
                "name belongs here, never the secret itself",
            )
        return name


def read_toml(path: Path, display: str) -> dict[str, Any]:
    """The top-level table of the TOML file at `path`; `display` names it in errors."""
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


# --- secrets named by environment variable ------------------------------------


def dotted(name: str) -> str:
    """`name` as one part of a dotted key: bare, or quoted as TOML would need it."""
    return name if _BARE_KEY.fullmatch(name) else json.dumps(name)


_CONVENTIONAL_ENV = re.compile(r"[A-Z_][A-Z0-9_]*")
NAME_NOT_SHOWN = "<name not shown: not in capitals, it may be the secret itself>"


def shown_env(name: str, dollar: bool = False) -> str:
    """A variable's name for a message: as it is when it reads as one (capitals,
    digits, `_`), else not at all: a `*_env` key holding a secret pasted in by
    mistake (`f00dbabe4c7d...`) is a valid name too, and messages reach logs."""
    if _CONVENTIONAL_ENV.fullmatch(name):
        return f"${name}" if dollar else name
    return NAME_NOT_SHOWN


def secret(t: Table, key: str, var: str, env: Mapping[str, str]) -> str:
    """The value of `var`, stripped; unset or blank is an error at `key` of `t`."""
    value = env.get(var)
    if value is None:
        raise t.environment_error(key, f"environment variable {shown_env(var)} is not set")
    if not value.strip():
        raise t.environment_error(key, f"environment variable {shown_env(var)} is empty")
    return value.strip()


def bearer_tokens(
    t: Table, env: Mapping[str, str], key: str = "worker_tokens_env"
) -> tuple[str, ...] | None:
    """Comma-separated bearer tokens from the variable named by `key`; key absent:
    None (no auth); key present but the variable unset or empty: an error."""
    if key not in t.data:
        return None
    var = t.env_name(key, "")
    tokens = [tok.strip() for tok in secret(t, key, var, env).split(",")]
    tokens = [tok for tok in tokens if tok]
    if not tokens:
        raise t.environment_error(key, f"environment variable {shown_env(var)} holds no tokens")
    for number, token in enumerate(tokens, 1):
        if not VISIBLE.fullmatch(token):
            # The token itself is never echoed.
            raise t.environment_error(
                key,
                f"environment variable {shown_env(var)}: token {number} has characters other than "
                "visible ASCII",
            )
    return tuple(dict.fromkeys(tokens))
