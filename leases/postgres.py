"""The PostgreSQL lease store (asyncpg), with the same semantics and errors as SQLite.

Each operation is one short READ COMMITTED transaction on a pooled connection:
lock the job's row (`SELECT ... FOR UPDATE`, or `INSERT ... ON CONFLICT DO
NOTHING` for a job never seen), read the store's clock, ask `leases.model`, write.
The clock is read only after the row lock is held, so a claim or renewal that
waited for a competitor is judged at the time it actually decides.

The store's clock is the server's `clock_timestamp()` plus `clock_offset`
seconds; the offset is sent as a bound parameter with every statement that
reads the clock, so tests can move time by assigning the attribute. Times are
stored as epoch seconds in `double precision` columns, the table shape SQLite
uses, so the gateway's PostgreSQL store can share the table through the
module-level helpers below inside its own transactions.

PgBouncer (transaction pooling): the store keeps no session state. There are no
`SET`s (durability is set with `set_config(..., is_local => true)`, which ends
with the transaction), no session advisory locks (the schema lock is
`pg_advisory_xact_lock`), no temporary tables, no LISTEN. asyncpg's own
statement cache is kept by default (`statement_cache_size=100`): it works with
PgBouncer 1.21+ configured with `max_prepared_statements`; behind an older
PgBouncer open the store with `statement_cache_size=0` (or put
`statement_cache_size=0` in the URL's query, which wins over the argument),
which makes asyncpg re-parse every statement instead of relying on named
prepared statements.

Bounds: an operation waits at most `acquire_timeout` seconds for a pooled
connection and each of its statements at most `statement_timeout` seconds for
its answer (asyncpg's `command_timeout`), both 10 s by default; past either it
fails with `StoreUnavailable`, as when the server is down. A connection whose
statement timed out (a server host gone, a firewall dropping the connection's
state: no reset ever arrives), or whose caller was cancelled meanwhile, is
closed, not put back in the pool, where the next operation would wait on it
again; its transaction is left to the server to roll back. The schema is
created and migrated on a connection of its own without a statement bound: a
migration of a large table may take longer.

Durability: every write transaction raises `synchronous_commit` to `on` when the
server or role has it `off` (and leaves stronger settings such as
`remote_apply` alone), so a lease change is flushed to the WAL before the call
returns, whatever the server's configuration.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager, suppress
from types import MappingProxyType
from typing import Any, TypeVar

import asyncpg  # type: ignore[import-untyped]

from . import model
from .base import Closing
from .errors import (
    ForeignTables,
    JobCompleted,
    LeaseHeld,
    SchemaTooNew,
    StoreUnavailable,
    refused,
)
from .model import Lease, LeaseRef, LeaseRow, Reason, State
from .urls import check_readable, is_postgres_url, shown_scheme, split_statement_cache

T = TypeVar("T")
Conn = Any  # asyncpg.Connection or a pool's proxy for one; asyncpg ships no type hints

LEASES_SCHEMA_VERSION = 1
# How long an operation waits for a pooled connection, and each of its statements
# for the answer, before the store counts as unavailable (see the module doc).
ACQUIRE_TIMEOUT_S = 10.0
STATEMENT_TIMEOUT_S = 10.0
# "sinkgate" in ASCII: the one advisory lock every sinkgate component takes
# around its DDL, so that processes starting at once against an empty database
# do not race each other's CREATE TABLE IF NOT EXISTS (which is not atomic).
SCHEMA_LOCK_KEY = 0x73696E6B67617465

_LEASES_DDL = """
CREATE TABLE IF NOT EXISTS sinkgate_schema (
    component text PRIMARY KEY,
    version integer NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
    job_id text PRIMARY KEY,
    owner text NOT NULL,
    generation bigint NOT NULL CHECK (generation >= 1),
    state text NOT NULL CHECK (state IN ('free', 'active', 'done')),
    lease_until double precision NOT NULL,
    ttl double precision NOT NULL
);
"""

_LEASE_COLUMNS = "job_id, owner, generation, state, lease_until, ttl"
# The SQL fragments every PostgreSQL statement of sinkgate shares (the gateway's too).
# STORE_NOW: the store's clock, `{}` the placeholder of the clock offset (seconds).
STORE_NOW = "extract(epoch FROM clock_timestamp())::float8 + {}::float8"
# DURABLE: `synchronous_commit` raised to `on` for this transaction when the server
# or role has it `off`; stronger settings are kept.
DURABLE = (
    "set_config('synchronous_commit', CASE current_setting('synchronous_commit') "
    "WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END, true)"
)

_NOW_SQL = f"SELECT {STORE_NOW.format('$1')}"
_DURABLE_SQL = f"SELECT {DURABLE}"
_GET_SQL = (
    "SELECT n.now, l.job_id, l.owner, l.generation, l.state, l.lease_until, l.ttl "
    f"FROM (SELECT {STORE_NOW.format('$2')} AS now) n "
    "LEFT JOIN leases l ON l.job_id = $1"
)


# --- helpers shared with the gateway's PostgreSQL store ------------------------------


@contextmanager
def driver_errors(what: str) -> Iterator[None]:
    """The one place asyncpg and socket errors become `StoreUnavailable`.

    `ClientConfigurationError` (a malformed URL or option) is a `ValueError` and
    stays one: it is the caller's mistake, not an outage.
    """
    try:
        yield
    except asyncpg.ClientConfigurationError:
        raise
    except TimeoutError as exc:  # a pooled connection, or a statement's answer
        raise StoreUnavailable(f"{what}: PostgreSQL did not answer in time") from exc
    except _POOLED_AWAY as exc:
        # asyncpg's own text goes on for ten lines about a driver option the
        # gateway's config cannot set; this says what can be.
        first = str(exc).split("\n", 1)[0]
        raise StoreUnavailable(
            f"{what}: {type(exc).__name__}: {first}: a pooler in transaction mode "
            "(PgBouncer below 1.21, or without max_prepared_statements) does not keep "
            "prepared statements; add statement_cache_size=0 to the store URL's query"
        ) from exc
    except (
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        # "another operation is in progress": a pooled connection left mid-operation
        # when its backend was terminated or its connection cut (seen under
        # `sinkgate chaos --store-faults --wire-faults`); an outage, not a 500.
        asyncpg.InternalClientError,
        OSError,
    ) as exc:
        raise StoreUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc


# What a named prepared statement gives when the pooler lent its connection's
# server to someone else in between (or lent this one a server that has it).
_POOLED_AWAY = (asyncpg.InvalidSQLStatementNameError, asyncpg.DuplicatePreparedStatementError)

# How an operation can end with its connection's state unknown: a statement timed
# out, or the caller was cancelled while one was on its way.
_ABANDONED = (TimeoutError, asyncio.CancelledError)
# SQLSTATE classes after which a connection is not used again: connection
# exceptions, and operator intervention (a terminated backend's FATAL arrives
# before its socket closes, and leaves the driver waiting for a "ready" that
# never comes: the next statement on it fails with "another operation is in
# progress").
_LOST_CLASSES = ("08", "57")


def unusable(exc: BaseException) -> bool:
    """Whether a connection that raised `exc` must be closed, not reused or rolled
    back: abandoned (see `_ABANDONED`), lost, or left in a state the driver cannot
    tell (its own errors, a socket error)."""
    if isinstance(exc, asyncpg.PostgresError):
        return str(exc.sqlstate or "")[:2] in _LOST_CLASSES
    return isinstance(
        exc, (*_ABANDONED, OSError, asyncpg.InterfaceError, asyncpg.InternalClientError)
    )


def _terminate(conn: Conn) -> None:
    """Close `conn` at once. When its connection was lost, asyncpg has already
    handed the pooled slot back (the proxy then refuses every call): nothing to do."""
    with suppress(asyncpg.InterfaceError):
        conn.terminate()


class CannotConnect(OSError):
    """The server refused a new connection of the pool, in an error of its own
    (`database ... is not currently accepting connections` is SQLSTATE 55000, a
    role that may not log in 28000): an outage like a refused socket, whatever
    the SQLSTATE; nothing was sent."""


@asynccontextmanager
async def connection(pool: Any, wait: float | None) -> AsyncIterator[Conn]:
    """A pooled connection for one operation, waited for at most `wait` seconds
    (None: as long as it takes). One that is `unusable` after what it raised (a
    statement timed out, the caller was cancelled, the connection was lost) is
    closed rather than put back (see the module doc)."""
    acquiring = pool.acquire(timeout=wait)
    try:
        conn = await acquiring.__aenter__()
    except asyncpg.PostgresError as exc:
        raise CannotConnect(f"{type(exc).__name__}: {exc}") from exc
    try:
        yield conn
    except BaseException as exc:
        if unusable(exc):
            _terminate(conn)
        raise
    finally:
        await acquiring.__aexit__(None, None, None)


@asynccontextmanager
async def transaction(pool: Any, wait: float | None, **options: Any) -> AsyncIterator[Conn]:
    """`connection` in one transaction (`options` as asyncpg's `transaction`).
    ROLLBACK is sent only after a statement's own error on a sound connection:
    after a timeout or a cancellation it could wait on the same silent connection
    (a cancelled caller must not wait at all), and on a lost one there is nothing
    to roll back. `connection` closes those, which ends the transaction on the
    server. A ROLLBACK that fails closes the connection too; the statement's error
    is the one raised."""
    async with connection(pool, wait) as conn:
        tx = conn.transaction(**options)
        await tx.start()
        try:
            yield conn
        except BaseException as exc:
            if not unusable(exc):
                try:
                    await tx.rollback()
                except Exception:
                    _terminate(conn)
            raise
        await tx.commit()


@asynccontextmanager
async def schema_connection(url: str, connect_timeout: float) -> AsyncIterator[Conn]:
    """A connection of its own, without a statement bound, to create and migrate
    the schema on: DDL may wait for another process's migration (the schema lock)
    and a migration of a large table may take longer than `STATEMENT_TIMEOUT_S`."""
    conn = await asyncpg.connect(url, timeout=connect_timeout, statement_cache_size=0)
    try:
        yield conn
    finally:
        await conn.close()


async def db_now(conn: Conn, clock_offset: float) -> float:
    """The store's clock: the server's `clock_timestamp()` plus `clock_offset`, epoch s."""
    now: float = await conn.fetchval(_NOW_SQL, float(clock_offset))
    return now


async def require_durable_commit(conn: Conn) -> None:
    """Make the current transaction's commit wait for the WAL flush (see module doc)."""
    await conn.execute(_DURABLE_SQL)


async def read_lease_for_update(conn: Conn, job_id: str) -> LeaseRow | None:
    """The job's lease row, locked until the end of the caller's transaction."""
    record = await conn.fetchrow(
        f"SELECT {_LEASE_COLUMNS} FROM leases WHERE job_id = $1 FOR UPDATE", job_id
    )
    return None if record is None else _row(record)


async def insert_lease(conn: Conn, row: LeaseRow) -> bool:
    """Insert the first row of a job; False (and nothing written) when a concurrent
    transaction inserted it first. Waits for that transaction to finish, so a
    following `read_lease_for_update` sees its row."""
    inserted = await conn.fetchval(
        f"INSERT INTO leases ({_LEASE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6) "
        "ON CONFLICT (job_id) DO NOTHING RETURNING true",
        *_values(row),
    )
    return inserted is True


async def update_lease(conn: Conn, row: LeaseRow) -> None:
    """Overwrite a row the caller holds locked (`read_lease_for_update`)."""
    await conn.execute(
        "UPDATE leases SET owner = $2, generation = $3, state = $4, lease_until = $5, "
        "ttl = $6 WHERE job_id = $1",
        *_values(row),
    )


async def ensure_component(conn: Conn, component: str, version: int) -> int | None:
    """Record `component`'s schema version; refuse a database from a newer release.
    The version recorded before (None: none).

    Call with `SCHEMA_LOCK_KEY` held (as `ensure_schema` does).
    """
    current = await conn.fetchval(
        "SELECT version FROM sinkgate_schema WHERE component = $1", component
    )
    if current is None:
        await conn.execute(
            "INSERT INTO sinkgate_schema (component, version) VALUES ($1, $2)", component, version
        )
    elif current > version:
        raise SchemaTooNew(component, current, version)
    elif current < version:
        await conn.execute(
            "UPDATE sinkgate_schema SET version = $2 WHERE component = $1", component, version
        )
    return None if current is None else int(current)


async def component_version(conn: Conn, component: str) -> int | None:
    """`component`'s recorded schema version (None: none, or no sinkgate_schema)."""
    if await conn.fetchval("SELECT to_regclass('sinkgate_schema')") is None:
        return None
    version: int | None = await conn.fetchval(
        "SELECT version FROM sinkgate_schema WHERE component = $1", component
    )
    return version


async def refuse_foreign_tables(conn: Conn, component: str, tables: tuple[str, ...]) -> None:
    """Before `component`'s first DDL (no version recorded): `ForeignTables` if any
    of its `tables` is already in the schema its DDL would create them in."""
    found = await conn.fetch(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = current_schema() AND c.relname = ANY($1::text[]) ORDER BY 1",
        list(tables),
    )
    if found:
        raise ForeignTables(component, [str(row[0]) for row in found])


async def refuse_foreign_schema(conn: Conn, components: Mapping[str, tuple[str, ...]]) -> None:
    """Before any DDL: `ForeignTables` where a component whose version is not recorded
    has a table of its name already there, for every component this store will
    create (so that a refusal leaves nothing of sinkgate's behind). Under the schema
    lock: a sinkgate starting beside commits its tables and versions together."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK_KEY)
        for component, tables in components.items():
            if await component_version(conn, component) is None:
                await refuse_foreign_tables(conn, component, tables)


async def ensure_schema(conn: Conn) -> None:
    """Create the lease tables and record component 'leases' at version 1.

    Safe when several processes start at once on an empty database: the DDL runs
    under a transaction-scoped advisory lock. Runs in its own transaction, or in a
    savepoint of the caller's (the lock then lasts until the caller commits).
    """
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK_KEY)
        await conn.execute(_LEASES_DDL)
        await ensure_component(conn, "leases", LEASES_SCHEMA_VERSION)


async def claim_tx(conn: Conn, job_id: str, owner: str, ttl: float, clock_offset: float) -> Lease:
    """Claim inside the caller's transaction; raises LeaseHeld or JobCompleted."""
    # Two rounds at most: when a concurrent first claim of the job wins the
    # insert, the second round decides against the winner's committed row.
    for _ in range(2):
        current = await read_lease_for_update(conn, job_id)
        now = await db_now(conn, clock_offset)
        refusal = model.claim_refusal(current, now)
        if refusal is Reason.JOB_COMPLETED:
            assert current is not None
            raise JobCompleted(job_id, current.generation)
        if refusal is not None:
            assert current is not None
            raise LeaseHeld(
                job_id, current.owner, model.expires_in(current, now), current.generation
            )
        row = model.claimed(current, job_id, owner, ttl, now)
        if current is not None:
            await update_lease(conn, row)
            return Lease.from_row(row, now)
        if await insert_lease(conn, row):
            return Lease.from_row(row, now)
    # Only reachable if the competing row vanished again; leases are never deleted.
    raise StoreUnavailable(f"the lease row of {job_id!r} changed under a claim; retry")


async def held_tx(
    conn: Conn,
    op: str,
    job_id: str,
    owner: str,
    generation: int,
    ttl: float | None,
    clock_offset: float,
) -> Lease:
    """renew / complete / release inside the caller's transaction; raises LeaseLost."""
    current = await read_lease_for_update(conn, job_id)
    now = await db_now(conn, clock_offset)
    row = model.held_row(current, op, generation, owner, ttl, now)
    if isinstance(row, Reason):
        raise refused(job_id, generation, str(row), current.generation if current else None)
    await update_lease(conn, row)
    return Lease.from_row(row, now)


async def _no_reset(conn: Any) -> None:
    """Skip asyncpg's reset query on release: one round trip less per operation.

    Safe because the stores keep no session state: every setting is
    transaction-local (set_config(..., true)), every advisory lock transaction-scoped, and a
    connection goes back to the pool only after its transaction has ended.
    """


def _row(record: Any) -> LeaseRow:
    return LeaseRow(
        record["job_id"],
        record["owner"],
        record["generation"],
        State(record["state"]),
        record["lease_until"],
        record["ttl"],
    )


def _values(row: LeaseRow) -> tuple[str, str, int, str, float, float]:
    return (row.job_id, row.owner, row.generation, str(row.state), row.lease_until, row.ttl)


# --- the store -----------------------------------------------------------------------


class PostgresLeaseStore(Closing):
    """The lease API on PostgreSQL (see SPEC 3 and 9).

    `clock_offset` (seconds, default 0) is added to the server's clock; tests
    assign it to move time.
    """

    # The tables of each schema component `open` creates, looked for first.
    SCHEMA_TABLES: Mapping[str, tuple[str, ...]] = MappingProxyType({"leases": ("leases",)})

    def __init__(
        self,
        pool: Any,
        *,
        clock_offset: float = 0.0,
        acquire_timeout: float | None = ACQUIRE_TIMEOUT_S,
    ) -> None:
        self._pool = pool
        self._wait = acquire_timeout  # for a pooled connection
        # What connections outside the pool dial: the URL `open` was given, without
        # the parameter the driver does not read (`split_statement_cache`).
        self._url = ""
        self._closed = False
        self.clock_offset = clock_offset

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        clock_offset: float = 0.0,
        min_size: int = 1,
        max_size: int = 10,
        statement_cache_size: int = 100,
        connect_timeout: float = 10.0,
        acquire_timeout: float | None = ACQUIRE_TIMEOUT_S,
        statement_timeout: float | None = STATEMENT_TIMEOUT_S,
    ) -> PostgresLeaseStore:
        """Open a pool on `url` (postgresql://...) and create or check the schema.
        `acquire_timeout` and `statement_timeout` bound each operation (None: no
        bound); see the module doc."""
        _validate_open(url, clock_offset, min_size, max_size, statement_cache_size)
        url, from_url = split_statement_cache(url)
        if from_url is not None:  # the URL's word wins: it is what a config file can say
            statement_cache_size = from_url
        model.validate_seconds("connect_timeout", connect_timeout)
        for name, bound in (
            ("acquire_timeout", acquire_timeout),
            ("statement_timeout", statement_timeout),
        ):
            if bound is not None:
                model.validate_seconds(name, bound)
        with driver_errors("cannot open the PostgreSQL lease store"):
            pool = await asyncpg.create_pool(
                url,
                min_size=min_size,
                max_size=max_size,
                statement_cache_size=statement_cache_size,
                timeout=connect_timeout,
                command_timeout=statement_timeout,
                reset=_no_reset,
            )
        store = cls(pool, clock_offset=float(clock_offset), acquire_timeout=acquire_timeout)
        store._url = url
        try:
            with driver_errors("cannot create the PostgreSQL lease schema"):
                async with schema_connection(url, connect_timeout) as conn:
                    await refuse_foreign_schema(conn, cls.SCHEMA_TABLES)
                    await ensure_schema(conn)
        except BaseException:
            await store.close()
            raise
        return store

    async def claim(self, job_id: str, *, owner: str | None = None, ttl: float) -> Lease:
        model.validate_ident(job_id, "job_id")
        owner = model.validate_ident(model.default_owner() if owner is None else owner, "owner")
        ttl = model.validate_ttl(ttl)
        offset = self._offset()
        return await self._write(lambda c: claim_tx(c, job_id, owner, ttl, offset))

    async def get(self, job_id: str) -> Lease | None:
        model.validate_ident(job_id, "job_id")
        offset = self._offset()
        self._check_open()
        with driver_errors("PostgreSQL lease read failed"):
            async with connection(self._pool, self._wait) as conn:
                record = await conn.fetchrow(_GET_SQL, job_id, offset)
        if record["job_id"] is None:
            return None
        return Lease.from_row(_row(record), record["now"])

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with driver_errors("closing the PostgreSQL lease store failed"):
            await self._pool.close()

    async def _held(self, op: str, lease: Lease | LeaseRef, ttl: float | None) -> Lease:
        job_id, owner, generation = model.lease_fields(lease)
        offset = self._offset()
        return await self._write(lambda c: held_tx(c, op, job_id, owner, generation, ttl, offset))

    async def _write(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        """Run `fn` in one durable READ COMMITTED transaction on a pooled connection."""
        self._check_open()
        with driver_errors("PostgreSQL lease write failed"):
            async with transaction(self._pool, self._wait, isolation="read_committed") as conn:
                await require_durable_commit(conn)
                return await fn(conn)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("store is closed")

    def _offset(self) -> float:
        offset = self.clock_offset
        if not _is_number(offset) or not math.isfinite(offset):
            raise ValueError("clock_offset must be a finite number of seconds")
        return float(offset)


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def _validate_open(
    url: object, clock_offset: object, min_size: object, max_size: object, cache: object
) -> None:
    if not isinstance(url, str) or not is_postgres_url(url):
        # Never the URL itself: it may carry a password.
        shown = shown_scheme(url) if isinstance(url, str) else type(url).__name__
        raise ValueError(f"not a PostgreSQL URL: {shown} (expected postgresql://...)")
    check_readable(url)  # asyncpg would raise urllib's words, which may quote the password
    if isinstance(clock_offset, bool) or not isinstance(clock_offset, int | float):
        raise ValueError("clock_offset must be a finite number of seconds")
    if not math.isfinite(clock_offset):
        raise ValueError("clock_offset must be a finite number of seconds")
    sizes = (
        ("min_size", min_size, 0),
        ("max_size", max_size, 1),
        ("statement_cache_size", cache, 0),
    )
    for name, value, low in sizes:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}")
    assert isinstance(min_size, int) and isinstance(max_size, int)
    if min_size > max_size:
        raise ValueError("min_size must not exceed max_size")
