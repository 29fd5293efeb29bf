"""The listening connection of `Prefer: wait` on PostgreSQL (`postgres_notify`):
what ended it, or held it deaf, when its backend was terminated under a statement.
The real connection's case is `tests/conformance/test_settlements.py`, which
failed now and then (about one run in six) before these."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import structlog

from gateway.store import postgres_notify
from gateway.store.postgres_notify import _listen, _unless_lost


async def test_a_statement_unanswered_is_given_up_when_the_connection_is_lost() -> None:
    """A statement sent as its backend was terminated may get no answer: it waited
    its whole bound (10 s), the process deaf meanwhile."""
    lost = asyncio.Event()
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.01, lost.set)
    await asyncio.wait_for(_unless_lost(never, lost), 1.0)
    assert never.cancelled()


async def test_a_statement_that_fails_on_a_sound_connection_says_so() -> None:
    async def failing() -> None:
        raise asyncpg.InterfaceError("connection is closed")

    try:
        await _unless_lost(failing(), asyncio.Event())
    except asyncpg.InterfaceError:
        return
    raise AssertionError("the statement's error was not raised")


class _Connection:
    """A listening connection whose statement fails as asyncpg's does on a
    connection terminated under it."""

    def __init__(self) -> None:
        self.listening = False

    def add_termination_listener(self, callback: Any) -> None:
        pass

    async def add_listener(self, channel: str, callback: Any) -> None:
        self.listening = True

    async def execute(self, *args: Any, **kwargs: Any) -> None:
        raise asyncpg.InternalClientError(
            "cannot perform operation: another operation is in progress"
        )


async def test_any_error_of_the_driver_opens_the_connection_again(monkeypatch: Any) -> None:
    """InternalClientError is none of the classes it caught: it ended the listening
    loop, and the process heard no settlement until it was restarted."""
    monkeypatch.setattr(postgres_notify, "HOLDING_REFRESH_S", 0.01)
    holding = asyncio.Event()
    holding.set()
    conn = _Connection()
    said: list[bool] = []
    listened = await asyncio.wait_for(
        _listen(conn, None, said.append, holding, "p", 1.0, _never_sent), 1.0
    )
    assert listened is True and conn.listening  # then opened again by its caller
    assert said == []  # never heard: its echo was never even sent


async def _never_sent(payload: str) -> None:
    raise AssertionError("no echo is sent on a connection that does not answer")


class _Pooled:
    """A connection through a pooler in transaction mode: LISTEN and every
    statement succeed, and what another session notifies (`notify`) arrives
    only where `delivers` is set (a real session); `others` is what any other
    process notified meanwhile."""

    def __init__(self, delivers: bool, others: tuple[str, ...] = ()) -> None:
        self.delivers, self.others = delivers, others
        self.callback: Any = None

    def add_termination_listener(self, callback: Any) -> None:
        pass

    async def add_listener(self, channel: str, callback: Any) -> None:
        self.callback = callback

    async def execute(self, sql: str, *args: Any, **kwargs: Any) -> None:
        assert "pg_notify" not in sql  # sent here, it came back behind the pooler

    async def notify(self, payload: str) -> None:
        if self.delivers:
            for each in (*self.others, payload):
                self.callback(self, 1, postgres_notify.CHANNEL, each)


async def _hear(conn: _Pooled, monkeypatch: Any) -> tuple[list[bool], list[Any], list[Any]]:
    """What `hearing` was told and what `settled` got over a few idle pings,
    and the log."""
    monkeypatch.setattr(postgres_notify, "PING_S", 0.01)
    said: list[bool] = []
    told: list[Any] = []

    def on_notification(conn: Any, pid: int, channel: str, payload: str) -> None:
        told.append(payload)

    with structlog.testing.capture_logs() as logs:
        listening = asyncio.create_task(
            _listen(conn, on_notification, said.append, asyncio.Event(), "p", 0.05, conn.notify)
        )
        await asyncio.sleep(0.3)
        listening.cancel()
        await asyncio.gather(listening, return_exceptions=True)
    return said, told, logs


async def test_a_listen_whose_notifications_never_arrive_is_said_deaf_once(
    monkeypatch: Any,
) -> None:
    """Behind a pooler in transaction mode LISTEN is accepted and nothing ever
    arrives: said to be deaf (once, not at every ping), never heard."""
    said, _, logs = await _hear(_Pooled(delivers=False), monkeypatch)
    assert said == [False]
    (line,) = [e for e in logs if e["event"] == "settlements_unheard"]
    assert "pooler in transaction mode" in line["error"]


async def test_a_listen_that_hears_its_echo_is_heard_and_passes_the_rest_on(
    monkeypatch: Any,
) -> None:
    said, told, logs = await _hear(_Pooled(delivers=True, others=("job-1\npay\nk",)), monkeypatch)
    assert said == [True]  # once, however many pings came back
    assert told and set(told) == {"job-1\npay\nk"}  # its own echo is nobody's business
    assert [e for e in logs if e["event"] == "settlements_unheard"] == []


class _ListenEndsAsCancelled(_Pooled):
    """A LISTEN whose answer arrives in the very turn its caller is cancelled."""

    def __init__(self) -> None:
        super().__init__(delivers=True)
        self.answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.asked = asyncio.Event()

    async def add_listener(self, channel: str, callback: Any) -> None:
        self.callback = callback
        self.asked.set()
        await self.answer


async def test_a_stop_during_listen_stops_the_listener() -> None:
    """`wait_for` around the LISTEN returned its result when it ended as the task
    was cancelled (Python 3.11), swallowing the cancel: the listener went on,
    and the gateway's stop, waiting for it, never ended."""
    conn = _ListenEndsAsCancelled()
    listening = asyncio.create_task(
        _listen(conn, None, lambda heard: None, asyncio.Event(), "p", 5.0, conn.notify)
    )
    await conn.asked.wait()
    conn.answer.set_result(None)
    listening.cancel()
    done, _ = await asyncio.wait({listening}, timeout=2)
    assert done, "the listener went on after its stop"
    assert listening.cancelled()
