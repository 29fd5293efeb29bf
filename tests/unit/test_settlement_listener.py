"""The listening connection of `Prefer: wait` on PostgreSQL (`postgres_notify`):
what ended it, or held it deaf, when its backend was terminated under a statement.
The real connection's case is `tests/conformance/test_settlements.py`, which
failed now and then (about one run in six) before these."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg  # type: ignore[import-untyped]

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
    listened = await asyncio.wait_for(_listen(conn, None, holding, "p", 1.0), 1.0)
    assert listened is True and conn.listening  # then opened again by its caller
