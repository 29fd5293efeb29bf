"""The SQLite lease store, and the group-commit executor the gateway shares.

One write connection per process. Callers hand the executor small synchronous
transaction functions; everything queued while a batch is being written goes
into the next batch, which runs in aiosqlite's worker thread in one hop as ONE
`BEGIN IMMEDIATE ... COMMIT` (so one fsync); a function that fails changes
nothing while its neighbours commit (see `_write_batch`).
`BEGIN IMMEDIATE` takes SQLite's write lock up front, which makes every read-
decide-write function atomic also against other processes sharing the file.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

from . import model
from .base import Closing
from .errors import JobCompleted, LeaseHeld, SchemaTooNew, StoreUnavailable, refused
from .model import Lease, LeaseRef, LeaseRow, Reason, State
from .urls import shown_url

T = TypeVar("T")
Clock = Callable[[], float]
TxFn = Callable[[sqlite3.Connection], Any]

MAX_BATCH = 256
# How long an operation may wait for another process's write lock (SQLite's busy
# timeout), counted from when it was queued: a batch whose operations already
# waited for the batch before it (which may itself have waited out the lock) gets
# only what is left of its oldest one's, so no operation waits two timeouts; the
# others of a batch that timed out go again. Timeouts are whole BUSY_STEP_S.
BUSY_TIMEOUT_S = 10.0
BUSY_STEP_S = 0.1


def _null(value: None) -> None:
    return None


# The values bound to a statement: sqlite3 binds an int, float, str or bytearray
# as it is, and looks anything else up as an adapter first (None, a StrEnum such
# as a rejection's reason or a lease's state). Unregistered, that lookup ends by
# asking its protocol type for `__adapt__`, an AttributeError formatted and
# cleared for each such value (about 3,000 instructions under the GIL: a
# rejection row binds three or more). Registered, it is one dict hit; the values
# bound are the same (NULL, the member's text). The registry is the process's:
# an adapter a program of the worker's registered first is left as it is.
if (type(None), sqlite3.PrepareProtocol) not in sqlite3.adapters:
    sqlite3.register_adapter(type(None), _null)
for _enum in (Reason, State):
    if (_enum, sqlite3.PrepareProtocol) not in sqlite3.adapters:
        sqlite3.register_adapter(_enum, str)

LEASES_SCHEMA = """
CREATE TABLE IF NOT EXISTS sinkgate_schema (
    component TEXT PRIMARY KEY,
    version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
    job_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    generation INTEGER NOT NULL CHECK (generation >= 1),
    state TEXT NOT NULL CHECK (state IN ('free', 'active', 'done')),
    lease_until REAL NOT NULL,
    ttl REAL NOT NULL
);
"""
LEASES_SCHEMA_VERSION = 1


def sqlite_path(url: str) -> str:
    """`sqlite:///rel/path` -> `rel/path`; `sqlite:////abs/path` -> `/abs/path`. The
    scheme in any case, as `open_store` reads it; the rest is the file's name."""
    prefix = "sqlite:///"
    if url[: len(prefix)].lower() != prefix or len(url) == len(prefix):
        got = shown_url(url)
        raise ValueError(f"not a sqlite URL: {got} (expected sqlite:///path)")
    path = url[len(prefix) :]
    if path == ":memory:":
        # The store's connections (a writer and a reader) would each open a database
        # of their own: a claim would be written where no read looks.
        raise ValueError("an in-memory SQLite database cannot be a store: name a file")
    return path


def ensure_component(conn: sqlite3.Connection, component: str, version: int) -> int | None:
    """Record `component`'s schema version; refuse a database from a newer release.
    The version recorded before (None: none)."""
    row = conn.execute(
        "SELECT version FROM sinkgate_schema WHERE component = ?", (component,)
    ).fetchone()
    if row is None:
        conn.execute(
            "INSERT INTO sinkgate_schema (component, version) VALUES (?, ?)", (component, version)
        )
    elif row[0] > version:
        raise SchemaTooNew(component, row[0], version)
    elif row[0] < version:
        conn.execute(
            "UPDATE sinkgate_schema SET version = ? WHERE component = ?", (version, component)
        )
    return None if row is None else int(row[0])


class SQLiteExecutor:
    """Group commit over one aiosqlite write connection plus one read connection."""

    def __init__(self, writer: aiosqlite.Connection, reader: aiosqlite.Connection) -> None:
        self._writer = writer
        self._reader = reader
        # (fn, its caller's future, when queued, dropped if its caller went away)
        self._pending: list[tuple[TxFn, asyncio.Future[Any], float, bool]] = []
        # The write connection's busy timeout in ms (None: not known, set it again).
        self._busy_ms: int | None = round(BUSY_TIMEOUT_S * 1000)
        self._flusher: asyncio.Task[None] | None = None
        self._closed = False
        self.batches = 0
        self.operations = 0

    @classmethod
    async def open(cls, path: str | Path) -> SQLiteExecutor:
        path = str(path)
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file in the way, no permission, a read-only place
            raise StoreUnavailable(f"cannot make the directory of {path}: {exc}") from exc
        opened: list[aiosqlite.Connection] = []
        try:
            writer = await _connect(path)
            opened.append(writer)
            # WAL + synchronous=FULL: a commit is on disk before run() returns, so a
            # reservation is durable before the gateway forwards.
            await enable_wal(writer)
            await writer.execute("PRAGMA synchronous=FULL")
            await writer.execute("PRAGMA foreign_keys=ON")
            reader = await _connect(path)
            opened.append(reader)
            await reader.execute("PRAGMA query_only=ON")
        except sqlite3.Error as exc:
            for conn in opened:
                await conn.close()
            raise StoreUnavailable(f"cannot open SQLite database {path}: {exc}") from exc
        return cls(writer, reader)

    async def run(
        self, fn: Callable[[sqlite3.Connection], T], *, drop_cancelled: bool = False
    ) -> T:
        """Run `fn` atomically inside the next group-committed write transaction.

        Returns once the batch holding it is durably committed. An exception `fn`
        raises rolls back only `fn`'s own changes and is re-raised here. `fn` may
        run twice (see `_write_batch`): it must act only through `conn`.
        `drop_cancelled`: not run at all when its caller is cancelled before its
        batch begins (a write decision nobody waits for must not reserve a key).
        """
        if self._closed:
            raise StoreUnavailable("store is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._pending.append((fn, future, loop.time(), drop_cancelled))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop(), name="sqlite-group-commit")
        # No shield needed: a caller cancelled here cancels only `future`; `fn` is
        # queued and commits with its batch all the same (the flush loop skips
        # answering a future that is done), unless `drop_cancelled` and its batch
        # has not begun yet.
        return await future

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run a read-only `fn` on the read connection (a consistent WAL snapshot)."""
        if self._closed:
            raise StoreUnavailable("store is closed")
        try:
            result: T = await in_thread(self._reader, _read_snapshot, fn)
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"SQLite read failed: {exc}") from exc
        return result

    async def _flush_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            batch = [op for op in batch if not (op[3] and op[1].done())]
            if not batch:
                continue
            fns = [fn for fn, _, _, _ in batch]
            busy_ms = busy_budget_ms(loop.time() - batch[0][2])
            change = None if busy_ms == self._busy_ms else busy_ms
            self._busy_ms = None  # unknown until the batch has set it
            try:
                # aiosqlite runs each queued call in its own thread; handing it the
                # whole batch costs one thread hop instead of one per statement.
                outcomes = await in_thread(self._writer, _write_batch, fns, change)
            except BaseException as exc:
                failed = batch
                if _locked(exc):  # BEGIN IMMEDIATE waited, with the timeout set
                    self._busy_ms = busy_ms
                    # Nothing of the batch was applied: those that have not waited
                    # their whole timeout yet go again, with what is left of it.
                    cutoff = loop.time() - BUSY_TIMEOUT_S + BUSY_STEP_S  # queued before: done
                    self._pending[:0] = [op for op in batch if op[2] > cutoff]
                    failed = [op for op in batch if op[2] <= cutoff]
                err = StoreUnavailable(f"SQLite write failed: {exc}")
                err.__cause__ = exc
                for _, future, _, _ in failed:
                    if not future.done():
                        future.set_exception(err)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            self._busy_ms = busy_ms
            self.batches += 1
            self.operations += len(batch)
            for (_, future, _, _), (ok, value) in zip(batch, outcomes, strict=True):
                if future.done():
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)

    async def close(self) -> None:
        self._closed = True
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)
        await self._reader.close()
        await self._writer.close()


async def enable_wal(conn: aiosqlite.Connection, max_wait: float = BUSY_TIMEOUT_S) -> None:
    """`PRAGMA journal_mode=WAL`, waiting for another connection's write lock.

    While a file is still in rollback-journal mode, the switch fails at once
    with "database is locked", without SQLite's busy timeout, if another
    connection holds the write lock: as when several processes open a new store
    at the same moment and one of them is switching it to WAL. So a busy switch
    is tried again, every 5 ms at first and at most every 100 ms, until
    `max_wait` seconds; once the file is in WAL mode, the pragma only reads.
    """
    deadline = time.monotonic() + max_wait
    delay = 0.005
    while True:
        try:
            await conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if not _locked(exc) or time.monotonic() >= deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)


async def _connect(path: str) -> aiosqlite.Connection:
    """An aiosqlite connection whose worker thread does not keep the process alive.

    aiosqlite's thread is not a daemon, so a store its program never closed (an
    exception escaping before `close()`) hung the process at exit, waiting for
    that thread. As a daemon it ends with the process; an unfinished batch is then
    a crash, which SQLite's WAL and the gateway's reservations already survive.
    Set before `await` starts the thread (`_thread` is aiosqlite's internal,
    pinned like those `in_thread` uses).
    """
    conn = aiosqlite.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_S)
    conn._thread.daemon = True
    return await conn


async def in_thread(conn: aiosqlite.Connection, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(sqlite3_connection, *args)` in `conn`'s worker thread, in one hop.

    aiosqlite's own API makes one thread hop per statement; a whole batch in one
    hop is what makes group commit cheap. `_execute`/`_conn` are aiosqlite's
    internals, pinned by the version bound in pyproject.toml; this and
    `_connect` are the only places that touch aiosqlite's internals.
    """
    result: T = await conn._execute(fn, conn._conn, *args)  # type: ignore[no-untyped-call]
    return result


def busy_budget_ms(waited: float) -> int:
    """The busy timeout for a batch whose oldest operation was queued `waited`
    seconds ago: what is left of `BUSY_TIMEOUT_S`, rounded up to `BUSY_STEP_S`
    (so that the milliseconds a batch waits for the one before it change nothing)."""
    steps = math.ceil((BUSY_TIMEOUT_S - waited) / BUSY_STEP_S)
    return max(0, round(steps * BUSY_STEP_S * 1000))


def _locked(exc: BaseException) -> bool:
    """Whether `exc` is SQLite's "database is locked" (extended codes too): the
    busy timeout ran out."""
    code = getattr(exc, "sqlite_errorcode", None)
    return (
        isinstance(exc, sqlite3.OperationalError)
        and code is not None
        and (code & 0xFF) == sqlite3.SQLITE_BUSY
    )


def _write_batch(
    conn: sqlite3.Connection, fns: list[TxFn], busy_ms: int | None = None
) -> list[tuple[bool, Any]]:
    """Run `fns` in ONE transaction; each fn's exception undoes only its own changes.
    `busy_ms`: first set the connection's busy timeout to it.

    The common case pays no savepoints: a function that raises before it has
    changed a row (every refusal here decides before it writes) needs nothing
    undone, which `total_changes` tells. Only if one raises after changing rows
    is the whole batch rolled back and run again with a savepoint around each
    function. Nothing is answered before COMMIT, so the first run leaves no trace.
    """
    if busy_ms is not None:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_ms)}")
    conn.execute("BEGIN IMMEDIATE")
    try:
        outcomes: list[tuple[bool, Any]] = []
        redo = False
        for fn in fns:
            before = conn.total_changes
            try:
                value = fn(conn)
            except sqlite3.Error:
                raise  # the connection itself failed: the whole batch fails
            except Exception as exc:
                if conn.total_changes != before:
                    redo = True  # it wrote, then failed: redo with savepoints
                    break
                outcomes.append((False, exc))
            else:
                outcomes.append((True, value))
        if redo:
            conn.execute("ROLLBACK")
            conn.execute("BEGIN IMMEDIATE")
            outcomes = [_in_savepoint(conn, fn) for fn in fns]
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return outcomes


def _in_savepoint(conn: sqlite3.Connection, fn: TxFn) -> tuple[bool, Any]:
    conn.execute("SAVEPOINT op")
    try:
        value = fn(conn)
    except sqlite3.Error:
        raise
    except Exception as exc:
        conn.execute("ROLLBACK TO op")
        conn.execute("RELEASE op")
        return False, exc
    conn.execute("RELEASE op")
    return True, value


def _read_snapshot(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
    conn.execute("BEGIN")
    try:
        return fn(conn)
    finally:
        conn.execute("COMMIT")


# --- lease transactions, shared with the gateway's store -----------------------------

_LEASE_COLUMNS = "job_id, owner, generation, state, lease_until, ttl"


def read_lease(conn: sqlite3.Connection, job_id: str) -> LeaseRow | None:
    row = conn.execute(
        f"SELECT {_LEASE_COLUMNS} FROM leases WHERE job_id = ?", (job_id,)
    ).fetchone()
    if row is None:
        return None
    return LeaseRow(row[0], row[1], row[2], State(row[3]), row[4], row[5])


def _write_lease(conn: sqlite3.Connection, row: LeaseRow) -> None:
    conn.execute(
        f"INSERT INTO leases ({_LEASE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (job_id) DO UPDATE SET owner = excluded.owner, "
        "generation = excluded.generation, state = excluded.state, "
        "lease_until = excluded.lease_until, ttl = excluded.ttl",
        (row.job_id, row.owner, row.generation, str(row.state), row.lease_until, row.ttl),
    )


def claim_tx(conn: sqlite3.Connection, job_id: str, owner: str, ttl: float, now: float) -> Lease:
    current = read_lease(conn, job_id)
    refusal = model.claim_refusal(current, now)
    if refusal is Reason.JOB_COMPLETED:
        assert current is not None
        raise JobCompleted(job_id, current.generation)
    if refusal is not None:
        assert current is not None
        raise LeaseHeld(job_id, current.owner, model.expires_in(current, now), current.generation)
    row = model.claimed(current, job_id, owner, ttl, now)
    _write_lease(conn, row)
    return Lease.from_row(row, now)


def held_tx(
    conn: sqlite3.Connection,
    op: str,
    job_id: str,
    owner: str,
    generation: int,
    ttl: float | None,
    now: float,
) -> Lease:
    """renew / complete / release: same guard, different resulting row."""
    current = read_lease(conn, job_id)
    row = model.held_row(current, op, generation, owner, ttl, now)
    if isinstance(row, Reason):
        raise refused(job_id, generation, str(row), current.generation if current else None)
    _write_lease(conn, row)
    return Lease.from_row(row, now)


def init_leases_schema(conn: sqlite3.Connection) -> None:
    conn.executescript("BEGIN IMMEDIATE;" + LEASES_SCHEMA + "COMMIT;")
    conn.execute("BEGIN IMMEDIATE")
    try:
        ensure_component(conn, "leases", LEASES_SCHEMA_VERSION)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


class SQLiteLeaseStore(Closing):
    """The lease API on one SQLite file (see SPEC 3 and 9)."""

    def __init__(self, executor: SQLiteExecutor, clock: Clock = time.time) -> None:
        self._executor = executor
        self._clock = clock

    @classmethod
    async def open(cls, path: str | Path, *, clock: Clock = time.time) -> SQLiteLeaseStore:
        executor = await SQLiteExecutor.open(path)
        try:
            await in_thread(executor._writer, init_leases_schema)
        except BaseException as exc:
            await executor.close()
            if isinstance(exc, sqlite3.Error):
                raise StoreUnavailable(f"cannot create the lease schema: {exc}") from exc
            raise  # SchemaTooNew, or a bug: the store is closed either way
        return cls(executor, clock)

    async def claim(self, job_id: str, *, owner: str | None = None, ttl: float) -> Lease:
        model.validate_ident(job_id, "job_id")
        owner = model.validate_ident(model.default_owner() if owner is None else owner, "owner")
        ttl = model.validate_ttl(ttl)
        clock = self._clock
        return await self._executor.run(lambda c: claim_tx(c, job_id, owner, ttl, clock()))

    async def get(self, job_id: str) -> Lease | None:
        model.validate_ident(job_id, "job_id")
        now = self._clock()
        row = await self._executor.read(lambda c: read_lease(c, job_id))
        return None if row is None else Lease.from_row(row, now)

    async def close(self) -> None:
        await self._executor.close()

    async def _held(self, op: str, lease: Lease | LeaseRef, ttl: float | None) -> Lease:
        job_id, owner, generation = model.lease_fields(lease)
        clock = self._clock
        return await self._executor.run(
            lambda c: held_tx(c, op, job_id, owner, generation, ttl, clock())
        )
