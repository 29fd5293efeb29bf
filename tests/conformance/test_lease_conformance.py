"""The lease store contract (SPEC 1, 3, 9), run unchanged on every backend.

Time only moves when a test moves the store's clock (`lease_backend.advance`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from leases import (
    JobCompleted,
    Lease,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    LeaseRef,
    StoreUnavailable,
    hold,
    open_store,
)
from tests.backends import Backend
from tests.conftest import FakeClock

TTL = 30.0


def snapshot(lease: Lease | None) -> tuple[object, ...] | None:
    """What a store keeps about a lease; `expires_in` is left out, as it is relative
    to the moment of reading (which moves on a real server clock)."""
    if lease is None:
        return None
    return (lease.job_id, lease.owner, lease.generation, lease.state, lease.lease_until)


async def claim_to_generation(backend: Backend, job_id: str, generation: int) -> Lease:
    """Claim and release `job_id` until its next claim is `generation`; claim it."""
    store = backend.store
    while True:
        lease = await store.claim(job_id, owner="warm-up", ttl=TTL)
        if lease.generation == generation:
            return lease
        await store.release(lease)


# --- claim and get -------------------------------------------------------------------


async def test_first_claim_is_generation_one_active_for_ttl(lease_backend: Backend) -> None:
    store = lease_backend.store
    assert await store.get("job-1") is None
    lease = await store.claim("job-1", owner="worker-a", ttl=TTL)
    assert isinstance(lease, Lease)
    assert (lease.job_id, lease.owner, lease.generation, lease.state) == (
        "job-1",
        "worker-a",
        1,
        "active",
    )
    assert lease.expires_in == pytest.approx(TTL, abs=0.5)
    assert lease.lease_until.utcoffset() == timedelta(0)
    assert snapshot(await store.get("job-1")) == snapshot(lease)


async def test_claim_without_owner_uses_a_generated_owner(lease_backend: Backend) -> None:
    """owner=None picks a process-unique owner id, which is then the lease's owner."""
    lease = await lease_backend.store.claim("job-1", ttl=TTL)
    assert lease.owner and ":" in lease.owner
    assert (await lease_backend.store.get("job-1")).owner == lease.owner


async def test_claim_of_a_held_job_raises_lease_held_with_owner_and_expires_in(
    lease_backend: Backend,
) -> None:
    store = lease_backend.store
    await store.claim("job-1", owner="worker-a", ttl=TTL)
    lease_backend.advance(10)
    for claimant in ("worker-b", "worker-a"):  # a claim is not re-entrant, even for the owner
        with pytest.raises(LeaseHeld) as info:
            await store.claim("job-1", owner=claimant, ttl=TTL)
        assert info.value.reason == "lease_held"
        assert info.value.owner == "worker-a"
        assert info.value.expires_in == pytest.approx(TTL - 10, abs=0.5)
        assert info.value.current_generation == 1
    assert (await store.get("job-1")).generation == 1


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


async def test_a_worker_whose_claim_answer_was_lost_can_go_on_with_its_generation(
    lease_backend: Backend,
) -> None:
    """The claim committed but its answer never arrived: the retry's LeaseHeld names
    this worker and the generation, so it can renew instead of idling a whole ttl."""
    store = lease_backend.store
    await store.claim("job-1", owner="worker-a", ttl=TTL)  # the answer is "lost"
    with pytest.raises(LeaseHeld) as info:
        await store.claim("job-1", owner="worker-a", ttl=TTL)
    held = info.value
    assert held.owner == "worker-a" and held.current_generation == 1
    mine = Lease(held.job_id, held.owner, held.current_generation, "active", EPOCH, 0.0)
    renewed = await store.renew(mine, ttl=TTL)
    assert renewed.generation == 1 and renewed.owner == "worker-a"


async def test_every_claim_bumps_the_generation_by_one(lease_backend: Backend) -> None:
    """Release then claim, and expire then claim: each claim is exactly one higher."""
    store = lease_backend.store
    seen = []
    lease = await store.claim("job-1", owner="a", ttl=TTL)
    seen.append(lease.generation)
    for i in range(6):
        if i % 2:
            await store.release(lease)
        else:
            lease_backend.advance(TTL + 1)
        lease = await store.claim("job-1", owner=f"w{i}", ttl=TTL)
        seen.append(lease.generation)
    assert seen == [1, 2, 3, 4, 5, 6, 7]


async def test_generations_are_per_job(lease_backend: Backend) -> None:
    store = lease_backend.store
    a = await store.claim("job-a", owner="w", ttl=TTL)
    await store.release(a)
    await store.claim("job-a", owner="w", ttl=TTL)
    assert (await store.claim("job-b", owner="w", ttl=TTL)).generation == 1


async def test_a_lease_expires_by_the_store_clock(lease_backend: Backend) -> None:
    """Held just before lease_until; claimable once the store's clock passes it."""
    store = lease_backend.store
    await store.claim("job-1", owner="worker-a", ttl=TTL)
    lease_backend.advance(TTL - 1)
    with pytest.raises(LeaseHeld):
        await store.claim("job-1", owner="worker-b", ttl=TTL)
    lease_backend.advance(2)
    expired = await store.get("job-1")
    assert expired.state == "active" and expired.expires_in == 0
    lease = await store.claim("job-1", owner="worker-b", ttl=TTL)
    assert (lease.owner, lease.generation) == ("worker-b", 2)


# --- renew, complete, release ------------------------------------------------------------


async def test_renew_extends_from_the_store_now(lease_backend: Backend) -> None:
    store = lease_backend.store
    lease = await store.claim("job-1", owner="worker-a", ttl=TTL)
    lease_backend.advance(20)
    renewed = await store.renew(lease, ttl=60.0)
    assert renewed.generation == lease.generation and renewed.owner == "worker-a"
    assert renewed.expires_in == pytest.approx(60.0, abs=0.5)
    assert (renewed.lease_until - lease.lease_until).total_seconds() == pytest.approx(50, abs=0.5)
    lease_backend.advance(50)  # past the claim's ttl, inside the renewal's
    with pytest.raises(LeaseHeld):
        await store.claim("job-1", owner="worker-b", ttl=TTL)


async def test_renew_without_ttl_reuses_the_last_ttl(lease_backend: Backend) -> None:
    store = lease_backend.store
    lease = await store.claim("job-1", owner="worker-a", ttl=12.0)
    lease_backend.advance(5)
    renewed = await store.renew(lease)
    assert renewed.expires_in == pytest.approx(12.0, abs=0.5)
    renewed = await store.renew(renewed, ttl=40.0)
    assert (await store.renew(renewed)).expires_in == pytest.approx(40.0, abs=0.5)


async def test_a_lease_ref_names_a_lease_by_job_owner_and_generation(
    lease_backend: Backend,
) -> None:
    """The held verbs read only (job, owner, generation): a LeaseRef works like the
    Lease it names, and a ref to an older generation is refused like that lease."""
    store = lease_backend.store
    first = await store.claim("job-1", owner="worker-a", ttl=TTL)
    renewed = await store.renew(LeaseRef("job-1", "worker-a", first.generation), ttl=TTL)
    assert (renewed.generation, renewed.state) == (first.generation, "active")
    with pytest.raises(LeaseLost) as lost:
        await store.complete(LeaseRef("job-1", "worker-a", first.generation + 1))
    assert lost.value.reason == "unknown_generation"
    done = await store.complete(LeaseRef("job-1", "worker-a", first.generation))
    assert done.state == "done"


async def test_complete_marks_done_and_the_job_can_never_be_claimed(
    lease_backend: Backend,
) -> None:
    store = lease_backend.store
    lease = await store.claim("job-1", owner="worker-a", ttl=TTL)
    done = await store.complete(lease)
    assert (done.state, done.generation, done.expires_in) == ("done", 1, 0)
    lease_backend.advance(TTL * 10)
    with pytest.raises(JobCompleted) as info:
        await store.claim("job-1", owner="worker-b", ttl=TTL)
    assert info.value.reason == "job_completed"
    assert info.value.current_generation == 1  # the generation that completed it
    assert (await store.get("job-1")).state == "done"


async def test_release_frees_the_job_for_an_immediate_claim(lease_backend: Backend) -> None:
    store = lease_backend.store
    lease = await store.claim("job-1", owner="worker-a", ttl=TTL)
    freed = await store.release(lease)
    assert (freed.state, freed.generation, freed.expires_in) == ("free", 1, 0)
    again = await store.claim("job-1", owner="worker-b", ttl=TTL)
    assert (again.owner, again.generation) == ("worker-b", 2)


async def test_worked_example_of_spec_1(lease_backend: Backend) -> None:
    """A claims generation 7 and pauses; after expiry B claims 8; A's renew and
    complete are refused as stale; B completes; nobody can claim the job again."""
    store = lease_backend.store
    a = await claim_to_generation(lease_backend, "job-42", 6)
    await store.release(a)
    a = await store.claim("job-42", owner="worker-a", ttl=TTL)
    assert a.generation == 7
    lease_backend.advance(TTL + 1)  # A is paused past its lease
    b = await store.claim("job-42", owner="worker-b", ttl=TTL)
    assert b.generation == 8
    for op in (store.renew, store.complete):
        with pytest.raises(LeaseLost) as info:
            await op(a)
        assert info.value.reason == "stale_generation"
        assert info.value.generation == 7
        assert info.value.current_generation == 8
    done = await store.complete(b)
    assert (done.state, done.generation, done.owner) == ("done", 8, "worker-b")
    with pytest.raises(JobCompleted):
        await store.claim("job-42", owner="worker-c", ttl=TTL)


# --- refusals: reason and "changes nothing" ------------------------------------------------


async def _refusal_case(backend: Backend, case: str) -> Lease:
    """Set up job-1 so that the returned lease is refused for `case`'s reason."""
    store = backend.store
    if case == "lease_not_held(never claimed)":
        return Lease("job-1", "worker-a", 1, "active", datetime.fromtimestamp(0, UTC), 0.0)
    lease = await store.claim("job-1", owner="worker-a", ttl=TTL)
    if case == "stale_generation":
        backend.advance(TTL + 1)
        await store.claim("job-1", owner="worker-b", ttl=TTL)
    elif case == "unknown_generation":
        lease = dataclasses.replace(lease, generation=lease.generation + 1)
    elif case == "job_completed":
        await store.complete(lease)
    elif case == "lease_not_held(free)":
        await store.release(lease)
    elif case == "lease_expired":
        backend.advance(TTL + 1)
        lease = dataclasses.replace(lease, owner="mallory")  # expiry is reported first
    elif case == "owner_mismatch":
        lease = dataclasses.replace(lease, owner="mallory")
    else:  # pragma: no cover
        raise AssertionError(case)
    return lease


REFUSALS = [
    "lease_not_held(never claimed)",
    "stale_generation",
    "unknown_generation",
    "job_completed",
    "lease_not_held(free)",
    "lease_expired",
    "owner_mismatch",
]


@pytest.mark.parametrize("case", REFUSALS)
async def test_refused_operation_raises_lease_lost_and_changes_nothing(
    lease_backend: Backend, case: str
) -> None:
    """renew, complete and release refuse with the case's reason and leave the
    stored lease exactly as it was (so the same setup serves all three)."""
    store = lease_backend.store
    lease = await _refusal_case(lease_backend, case)
    before = snapshot(await store.get("job-1"))
    for op in (store.renew, store.complete, store.release):
        with pytest.raises(LeaseLost) as info:
            await op(lease)
        assert info.value.reason == case.split("(")[0], op.__name__
        assert isinstance(info.value, LeaseError)
        assert snapshot(await store.get("job-1")) == before, op.__name__


async def test_refused_claim_changes_nothing(lease_backend: Backend) -> None:
    store = lease_backend.store
    await store.claim("job-1", owner="worker-a", ttl=TTL)
    done = await store.complete(await store.claim("job-2", owner="worker-a", ttl=TTL))
    before = [snapshot(await store.get(j)) for j in ("job-1", "job-2")]
    with pytest.raises(LeaseHeld):
        await store.claim("job-1", owner="worker-b", ttl=TTL)
    with pytest.raises(JobCompleted):
        await store.claim("job-2", owner="worker-b", ttl=TTL)
    assert [snapshot(await store.get(j)) for j in ("job-1", "job-2")] == before
    assert done.generation == 1


BAD_IDS = ["", "x" * 257, "jöb", "job 1", "job\n", 42, None, b"job"]
BAD_TTLS = [0, 0.049, 86400.1, -1, math.nan, math.inf, 10**400, True, "30"]
BAD_OWNERS = ["", "a b", "wörker", "x" * 257, 7]


async def test_bad_arguments_raise_value_error_and_change_nothing(
    lease_backend: Backend,
) -> None:
    """Job ids, owners and ttls outside the contract raise ValueError; no row is
    created and the existing lease is untouched."""
    store = lease_backend.store
    held = await store.claim("job-1", owner="worker-a", ttl=TTL)
    before = snapshot(await store.get("job-1"))
    for job_id in BAD_IDS:
        with pytest.raises(ValueError):
            await store.claim(job_id, owner="worker-a", ttl=TTL)
        with pytest.raises(ValueError):
            await store.get(job_id)
    for ttl in [*BAD_TTLS, None]:
        with pytest.raises(ValueError):
            await store.claim("job-2", owner="worker-a", ttl=ttl)
    for ttl in BAD_TTLS:  # renew(ttl=None) is valid: "the last ttl again"
        with pytest.raises(ValueError):
            await store.renew(held, ttl=ttl)
    for owner in BAD_OWNERS:
        with pytest.raises(ValueError):
            await store.claim("job-2", owner=owner, ttl=TTL)
    assert await store.get("job-2") is None
    assert snapshot(await store.get("job-1")) == before


async def test_malformed_lease_argument_raises_value_error_and_changes_nothing(
    lease_backend: Backend,
) -> None:
    store = lease_backend.store
    lease = await store.claim("job-1", owner="worker-a", ttl=TTL)
    before = snapshot(await store.get("job-1"))
    malformed = [
        "not a lease",
        {"job_id": "job-1", "owner": "worker-a", "generation": 1},
        dataclasses.replace(lease, generation=0),
        dataclasses.replace(lease, generation=True),
        dataclasses.replace(lease, generation=2**63),
        dataclasses.replace(lease, owner=""),
        dataclasses.replace(lease, job_id="a b"),
    ]
    for bad in malformed:
        for op in (store.renew, store.complete, store.release):
            with pytest.raises(ValueError):
                await op(bad)
    assert snapshot(await store.get("job-1")) == before


async def test_store_is_an_async_context_manager_that_closes(lease_backend: Backend) -> None:
    """`async with store` yields the store and closes it; a closed store refuses work."""
    async with lease_backend.store as store:
        assert store is lease_backend.store
        lease = await store.claim("job-1", owner="worker-a", ttl=TTL)
    with pytest.raises(StoreUnavailable):
        await store.renew(lease)


# --- clocks: only the store's clock decides ---------------------------------------------------


@pytest.mark.parametrize("skew", [-3600.0, 0.0, 3600.0], ids=["hour-slow", "exact", "hour-fast"])
async def test_worker_clock_off_by_an_hour_changes_no_decision(
    lease_backend: Backend, skew: float
) -> None:
    """The API takes no worker time: a worker whose own clock is an hour off (here
    the monotonic clock `hold` uses) sees the same outcomes, decided by the store's
    clock only: the hold completes normally, and a lease stolen after expiry by the
    store's clock is lost with stale_generation."""
    store = lease_backend.store
    worker_clock = FakeClock(start=10_000.0 + skew)

    async with hold(store, "job-ok", owner="worker-a", ttl=TTL, monotonic=worker_clock) as lease:
        lease_backend.advance(TTL / 2)
    assert (await store.get("job-ok")).state == "done"
    assert lease.generation == 1

    outcome = None
    with pytest.raises(LeaseLost) as info:
        async with hold(store, "job-lost", owner="worker-a", ttl=0.3, monotonic=worker_clock):
            lease_backend.advance(1.0)  # past the lease by the store's clock only
            stolen = await store.claim("job-lost", owner="worker-b", ttl=TTL)
            await asyncio.sleep(30)  # cancelled at the next renewal
            outcome = "stale effect"
    assert info.value.reason == "stale_generation"
    assert stolen.generation == 2 and outcome is None
    assert (await store.get("job-lost")).owner == "worker-b"


# --- competing claims ------------------------------------------------------------------------


async def test_fifty_concurrent_claims_have_exactly_one_winner(
    lease_backend: Backend,
) -> None:
    """50 tasks claim one free job at once, 100 times: exactly one wins each time,
    and every loser is told who holds it."""
    store = lease_backend.store

    async def attempt(job_id: str, owner: str) -> Lease | LeaseHeld:
        try:
            return await store.claim(job_id, owner=owner, ttl=TTL)
        except LeaseHeld as exc:
            return exc

    for round_no in range(100):
        job_id = f"race-{round_no}"
        results = await asyncio.gather(*(attempt(job_id, f"w{i}") for i in range(50)))
        winners = [r for r in results if isinstance(r, Lease)]
        assert len(winners) == 1, f"round {round_no}: {len(winners)} winners"
        assert winners[0].generation == 1
        assert {r.owner for r in results if isinstance(r, LeaseHeld)} == {winners[0].owner}
        assert (await store.get(job_id)).owner == winners[0].owner


@pytest.mark.parametrize(
    "url", ["sqlite:///{tmp}/x.db", "postgresql://u@127.0.0.1:1/x", "http://127.0.0.1:1"]
)
async def test_open_store_refuses_unknown_options_alike_on_every_backend(
    tmp_path: Path, url: str
) -> None:
    """One interface: the same ValueError (not a TypeError on some), before connecting."""
    with pytest.raises(ValueError, match="unknown store options: bogus"):
        await open_store(url.format(tmp=tmp_path), bogus=1)


async def test_an_in_memory_sqlite_store_is_refused_before_it_is_opened() -> None:
    """Its writer and reader connections would each have a database of their own:
    a claim was written where no `get` looked (StoreUnavailable: no such table)."""
    with pytest.raises(ValueError, match="in-memory SQLite database cannot be a store"):
        await open_store("sqlite:///:memory:")


async def test_the_sqlite_scheme_is_read_in_any_case(tmp_path: Path) -> None:
    """As the http and postgresql schemes are (RFC 3986: schemes are case-insensitive);
    SQLITE:/// was `not a sqlite URL`."""
    store = await open_store(f"SQLite:///{tmp_path / 'case.db'}")
    try:
        assert (await store.claim("job-1", owner="w", ttl=30)).generation == 1
    finally:
        await store.close()
    assert (tmp_path / "case.db").exists()


async def test_open_store_is_also_a_context_manager_that_closes_the_store(
    tmp_path: Path,
) -> None:
    """`async with open_store(url) as store:` (as asyncpg's create_pool takes) was a
    TypeError about a coroutine, and a warning that it was never awaited."""
    async with open_store(f"sqlite:///{tmp_path / 'cm.db'}") as store:
        assert (await store.claim("job-1", owner="w", ttl=30)).generation == 1
    with pytest.raises(StoreUnavailable, match="closed"):
        await store.get("job-1")
    with pytest.raises(ValueError, match="unknown store options: bogus"):
        async with open_store(f"sqlite:///{tmp_path / 'cm.db'}", bogus=1):
            pass
