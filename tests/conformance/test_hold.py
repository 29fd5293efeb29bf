"""`hold()`: background renewal, and the body stopped the moment the lease may be gone.

The store's clock is a `FakeClock`; where the worker's own deadline matters the
monotonic clock is fake too, so nothing here waits for a lease to run out. Real
time only paces the renewals (ttl 0.3 s: one every 0.1 s), and every wait on it
is bounded by a generous timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from leases import Lease, LeaseHeld, LeaseLost, StoreUnavailable, hold
from leases.sqlite import SQLiteLeaseStore
from tests.backends import Backend
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
        self.while_claiming: Callable[[], None] | None = None
        self._renewed = asyncio.Condition()

    async def claim(self, job_id: str, *, owner: str | None = None, ttl: float) -> Lease:
        lease = await self.inner.claim(job_id, owner=owner, ttl=ttl)
        if self.while_claiming is not None:
            self.while_claiming()  # e.g. the worker's clock moves while the answer travels
        return lease

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
        {"cancel_timeout": 0},
        {"cancel_timeout": float("inf")},
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
    # The deadline passed because the store could not be reached (the README's word)
    assert info.value.reason == "store_unavailable"
    assert effects == ["before the deadline"]
    assert [e["reason"] for e in logs if e["event"] == "lease_lost"] == [info.value.reason]
    assert renewal_tasks() == []


@pytest.mark.parametrize(
    ("failure", "said"),
    [
        (StoreUnavailable("lease API POST /leases/j/renew answered 401", status=401), True),
        (StoreUnavailable("answered 400", status=400), True),
        (StoreUnavailable("malformed lease from the lease API", status=200), True),
        (ValueError("an answer the client could not read"), True),
        (StoreUnavailable("answered 503", status=503), False),
        (StoreUnavailable("failed: ConnectionRefusedError"), False),
    ],
)
async def test_a_renewal_refused_for_its_request_is_said_an_outage_is_not(
    store: SpyStore, worker_clock: FakeClock, failure: Exception, said: bool
) -> None:
    """A 401 (a wrong lease token) or another answer about the request itself is
    the configuration's: each failed renewal says so (`renewal_failed`), where an
    outage (nothing answered, a 5xx) is only the loss at the deadline. The 401
    was read as an outage: the lease lost without a word of why."""
    with capture_logs() as logs, pytest.raises(LeaseLost) as info:
        async with hold(store, "job-1", owner="worker-a", ttl=TTL, monotonic=worker_clock):
            store.fail_renewals = failure
            await store.wait_renewals(store.renewals + 2)
            worker_clock.advance(TTL)
            await asyncio.sleep(PATIENCE * 10)
    assert info.value.reason == "store_unavailable"
    failed = [e for e in logs if e["event"] == "renewal_failed"]
    assert (len(failed) >= 2) is said and (failed == []) is not said
    assert all(e["job_id"] == "job-1" and str(failure) in e["error"] for e in failed)


async def test_a_claim_answered_after_the_local_deadline_never_starts_the_body(
    store: SpyStore, worker_clock: FakeClock
) -> None:
    """The claim was granted, but its answer took longer than the lease is safe for
    on the worker's clock: the body does not run at all (not even up to its first
    await), LeaseLost(lease_expired) leaves `hold`, and the lease is given back."""
    store.while_claiming = lambda: worker_clock.advance(TTL)
    entered = False
    with pytest.raises(LeaseLost) as info:
        async with hold(store, "job-1", owner="worker-a", ttl=TTL, monotonic=worker_clock):
            entered = True
    assert not entered
    assert (info.value.reason, info.value.generation) == ("lease_expired", 1)
    after = await store.get("job-1")
    assert after is not None and after.state == "free"
    assert renewal_tasks() == []


async def test_a_claim_answered_just_before_the_local_deadline_starts_the_body(
    store: SpyStore, worker_clock: FakeClock
) -> None:
    """The other side of the line: an answer that is late but inside the deadline."""
    store.while_claiming = lambda: worker_clock.advance(TTL * 0.9)  # < ttl * (1 - 0.05)
    async with hold(store, "job-1", owner="worker-a", ttl=TTL, monotonic=worker_clock) as lease:
        assert lease.generation == 1
    after = await store.get("job-1")
    assert after is not None and after.state == "done"


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
    assert info.value.reason == "store_unavailable"
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


# --- cancelled from outside -------------------------------------------------------------------


class GatedStore(SpyStore):
    """A SpyStore that records its lease calls in order, can hold an applied
    renewal's answer, can hold, hang or fail complete/release, and can run a hook
    the moment a renewal is refused."""

    def __init__(self, inner: SQLiteLeaseStore) -> None:
        super().__init__(inner)
        self.calls: list[str] = []
        self.hold_renewal_answers: asyncio.Event | None = None  # answered once set
        self.renewal_applied = asyncio.Event()
        self.on_refused: Callable[[], object] | None = None
        self.exit_gate: asyncio.Event | None = None  # complete/release wait for it
        self.exit_started = asyncio.Event()
        self.fail_exits: Exception | None = None

    async def renew(self, lease: Lease, *, ttl: float | None = None) -> Lease:
        try:
            renewed = await super().renew(lease, ttl=ttl)
        except LeaseLost:
            if self.on_refused is not None:
                self.on_refused()
            raise
        if self.hold_renewal_answers is not None:
            self.calls.append("renew applied")
            self.renewal_applied.set()
            try:
                await self.hold_renewal_answers.wait()
            except asyncio.CancelledError:
                self.calls.append("renew cancelled")
                raise
        return renewed

    async def complete(self, lease: Lease) -> Lease:
        return await self._exit("complete", lease)

    async def release(self, lease: Lease) -> Lease:
        return await self._exit("release", lease)

    async def _exit(self, op: str, lease: Lease) -> Lease:
        self.calls.append(op)
        self.exit_started.set()
        if self.exit_gate is not None:
            await self.exit_gate.wait()
        if self.fail_exits is not None:
            raise self.fail_exits
        result: Lease = await getattr(self.inner, op)(lease)
        return result


@pytest.fixture
async def gated(tmp_path: Path, fake_clock: FakeClock) -> AsyncIterator[GatedStore]:
    inner = await SQLiteLeaseStore.open(tmp_path / "leases.db", clock=fake_clock)
    try:
        yield GatedStore(inner)
    finally:
        await inner.close()


async def holding_task(
    store: Any, *, body_returns: bool = False, **kwargs: Any
) -> tuple[asyncio.Task[None], list[BaseException]]:
    """Start a worker task holding job-1 as worker-a; return once its body runs,
    with the list that what leaves its `async with` is recorded in. The body waits
    (for a cancellation) unless `body_returns`."""
    entered = asyncio.Event()
    caught: list[BaseException] = []

    async def worker() -> None:
        try:
            async with hold(store, "job-1", owner="worker-a", **{"ttl": TTL, **kwargs}):
                entered.set()
                if not body_returns:
                    await asyncio.sleep(PATIENCE * 10)
        except BaseException as exc:
            caught.append(exc)
            raise

    task = asyncio.create_task(worker())
    async with asyncio.timeout(PATIENCE):
        await entered.wait()
    return task, caught


async def ends_cancelled(task: asyncio.Task[None], caught: list[BaseException]) -> None:
    """The task ends, in bounded time, cancelled: CancelledError left the `async with`."""
    async with asyncio.timeout(PATIENCE):
        with pytest.raises(asyncio.CancelledError):
            await task
    assert task.cancelled()
    assert len(caught) == 1 and type(caught[0]) is asyncio.CancelledError
    assert renewal_tasks() == []


async def test_outside_cancellation_releases_the_lease_at_once(
    lease_backend: Backend, worker_clock: FakeClock
) -> None:
    """A worker shutting down cancels its task: the lease is released before the
    CancelledError leaves the `async with`, so another owner claims the job right
    away - no clock moved, no waiting for expiry - with the generation bumped."""
    store = lease_backend.store
    task, caught = await holding_task(store, monotonic=worker_clock)
    task.cancel()
    await ends_cancelled(task, caught)
    released = await store.get("job-1")
    assert (released.state, released.generation, released.owner) == ("free", 1, "worker-a")
    taken = await store.claim("job-1", owner="worker-b", ttl=TTL)
    assert (taken.generation, taken.owner) == (2, "worker-b")


async def test_outside_cancellation_keeps_the_cancel_bookkeeping(
    store: SpyStore, worker_clock: FakeClock
) -> None:
    """hold() neither swallows nor uncancels a cancellation it did not make: an
    enclosing asyncio.timeout still sees its own, turns it into TimeoutError, and
    leaves the task with no cancellation pending; the lease was released."""
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(None) as scope:
            async with hold(store, "job-1", owner="worker-a", ttl=TTL, monotonic=worker_clock):
                scope.reschedule(asyncio.get_running_loop().time())
                await asyncio.sleep(PATIENCE * 10)
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    assert (await store.get("job-1")).state == "free"
    assert renewal_tasks() == []


@pytest.mark.parametrize(
    ("body_returns", "failure", "action", "reason"),
    [
        pytest.param(False, None, "release", "timeout", id="release-hangs"),
        pytest.param(
            False,
            StoreUnavailable("unreachable"),
            "release",
            "store_unavailable",
            id="release-fails",
        ),
        # cancelled while the on_exit complete is in flight; it never answers
        pytest.param(True, None, "complete", "timeout", id="complete-hangs"),
    ],
)
async def test_dead_store_at_cancellation_is_bounded_and_still_cancels(
    gated: GatedStore,
    worker_clock: FakeClock,
    body_returns: bool,
    failure: Exception | None,
    action: str,
    reason: str,
) -> None:
    """A store that hangs or fails when the lease is given back after a cancellation
    cannot hold the worker up past `cancel_timeout` (nor swallow the cancellation):
    the failure is logged, CancelledError propagates, the lease is left to expire."""
    gated.exit_gate = asyncio.Event() if failure is None else None  # never set: hangs
    gated.fail_exits = failure
    with capture_logs() as logs:
        task, caught = await holding_task(
            gated, body_returns=body_returns, cancel_timeout=0.2, monotonic=worker_clock
        )
        if body_returns:  # cancelled while the exit's store call is in flight
            async with asyncio.timeout(PATIENCE):
                await gated.exit_started.wait()
        task.cancel()
        started = time.monotonic()
        await ends_cancelled(task, caught)
    assert time.monotonic() - started < PATIENCE
    assert gated.calls == [action]
    failed = [e for e in logs if e["event"] == "lease_exit_failed"]
    assert len(failed) == 1 and failed[0]["log_level"] == "warning"
    assert (failed[0]["action"], failed[0]["reason"]) == (action, reason)
    assert (failed[0]["job_id"], failed[0]["generation"], failed[0]["owner"]) == (
        "job-1",
        1,
        "worker-a",
    )
    assert (await gated.get("job-1")).state == "active"


async def test_cancellation_during_a_renewal_in_flight_releases_after_it(
    gated: GatedStore, worker_clock: FakeClock
) -> None:
    """The store applied a renewal whose answer has not come back when the task is
    cancelled: the renewal is cancelled first, then the release (with the lease
    as last known, same generation) goes through."""
    gated.hold_renewal_answers = asyncio.Event()  # never set
    # a renewal every 0.3 s whose own timeout (the local deadline) is ~30 s away
    task, caught = await holding_task(
        gated, ttl=30.0, renew_fraction=0.01, safety_margin=0.005, monotonic=worker_clock
    )
    async with asyncio.timeout(PATIENCE):
        await gated.renewal_applied.wait()
    task.cancel()
    await ends_cancelled(task, caught)
    assert gated.calls == ["renew applied", "renew cancelled", "release"]
    assert (await gated.get("job-1")).state == "free"
    assert (await gated.claim("job-1", owner="worker-b", ttl=TTL)).generation == 2


async def test_cancellation_after_a_takeover_leaves_the_new_owner_alone(
    gated: GatedStore, fake_clock: FakeClock, worker_clock: FakeClock
) -> None:
    """Renewals stop answering, the lease runs out by the store's clock and
    worker-b takes the job over; then worker-a is cancelled before its watchdog
    noticed. Its release is refused (stale generation), logged, and
    CancelledError still propagates; worker-b keeps the job."""
    task, caught = await holding_task(gated, monotonic=worker_clock)
    gated.hang_renewals = True
    await gated.wait_renewals(gated.renewals + 1)  # no renewal that applies is in flight
    fake_clock.advance(TTL + 1)
    await gated.claim("job-1", owner="worker-b", ttl=60.0)
    with capture_logs() as logs:
        task.cancel()
        await ends_cancelled(task, caught)
    assert gated.calls == ["release"]
    failed = [e for e in logs if e["event"] == "lease_exit_failed"]
    assert [(e["action"], e["reason"]) for e in failed] == [("release", "stale_generation")]
    current = await gated.get("job-1")
    assert (current.owner, current.generation, current.state) == ("worker-b", 2, "active")


@pytest.mark.parametrize(("on_exit", "state"), [("complete", "done"), ("release", "free")])
async def test_cancellation_during_on_exit_lets_the_exit_call_finish(
    gated: GatedStore, worker_clock: FakeClock, on_exit: str, state: str
) -> None:
    """The body returned and the on_exit call is in flight when the task is
    cancelled: that call is not cut off halfway but finishes, then CancelledError
    propagates."""
    gated.exit_gate = asyncio.Event()
    task, caught = await holding_task(
        gated,
        body_returns=True,
        on_exit=on_exit,
        cancel_timeout=PATIENCE,
        monotonic=worker_clock,
    )
    async with asyncio.timeout(PATIENCE):
        await gated.exit_started.wait()
    task.cancel()
    gated.exit_gate.set()
    await ends_cancelled(task, caught)
    assert gated.calls == [on_exit]
    assert (await gated.get("job-1")).state == state


async def test_further_cancellations_do_not_cut_the_release_short(
    gated: GatedStore, worker_clock: FakeClock
) -> None:
    """Cancelled again (twice) while its release is in flight: the release still
    completes, once, and one CancelledError leaves the `async with`."""
    gated.exit_gate = asyncio.Event()
    task, caught = await holding_task(gated, cancel_timeout=PATIENCE, monotonic=worker_clock)
    task.cancel()
    async with asyncio.timeout(PATIENCE):
        await gated.exit_started.wait()
    for _ in range(2):
        task.cancel()
        await asyncio.sleep(0)  # delivered to the waiting worker
    assert not task.done()
    gated.exit_gate.set()
    await ends_cancelled(task, caught)
    assert gated.calls == ["release"]
    assert (await gated.get("job-1")).state == "free"


async def test_lease_lost_as_the_task_is_cancelled_gives_nothing_back(
    gated: GatedStore, worker_clock: FakeClock
) -> None:
    """The outside cancellation lands at the very moment the watchdog finds the
    lease gone (here: completed by someone else): as before, CancelledError
    propagates and nothing is released or completed - there is nothing to give."""
    task, caught = await holding_task(gated, monotonic=worker_clock)
    lease = await gated.get("job-1")
    gated.on_refused = task.cancel  # the shutdown's cancel, in the same instant
    with capture_logs() as logs:
        await gated.inner.complete(lease)
        await ends_cancelled(task, caught)
    assert gated.calls == []
    assert [e["reason"] for e in logs if e["event"] == "lease_lost"] == ["job_completed"]
    assert [e for e in logs if e["event"] == "lease_exit_failed"] == []
    assert (await gated.get("job-1")).state == "done"


async def test_lost_lease_still_raises_lease_lost_and_gives_nothing_back(
    gated: GatedStore, worker_clock: FakeClock
) -> None:
    """The cancellation hold() makes itself when the lease is lost is unchanged:
    LeaseLost (not CancelledError) leaves the `async with`, nothing is released,
    and the task has no cancellation left pending."""
    with pytest.raises(LeaseLost) as info:
        async with hold(gated, "job-1", owner="worker-a", ttl=TTL, monotonic=worker_clock) as a:
            await gated.inner.complete(a)
            await asyncio.sleep(PATIENCE * 10)
    assert info.value.reason == "job_completed"
    assert gated.calls == []
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    assert renewal_tasks() == []


# --- cancelled while the claim is on the wire -------------------------------------------


class ClaimGatedStore(SpyStore):
    """A SpyStore whose claim waits for `gate` before it reaches the store."""

    def __init__(self, inner: SQLiteLeaseStore) -> None:
        super().__init__(inner)
        self.gate = asyncio.Event()
        self.claim_started = asyncio.Event()

    async def claim(self, job_id: str, *, owner: str | None = None, ttl: float) -> Lease:
        self.claim_started.set()
        await self.gate.wait()
        return await self.inner.claim(job_id, owner=owner, ttl=ttl)


async def test_a_claim_granted_after_its_worker_was_cancelled_is_given_back(
    store: SpyStore,
) -> None:
    gated = ClaimGatedStore(store.inner)

    async def worker() -> None:
        async with hold(gated, "job-1", owner="worker-a", ttl=30):
            await asyncio.Event().wait()

    task = asyncio.create_task(worker())
    await gated.claim_started.wait()
    task.cancel()
    await asyncio.sleep(0)
    gated.gate.set()  # the store grants the claim after all
    with pytest.raises(asyncio.CancelledError):
        await task
    lease = await store.inner.get("job-1")
    assert lease is not None and (lease.state, lease.generation) == ("free", 1)
    taken = await store.inner.claim("job-1", owner="worker-b", ttl=30)
    assert taken.generation == 2  # at once, not after a ttl


async def test_a_claim_that_never_answers_does_not_hold_up_the_cancellation(
    store: SpyStore,
) -> None:
    gated = ClaimGatedStore(store.inner)  # the gate never opens

    async def worker() -> None:
        async with hold(gated, "job-1", owner="worker-a", ttl=30, cancel_timeout=0.2):
            await asyncio.Event().wait()

    task = asyncio.create_task(worker())
    await gated.claim_started.wait()
    task.cancel()
    with capture_logs() as logs, pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)  # bounded by cancel_timeout, with a wide margin
    assert [(e["event"], e["reason"]) for e in logs] == [("lease_exit_failed", "timeout")]
    assert await store.inner.get("job-1") is None  # never reached the store
