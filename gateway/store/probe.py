"""`check-config --connect`'s look at the store (SPEC 6): can it be opened, and is
its schema current, older (serve upgrades it) or missing (serve creates it)?
Read-only: nothing is created or changed (but for SQLite's own -wal and -shm files
beside a WAL database). Also the one line `serve` prints for
a PostgreSQL database that does not exist, naming it and how to create it, and
for a TLS setting of the URL that fails.

The driver is imported when a URL names it, as `open_store` does.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from gateway.errors import GatewayError, os_error_words
from gateway.store import sqlite_schema
from leases import sqlite as lease_sqlite
from leases.urls import is_postgres_url, split_statement_cache, unreadable_url

CONNECT_TIMEOUT_S = 5.0
# Both components' versions: `serve` refuses a database either is newer in.
_VERSION_SQL = "SELECT component, version FROM sinkgate_schema"
_INVALID_CATALOG = "3D000"  # SQLSTATE: the database does not exist
_UNDEFINED_TABLE = "42P01"
_AUTH_FAILED = ("28000", "28P01")


class ProbeFailed(GatewayError):
    """The store cannot be used as configured; the message says what to check."""


async def store_status(url: str) -> str:
    """How the store is, in words (`schema current (v4)`); `ProbeFailed` when it
    cannot be opened."""
    if url.startswith("sqlite:///"):
        return await asyncio.to_thread(_sqlite_status, url[len("sqlite:///") :])
    return await _postgres_status(url)


def schema_words(version: int | None, current: int, component: str = "") -> str:
    """`missing`, `older`, `current` or (ProbeFailed) newer than this release's
    `current` (each backend numbers its own schema); `component`: the name
    before "schema" (the gateway's own schema goes unnamed)."""
    schema = f"{component} schema" if component else "schema"
    if version is None:
        return f"{schema} missing: serve creates it"
    if version < current:
        return f"{schema} older (v{version}): serve upgrades it to v{current}"
    if version == current:
        return f"{schema} current (v{version})"
    raise ProbeFailed(
        f"its {schema} is v{version}, newer than this release's v{current}: "
        "run the release that wrote it, or a newer one"
    )


def schemas_words(versions: dict[str, int], gateway: int, leases: int) -> str:
    """The gateway's schema in words (`schema_words`), then the lease store's
    where it is not current too (`serve` checks both, and refuses a newer one)."""
    words = schema_words(versions.get("gateway"), gateway)
    leases_version = versions.get("leases")
    leases_words = schema_words(leases_version, leases, "leases")  # raises when newer
    if "gateway" in versions and leases_version != leases:
        words += f"; {leases_words}"
    return words


def _sqlite_status(path: str) -> str:
    current = sqlite_schema.GATEWAY_SCHEMA_VERSION
    leases = lease_sqlite.LEASES_SCHEMA_VERSION
    if path == ":memory:":
        return "in memory: nothing to check"
    file = Path(path)
    if not file.exists():
        if file.is_symlink():  # dangling: SQLite creates the file where it points, if it can
            target = Path(os.path.realpath(file))
            if not target.parent.is_dir():
                raise ProbeFailed(f"it is a link to {target}, whose directory does not exist")
            return _missing_file(target.parent)
        return _missing_file(file.parent)
    try:
        # A URI, so that mode=ro holds: the path encoded in it, or a `#`, `?` or `%`
        # in a directory's name would name (and create) another file.
        uri = file.resolve().as_uri() + "?mode=ro"
        conn = sqlite3.connect(uri, uri=True, timeout=CONNECT_TIMEOUT_S)
        try:
            rows = conn.execute(_VERSION_SQL).fetchall()
        finally:
            conn.close()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return schema_words(None, current)
        raise ProbeFailed(f"cannot be read: {exc}") from exc
    except sqlite3.DatabaseError as exc:
        raise ProbeFailed(f"is not a SQLite database: {exc}") from exc
    return schemas_words({str(c): int(v) for c, v in rows}, current, leases)


def _missing_file(parent: Path) -> str:
    """What `serve` will do about a SQLite file that does not exist, in `parent`:
    create it, and the missing directories too (as `sinkgate init` leaves `data/`
    to it), where the nearest one that exists is a writable directory."""
    if parent.is_dir():
        if not os.access(parent, os.W_OK):
            raise ProbeFailed(f"its directory {parent} is not writable by this user")
        return "file missing: serve creates it with the schema"
    # `lexists`: a dangling link is in the way too (serve's mkdir fails on it).
    existing = next((p for p in (parent, *parent.parents) if os.path.lexists(p)), Path("."))
    if not existing.is_dir():
        raise ProbeFailed(f"{existing} is in the way of its directory {parent}: not a directory")
    if not os.access(existing, os.W_OK):
        raise ProbeFailed(
            f"its directory {parent} does not exist, and {existing} is not writable "
            "by this user: create it"
        )
    return "file missing: serve creates it and its directory, with the schema"


async def _postgres_status(url: str) -> str:
    import asyncpg  # type: ignore[import-untyped]

    from gateway.store.postgres_schema import GATEWAY_SCHEMA_VERSION as current
    from leases.postgres import LEASES_SCHEMA_VERSION as leases

    driver_url, cache = split_statement_cache(url)
    try:
        conn = await asyncpg.connect(driver_url, timeout=CONNECT_TIMEOUT_S, statement_cache_size=0)
    except (
        OSError,
        TimeoutError,
        UnicodeError,  # a host name the resolver cannot encode (`a..b`)
        ValueError,  # a URL asyncpg cannot read (the config check refuses those)
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
    ) as exc:
        raise ProbeFailed(postgres_trouble(url, exc)) from exc
    try:
        try:
            rows = await conn.fetch(_VERSION_SQL)
        except asyncpg.PostgresError as exc:
            if getattr(exc, "sqlstate", None) != _UNDEFINED_TABLE:
                raise ProbeFailed(f"cannot be read: {type(exc).__name__}: {exc}") from exc
            rows = []
        versions = {str(c): int(v) for c, v in rows}
        await _foreign_tables(conn, versions)
        pooled = cache != 0 and await _lends_servers(driver_url, conn)
    finally:
        await conn.close()
    words = schemas_words(versions, current, leases) if versions else schema_words(None, current)
    return f"{words}; WARNING: {POOLED}" if pooled else words


POOLED = (
    "reached through a pooler in transaction mode (two sessions were given one "
    "server): writes fail 503 as soon as it moves a session between servers, unless "
    "statement_cache_size=0 is added to the URL's query or the pooler keeps prepared "
    "statements (PgBouncer 1.21+ with max_prepared_statements)"
)


async def pooler_warning(url: str) -> str | None:
    """`serve`'s start: the words of `check-config --connect`'s WARNING when the
    PostgreSQL `url` reaches a pooler in transaction mode with the driver's
    statement cache on; else None (a failure to tell is no reason to stop)."""
    import asyncpg

    driver_url, cache = split_statement_cache(url)
    if cache == 0:
        return None
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S * 2):
            first = await asyncpg.connect(driver_url, statement_cache_size=0)
            try:
                pooled = await _lends_servers(driver_url, first)
            finally:
                await first.close()
    except Exception:  # unreachable, refused, slow: the store's own opening says so
        return None
    return POOLED if pooled else None


async def _lends_servers(url: str, first: Any) -> bool:
    """Whether `url` reaches a pooler in transaction mode: a second session, in a
    transaction, is given the server the first one's last statement ran on (the
    pooler lends the server it got back last). Directly, or through a pooler in
    session mode, two sessions never share a server. A pooler that lends another
    server is not found: this can say so, not rule it out."""
    import asyncpg

    ran_on = await first.fetchval("SELECT pg_backend_pid()")
    second = await asyncpg.connect(url, timeout=CONNECT_TIMEOUT_S, statement_cache_size=0)
    try:
        async with second.transaction():
            return bool(await second.fetchval("SELECT pg_backend_pid()") == ran_on)
    finally:
        await second.close()


async def _foreign_tables(conn: Any, versions: dict[str, int]) -> None:
    """`ProbeFailed` where `serve` would refuse tables it did not make (see
    `leases.postgres.refuse_foreign_tables`)."""
    from gateway.store.postgres_schema import GATEWAY_TABLES
    from leases.errors import ForeignTables
    from leases.postgres import refuse_foreign_tables

    try:
        if "leases" not in versions:
            await refuse_foreign_tables(conn, "leases", ("leases",))
        if "gateway" not in versions:
            await refuse_foreign_tables(conn, "gateway", GATEWAY_TABLES)
    except ForeignTables as exc:
        raise ProbeFailed(str(exc)) from exc
    except Exception as exc:  # the driver's: a catalog that cannot be read
        raise ProbeFailed(f"cannot be read: {type(exc).__name__}: {exc}") from exc


def postgres_trouble(url: str, exc: BaseException) -> str:
    """What an error opening a PostgreSQL store means, and what to do about it."""
    where = _server(url)
    sqlstate = _sqlstate(exc)
    if sqlstate == _INVALID_CATALOG:
        return missing_database(url)
    if sqlstate in _AUTH_FAILED:
        return f"{where} refused the user: check the URL's user and password, and pg_hba.conf"
    if isinstance(exc, TimeoutError):
        return f"no answer from {where} within {CONNECT_TIMEOUT_S:g} s: check the host and port"
    if isinstance(exc, UnicodeError):  # e.g. "label empty or too long"
        why = exc.__cause__ or exc
        return f"cannot resolve the host of {where} ({why}): check the URL's host name"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host of {where} ({exc.strerror}): check the URL's host name"
    tls = tls_trouble(url, exc)
    if tls is not None:
        return tls
    if isinstance(exc, OSError):
        return (
            f"cannot connect to {where} ({os_error_words(exc)}): is PostgreSQL running there, "
            "and is the URL's port its port?"
        )
    if type(exc) is ValueError:  # never urllib's words: they may quote the password
        return f"cannot read the URL: {unreadable_url(exc)}"
    return f"{where}: {type(exc).__name__}: {first_line(exc)}"


def first_line(exc: BaseException) -> str:
    """The driver's message without the `HINT:` lines libpq's words come with."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


# The URL's parameters naming TLS files, as libpq (and asyncpg) read them.
_TLS_FILES = ("sslrootcert", "sslcert", "sslkey", "sslcrl")


def tls_trouble(url: str, exc: BaseException) -> str | None:
    """What a TLS failure opening the store means, naming the URL's parameter at
    fault; None when `exc` is not one. asyncpg raises a bare `FileNotFoundError`
    for a missing file and `[SSL] PEM lib` for a file that is not what it should
    be, and says a refused upgrade in words that read like an outage."""
    where = _server(url)
    params = _tls_params(url)
    mode = params.get("sslmode", "")
    if "rejected SSL upgrade" in str(exc):
        return (
            f"{where} does not take TLS, and the URL's sslmode={mode or 'require'} asks for "
            "it: turn on ssl in the server's postgresql.conf (or, on a network you trust, "
            "use sslmode=prefer)"
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"{where}'s certificate was not accepted ({exc.verify_message}): sslrootcert must "
            "name the CA that signed it, and the URL's host a name it has"
        )
    if isinstance(exc, ssl.SSLError) and "PEM" in str(exc):
        files = " and ".join(f"{k}={params[k]}" for k in ("sslcert", "sslkey") if k in params)
        return (
            f"the URL's TLS files ({files or 'sslcert, sslkey'}) cannot be loaded: sslcert must "
            "be a PEM certificate and sslkey its own private key, not encrypted"
        )
    if isinstance(exc, OSError) and exc.filename is None and exc.errno in (2, 13):
        for name in _TLS_FILES:
            path = params.get(name)
            if path is not None and not os.access(path, os.R_OK):
                missing = "does not exist" if not os.path.exists(path) else "cannot be read"
                return f"the URL's {name} file {path} {missing}"
    if "root certificate file" in str(exc):  # verify-* without sslrootcert
        return f"{first_line(exc)}: name the CA's certificate file with the URL's sslrootcert"
    return None


def _tls_params(url: str) -> dict[str, str]:
    try:
        query = urlsplit(url).query
    except ValueError:
        return {}
    return {k: v for k, v in parse_qsl(query) if k == "sslmode" or k in _TLS_FILES}


def missing_database(url: str) -> str:
    """The line for a database that does not exist: which, and how to create it."""
    parts = urlsplit(url)
    name = unquote(parts.path.lstrip("/")) or unquote(parts.username or "") or "postgres"
    user = f" -U {unquote(parts.username)}" if parts.username else ""
    host = f" -h {parts.hostname}" if parts.hostname else ""
    port = f" -p {parts.port}" if parts.port else ""
    return (
        f'database "{name}" does not exist on {_server(url)}: create it with '
        f"`createdb{host}{port}{user} {name}` (or CREATE DATABASE {name})"
    )


def known_trouble_in(url: str, exc: BaseException) -> str | None:
    """`serve`'s line for a store it could not open, when `exc` (or what caused it)
    is one with more to say than the driver: a database that does not exist, TLS
    (`tls_trouble`), or a server that cannot be reached, in `check-config
    --connect`'s words; else None."""
    if _sqlstate(exc) == _INVALID_CATALOG:
        return missing_database(url)
    cause = exc.__cause__ or exc.__context__
    if cause is None:
        return None
    tls = tls_trouble(url, cause)
    if tls is None and is_postgres_url(url):
        if isinstance(cause, OSError | TimeoutError):  # refused, unresolved, silent
            return postgres_trouble(url, cause)
    return tls


def _sqlstate(exc: BaseException | None) -> str | None:
    seen = 0
    while exc is not None and seen < 10:  # the driver's error may be a cause or context
        state = getattr(exc, "sqlstate", None)
        if state:
            return str(state)
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _server(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:  # `[::1` and the like: no host to name
        return "the URL's server"
    try:
        port = parts.port or 5432
    except ValueError:
        port = 5432
    return f"{parts.hostname or 'localhost'}:{port}"
