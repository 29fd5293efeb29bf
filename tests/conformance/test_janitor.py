"""Retention with a moved clock: completed keys and old rejections go, in small
batches; in-flight and unknown-outcome keys stay whatever their age."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from gateway.errors import StoreUnavailable
from gateway.policy.decision import Fencing, WriteFacts
from gateway.policy.records import Outcome, RejectionRecord, WriteContext
from gateway.store.janitor import purge_once, run_janitor
from gateway.store.records import RejectionQuery
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.metrics import Metrics
from tests.conftest import FakeClock

HOUR = 3600.0
DAY = 86400.0
CONTEXT = WriteContext(remote="127.0.0.1", body_sha256="00" * 32, body_bytes=0)


def facts(key: str, generation: int = 1) -> WriteFacts:
    return WriteFacts(
        destination="payments",
        method="POST",
        path="/charge",
        query="",
        job_id=f"job-{key}",
        generation=generation,
        owner=None,
        key=key,
        fingerprint="fp-" + key,
        fencing=Fencing.MONOTONIC,
        upstream_idempotent=False,
        timeout=10.0,
    )


class CountingStore:
    """The real store, with its purge calls counted and announced."""

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store
        self.clock = store.clock
        self.calls: list[tuple[int, int]] = []
        self.purged = asyncio.Event()
        self.fail_next = False

    async def purge(self, **kwargs: float) -> tuple[int, int]:
        if self.fail_next:
            self.fail_next = False
            self.purged.set()
            raise StoreUnavailable("store is down for this test")
        result = await self._store.purge(**kwargs)  # type: ignore[arg-type]
        self.calls.append(result)
        self.purged.set()
        return result

    async def purge_audit(self, *, before: float, batch: int) -> int:
        return await self._store.purge_audit(before=before, batch=batch)


@pytest.fixture
async def store(tmp_path, fake_clock: FakeClock) -> AsyncIterator[SQLiteStore]:
    s = await SQLiteStore.open("sqlite:///" + str(tmp_path / "g.db"), clock=fake_clock)
    yield s
    await s.close()


async def completed(store: SQLiteStore, key: str) -> None:
    verdict = await store.decide_write(facts(key), CONTEXT)
    assert verdict.attempt is not None
    outcome = Outcome("completed", status=200, body=b"ok")
    assert await store.record_outcome(facts(key), verdict.attempt, outcome)


async def in_flight(store: SQLiteStore, key: str) -> str:
    verdict = await store.decide_write(facts(key), CONTEXT)
    assert verdict.attempt is not None
    return verdict.attempt


async def unknown(store: SQLiteStore, key: str) -> None:
    attempt = await in_flight(store, key)
    assert await store.record_outcome(facts(key), attempt, Outcome("unknown"))


async def rejections(store: SQLiteStore, n: int, reason: str = "stale_generation") -> list[int]:
    return [
        await store.record_rejection(RejectionRecord(reason=reason, detail="test"))
        for _ in range(n)
    ]


async def test_old_completed_keys_and_rejections_go_in_batches(store, fake_clock):
    for i in range(7):
        await completed(store, f"old-{i}")
    await rejections(store, 5)
    fake_clock.advance(2 * DAY)
    for i in range(2):
        await completed(store, f"fresh-{i}")
    fresh_rejections = await rejections(store, 2, "lease_expired")
    fake_clock.advance(HOUR)
    counting = CountingStore(store)
    metrics = Metrics()

    result = await purge_once(
        counting, metrics, idempotency_ttl=DAY, rejections_ttl=DAY, audit_ttl=DAY, batch=3
    )

    assert result == (7, 5)
    assert counting.calls == [(3, 3), (3, 2), (1, 0)]  # repeated while a batch came back full
    for i in range(7):
        assert await store.key_record("payments", f"old-{i}") is None
    for i in range(2):
        assert (await store.key_record("payments", f"fresh-{i}")) is not None
    left = await store.list_rejections(RejectionQuery(limit=100))
    assert [r.id for r in left] == fresh_rejections[::-1]
    assert metrics.purged.labels(kind="idempotency")._value.get() == 7
    assert metrics.purged.labels(kind="rejections")._value.get() == 5


async def test_in_flight_and_unknown_keys_are_never_purged(store, fake_clock):
    await in_flight(store, "on-the-wire")
    await unknown(store, "maybe-sent")
    await in_flight(store, "dead-attempt")  # its gateway "died": never recorded an outcome
    await completed(store, "done")
    fake_clock.advance(30 * DAY)
    # Even with the smallest ttl and many passes, only the completed key goes.
    for _ in range(3):
        await purge_once(
            store, Metrics(), idempotency_ttl=1, rejections_ttl=1, audit_ttl=DAY, batch=1
        )
    assert await store.key_record("payments", "done") is None
    on_the_wire = await store.key_record("payments", "on-the-wire")
    maybe_sent = await store.key_record("payments", "maybe-sent")
    dead = await store.key_record("payments", "dead-attempt")
    assert on_the_wire is not None and maybe_sent is not None and dead is not None
    assert str(maybe_sent.state) == "unknown"
    assert str(dead.state_at(fake_clock())) == "unknown"


async def test_a_key_younger_than_the_ttl_stays(store, fake_clock):
    await completed(store, "young")
    fake_clock.advance(DAY - 1)
    assert await purge_once(
        store, Metrics(), idempotency_ttl=DAY, rejections_ttl=DAY, audit_ttl=DAY
    ) == (0, 0)
    assert await store.key_record("payments", "young") is not None
    fake_clock.advance(2)
    assert await purge_once(
        store, Metrics(), idempotency_ttl=DAY, rejections_ttl=DAY, audit_ttl=DAY
    ) == (1, 0)


async def test_purged_key_is_fresh_again(store, fake_clock):
    """After retention, the same key is a new write (SPEC 8: within idempotency_ttl)."""
    await completed(store, "k")
    fake_clock.advance(DAY + 1)
    await purge_once(store, Metrics(), idempotency_ttl=DAY, rejections_ttl=7 * DAY, audit_ttl=DAY)
    verdict = await store.decide_write(facts("k", generation=2), CONTEXT)
    assert verdict.attempt is not None  # forwarded, not replayed


async def test_run_janitor_purges_each_interval_and_survives_a_store_outage(store, fake_clock):
    for i in range(4):
        await completed(store, f"k-{i}")
    fake_clock.advance(2 * DAY)
    counting = CountingStore(store)
    counting.fail_next = True
    metrics = Metrics()
    task = asyncio.create_task(
        run_janitor(
            counting,
            metrics,
            idempotency_ttl=DAY,
            rejections_ttl=DAY,
            audit_ttl=DAY,
            interval=0.01,
            batch=2,
        )
    )
    try:
        # First pass fails (store down); later passes purge 2 + 2 + 0.
        while len(counting.calls) < 3:
            counting.purged.clear()
            await asyncio.wait_for(counting.purged.wait(), timeout=10)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert counting.calls[:3] == [(2, 0), (2, 0), (0, 0)]
    assert metrics.store_errors.labels(op="purge")._value.get() == 1
    assert metrics.purged.labels(kind="idempotency")._value.get() == 4


async def test_run_janitor_asks_retention_before_each_purge(store, fake_clock):
    """A reload may change [retention]: the janitor uses the TTLs of the moment."""
    for i in range(2):
        await completed(store, f"k-{i}")
    fake_clock.advance(2 * DAY)
    counting = CountingStore(store)
    ttls = [(3 * DAY, 3 * DAY, 3 * DAY)]
    task = asyncio.create_task(
        run_janitor(
            counting,
            Metrics(),
            idempotency_ttl=3 * DAY,
            rejections_ttl=3 * DAY,
            audit_ttl=DAY,
            interval=0.01,
            retention=lambda: ttls[-1],
        )
    )
    try:
        await asyncio.wait_for(counting.purged.wait(), timeout=10)
        assert counting.calls[0] == (0, 0)  # younger than 3 days: kept
        ttls.append((DAY, DAY, DAY))  # as a reload would
        while sum(keys for keys, _ in counting.calls) < 2:
            counting.purged.clear()
            await asyncio.wait_for(counting.purged.wait(), timeout=10)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_run_janitor_crashes_on_other_errors(store):
    class Broken(CountingStore):
        async def purge(self, **kwargs: float) -> tuple[int, int]:
            raise RuntimeError("bug")

    with pytest.raises(RuntimeError, match="bug"):
        await run_janitor(
            Broken(store), Metrics(), idempotency_ttl=1, rejections_ttl=1, audit_ttl=DAY
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"idempotency_ttl": 0, "rejections_ttl": 1, "audit_ttl": 1},
        {"idempotency_ttl": 1, "rejections_ttl": -1, "audit_ttl": 1},
        {"idempotency_ttl": 1, "rejections_ttl": 1, "audit_ttl": 0},
        {"idempotency_ttl": 1, "rejections_ttl": 1, "audit_ttl": 1, "interval": 0},
    ],
)
async def test_run_janitor_refuses_nonsense_settings(store, kwargs):
    with pytest.raises(ValueError):
        await run_janitor(store, Metrics(), **kwargs)


async def test_attempt_rows_of_dead_gateways_are_cleared_but_live_ones_kept(store, fake_clock):
    """Only keyless writes have attempt rows (a keyed write's barrier is in its
    key's row, which stays and reads `unknown`)."""
    keyless = [replace(facts(name), key=None, job_id=f"job-{name}") for name in ("dead", "live")]
    await store.decide_write(keyless[0], CONTEXT)  # never records an outcome
    await in_flight(store, "dead-keyed")
    fake_clock.advance(2 * DAY)
    await store.decide_write(keyless[1], CONTEXT)

    def attempt_jobs(conn):
        return sorted(row[0] for row in conn.execute("SELECT job_id FROM attempts"))

    assert await store._executor.read(attempt_jobs) == ["job-dead", "job-live"]
    await purge_once(store, Metrics(), idempotency_ttl=DAY, rejections_ttl=DAY, audit_ttl=DAY)
    assert await store._executor.read(attempt_jobs) == ["job-live"]
    assert await store.key_record("payments", "dead-keyed") is not None  # stays (unknown)
