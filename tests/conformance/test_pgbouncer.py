"""The gateway behind PgBouncer in transaction mode (docs/deploying.md says it works).

PgBouncer lends each transaction whichever server connection is free. Two
things the gateway does on a direct connection break there: asyncpg's named
prepared statements (prepared on one server, executed on another: "prepared
statement ... does not exist", unless PgBouncer 1.21+ keeps them), and LISTEN
(run on a server connection that is then lent to others: nothing notified
arrives). The first is turned off by `statement_cache_size=0` in the store
URL; the second is said (`sinkgate_settlements_unheard`), and held writes wake
by their poll. The server has fewer connections than the store's pool has
clients, so clients change servers between transactions, as under load.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
import structlog

from gateway.http.appkeys import METRICS
from gateway.store import postgres_notify
from gateway.store.postgres import PostgresStore
from gateway.store.postgres_notify import CHANNEL
from gateway.store.probe import store_status
from leases.errors import StoreUnavailable
from tests.harness import (
    Gateway,
    RecordingUpstream,
    destination,
    eventually,
    make_config,
    recording_upstream,
    running_gateway,
)
from tests.pg import fresh_database
from tests.pgbouncer import transaction_pooler
from tests.served import served

pytestmark = pytest.mark.postgres

UNCACHED = "?statement_cache_size=0"


async def test_named_prepared_statements_fail_there_with_words_that_name_the_fix() -> None:
    """The protection switched off: the driver's statement cache on, as before the
    URL could turn it off. Claims fail as the pooler moves clients between
    servers, each with what to change, not the driver's ten lines."""
    async with transaction_pooler() as url:
        store = await PostgresStore.open(url)
        try:
            results = await asyncio.gather(
                *(store.claim(f"job-{i}", ttl=30) for i in range(200)),
                return_exceptions=True,
            )
        finally:
            await store.close()
    failed = [r for r in results if isinstance(r, BaseException)]
    assert failed, "every claim succeeded: the pooler kept each client on one server"
    assert all(isinstance(e, StoreUnavailable) for e in failed), failed[:3]
    assert all("add statement_cache_size=0 to the store URL" in str(e) for e in failed)
    assert all("\n" not in str(e) for e in failed)


async def test_writes_decided_replayed_and_fenced_through_the_pooler(tmp_path: Path) -> None:
    async with (
        transaction_pooler() as url,
        recording_upstream() as upstream,
        running_gateway(
            make_config(tmp_path, destination("pay", upstream.url + "/api")),
            backend=url + UNCACHED,
        ) as gw,
    ):
        generations = {job: await gw.claim(job) for job in (f"job-{i}" for i in range(8))}

        async def write(i: int) -> tuple[int, bytes]:
            job = f"job-{i % 8}"
            status, _, body = await gw.write(
                "/to/pay/charges", job=job, generation=generations[job], key=f"key-{i}"
            )
            return status, body

        first = await asyncio.gather(*(write(i) for i in range(120)))
        assert [status for status, _ in first] == [201] * 120
        assert len(upstream.received) == 120
        again = await asyncio.gather(*(write(i) for i in range(0, 120, 6)))
        assert again == [first[i] for i in range(0, 120, 6)]  # replays, byte for byte
        assert len(upstream.received) == 120
        status, _, body = await gw.write(
            "/to/pay/charges", job="job-0", generation=generations["job-0"] + 1, key="new"
        )
        assert (status, b'"unknown_generation"' in body) == (409, True)
        assert len(upstream.received) == 120


async def test_check_config_connect_says_the_url_reaches_a_transaction_pooler() -> None:
    """Found before the first write fails: two sessions given one server. Not said
    once the URL turns the statement cache off, nor of the server itself."""
    async with transaction_pooler() as url:
        assert "WARNING: reached through a pooler in transaction mode" in await store_status(url)
        assert await store_status(url + UNCACHED) == "schema missing: serve creates it"
    async with fresh_database() as direct:
        assert await store_status(direct) == "schema missing: serve creates it"


async def test_serve_says_at_start_that_its_store_is_behind_a_transaction_pooler(
    tmp_path: Path,
) -> None:
    """The same words in serve's log, for whoever never ran check-config --connect;
    not once the URL turns the statement cache off."""
    for query, said in (("", 1), (UNCACHED, 0)):
        # One server: the check's second session is lent the first one's, whatever
        # the gateway's own sessions are doing meanwhile.
        async with transaction_pooler(server_connections=1) as url:
            config = make_config(tmp_path / str(said), store_url=url + query)
            with structlog.testing.capture_logs() as logs:
                async with served(config):
                    if said:
                        await eventually(
                            lambda: any(e["event"] == "store_behind_pooler" for e in logs),
                            within=30,
                            what="the warning",
                        )
            lines = [e for e in logs if e["event"] == "store_behind_pooler"]
            assert len(lines) == said
            assert all("statement_cache_size=0" in e["warning"] for e in lines)


async def test_the_pooler_hands_back_only_what_the_listening_session_sent() -> None:
    """What fooled the first echo check: a NOTIFY sent on the listening client's
    own session runs on the server connection that ran LISTEN and comes back;
    what another session notifies, as every settlement is, never does."""
    async with transaction_pooler() as url:
        listening = await asyncpg.connect(url, statement_cache_size=0)
        other = await asyncpg.connect(url, statement_cache_size=0)
        heard: list[str] = []
        try:
            await listening.add_listener(CHANNEL, lambda *args: heard.append(args[3]))
            await listening.execute("SELECT pg_notify($1, 'own')", CHANNEL)
            await eventually(lambda: heard == ["own"], what="its own notification")
            await other.execute("SELECT pg_notify($1, 'other')", CHANNEL)
            await listening.execute("SELECT 1")  # a turn on the server, for it to arrive
            await asyncio.sleep(0.5)  # what is never coming: a bounded look
            assert heard == ["own"]
        finally:
            await other.close()
            await listening.close()


def _sample(gw: Gateway, name: str) -> float | None:
    value: float | None = gw.app[METRICS].registry.get_sample_value(name)
    return value


def _unheard(gw: Gateway) -> float | None:
    return _sample(gw, "sinkgate_settlements_unheard")


async def test_a_process_behind_the_pooler_says_it_hears_nothing_and_its_held_writes_wake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes: a duplicate held in one (`Prefer: wait`) while its original
    is in flight in the other gets the replay, woken by its poll, with one
    request; and each process says it hears no settlement."""
    monkeypatch.setattr(postgres_notify, "ECHO_WAIT_S", 0.5)  # said deaf sooner
    async with (
        transaction_pooler() as url,
        recording_upstream() as upstream,
    ):
        with structlog.testing.capture_logs() as logs:
            await _two_processes(tmp_path, url, upstream, logs)


async def _two_processes(
    tmp_path: Path, url: str, upstream: RecordingUpstream, logs: list[dict[str, Any]]
) -> None:
    async with (
        running_gateway(
            make_config(tmp_path / "a", destination("pay", upstream.url + "/api")),
            backend=url + UNCACHED,
        ) as first,
        running_gateway(
            make_config(tmp_path / "b", destination("pay", upstream.url + "/api")),
            backend=url + UNCACHED,
        ) as second,
    ):
        # Each says so once its echo failed to come back (both are deaf until then).
        await eventually(
            lambda: sum("pooler in transaction mode" in e.get("error", "") for e in logs) == 2,
            within=30,  # a loaded machine's start of two gateways and their listeners
            what="both processes finding themselves deaf",
        )
        assert [_unheard(gw) for gw in (first, second)] == [1, 1]
        generation = await first.claim("job-1")
        original = asyncio.create_task(first.write("/to/pay/slow/1", generation=generation))
        await upstream.arrived.wait()
        held = asyncio.create_task(
            second.write("/to/pay/slow/1", generation=generation, headers={"Prefer": "wait=20"})
        )
        await eventually(
            lambda: _sample(second, "sinkgate_waiting_writes") == 1,
            what="the duplicate held",
        )
        upstream.release.set()
        status, _, body = await original
        replayed_status, headers, replayed = await asyncio.wait_for(held, 10)
        assert (replayed_status, replayed) == (status, body)
        assert headers.get("Preference-Applied", "").startswith("wait=")
        assert len(upstream.received) == 1
        assert _unheard(second) == 1
