"""`Prefer: wait` across gateway processes (SPEC 2 "Waiting"): a write held in one
process is woken, within 1 s, by the settlement another process records on the
same store. On PostgreSQL by its notifications; two processes on one SQLite file
(nothing to notify them) by the waiters' poll of the key's row.

Two `python -m gateway serve` processes per test, with their own config files and
free ports; the original goes to one, its duplicate to the other. Nothing waits on
a timer: the duplicate is known to be held once its first refusal is in the
rejection log, and the slow upstream answers when the test releases it.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from gateway.store import open_store
from gateway.store.records import RejectionQuery
from tests.harness import (
    eventually,
    recording_upstream,
    spawn_serve,
    stop_serve,
    wait_until_ok,
    write_serve_config,
)
from tests.pg import fresh_database

pytestmark = [pytest.mark.slow]

HEADERS = {
    "Content-Type": "application/json",
    "Fencing-Job": "job-1",
    "Fencing-Token": "1",
    "Idempotency-Key": "key-1",
}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'shared.db'}"
    else:
        async with fresh_database() as url:
            yield url


async def timed_post(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> tuple[int, dict[str, str], float]:
    async with session.post(url, data=b'{"amount": 1}', headers=headers) as resp:
        await resp.read()
        return resp.status, dict(resp.headers), time.monotonic()


async def test_a_settlement_in_one_process_wakes_a_waiter_in_another(
    tmp_path: Path, shared_store: str
) -> None:
    async with recording_upstream() as upstream, aiohttp.ClientSession() as session:
        started = []
        for name in ("a", "b"):
            config, url = write_serve_config(tmp_path / name, shared_store, upstream.url)
            log = tmp_path / f"{name}.log"
            started.append((url, await spawn_serve(config, log), log))
        try:
            for url, process, log in started:
                await wait_until_ok(
                    session,
                    f"{url}/readyz",
                    exited=lambda p=process, lg=log: (
                        None if p.returncode is None else f"exited {p.returncode}: {lg.read_text()}"
                    ),
                )
            (a, _, _), (b, _, _) = started
            async with session.post(
                f"{a}/leases/job-1/claim", json={"owner": "w", "ttl": 60}
            ) as resp:
                assert resp.status == 200
            original = asyncio.create_task(timed_post(session, f"{a}/to/pay/slow/x", HEADERS))
            await asyncio.wait_for(upstream.arrived.wait(), 10)
            duplicate = asyncio.create_task(
                timed_post(session, f"{b}/to/pay/slow/x", {**HEADERS, "Prefer": "wait=20"})
            )
            store = await open_store(shared_store)
            try:
                await eventually(
                    lambda: store.list_rejections(RejectionQuery(reason="request_in_progress")),
                    what="the duplicate's first refusal",
                )
            finally:
                await store.close()
            upstream.release.set()
            first_status, _, first_at = await original
            status, headers, answered_at = await duplicate
        finally:
            upstream.release.set()
            codes = [await stop_serve(process, 20) for _, process, _ in started]
    assert first_status == 201
    assert status == 201 and headers["Idempotent-Replayed"] == "true"
    assert headers["Preference-Applied"] == "wait=20"
    assert answered_at - first_at < 1.0  # SPEC 2: within 1 s of the settlement
    assert len(upstream.received) == 1
    assert codes == [0, 0]


async def test_a_stopping_gateway_answers_its_held_writes_at_once(tmp_path: Path) -> None:
    """SIGTERM: the held write gets its 409 while the original is still draining,
    not at the end of its 20 s wait."""
    async with recording_upstream() as upstream, aiohttp.ClientSession() as session:
        config, url = write_serve_config(
            tmp_path / "a", f"sqlite:///{tmp_path / 'g.db'}", upstream.url, shutdown_grace="20s"
        )
        log = tmp_path / "a.log"
        process = await spawn_serve(config, log)
        try:
            await wait_until_ok(
                session,
                f"{url}/readyz",
                exited=lambda: None if process.returncode is None else log.read_text(),
            )
            claim = {"owner": "w", "ttl": 60}
            async with session.post(f"{url}/leases/job-1/claim", json=claim) as resp:
                assert resp.status == 200
            original = asyncio.create_task(timed_post(session, f"{url}/to/pay/slow/x", HEADERS))
            await asyncio.wait_for(upstream.arrived.wait(), 10)
            held = asyncio.create_task(
                timed_post(session, f"{url}/to/pay/slow/x", {**HEADERS, "Prefer": "wait=20"})
            )
            store = await open_store(f"sqlite:///{tmp_path / 'g.db'}")
            try:
                await eventually(
                    lambda: store.list_rejections(RejectionQuery(reason="request_in_progress")),
                    what="the write held",
                )
            finally:
                await store.close()
            process.send_signal(signal.SIGTERM)
            status, headers, _ = await asyncio.wait_for(held, 10)
            assert not original.done()  # still draining: the held write did not wait for it
            upstream.release.set()
            assert (await original)[0] == 201
        finally:
            upstream.release.set()
            code = await stop_serve(process, 20)
    assert status == 409 and headers["Sinkgate-Rejected"] == "request_in_progress"
    assert headers["Preference-Applied"] == "wait=20" and int(headers["Retry-After"]) >= 1
    assert code == 0
