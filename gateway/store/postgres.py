"""The gateway's store on PostgreSQL (asyncpg): fence, barrier, keys, rejection log.

The same tables as the SQLite store (`postgres_schema`), in the database the
lease store (`leases.postgres`) uses, so the lease-mode fence reads the very
lease table the lease API writes.

Group commit, as on SQLite: the write decisions (and the rejections logged
outside a decision) that arrive while a batch is on its way go into the next
batch, and one batch is one call of a server-side function on a pooled
connection, its own READ COMMITTED transaction (the function checks the level)
and one round trip: the advisory
locks of all its jobs and keys, then each decision in arrival order, read,
decided and applied, then COMMIT (durable); see `postgres_batch`. The outcomes
recorded meanwhile go together in one call of another function, also its own
transaction and one round trip (`postgres_outcomes`). Both keep one plan per
connection for their statements, with the scans and joins that read a whole
table ruled out (`PLAN_SETTINGS`): a plan costed while the tables were small
went on hashing the whole key table as it grew, and planning again for every
batch was half of the database's CPU. Each caller gets its own answer once its
batch has committed. A batch that fails other than by the store being
unreachable is run again one operation at a time, so an operation's failure is
its own alone.

Connection resets (a backend terminated, a failover): an outcome the store
failed to record is sent again on a fresh connection until its reservation's
deadline, so an applied write is not left `unknown` by a reset. A decision call
that got no answer may have committed or not; it is run again on a fresh
connection, up to `DECISION_TRIES` times in all, which is safe: a write it did
reserve is found under its own attempt id (drawn before the call) and answered
as forwarded. When every try fails, its callers are told the store failed and
its reservations, which nobody will forward, are released (best effort: a call
still running in the server after its client gave up, waiting for a lock, can
commit later than the release and leave its key in flight until its deadline).

The store's clock is the server's `clock_timestamp()` plus `clock_offset`.
`clock()` is synchronous (the lease API stamps `server_time`, the janitor and
admin views take their cut-offs from it), so it answers from the local clock
corrected by the skew last measured against the server: at open, and at every
batch of decisions. It is for display and retention cut-offs; no fence or
reservation is decided by it.

No session state (see `leases.postgres`): works behind PgBouncer in
transaction mode.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import MappingProxyType
from typing import Any, TypeVar, cast

import asyncpg  # type: ignore[import-untyped]
import structlog

from gateway.policy.decision import RESERVATION_GRACE_S, WriteFacts
from gateway.policy.records import (
    Outcome,
    OutcomeKind,
    RejectionRecord,
    Verdict,
    WriteContext,
)
from gateway.store import postgres_admin
from gateway.store.batching import GroupCommit
from gateway.store.postgres_batch import (
    NOT_READ_COMMITTED,
    Decide,
    Log,
    Operation,
    decide_batch,
)
from gateway.store.postgres_notify import listen_settlements
from gateway.store.postgres_outcomes import (
    Recorded,
    ReservationDeadlines,
    record_outcomes,
)
from gateway.store.postgres_schema import GATEWAY_SCHEMA_VERSION, GATEWAY_TABLES, init_schema
from gateway.store.protocol import Hearing, Retried, Settled
from gateway.store.records import schema_line
from leases.errors import StoreUnavailable
from leases.postgres import (
    ACQUIRE_TIMEOUT_S,
    STATEMENT_TIMEOUT_S,
    Conn,
    PostgresLeaseStore,
    connection,
    db_now,
    driver_errors,
    require_durable_commit,
    schema_connection,
    transaction,
)

T = TypeVar("T")

log = structlog.get_logger("gateway.store")

__all__ = ["GATEWAY_SCHEMA_VERSION", "PostgresStore"]

# SQLSTATE classes of a store that cannot answer (connection, resources, operator
# intervention, system): every operation of the batch fails, none is retried alone.
_OUTAGE_CLASSES = ("08", "53", "57", "58", "XX")


# An outcome the store failed to record is sent again after this long, then twice
# as long each time up to the maximum, until its reservation's deadline.
RECORD_RETRY_FIRST_S = 0.02
RECORD_RETRY_MAX_S = 0.5


# How often a decision batch is tried when the store fails before its COMMIT.
DECISION_TRIES = 3


# Batches of each kind on their way at once, each on its own connection. More than
# one overlaps a batch's round trips with the next one's; they are as safe as
# two replicas' batches (the same locks, in the same order).
BATCHES_IN_FLIGHT = 2


class PostgresStore(postgres_admin.PostgresAdmin, PostgresLeaseStore):
    """Gateway store on PostgreSQL; also the lease store the lease API uses.

    Several gateway processes may share one database: every decision is taken
    under the database's locks and by the database server's clock.
    """

    SCHEMA_TABLES = MappingProxyType({"leases": ("leases",), "gateway": GATEWAY_TABLES})

    def __init__(
        self,
        pool: Any,
        *,
        clock_offset: float = 0.0,
        acquire_timeout: float | None = ACQUIRE_TIMEOUT_S,
    ) -> None:
        super().__init__(pool, clock_offset=clock_offset, acquire_timeout=acquire_timeout)
        self._skew = 0.0  # server clock minus local clock, seconds
        self._listen = ("", 0.0)  # where `watch_settlements` connects: set by `open`
        self.clock = self._clock
        self._decisions: GroupCommit[Operation] = GroupCommit(
            self._run_decisions,
            name="postgres-decisions",
            in_flight=BATCHES_IN_FLIGHT,
            drop_cancelled=True,
        )
        self._outcomes: GroupCommit[Recorded] = GroupCommit(
            self._run_outcomes, name="postgres-outcomes", in_flight=BATCHES_IN_FLIGHT
        )
        # Batches run again one operation at a time, by the SQLSTATE (or error
        # type) that failed them: a deadlock here would say the lock order broke.
        self.isolated: Counter[str] = Counter()
        self._reserved_until = ReservationDeadlines()
        self.outcome_retries = 0  # outcomes sent again after the store failed to answer
        self.decision_retries = 0  # decision batches run again, nothing committed
        self.retried: Retried = _ignore  # told of each of those two (`RetriesCalls`)
        self.uncertain_released = 0  # key reservations released after a call without answer
        # The database's default isolation is not READ COMMITTED: each decision call
        # goes inside an explicit READ COMMITTED transaction (three round trips).
        self._read_committed = False
        self._releases: set[asyncio.Task[None]] = set()

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
    ) -> PostgresStore:
        """Open a pool on `url`, create or check the lease and gateway schema;
        the timeouts and `statement_cache_size` as `PostgresLeaseStore.open`'s."""
        store = cast(
            PostgresStore,
            await super().open(
                url,
                clock_offset=clock_offset,
                min_size=min_size,
                max_size=max_size,
                statement_cache_size=statement_cache_size,
                connect_timeout=connect_timeout,
                acquire_timeout=acquire_timeout,
                statement_timeout=statement_timeout,
            ),
        )
        store._listen = (store._url, connect_timeout)
        try:
            with driver_errors("cannot create the PostgreSQL gateway schema"):
                async with schema_connection(store._url, connect_timeout) as conn:
                    found = await init_schema(conn)
                    before = time.time()
                    server = await db_now(conn, 0.0)
                    store._skew = server - (before + time.time()) / 2
        except BaseException:
            await store.close()
            raise
        schema_line("postgresql", found, GATEWAY_SCHEMA_VERSION)
        return store

    def _clock(self) -> float:
        return time.time() + self._skew + self._offset()

    async def watch_settlements(
        self, settled: Settled, holding: asyncio.Event, hearing: Hearing | None = None
    ) -> None:
        """`SettlementFeed`: every process's settlements, on a connection of its own."""
        url, connect_timeout = self._listen
        await listen_settlements(url, settled, holding, connect_timeout, hearing)

    def _observed(self, now: float, offset: float) -> None:
        self._skew = now - offset - time.time()

    # --- writes: each one rides the next batch -------------------------------------------

    async def decide_write(self, facts: WriteFacts, context: WriteContext) -> Verdict:
        self._check_open()
        verdict: Verdict = await self._decisions.submit(Decide(facts, context))
        return verdict

    def start_decision(
        self, facts: WriteFacts, context: WriteContext, answer: asyncio.Future[Verdict | None]
    ) -> None:
        """`decide_write`, its verdict set on `answer` (`StartsDecisions`)."""
        self._decisions.enqueue(Decide(facts, context), answer)

    async def record_outcome(self, facts: WriteFacts, attempt: str, outcome: Outcome) -> bool:
        """Record `outcome`; when the store cannot answer (a connection lost, a
        backend terminated), again on a fresh connection until the reservation's
        deadline, after which the key reads `unknown` whatever is recorded."""
        self._check_open()
        until = self._reserved_until.pop(attempt)
        delay = RECORD_RETRY_FIRST_S
        while True:
            try:
                held: bool = await self._outcomes.submit(Recorded(facts, attempt, outcome))
                return held
            except StoreUnavailable as exc:
                left = until - time.monotonic()
                if self._closed or not _outage(exc) or left <= delay:
                    raise
            self.outcome_retries += 1
            self.retried("record")
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECORD_RETRY_MAX_S)

    async def record_rejection(self, record: RejectionRecord) -> int:
        self._check_open()
        # Logged even when its caller went away: the rejection happened all the same.
        rejection_id: int = await self._decisions.submit(Log(record), drop_cancelled=False)
        return rejection_id

    async def close(self) -> None:
        await self._decisions.close()
        for task in self._releases:  # best effort: the keys are left to their deadline
            task.cancel()
        await asyncio.gather(*self._releases, return_exceptions=True)
        await self._outcomes.close()
        await super().close()

    async def _run_decisions(self, batch: list[Operation]) -> list[Any]:
        answers = await self._isolating(batch, self._decide_once)
        for op, answer in zip(batch, answers, strict=True):
            # Each reservation's deadline, as its verdict comes back (whoever waits for it)
            if isinstance(answer, Verdict) and answer.attempt is not None:
                assert isinstance(op, Decide)
                self._reserved_until.add(answer.attempt, op.facts.timeout + RESERVATION_GRACE_S)
        return answers

    async def _decide_once(self, batch: list[Operation]) -> list[Any]:
        """The batch in one call, its own transaction. A call that got no answer may
        have committed or not; it is run again, up to `DECISION_TRIES` times in all:
        a write it did reserve is found under its own attempt id and answered as
        forwarded, nothing written twice (`postgres_batch`). When every try fails,
        its callers are told the store failed and its reservations are released."""
        tries = DECISION_TRIES
        while True:
            offset = self._offset()
            self._check_open()
            called = False  # no connection, no call: nothing can have committed
            try:
                with driver_errors("PostgreSQL write decision failed"):
                    async with self._decision_connection() as conn:
                        called = True
                        answers, now = await decide_batch(conn, batch, offset)
            except StoreUnavailable as exc:
                if _sqlstate(exc) == NOT_READ_COMMITTED and not self._read_committed:
                    self._read_committed = True  # nothing ran: the function refused first
                    log.warning("postgres_not_read_committed", detail=str(exc.__cause__))
                    continue
                tries -= 1
                if self._closed or not _outage(exc) or not tries:
                    if called and _outage(exc):
                        self._release_in_background(batch)
                    raise
                self.decision_retries += 1
                self.retried("decide")
                continue
            self._observed(now, offset)
            return list(answers)

    def _decision_connection(self) -> AbstractAsyncContextManager[Conn]:
        """A pooled connection for a decision call; inside an explicit READ COMMITTED
        transaction once the database's default isolation was found to be another."""
        if self._read_committed:
            return transaction(self._pool, self._wait, isolation="read_committed")
        return connection(self._pool, self._wait)

    def _release_in_background(self, batch: list[Operation]) -> None:
        """`_release_uncertain` as a task of its own: the batch's callers get their
        answer (the store failed) now, not once the store answers again. Kept until
        done; cancelled by `close`."""
        task = asyncio.create_task(self._release_uncertain(batch))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_uncertain(self, batch: list[Operation]) -> None:
        """A call whose answer was lost may have committed the batch's
        reservations, and their callers are told the store failed: nobody will
        forward them. Release them (as a forward that could not be sent is), so
        the keys do not sit in flight and then read `unknown` without ever having
        been sent. Every attempt id of the batch is released: one that reserved
        nothing touches nothing. Best effort: a store still failing until their
        deadline, or closing, leaves them to it."""
        reserved = [(op.facts, op.attempt) for op in batch if isinstance(op, Decide)]
        for facts, attempt in reserved:
            self._reserved_until.add(attempt, facts.timeout + RESERVATION_GRACE_S)
        results = await asyncio.gather(
            *(self.record_outcome(f, a, Outcome(OutcomeKind.RELEASED)) for f, a in reserved),
            return_exceptions=True,
        )
        self.uncertain_released += sum(
            1 for (facts, _), r in zip(reserved, results, strict=True) if r is True and facts.key
        )

    async def _run_outcomes(self, batch: list[Recorded]) -> list[Any]:
        return await self._isolating(batch, self._outcomes_once)

    async def _outcomes_once(self, batch: list[Recorded]) -> list[Any]:
        offset = self._offset()
        self._check_open()
        with driver_errors("PostgreSQL gateway write failed"):
            async with connection(self._pool, self._wait) as conn:  # one call, its own tx
                return list(await record_outcomes(conn, batch, offset))

    async def _isolating(
        self, batch: list[T], once: Callable[[list[T]], Awaitable[list[Any]]]
    ) -> list[Any]:
        """`once(batch)`; if it fails other than by an outage, `once([op])` for each
        operation in turn, so that an operation's failure is its own alone."""
        try:
            return await once(batch)
        except Exception as exc:
            if len(batch) == 1 or _outage(exc):
                raise
            self.isolated[_failure(exc)] += 1
        answers: list[Any] = []
        for op in batch:
            try:
                answers.extend(await once([op]))
            except Exception as exc:  # this operation's own failure: its caller's answer
                answers.append(exc)
        return answers

    async def purge(
        self, *, completed_before: float, rejections_before: float, batch: int
    ) -> tuple[int, int]:
        return await self._write_tx(
            lambda c: _purge_tx(c, completed_before, rejections_before, batch)
        )

    async def _write_tx(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        """`fn(conn)` in one durable READ COMMITTED transaction (as the lease verbs)."""
        self._check_open()
        with driver_errors("PostgreSQL gateway write failed"):
            async with transaction(self._pool, self._wait, isolation="read_committed") as conn:
                await require_durable_commit(conn)
                return await fn(conn)

    async def _snapshot(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        """Run `fn` in one read-only REPEATABLE READ transaction: a consistent view."""
        self._check_open()
        with driver_errors("PostgreSQL read failed"):
            async with transaction(
                self._pool, self._wait, isolation="repeatable_read", readonly=True
            ) as conn:
                return await fn(conn)

    async def ping(self) -> None:
        """Ready means the database answers and still holds this release's schema: a
        database dropped and created again answers `SELECT 1` while every write
        fails on a missing table."""
        found = await self._read(
            lambda c: c.fetchval("SELECT version FROM sinkgate_schema WHERE component = 'gateway'")
        )
        if found is None or found < GATEWAY_SCHEMA_VERSION:
            raise StoreUnavailable(
                f"the database holds gateway schema {found}, not {GATEWAY_SCHEMA_VERSION}: "
                "was it dropped or restored from an older copy? a restart creates the schema"
            )

    async def _read(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        self._check_open()
        with driver_errors("PostgreSQL read failed"):
            async with connection(self._pool, self._wait) as conn:
                return await fn(conn)


def _sqlstate(exc: BaseException) -> str | None:
    return getattr(exc.__cause__ or exc, "sqlstate", None)


def _failure(exc: BaseException) -> str:
    """What failed a batch: the driver's SQLSTATE, else the error's type."""
    cause = exc.__cause__ or exc
    return str(getattr(cause, "sqlstate", None) or type(cause).__name__)


def _outage(exc: BaseException) -> bool:
    """Whether `exc` says the store cannot answer at all (then running the batch's
    operations alone would only fail each of them again, slowly)."""
    if isinstance(exc, StoreUnavailable) and exc.__cause__ is None:
        return True  # closed
    cause = exc.__cause__ or exc
    if isinstance(cause, asyncpg.PostgresError):
        return str(cause.sqlstate or "")[:2] in _OUTAGE_CLASSES
    if isinstance(cause, ValueError):  # an argument the driver cannot encode
        return False
    return isinstance(cause, OSError | asyncpg.InterfaceError | asyncpg.InternalClientError)


async def _purge_tx(
    conn: Conn, completed_before: float, rejections_before: float, batch: int
) -> tuple[int, int]:
    # The batch is picked in a MATERIALIZED CTE: a LIMIT in an IN (...) subquery may
    # be evaluated more than once and delete more than `batch`. SKIP LOCKED: the
    # janitors of several replicas share the work instead of queueing on each other.
    keys = await conn.execute(
        "WITH doomed AS MATERIALIZED (SELECT destination, key FROM idempotency "
        "WHERE state = 'completed' AND completed_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED) "
        "DELETE FROM idempotency i USING doomed d "
        "WHERE i.destination = d.destination AND i.key = d.key AND i.state = 'completed'",
        completed_before,
        batch,
    )
    rejections = await conn.execute(
        "WITH doomed AS MATERIALIZED (SELECT id FROM rejections WHERE at < $1 "
        "ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED) "
        "DELETE FROM rejections r USING doomed d WHERE r.id = d.id",
        rejections_before,
        batch,
    )
    # An attempt whose gateway died never deletes its own row; past its deadline it
    # bars nothing (reads only look at deadline > now), so once it is as old as a
    # purgeable key it is garbage.
    await conn.execute(
        "WITH doomed AS MATERIALIZED (SELECT attempt FROM attempts WHERE deadline < $1 "
        "LIMIT $2 FOR UPDATE SKIP LOCKED) "
        "DELETE FROM attempts a USING doomed d WHERE a.attempt = d.attempt",
        completed_before,
        batch,
    )
    return _rowcount(keys), _rowcount(rejections)


def _rowcount(status: str) -> int:
    """Rows touched, from a command tag such as 'UPDATE 1' or 'DELETE 0'."""
    return int(status.rsplit(" ", 1)[-1])


def _ignore(op: str) -> None:
    """`retried` until someone listens."""
