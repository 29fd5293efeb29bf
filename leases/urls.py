"""Store URLs in messages: never quoted, since they may carry a password.

urllib's own `ValueError` for a URL it cannot read may quote the user and
password (`netloc 'u:pw@h' contains invalid characters under NFKC
normalization`), and asyncpg passes it on as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import parse_qs, unquote, unquote_plus, urlsplit

__all__ = [
    "check_readable",
    "is_postgres_url",
    "postgres_hosts",
    "redact_url",
    "shown_scheme",
    "shown_url",
    "split_statement_cache",
    "unreadable_url",
    "url_problem",
]

# The one query parameter of a postgresql:// URL read here, not by the driver:
# asyncpg would send it to the server as a setting, which refuses it.
STATEMENT_CACHE = "statement_cache_size"

_QUERY_PARAMETER = re.compile(r"([?&])([^=&]*)=([^&]*)")
_PASSWORDS = frozenset({"password", "sslpassword"})  # as the driver reads the name


def _hidden_parameter(match: re.Match[str]) -> str:
    """A query parameter, its value hidden where the driver reads its name as a
    password's: decoded, as `parse_qs` does (`pass%77ord`)."""
    name = match[2]
    read = unquote_plus(name).strip().lower()
    return f"{match[1]}{name}=***" if read in _PASSWORDS else match[0]


def unreadable_url(exc: ValueError) -> str:
    """Why urllib cannot read a URL, in words that quote nothing of it."""
    text = str(exc)
    if "NFKC" in text:
        return (
            "a character in it reads as a URL delimiter once normalised (a full-width "
            "number sign, solidus, question mark or at sign, say): percent-encode it"
        )
    if "IPv6" in text:
        return "a host in [ ] is not an IPv6 address, or its ] is missing or misplaced"
    return "its user, password or host part is malformed"


def url_problem(url: str) -> str | None:
    """Why the PostgreSQL driver could not read `url` (None: it can), in words
    that quote nothing of it. asyncpg reads it with urllib, then takes the user
    and password up to the *first* `@` and parses the query strictly; its own
    errors for either quote what follows (a piece of the password)."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        return unreadable_url(exc)
    if parts.netloc.count("@") > 1:
        return "an @ in its user or password must be percent-encoded (%40)"
    if not all(_port_ok(port) for _, port in postgres_hosts(url)):
        return "a port in it is not a number from 1 to 65535"
    if parts.query:
        try:
            query = parse_qs(parts.query, strict_parsing=True)
        except ValueError:
            return "its query is not name=value pairs joined by &"
        cache = query.get(STATEMENT_CACHE)
        if cache is not None and (len(cache) > 1 or not _count(cache[0])):
            return f"{STATEMENT_CACHE} in its query must be one integer >= 0"
    return None


def _count(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 9


def split_statement_cache(url: str) -> tuple[str, int | None]:
    """`url` without its `statement_cache_size` query parameter, and that
    parameter's value (None where it is not given). 0 turns asyncpg's named
    prepared statements off, for a pooler in transaction mode that cannot keep
    them (PgBouncer below 1.21, or without `max_prepared_statements`); the
    gateway, which takes a URL and no driver options, is told so this way.
    A value `url_problem` refuses is left in place, for the driver to refuse."""
    base, mark, query = url.partition("?")
    if not mark:
        return url, None
    kept: list[str] = []
    found: list[str] = []
    for pair in query.split("&"):
        name, _, value = pair.partition("=")
        if unquote(name) == STATEMENT_CACHE:
            found.append(unquote(value))
        else:
            kept.append(pair)
    if len(found) != 1 or not _count(found[0]):
        return url, None
    return (f"{base}?{'&'.join(kept)}" if kept else base), int(found[0])


def is_postgres_url(url: str) -> bool:
    """Whether `url`'s scheme is postgresql:// or postgres://, in any case."""
    return url.split(":", 1)[0].lower() in ("postgresql", "postgres")


def postgres_hosts(url: str) -> list[tuple[str, str]]:
    """Each `(host, port)` written in a postgresql:// URL's authority (asyncpg
    takes a comma-separated list, and `[v6]:port`); "" where either is left out.
    A socket directory (`%2Frun%2Fpostgresql`, or `?host=`) is not a host here."""
    netloc = url.partition("://")[2].split("/", 1)[0].split("?", 1)[0]
    found: list[tuple[str, str]] = []
    for spec in netloc.rpartition("@")[2].split(","):
        if spec.startswith("["):
            host, _, after = spec[1:].partition("]")
            # anything but `:port` after the brackets is a bad port
            port = after[1:] if after.startswith(":") else after
        else:
            host, _, port = spec.rpartition(":") if ":" in spec else (spec, "", "")
            host = unquote(host)
        found.append(("" if host.startswith("/") else host, port))
    return found


def _port_ok(port: str) -> bool:
    return not port or (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535)


def check_readable(url: str) -> None:
    """`ValueError`, quoting nothing of `url`, when the driver cannot read it."""
    problem = url_problem(url)
    if problem is not None:
        raise ValueError(f"the store URL cannot be read: {problem}")


def redact_url(url: str) -> str:
    """`url` with any password replaced by `***`, for summaries and logs: the
    userinfo's and a `password=` query parameter's. Read as text, not parsed: a
    URL a parser refuses (a raw `[`, `#` or `/` in the password) is shown all
    the same, and rather too much is hidden than too little."""
    scheme, separator, rest = url.partition("://")
    if separator:
        userinfo, at, host = rest.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        if at and colon:
            rest = f"{user}:***@{host}"
        url = f"{scheme}://{rest}"
    return _QUERY_PARAMETER.sub(_hidden_parameter, url)


def shown_scheme(url: str) -> str:
    """The part of `url` a message may show: its scheme, or that it has none."""
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme.replace("+", "").replace(".", "").replace("-", "").isalnum():
        return "a URL without scheme://"
    return f"a {scheme}:// URL"


def shown_url(url: str, quote: Callable[[str], str] = repr) -> str:
    """`url` quoted for a message, or only its scheme where it has an `@`: what
    precedes it may be a password."""
    return quote(url) if "@" not in url else shown_scheme(url)
