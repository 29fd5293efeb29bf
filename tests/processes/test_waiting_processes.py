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
