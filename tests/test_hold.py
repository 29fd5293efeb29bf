"""`hold()`: background renewal, and the body stopped the moment the lease may be gone.

The store's clock is a `FakeClock`; where the worker's own deadline matters the
monotonic clock is fake too, so nothing here waits for a lease to run out. Real
time only paces the renewals (ttl 0.3 s: one every 0.1 s), and every wait on it
is bounded by a generous timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from leases import Lease, LeaseHeld, LeaseLost, StoreUnavailable, hold
from leases.sqlite import SQLiteLeaseStore
from tests.conftest import FakeClock

TTL = 0.3
INTERVAL = TTL / 3  # hold's default renew_fraction
PATIENCE = 5.0  # generous bound on anything paced by real time
# Where both clocks are real, the gap between the worker's deadline and the store's
# expiry is ttl * safety_margin: 150 ms here, so a busy machine cannot close it.
REAL_CLOCK_HOLD: dict[str, Any] = {"ttl": 0.6, "safety_margin": 0.25}


class SpyStore:
    """Wraps a lease store: counts renewals (waitable) and can make them fail."""

    def __init__(self, inner: SQLiteLeaseStore) -> None:
        self.inner = inner
        self.renewals = 0
        self.fail_renewals: Exception | None = None
        self.hang_renewals = False
        self.slow_response = 0.0
        self.last_renewed: Lease | None = None
        self._renewed = asyncio.Condition()

    async def claim(self, job_id: str, *, owner: str | None = None, ttl: float) -> Lease:
        return await self.inner.claim(job_id, owner=owner, ttl=ttl)

    async def renew(self, lease: Lease, *, ttl: float | None = None) -> Lease:
        try:
            if self.fail_renewals is not None:
                raise self.fail_renewals
            if self.hang_renewals:
                await asyncio.Event().wait()  # a store that never answers
            self.last_renewed = await self.inner.renew(lease, ttl=ttl)
            if self.slow_response:
                await asyncio.sleep(self.slow_response)  # applied, but the answer is late
            return self.last_renewed
        finally:
            async with self._renewed:
                self.renewals += 1
                self._renewed.notify_all()

    async def complete(self, lease: Lease) -> Lease:
        return await self.inner.complete(lease)

    async def release(self, lease: Lease) -> Lease:
        return await self.inner.release(lease)

    async def get(self, job_id: str) -> Lease | None:
        return await self.inner.get(job_id)

    async def wait_renewals(self, count: int) -> None:
        """Wait until `count` renewal attempts have finished (successful or not)."""
        async with asyncio.timeout(PATIENCE), self._renewed:
            await self._renewed.wait_for(lambda: self.renewals >= count)


@pytest.fixture
async def store(tmp_path: Path, fake_clock: FakeClock) -> AsyncIterator[SpyStore]:
    inner = await SQLiteLeaseStore.open(tmp_path / "leases.db", clock=fake_clock)
    try:
        yield SpyStore(inner)
    finally:
        await inner.close()


@pytest.fixture
def worker_clock() -> FakeClock:
    """The worker's monotonic clock; it stands still unless a test moves it."""
    return FakeClock(start=500.0)


def renewal_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("lease-renewal:")]


# --- renewal and exit -----------------------------------------------------------------------


async def test_hold_renews_in_the_background_past_the_ttl(
    store: SpyStore, fake_clock: FakeClock, worker_clock: FakeClock
) -> None:
    """While the body runs, the lease is renewed: after the store's clock has moved
    well past the claim's ttl it is still active, same generation, and held."""
    async with hold(store, "job-1", owner="worker-a", ttl=TTL, monotonic=worker_clock) as lease:
        for _ in range(3):
            fake_clock.advance(TTL * 0.6)
            # the renewal in flight may have read the old clock; the one after cannot
            await store.wait_renewals(store.renewals + 2)
        current = await store.get("job-1")
        assert current.state == "active" and current.generation == lease.generation
        assert current.expires_in > 0
        assert fake_clock() > lease.lease_until.timestamp()  # the claim alone would be over
        with pytest.raises(LeaseHeld):
            await store.claim("job-1", owner="worker-b", ttl=TTL)
    assert store.renewals >= 6


@pytest.mark.parametrize(
    ("on_exit", "state"), [("complete", "done"), ("release", "free"), ("keep", "active")]
)
async def test_normal_exit_applies_on_exit(
    store: SpyStore, worker_clock: FakeClock, on_exit: str, state: str
) -> None:
    """complete (the default) marks the job done, release frees it, keep leaves it held."""
    async with hold(
        store, "job-1", owner="worker-a", ttl=TTL, on_exit=on_exit, monotonic=worker_clock
    ) as lease:
        assert (lease.state, lease.generation) == ("active", 1)
    current = await store.get("job-1")
    assert (current.state, current.generation, current.owner) == (state, 1, "worker-a")
    assert renewal_tasks() == []


async def test_complete_is_the_default_on_exit(store: SpyStore) -> None:
    async with hold(store, "job-1", owner="worker-a", ttl=TTL):
        pass
    assert (await store.get("job-1")).state == "done"


async def test_exception_in_body_releases_and_propagates(
    store: SpyStore, worker_clock: FakeClock
) -> None:
    """The error leaves the `async with` unchanged and another worker can take the
    job over at once (no waiting for expiry)."""
    with pytest.raises(RuntimeError, match="boom"):
        async with hold(store, "job-1", owner="worker-a", ttl=TTL, monotonic=worker_clock):
            raise RuntimeError("boom")
    assert (await store.get("job-1")).state == "free"
    assert (await store.claim("job-1", owner="worker-b", ttl=TTL)).generation == 2
    assert renewal_tasks() == []


async def test_external_cancellation_propagates_as_cancelled_error(
    store: SpyStore, worker_clock: FakeClock
) -> None:
    """Cancelling the worker's task is not a lost lease: CancelledError comes out."""
    entered = asyncio.Event()
    caught: list[BaseException] = []

    async def worker() -> None:
        try:
            async with hold(store, "job-1", owner="worker-a", ttl=TTL, monotonic=worker_clock):
                entered.set()
                await asyncio.sleep(PATIENCE * 10)
        except BaseException as exc:
            caught.append(exc)
            raise

    task = asyncio.create_task(worker())
    async with asyncio.timeout(PATIENCE):
        await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert len(caught) == 1 and type(caught[0]) is asyncio.CancelledError
    assert renewal_tasks() == []


async def test_bad_arguments_raise_value_error_before_claiming(store: SpyStore) -> None:
    """A bad ttl, on_exit or renew_fraction is refused before anything is claimed."""
    bad: list[dict[str, Any]] = [
        {"ttl": 0.01},
        {"ttl": True},
        {"on_exit": "finish"},
        {"renew_fraction": 1.0},
        {"renew_fraction": 0.0},
        {"safety_margin": 0.5},
    ]
    for kwargs in bad:
        with pytest.raises(ValueError):
            async with hold(store, "job-1", owner="worker-a", **{"ttl": TTL, **kwargs}):
                pytest.fail("body must not run")
    assert await store.get("job-1") is None


# --- losing the lease --------------------------------------------------------------------


async def test_stolen_lease_cancels_body_at_next_renewal_with_lease_lost(
    store: SpyStore, fake_clock: FakeClock, worker_clock: FakeClock
) -> None:
    """The job expires by the store's clock and worker-b claims it: the very next
    renewal fails, the body is cancelled before its pending effect, and LeaseLost
    (stale_generation) leaves the `async with`; a lease_lost event is logged."""
    effects: list[str] = []
    with capture_logs() as logs, pytest.raises(LeaseLost) as info:
        async with hold(store, "job-1", owner="worker-a", ttl=TTL, monotonic=worker_clock):
            fake_clock.advance(TTL + 1)
            await store.claim("job-1", owner="worker-b", ttl=TTL)
            renewals_at_steal = store.renewals
            stolen_at = time.monotonic()
            await asyncio.sleep(PATIENCE * 10)
            effects.append("stale write by worker-a")  # must never happen
    lost_after = time.monotonic() - stolen_at
    assert info.value.reason == "stale_generation"
    assert (info.value.generation, info.value.current_generation) == (1, 2)
    assert effects == []
    # lost at the first renewal after the steal: within one renewal interval
    assert store.renewals - renewals_at_steal <= 2  # one possibly already in flight
    assert lost_after < INTERVAL + PATIENCE / 2
    lost = [e for e in logs if e["event"] == "lease_lost"]
    assert len(lost) == 1
    assert lost[0]["reason"] == "stale_generation" and lost[0]["log_level"] == "warning"
    assert (lost[0]["job_id"], lost[0]["generation"], lost[0]["owner"]) == ("job-1", 1, "worker-a")
    assert (await store.get("job-1")).owner == "worker-b"
    assert renewal_tasks() == []


async def test_completed_by_someone_else_cancels_body(
    store: SpyStore, fake_clock: FakeClock, worker_clock: FakeClock
) -> None:
    """Any refused renewal ends the hold with that refusal's reason."""
    with pytest.raises(LeaseLost) as info:
        async with hold(store, "job-1", owner="worker-a", ttl=TTL, monotonic=worker_clock) as a:
            await store.complete(a)
            await asyncio.sleep(PATIENCE * 10)
    assert info.value.reason == "job_completed"
    assert (await store.get("job-1")).state == "done"


async def test_unreachable_store_cancels_body_at_the_local_deadline(
    store: SpyStore, fake_clock: FakeClock, worker_clock: FakeClock
) -> None:
    """Renewals fail with StoreUnavailable: the body keeps running while the worker's
    own (monotonic) deadline allows, and is cancelled with LeaseLost once it passes."""
    effects: list[str] = []
    with capture_logs() as logs, pytest.raises(LeaseLost) as info:
        async with hold(store, "job-1", owner="worker-a", ttl=TTL, monotonic=worker_clock):
            store.fail_renewals = StoreUnavailable("disk gone")
            await store.wait_renewals(store.renewals + 3)  # failures before the deadline...
            effects.append("before the deadline")  # ...do not stop the body
            worker_clock.advance(TTL)  # past ttl * (1 - safety_margin)
            await asyncio.sleep(PATIENCE * 10)
            effects.append("after the deadline")
    assert info.value.reason in ("lease_expired", "store_unavailable")
    assert effects == ["before the deadline"]
    assert [e["reason"] for e in logs if e["event"] == "lease_lost"] == [info.value.reason]
    assert renewal_tasks() == []


async def test_closed_store_stops_body_before_the_store_could_reassign_the_job(
    tmp_path: Path,
) -> None:
    """Real clocks on both sides: the store is closed underneath the hold, so every
    renewal fails. The body is cancelled before the lease ends by the store's
    clock, i.e. before anybody else could have claimed the job."""
    inner = await SQLiteLeaseStore.open(tmp_path / "leases.db")
    spy = SpyStore(inner)
    try:
        with pytest.raises(LeaseLost) as info:
            async with hold(spy, "job-1", owner="worker-a", **REAL_CLOCK_HOLD):
                await spy.wait_renewals(1)
                await inner.close()  # renewals now raise StoreUnavailable
                await asyncio.sleep(PATIENCE * 10)
        stopped_at = time.time()
    finally:
        await inner.close()
    assert info.value.reason in ("lease_expired", "store_unavailable")
    assert spy.last_renewed is not None
    assert stopped_at < spy.last_renewed.lease_until.timestamp()


async def test_hanging_renewal_is_cut_off_at_the_local_deadline(tmp_path: Path) -> None:
    """A renewal that never answers is abandoned when the worker's deadline (ttl
    minus the safety margin after the last successful renewal was sent) passes:
    LeaseLost(store_unavailable), before the lease could end in the store."""
    inner = await SQLiteLeaseStore.open(tmp_path / "leases.db")
    spy = SpyStore(inner)
    effects: list[str] = []
    try:
        with pytest.raises(LeaseLost) as info:
            async with hold(spy, "job-1", owner="worker-a", **REAL_CLOCK_HOLD):
                await spy.wait_renewals(1)
                spy.hang_renewals = True
                await asyncio.sleep(PATIENCE * 10)
                effects.append("after the deadline")
        stopped_at = time.time()
        assert renewal_tasks() == []
    finally:
        await inner.close()
    assert info.value.reason == "store_unavailable"
    assert effects == []
    assert spy.last_renewed is not None
    assert stopped_at < spy.last_renewed.lease_until.timestamp()


async def test_late_renewal_answer_counts_from_when_it_was_sent(tmp_path: Path) -> None:
    """A renewal whose answer arrives late extends the worker's deadline only from
    the moment the request was sent (the store may have applied it right then), so
    when the store then becomes unreachable the body still stops before the lease
    ends in the store."""
    inner = await SQLiteLeaseStore.open(tmp_path / "leases.db")
    spy = SpyStore(inner)
    try:
        with pytest.raises(LeaseLost):
            async with hold(spy, "job-1", owner="worker-a", **REAL_CLOCK_HOLD):
                await spy.wait_renewals(1)
                spy.slow_response = 0.22  # > ttl * safety_margin, < the renewal timeout
                await spy.wait_renewals(2)
                spy.fail_renewals = StoreUnavailable("unreachable")
                await asyncio.sleep(PATIENCE * 10)
        stopped_at = time.time()
    finally:
        await inner.close()
    assert spy.last_renewed is not None
    assert stopped_at < spy.last_renewed.lease_until.timestamp()


# --- safety: the protection switched off ------------------------------------------------------


async def test_without_hold_a_paused_worker_writes_a_stale_effect(
    store: SpyStore, fake_clock: FakeClock, worker_clock: FakeClock
) -> None:
    """Protection off vs on, same schedule: worker-a pauses past its lease, worker-b
    takes over with generation 2, then worker-a resumes. Unguarded, worker-a's stale
    generation-1 effect lands after generation 2's; under `hold`, it never runs."""

    async def worker_a_body(lease: Lease, effects: list[tuple[str, int]], guarded: bool) -> None:
        # worker-a pauses; meanwhile its lease runs out by the store's clock and
        # worker-b takes the job over
        fake_clock.advance(TTL + 1)
        b = await store.claim(lease.job_id, owner="worker-b", ttl=60.0)
        effects.append(("worker-b", b.generation))
        if guarded:
            await store.wait_renewals(store.renewals + 2)  # the renewer has had its chance
        else:
            await asyncio.sleep(INTERVAL * 2)  # the same pause, nothing watching
        effects.append(("worker-a", lease.generation))  # worker-a resumes: the external write

    # protection off: claim, then the same body with nothing watching the lease
    effects_off: list[tuple[str, int]] = []
    a = await store.claim("job-off", owner="worker-a", ttl=TTL)
    await worker_a_body(a, effects_off, guarded=False)
    assert effects_off == [("worker-b", 2), ("worker-a", 1)]  # the stale effect landed

    # protection on: the same body under hold
    effects_on: list[tuple[str, int]] = []
    with pytest.raises(LeaseLost) as info:
        async with hold(store, "job-on", owner="worker-a", ttl=TTL, monotonic=worker_clock) as a:
            await worker_a_body(a, effects_on, guarded=True)
    assert info.value.reason == "stale_generation"
    assert effects_on == [("worker-b", 2)]
