"""PostgreSQL tells every process of each settlement (SPEC 2 "Waiting"): what a
held write in another replica is woken by. Each way an attempt stops blocking is
told once it commits; a reservation is not; a lost listening connection is
opened again."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg  # type: ignore[import-untyped]
import pytest

from gateway.http.appkeys import METRICS
from gateway.policy.records import Outcome
from gateway.store import postgres_notify
from gateway.store.postgres import PostgresStore
from gateway.store.postgres_notify import (
    APPLICATION_NAME,
    HOLDING_TABLE,
    listen_settlements,
    parse_payload,
)
from tests.conformance.test_store_conformance import COMPLETED, CONTEXT, write
from tests.harness import (
    destination,
    eventually,
    make_config,
    recording_upstream,
    running_gateway,
)
from tests.pg import FreezingRelay, first_answer_lost, fresh_database

pytestmark = pytest.mark.postgres

Heard = list[tuple[str, str | None, str]]


@pytest.fixture
def holding(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    monkeypatch.setattr(postgres_notify, "HOLDING_REFRESH_S", 0.05)
    event = asyncio.Event()
    event.set()
    return event


async def _listening(url: str) -> set[int]:
    """The backends of the listening sessions on this database (other tests'
    databases have theirs)."""
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 "
            "AND datname = current_database()",
            APPLICATION_NAME,
        )
        return {row["pid"] for row in rows}
    finally:
        await conn.close()


async def _holding_rows(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval(f"SELECT count(*) FROM {HOLDING_TABLE}"))
    finally:
        await conn.close()


@pytest.fixture
async def stores(
    holding: asyncio.Event,
) -> AsyncIterator[tuple[str, PostgresStore, PostgresStore, Heard]]:
    """Two stores on one database (two replicas); the first listens, and holds
    writes while `holding` is set (it is, unless a test clears it)."""
    async with fresh_database() as url:
        listener, writer = await PostgresStore.open(url), await PostgresStore.open(url)
        heard: Heard = []
        watch = asyncio.create_task(listener.watch_settlements(lambda *s: heard.append(s), holding))
        try:
            await eventually(lambda: _listening(url), what="the listener")
            await eventually(lambda: _holding_rows(url), what="the listener holding")
            yield url, listener, writer, heard
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            await listener.close()
            await writer.close()


async def test_each_way_of_settling_is_told_and_a_reservation_is_not(
    stores: tuple[str, PostgresStore, PostgresStore, Heard],
) -> None:
    _, _, store, heard = stores
    kinds = {"k1": COMPLETED, "k2": Outcome("released"), "k3": Outcome("unknown")}
    for key, outcome in kinds.items():
        verdict = await store.decide_write(write(key=key), CONTEXT)
        assert await store.record_outcome(write(key=key), verdict.attempt, outcome)
    keyless = await store.decide_write(write(key=None, job_id="job-2"), CONTEXT)
    await store.decide_write(write(key="k4"), CONTEXT)  # reserved, still in flight
    assert await store.record_outcome(write(key=None, job_id="job-2"), keyless.attempt, COMPLETED)
    expected = {("pay", "k1", "job-1"), ("pay", "k2", "job-1"), ("pay", "k3", "job-1")}
    expected.add(("pay", None, "job-2"))
    await eventually(lambda: set(heard) == expected, what="every settlement told")
    assert len(heard) == 4  # k4's reservation told nobody


async def test_a_lost_listening_connection_is_opened_again(
    stores: tuple[str, PostgresStore, PostgresStore, Heard],
) -> None:
    url, _, store, heard = stores
    (lost,) = await _listening(url)
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SELECT pg_terminate_backend($1)", lost)
    finally:
        await conn.close()

    async def back() -> bool:
        return bool(await _listening(url) - {lost})

    await eventually(back, what="the listener back")
    verdict = await store.decide_write(write(), CONTEXT)
    assert await store.record_outcome(write(), verdict.attempt, COMPLETED)
    await eventually(lambda: heard == [("pay", "key-1", "job-1")], what="the settlement told")


async def test_nothing_is_told_while_no_process_holds_writes(
    stores: tuple[str, PostgresStore, PostgresStore, Heard], holding: asyncio.Event
) -> None:
    """A notification costs every settling transaction a cluster-wide lock at
    commit: the triggers notify only while a process says it holds writes."""
    url, _, store, heard = stores
    holding.clear()
    await eventually(lambda: _zero(_holding_rows(url)), what="the row taken away")
    for key in ("quiet", "told"):
        if key == "told":
            holding.set()
            await eventually(lambda: _holding_rows(url), what="the listener holding again")
        verdict = await store.decide_write(write(key=key), CONTEXT)
        assert await store.record_outcome(write(key=key), verdict.attempt, COMPLETED)
    # Notifications arrive in commit order: had the first been told, it would be here.
    await eventually(lambda: heard, what="the second settlement told")
    assert heard == [("pay", "told", "job-1")]


async def _zero(count: Any) -> bool:
    return await count == 0


async def test_a_listening_connection_gone_silent_is_found_and_opened_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection that stops answering without a reset (a failover, a firewall
    dropping its state) would leave the process deaf until TCP gives up: an idle
    listener asks the server something every `PING_S` and opens a new one; and
    `hearing` is told so each way."""
    monkeypatch.setattr(postgres_notify, "PING_S", 0.1)
    monkeypatch.setattr(postgres_notify, "RECONNECT_S", 0.05)
    async with fresh_database() as url:
        store = await PostgresStore.open(url)
        parts = urlsplit(url)
        relay = FreezingRelay(parts.hostname or "127.0.0.1", parts.port or 5432)
        await relay.start()
        netloc = parts.netloc.rsplit("@", 1)
        auth = f"{netloc[0]}@" if len(netloc) == 2 else ""
        relayed = urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{relay.port}"))
        heard: Heard = []
        said: list[bool] = []  # what `hearing` was told
        idle = asyncio.Event()  # this process holds nothing: the connection is idle
        watch = asyncio.create_task(
            listen_settlements(relayed, lambda *s: heard.append(s), idle, 1.0, said.append)
        )
        try:
            conn = await asyncpg.connect(url)
            try:  # another process holds writes, so settlements are told
                await conn.execute(f"INSERT INTO {HOLDING_TABLE} VALUES ('other', 1e12)")
            finally:
                await conn.close()
            # Not the backend's row in pg_stat_activity: that is there before LISTEN.
            await eventually(lambda: said[-1:] == [True], what="the listener hearing")
            assert said == [False, True]  # heard once its own notification came back
            first = await _listening(url)
            relay.freeze()
            await eventually(lambda: said.count(True) >= 2, what="heard on a new connection")
            assert said[:3] == [False, True, False]  # deaf between the two
            assert await _listening(url) - first
            verdict = await store.decide_write(write(), CONTEXT)
            assert await store.record_outcome(write(), verdict.attempt, COMPLETED)
            await eventually(lambda: heard == [("pay", "key-1", "job-1")], what="it told")
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            await relay.stop()
            await store.close()


def _sample(text: str, series: str) -> float | None:
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return None if found is None else float(found[1])


async def test_what_the_store_absorbed_is_in_the_metrics(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Through a running gateway: a decision call whose answer was lost, run again
    unseen by the write, counts in `sinkgate_store_retries_total{op="decide"}`;
    the process's listening connection lost shows as
    `sinkgate_settlements_unheard` 1 until the next one listens."""
    monkeypatch.setattr(postgres_notify, "RECONNECT_S", 3.0)  # the deaf spell, seen
    async with (
        fresh_database() as url,
        recording_upstream() as upstream,
        running_gateway(
            make_config(tmp_path, destination("pay", upstream.url + "/api")), backend=url
        ) as gw,
    ):
        metrics = gw.app[METRICS]

        def unheard() -> float | None:
            return _sample(metrics.render()[0].decode(), "sinkgate_settlements_unheard")

        (listener,) = await eventually(lambda: _listening(url), what="the listener")
        await eventually(lambda: unheard() == 0, what="heard")
        calls = first_answer_lost(monkeypatch)
        generation = await gw.claim("job-1")
        status, _, _ = await gw.write("/to/pay/charges", generation=generation)
        assert (status, len(upstream.received), calls[0]) == (201, 1, 2)
        text = metrics.render()[0].decode()
        assert _sample(text, 'sinkgate_store_retries_total{op="decide"}') == 1

        conn = await asyncpg.connect(url)
        try:
            await conn.execute("SELECT pg_terminate_backend($1)", listener)
        finally:
            await conn.close()
        await eventually(lambda: unheard() == 1, what="unheard said")
        await eventually(lambda: unheard() == 0, what="heard again")
    assert unheard() == 0  # stopped: nothing left to hear


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ("job-1\npay\nkey-1", ("pay", "key-1", "job-1")),
        ("job-1\npay", ("pay", None, "job-1")),
        ("something else", None),
    ],
)
def test_payloads(payload: str, expected: tuple[str, str | None, str] | None) -> None:
    assert parse_payload(payload) == expected
