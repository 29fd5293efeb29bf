"""Settlements on PostgreSQL, told to every gateway process (SPEC 2 "Waiting").

A write held under `Prefer: wait` in one replica waits on an attempt another
replica forwarded. Triggers on the key and attempt tables `NOTIFY` on channel
`sinkgate_settled` whenever an attempt stops blocking: its key leaves
`in_flight` (an outcome recorded: completed or unknown), its in-flight key row
is deleted (released), or a keyless attempt's row is deleted. The trigger sits
beside the statements that settle attempts rather than inside them, so every
way of settling one (outcomes, an operator's resolve, retention) is told, and
the payload, `job_id\\ndestination[\\nkey]`, is sent only once the transaction
commits, as PostgreSQL delivers notifications.

Each gateway process listens on one connection of its own, outside the pool
(`listen_settlements`); LISTEN is session state, so behind a pooler in
transaction mode no notification arrives and the waiters' fallback poll wakes
them instead. A lost connection is opened again after `RECONNECT_S`, and one
that cannot be opened, or refuses LISTEN, is tried again at growing intervals
(up to `MAX_RECONNECT_S`). As it starts listening and every `PING_S` while
idle, a connection is asked something, and a notification of its own is sent
from another session, a connection opened for it (`_Echo`): one gone silent is
found and opened again, and one that answers but never hears its echo (the
pooler) is said deaf. Not from its own session: behind a pooler in
transaction mode, a NOTIFY sent there runs on the very server connection that
ran LISTEN and comes back, while what other sessions notify never does.

The triggers notify only while some process holds writes. A transaction that
notifies takes a cluster-wide lock from just before its commit to its end, so
notifying transactions commit one at a time, each waiting for its own flush:
measured on the store alone (32 callers), notifying on every settlement cut its
writes/s by about a third. So a process keeps a row in `HOLDING_TABLE` while it
holds writes, written on its listening connection as its first write starts to
wait and refreshed while any does; the triggers notify while a row is current.
A settlement committed before the row is does not notify: the held write's
poll (SPEC 2: within 1 s) wakes it. A row of a process that died runs out after
`HOLDING_TTL_S`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import structlog

from gateway.store.protocol import Hearing, Settled

log = structlog.get_logger("gateway.store")

CHANNEL = "sinkgate_settled"
RECONNECT_S = 1.0
MAX_RECONNECT_S = 30.0
STEADY_S = 5.0  # a connection that listened this long was no failure of its own
# How the listening connection names itself to the server (`pg_stat_activity`),
# and the short-lived one that sends its echo.
APPLICATION_NAME = "sinkgate-settlements"
ECHO_APPLICATION_NAME = "sinkgate-settlements-echo"

HOLDING_TABLE = "sinkgate_holding"
HOLDING_TTL_S = 30.0  # how long a row says its process holds writes
HOLDING_REFRESH_S = 10.0  # how often it is written again while the process does
# How often an idle listening connection is asked something, to find it gone silent.
PING_S = 30.0
# How long an echo may take to come back before the connection is said deaf (at
# most the statements' bound): a notification sent from another connection
# arrives within milliseconds; one later than this comes at the next ping, and is heard then.
ECHO_WAIT_S = 5.0
_HOLDING_SQL = (
    f"INSERT INTO {HOLDING_TABLE} (process, until) "
    "VALUES ($1, extract(epoch FROM clock_timestamp()) + $2) "
    "ON CONFLICT (process) DO UPDATE SET until = excluded.until"
)
_NOT_HOLDING_SQL = (
    f"DELETE FROM {HOLDING_TABLE} "
    "WHERE process = $1 OR until < extract(epoch FROM clock_timestamp())"
)

# Created once, under the schema lock (`postgres_schema.init_schema`); a trigger
# that exists is left alone, so a start beside running replicas takes no lock on
# their tables.
NOTIFY_DDL = f"""
CREATE UNLOGGED TABLE IF NOT EXISTS {HOLDING_TABLE} (
    process text PRIMARY KEY,
    until float8 NOT NULL
);
CREATE OR REPLACE FUNCTION sinkgate_settled() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM {HOLDING_TABLE}
               WHERE until > extract(epoch FROM clock_timestamp())) THEN
        PERFORM pg_notify('{CHANNEL}', concat_ws(E'\\n', OLD.job_id, OLD.destination, OLD.key));
    END IF;
    RETURN NULL;
END $$;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'idempotency_settled'
                   AND tgrelid = 'idempotency'::regclass) THEN
        CREATE TRIGGER idempotency_settled AFTER UPDATE ON idempotency FOR EACH ROW
            WHEN (OLD.state = 'in_flight' AND NEW.state <> 'in_flight')
            EXECUTE FUNCTION sinkgate_settled();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'idempotency_released'
                   AND tgrelid = 'idempotency'::regclass) THEN
        CREATE TRIGGER idempotency_released AFTER DELETE ON idempotency FOR EACH ROW
            WHEN (OLD.state = 'in_flight')
            EXECUTE FUNCTION sinkgate_settled();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'attempts_settled'
                   AND tgrelid = 'attempts'::regclass) THEN
        CREATE TRIGGER attempts_settled AFTER DELETE ON attempts FOR EACH ROW
            EXECUTE FUNCTION sinkgate_settled();
    END IF;
END $$;
"""


def parse_payload(payload: str) -> tuple[str, str | None, str] | None:
    """(destination, key or None, job_id) of a notification; None if it is not ours."""
    parts = payload.split("\n")
    if len(parts) == 2:
        return parts[1], None, parts[0]
    if len(parts) == 3:
        return parts[1], parts[2], parts[0]
    return None


# Sends `pg_notify(CHANNEL, payload)` from a session other than the listening one.
Notify = Callable[[str], Awaitable[None]]


def _notify_by_a_connection_of_its_own(url: str, bound: float) -> Notify:
    """`Notify` on a connection opened for it and closed after, all within
    `bound` seconds. Not the store's pool: an echo that gets no answer (a
    connection gone silent) would hold one of the writes' connections for the
    statements' whole bound, and a listener that reconnects often (a flaky
    network) would do so again and again."""

    async def notify(payload: str) -> None:
        async with asyncio.timeout(bound):
            conn = await asyncpg.connect(
                url,
                statement_cache_size=0,
                server_settings={"application_name": ECHO_APPLICATION_NAME},
            )
            try:
                await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, payload)
            finally:
                conn.terminate()  # committed once answered; no goodbye to wait for

    return notify


async def listen_settlements(
    url: str,
    settled: Settled,
    holding: asyncio.Event,
    connect_timeout: float,
    hearing: Hearing | None = None,
) -> None:
    """Call `settled` for each settlement notified on `url`, and say this process
    holds writes while `holding` is set; until cancelled. `hearing` is told
    False at the start and whenever the listening connection is lost, refused or
    found deaf, True once its echo, sent on another connection, is heard on it
    (`_Echo`)."""
    heard = hearing or _nobody
    notify = _notify_by_a_connection_of_its_own(url, connect_timeout)

    def on_notification(conn: Any, pid: int, channel: str, payload: str) -> None:
        parsed = parse_payload(payload)
        if parsed is not None:
            settled(*parsed)

    process = uuid.uuid4().hex
    delay = RECONNECT_S
    heard(False)
    while True:
        try:
            conn = await asyncpg.connect(
                url,
                timeout=connect_timeout,
                statement_cache_size=0,
                server_settings={"application_name": APPLICATION_NAME},
            )
        except Exception as exc:  # whatever the driver raises: this loop must not end
            log.warning("settlements_unheard", error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RECONNECT_S)  # a server refusing us is not hammered
            continue
        opened = asyncio.get_running_loop().time()
        try:
            listened = await _listen(
                conn, on_notification, heard, holding, process, connect_timeout, notify
            )
        finally:
            conn.terminate()  # no goodbye needed: LISTEN ends with the session
            heard(False)
        log.warning("settlements_unheard", error="the listening connection was lost")
        # A connection that listened a while is opened again at once; one refused
        # LISTEN (a pooler) or lost straight away (a statement the server keeps
        # refusing, a read-only standby) is not hammered either.
        steady = listened and asyncio.get_running_loop().time() - opened >= STEADY_S
        if steady:
            delay = RECONNECT_S
        await asyncio.sleep(delay)
        if not steady:
            delay = min(delay * 2, MAX_RECONNECT_S)


async def _listen(
    conn: Any,
    on_notification: Any,
    heard: Hearing,
    holding: asyncio.Event,
    process: str,
    bound: float,
    notify: Notify,
) -> bool:
    """Listen on `conn` until it is lost; False if it never listened."""
    lost = asyncio.Event()
    conn.add_termination_listener(lambda _conn: lost.set())
    echo = _Echo(process, heard, notify)

    def listener(conn: Any, pid: int, channel: str, payload: str) -> None:
        if not echo.caught(payload):
            on_notification(conn, pid, channel, payload)

    try:
        # Bounded: the driver's LISTEN has no timeout of its own, and a connection
        # gone silent under it left the process deaf until TCP gave up. Not by
        # `wait_for`: on Python 3.11 it returns the result of a LISTEN that ended
        # as it was cancelled, swallowing the cancel, and the gateway's stop
        # waited for this loop forever.
        async with asyncio.timeout(bound):
            await conn.add_listener(CHANNEL, listener)
    except Exception:  # TimeoutError too
        return False
    try:
        await echo.ask(conn, lost, bound)
        await _say_holding(conn, holding, lost, process, bound, echo)
    except Exception as exc:
        # Any of the driver's (a statement on a connection terminated under it can
        # be InternalClientError, "another operation is in progress", which is
        # none of its other classes): the connection is opened again. An error
        # let through ended this loop, and the process heard nothing more.
        log.warning("settlements_unheard", error=f"{type(exc).__name__}: {exc}")
    return True


class _Echo:
    """Whether what is notified comes back on the listening connection. LISTEN
    accepted is no proof: a pooler in transaction mode runs it on a server
    connection it then lends to others, and nothing ever arrives. So a
    notification of this process's own (a payload no settlement has: no newline,
    ignored by every process) is sent from another session, as settlements are,
    and `heard` told whether it came back. Sent on the listening connection, it
    came back behind PgBouncer (its NOTIFY ran on the server connection that ran
    LISTEN, which tells its own session) and the process was said to hear."""

    def __init__(self, process: str, heard: Hearing, notify: Notify) -> None:
        self.payload = f"echo {process}"
        self.back = asyncio.Event()
        self.heard = heard
        self.notify = notify
        self.hearing: bool | None = None  # until first asked

    def caught(self, payload: str) -> bool:
        """Whether `payload` is this echo (then nobody else's business)."""
        if payload != self.payload:
            return False
        self.back.set()
        return True

    async def ask(self, conn: Any, lost: asyncio.Event, bound: float) -> None:
        """Ask `conn` something (its statement's failure is raised: the connection
        is opened again), notify, and wait up to `ECHO_WAIT_S` seconds (at most
        `bound`) to hear it."""
        self.back.clear()
        await _unless_lost(conn.execute("SELECT 1", timeout=bound), lost)
        if lost.is_set():
            return
        try:
            await self.notify(self.payload)
        except Exception as exc:  # the store's trouble, told by the writes: nothing learnt
            log.warning("settlements_echo_unsent", error=f"{type(exc).__name__}: {exc}")
            return
        await _first_of(self.back, lost, seconds=min(bound, ECHO_WAIT_S))
        if lost.is_set() or self.back.is_set() == self.hearing:
            return
        self.hearing = self.back.is_set()
        self.heard(self.hearing)
        if not self.hearing:
            log.warning(
                "settlements_unheard",
                error="LISTEN was accepted, but nothing notified comes back on the "
                "connection (a pooler in transaction mode?): held writes wake by the poll",
            )


async def _say_holding(
    conn: Any,
    holding: asyncio.Event,
    lost: asyncio.Event,
    process: str,
    bound: float,
    echo: _Echo,
) -> None:
    """Keep this process's row in `HOLDING_TABLE` current while `holding` is set,
    and take it away once it is not, and ask the server something at least every
    `PING_S` (the `echo`); until the connection is `lost` (or a statement fails:
    each waits at most `bound` seconds for its answer)."""
    while True:
        await _first_of(holding, lost, seconds=PING_S)
        if lost.is_set():
            return
        if not holding.is_set():
            # Nothing to say, so ask anyway: a connection gone silent (a failover, a
            # firewall dropping its state) is found and opened again, not left deaf;
            # one that answers but hears nothing is said to be deaf.
            await echo.ask(conn, lost, bound)
            continue
        while holding.is_set() and not lost.is_set():
            await _unless_lost(
                conn.execute(_HOLDING_SQL, process, HOLDING_TTL_S, timeout=bound), lost
            )
            await _first_of(lost, seconds=HOLDING_REFRESH_S)
        if lost.is_set():
            return
        await _unless_lost(conn.execute(_NOT_HOLDING_SQL, process, timeout=bound), lost)


async def _unless_lost(statement: Awaitable[Any], lost: asyncio.Event) -> None:
    """`statement`, given up as soon as the connection is `lost`: a statement sent
    as its backend was terminated may get no answer, and waited its whole `bound`
    (10 s) while the process heard nothing."""
    running = asyncio.ensure_future(statement)
    waiting = asyncio.ensure_future(lost.wait())
    try:
        await asyncio.wait((running, waiting), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
        if not running.done():
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
    if running.cancelled():
        return  # the connection was lost first
    error = running.exception()  # read either way: never "exception never retrieved"
    if error is not None and not lost.is_set():
        raise error


async def _first_of(*events: asyncio.Event, seconds: float | None = None) -> None:
    """Until one of `events` is set, or `seconds` have passed."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def _nobody(heard: bool) -> None:
    """`hearing` when nobody asked."""
