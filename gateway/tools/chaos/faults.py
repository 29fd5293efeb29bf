"""The chaos run's store faults (`--store-faults SHARE`).

An injector runs beside the workers. It alternates quiet gaps and faults so that
about `share` of the run's time is spent under a fault, one kind at a time,
kinds taken from shuffled decks (a short run still injects each kind):

PostgreSQL (always on a database the run created for itself, see `RunDatabase`):

- `terminate_backends`: 1-3 of the gateways' backends terminated with
  `pg_terminate_backend` in the middle of a write decision: the run holds the
  job locks of a few jobs under way and terminates backends that come to wait
  on them within 2 s, inside their decision transaction (an idle pooled
  connection that dies is replaced unnoticed); else busy or any backends;
- `refuse_connections`: `ALLOW_CONNECTIONS false` on the run's database and
  every backend of it terminated, for 1-3 s, then `ALLOW_CONNECTIONS true`;
- `lock_delay`: the run holds the advisory lock of a few jobs under way (the
  lock a write decision in `gateway.store.postgres` takes first), alternately
  for less than `LOCK_PATIENCE_S` (a delay) and for longer: the run's database
  has `lock_timeout = LOCK_PATIENCE_S`, so a longer hold outlasts the gateway's
  patience and the writes of those jobs are refused.

SQLite:

- `write_lock`: another process (this one) holds the file's write lock with
  `BEGIN IMMEDIATE`, mostly for 0.3-2 s, one time in four for longer than the
  gateway's busy timeout (`BUSY_TIMEOUT_S`), so that its commits give up;
- `writes_failing`: the gateway processes' file-size limit (`RLIMIT_FSIZE`,
  set from outside with `prlimit`) drops to 1 byte for 0.5-2.5 s, so every file
  write fails (EFBIG, as on a full disk), then goes back to what it was.
  Their stderr goes through a pipe (`PipedGateway`) so that logging still works.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import resource
import secrets
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from gateway.tools.chaos.processes import GatewayProcess, ProcessFailed, death_signal
from leases.sqlite import BUSY_TIMEOUT_S
from leases.urls import redact_url, split_statement_cache

PG_KINDS = ("terminate_backends", "refuse_connections", "lock_delay")
SQLITE_KINDS = ("write_lock", "writes_failing")
LOCK_PATIENCE_S = 1.5
APPLICATION_NAME = "sinkgate-chaos"  # the run's own sessions, never terminated
# The job lock of a write decision, exactly as `gateway.store.postgres` takes it.
_JOB_LOCK_SQL = "SELECT pg_advisory_xact_lock(hashtextextended('job:' || $1::text, 0))"


def database_url(url: str, name: str) -> str:
    """`url` naming database `name` instead."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


def with_address(url: str, host: str, port: int) -> str:
    """`url` pointing at host:port (user and password kept): through a proxy."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{auth}@{host}:{port}" if auth else f"{host}:{port}"))


async def _connect(url: str) -> Any:
    import asyncpg  # type: ignore[import-untyped]

    return await asyncpg.connect(
        split_statement_cache(url)[0],  # the store's parameter, not the driver's
        timeout=10,
        server_settings={"application_name": APPLICATION_NAME},
    )


class RunDatabase:
    """A fresh PostgreSQL database for one run, created through the database the
    given URL names (used only to create, alter and drop the run's own database,
    never faulted itself), and dropped at the end."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.name = f"sinkgate_chaos_{secrets.token_hex(6)}"
        self.url = database_url(admin_url, self.name)
        self.admin: Any = None  # an asyncpg connection

    async def create(self) -> None:
        """Connect and create the run's database; `ProcessFailed` (one line, naming
        the URL without its password) if the given database cannot be used for it."""
        import asyncpg

        try:
            self.admin = await _connect(self.admin_url)
            await self._execute(f'CREATE DATABASE "{self.name}"')
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise ProcessFailed(
                f"--store-faults needs a database to create the run's own in: "
                f"{redact_url(self.admin_url)}: {type(exc).__name__}: {exc}"
            ) from None
        # The gateway's patience for a lock (see `lock_delay`).
        await self._execute(
            f"ALTER DATABASE \"{self.name}\" SET lock_timeout = '{int(LOCK_PATIENCE_S * 1000)}ms'"
        )

    async def allow_connections(self, allowed: bool) -> None:
        assert self.name.startswith("sinkgate_chaos_")  # never any other database
        await self._execute(
            f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS {"true" if allowed else "false"}'
        )

    async def backends(self) -> list[tuple[int, str, str]]:
        """(pid, state, query) of every session on the run's database but the run's own."""
        rows = await self.admin.fetch(
            "SELECT pid, CASE WHEN wait_event_type = 'Lock' AND wait_event = 'advisory' "
            "THEN 'waiting' ELSE coalesce(state, '') END AS state, "
            "coalesce(query, '') AS query FROM pg_stat_activity "
            "WHERE datname = $1 AND pid <> pg_backend_pid() AND application_name <> $2",
            self.name,
            APPLICATION_NAME,
        )
        return [(int(r["pid"]), str(r["state"]), str(r["query"])) for r in rows]

    async def terminate(self, pids: Sequence[int]) -> int:
        """Terminate those of `pids` still on the run's database; how many were."""
        done = await self.admin.fetchval(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = $1 AND pid = ANY($2::int[])",
            self.name,
            list(pids),
        )
        return int(done)

    async def drop(self) -> None:
        if self.admin is None:
            return
        with contextlib.suppress(Exception):
            await self.allow_connections(True)
        with contextlib.suppress(Exception):
            await self._execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        await self.admin.close()
        self.admin = None

    async def _execute(self, sql: str) -> None:
        await self.admin.execute(sql)


def quiet_after(lasted: float, share: float, jitter: float) -> float:
    """PURE: the quiet gap after a fault that lasted `lasted` seconds. In proportion
    to the fault (kinds last from 0.3 s to past the busy timeout), so that about
    `share` of the time is spent under a fault whatever kinds were drawn;
    `jitter` (mean 1) spreads the gaps."""
    return lasted * (1 - share) / max(share, 0.01) * jitter


class StoreFaults:
    """The injector loop; a subclass injects its own kinds."""

    kinds: tuple[str, ...] = ()

    def __init__(self, share: float, seed: int) -> None:
        self.share = share
        self.rng = random.Random(f"{seed}:store-faults")
        self.counts: dict[str, int] = dict.fromkeys(self.kinds, 0)
        self.fault_s = 0.0
        self.windows: list[tuple[float, float]] = []  # loop-time spans under a fault
        self._deck: list[str] = []

    async def run(self, stop: asyncio.Event, pending: Callable[[], list[str]]) -> None:
        """Inject until `stop` is set; every fault is over when this returns."""
        loop = asyncio.get_running_loop()
        wait = 0.5  # the first fault early: a short run still gets each kind
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
                return
            if not self._deck:
                self._deck = list(self.kinds)
                self.rng.shuffle(self._deck)
            kind = self._deck.pop()
            began = loop.time()
            try:
                await self.inject(kind, pending)
            except Exception as exc:  # a fault that could not be injected is no fault
                print(f"sinkgate chaos: store fault {kind} failed: {exc!r}", file=sys.stderr)
                wait = 1.0
                continue
            lasted = loop.time() - began
            self.counts[kind] += 1
            self.windows.append((began, began + lasted))
            self.fault_s += lasted
            wait = quiet_after(lasted, self.share, self.rng.uniform(0.5, 1.5))

    async def inject(self, kind: str, pending: Callable[[], list[str]]) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        """Undo anything left in place."""


class PostgresFaults(StoreFaults):
    """`PG_KINDS` on the run's own database."""

    kinds = PG_KINDS

    def __init__(self, db: RunDatabase, share: float, seed: int) -> None:
        super().__init__(share, seed)
        self.db = db
        self.terminated = 0
        self._locker: Any = None  # an asyncpg connection

    async def inject(self, kind: str, pending: Callable[[], list[str]]) -> None:
        if kind == "terminate_backends":
            await self._terminate_some(pending())
        elif kind == "refuse_connections":
            await self._refuse(self.rng.uniform(1.0, 3.0))
        else:
            long = self.counts["lock_delay"] % 2 == 0
            seconds = (
                self.rng.uniform(1.2, 2.0) * LOCK_PATIENCE_S
                if long
                else self.rng.uniform(0.2, 0.8) * LOCK_PATIENCE_S
            )
            await self._lock_delay(pending(), seconds)

    async def _terminate_some(self, jobs: list[str]) -> None:
        """Catch decisions in the middle: hold the job locks of a few jobs under
        way, terminate the backends that come to wait on them inside their
        decision transaction, then let go; without any within 2 s, terminate
        busy backends (a lease verb, an outcome) or any."""
        loop = asyncio.get_running_loop()
        async with self._job_locks(jobs):
            deadline = loop.time() + 2.0
            while True:
                backends = await self.db.backends()
                waiting = [pid for pid, state, query in backends if state == "waiting"]
                if waiting or loop.time() > deadline:
                    break
                await asyncio.sleep(0.01)
            busy = [pid for pid, state, _ in backends if state not in ("idle", "")]
            pool = waiting or busy or [b[0] for b in backends]
            victims = self.rng.sample(pool, min(len(pool), self.rng.randint(1, 3)))
            self.terminated += await self.db.terminate(victims)

    async def _refuse(self, seconds: float) -> None:
        await self.db.allow_connections(False)
        try:
            self.terminated += await self.db.terminate([b[0] for b in await self.db.backends()])
            await asyncio.sleep(seconds)
        finally:
            await self.db.allow_connections(True)

    async def _locker_conn(self) -> Any:
        if self._locker is None or self._locker.is_closed():
            self._locker = await _connect(self.db.url)
        return self._locker

    @contextlib.asynccontextmanager
    async def _job_locks(self, jobs: list[str]) -> AsyncIterator[None]:
        """Hold the job locks of a few of `jobs` (those decisions wait meanwhile)."""
        conn = await self._locker_conn()
        held = self.rng.sample(jobs, min(len(jobs), 3))
        async with conn.transaction():
            await conn.execute("SET LOCAL lock_timeout = 0")
            for job in held:
                await conn.execute(_JOB_LOCK_SQL, job)
            yield

    async def _lock_delay(self, jobs: list[str], seconds: float) -> None:
        async with self._job_locks(jobs):
            await asyncio.sleep(seconds)

    async def close(self) -> None:
        if self._locker is not None:
            with contextlib.suppress(Exception):
                await self._locker.close()
        with contextlib.suppress(Exception):
            await self.db.allow_connections(True)


class SQLiteFaults(StoreFaults):
    """`SQLITE_KINDS` on the run's SQLite file and its gateway processes."""

    kinds = SQLITE_KINDS

    def __init__(
        self, path: str, gateways: Sequence[GatewayProcess], share: float, seed: int
    ) -> None:
        super().__init__(share, seed)
        self.path = path
        self.gateways = gateways
        self.long_holds = 0
        self._limited: dict[int, tuple[int, int]] = {}

    async def inject(self, kind: str, pending: Callable[[], list[str]]) -> None:
        if kind == "write_lock":
            long = self.rng.random() < 0.25
            if long:
                seconds = BUSY_TIMEOUT_S + self.rng.uniform(0.5, 1.5)
            else:
                seconds = self.rng.uniform(0.3, 2.0)
            await asyncio.to_thread(_hold_write_lock, self.path, seconds)
            self.long_holds += long  # counted once held: a hold that failed is no fault
        else:
            self._limit_file_size()
            try:
                await asyncio.sleep(self.rng.uniform(0.5, 2.5))
            finally:
                self._restore_file_size()

    def _limit_file_size(self) -> None:
        for gateway in self.gateways:
            if gateway.proc is None or gateway.proc.returncode is not None:
                continue
            pid = gateway.proc.pid
            with contextlib.suppress(ProcessLookupError):
                before = resource.prlimit(pid, resource.RLIMIT_FSIZE)
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (1, before[1]))
                self._limited[pid] = before

    def _restore_file_size(self) -> None:
        for pid, before in self._limited.items():
            with contextlib.suppress(ProcessLookupError):
                resource.prlimit(pid, resource.RLIMIT_FSIZE, before)
        self._limited.clear()

    async def close(self) -> None:
        self._restore_file_size()


def _hold_write_lock(path: str, seconds: float) -> None:
    conn = sqlite3.connect(path, timeout=60, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        time.sleep(seconds)
        conn.execute("ROLLBACK")
    finally:
        conn.close()


class PipedGateway(GatewayProcess):
    """A gateway whose stderr reaches its log file through a pipe: under a
    file-size limit the gateway's own log writes would fail, and its logging is
    not what the fault is about."""

    async def spawn(self, stdout: int | None = asyncio.subprocess.DEVNULL) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=stdout,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=death_signal(),
        )
        assert self.proc.stderr is not None
        self._drain = asyncio.create_task(_drain(self.proc.stderr, self.log_path))


async def _drain(stream: asyncio.StreamReader, path: Path) -> None:
    with path.open("ab") as log:
        while chunk := await stream.read(65536):
            log.write(chunk)
            log.flush()
