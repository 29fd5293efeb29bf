"""PostgreSQL for tests: where the server is, whether to skip, a fresh database each.

    reason = await pg_skip_reason()
    if reason:
        skip_or_fail(reason)
    async with fresh_database() as url:
        store = await open_store(url)

Without a reachable server the PostgreSQL tests skip, except under `CI=true`,
where they fail: CI must not go green by running nothing. `SINKGATE_TEST_PG`
names the server (an admin URL allowed to CREATE and DROP DATABASE).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

import asyncpg  # type: ignore[import-untyped]
import pytest

from gateway.store import postgres as postgres_store

PG_ADMIN_URL = os.environ.get("SINKGATE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")

CONNECT_TIMEOUT_S = 5.0

_UNCHECKED = object()
_skip_reason: object = _UNCHECKED


async def pg_skip_reason() -> str | None:
    """None when the server at PG_ADMIN_URL answers, else why not (checked once per process)."""
    global _skip_reason
    if _skip_reason is _UNCHECKED:
        _skip_reason = await _probe()
    assert _skip_reason is None or isinstance(_skip_reason, str)
    return _skip_reason


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the test, or fail it when the environment says CI=true."""
    if os.environ.get("CI", "").strip().lower() in ("true", "1"):
        pytest.fail(f"{reason} (CI=true: PostgreSQL tests must run)", pytrace=False)
    pytest.skip(reason)


@asynccontextmanager
async def fresh_database() -> AsyncIterator[str]:
    """Create an empty database `sinkgate_t_<hex>`, yield its URL, drop it afterwards.

    Skips (or fails under CI) when the server is unreachable. The drop uses
    WITH (FORCE), so connections a failed test left open do not keep it alive.
    """
    reason = await pg_skip_reason()
    if reason is not None:
        skip_or_fail(reason)
    name = f"sinkgate_t_{secrets.token_hex(8)}"
    await _admin(f'CREATE DATABASE "{name}"')
    try:
        yield database_url(name)
    finally:
        await _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def database_url(name: str) -> str:
    """PG_ADMIN_URL with its database replaced by `name`."""
    parts = urlsplit(PG_ADMIN_URL)
    return urlunsplit(parts._replace(path=f"/{name}"))


async def _admin(sql: str) -> None:
    conn = await asyncpg.connect(PG_ADMIN_URL, timeout=CONNECT_TIMEOUT_S)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def _probe() -> str | None:
    try:
        conn = await asyncpg.connect(PG_ADMIN_URL, timeout=CONNECT_TIMEOUT_S)
        try:
            await conn.fetchval("SELECT 1")
        finally:
            await conn.close()
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        return (
            f"PostgreSQL not reachable at {_redacted(PG_ADMIN_URL)} "
            f"({type(exc).__name__}: {exc}); set SINKGATE_TEST_PG to a server's admin URL"
        )
    return None


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


# --- a connection that goes silent ----------------------------------------------------


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter  # towards the store
    server: asyncio.StreamWriter  # towards PostgreSQL
    frozen: bool = False
    closed_by_client: bool = False


class FreezingRelay:
    """A TCP relay to the PostgreSQL server whose open connections can be frozen."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._server: asyncio.Server | None = None
        self._links: list[_Link] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def freeze(self) -> None:
        """Nothing more crosses the connections open now; they stay open."""
        for link in self._links:
            link.frozen = link.frozen or not link.closed_by_client

    @property
    def frozen_closed_by_client(self) -> int:
        """Frozen connections whose client (the store) has closed its end."""
        return sum(1 for link in self._links if link.frozen and link.closed_by_client)

    async def stop(self) -> None:
        """Reset every connection and stop listening."""
        if self._server is not None:
            self._server.close()
        for link in self._links:
            link.client.transport.abort()
            link.server.transport.abort()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        link = _Link(writer, up_writer)
        self._links.append(link)
        for source, sink, from_client in ((reader, up_writer, True), (up_reader, writer, False)):
            task = asyncio.create_task(self._pump(link, source, sink, from_client))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        link: _Link,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        from_client: bool,
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await source.read(65536):
                if link.frozen:
                    continue  # swallowed: never passed on
                sink.write(chunk)
                await sink.drain()
        if from_client:
            link.closed_by_client = True
        if not link.frozen:
            link.client.close()
            link.server.close()


def first_answer_lost(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The store's first decision call commits, then its answer is lost; later
    calls are answered. Returns the count of calls, kept up to date."""
    real = postgres_store.decide_batch
    calls = [0]

    async def answer_lost_once(conn: Any, *args: Any) -> Any:
        calls[0] += 1
        answers = await real(conn, *args)
        if calls[0] == 1:
            raise asyncpg.ConnectionDoesNotExistError("connection was closed")
        return answers

    monkeypatch.setattr(postgres_store, "decide_batch", answer_lost_once)
    return calls
