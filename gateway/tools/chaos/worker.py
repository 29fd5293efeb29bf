"""The chaos run's workers: real workers on the real client (`hold`, `FencedWriter`,
the HTTP lease store), with the faults a real fleet suffers.

A worker loops: pick a job not known to be done, claim it under `hold()` (its
monotonic clock skewed by a fixed rate), do `steps` effect writes with keys
derived from (job, step), complete on exit. Per job, with probability
`pause_rate`, it freezes between two writes for longer than its lease: its
renewals stop too (the lease store it uses is frozen), and when it wakes it goes
on writing with its old lease through a writer built from the plain `Lease`, so
no client-side guard saves it, then tries to complete. The gateway must refuse.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, fields

from gateway.tools.chaos.client import SkewedClock, WorkerLeaseStore, Writers
from gateway.tools.chaos.context import UNKNOWN_REASONS, RunContext, Tally, step_name
from leases import JobCompleted, Lease, LeaseHeld, LeaseLost, StoreUnavailable, hold
from leases.reasons import Reason
from leases.writer import (
    BadWrite,
    DuplicateWrite,
    GatewayRejected,
    GatewayUnavailable,
    StaleWrite,
    derive_key,
)

_RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})


def _plain(lease: Lease) -> Lease:
    """The bare values of what `hold()` yielded, without its live state: a writer
    given this has no client-side guard, as a process that missed its loss."""
    return Lease(**{f.name: getattr(lease, f.name) for f in fields(Lease)})


@dataclass
class _Zombie:
    lease: Lease
    step: int
    wake_at: float


async def run_worker(ctx: RunContext, index: int) -> None:
    """One worker until every job is done or the run's deadline passes."""
    rng = random.Random(f"{ctx.seed}:worker:{index}")
    rate = 1.0 + rng.uniform(-ctx.clock_skew, ctx.clock_skew)
    ctx.tally.clock_rates.append(rate)
    clock = SkewedClock(rate)
    store = WorkerLeaseStore(ctx.lease_stores, start=index)
    owner = f"chaos-worker-{index:02d}"
    backoff = LeaseBackoff(rng)
    loop = asyncio.get_running_loop()
    while loop.time() < ctx.deadline:
        pending = ctx.pending()
        if not pending:
            return
        job = rng.choice(pending)
        await _one_job(ctx, rng, store, clock, owner, job, index, backoff)


class LeaseBackoff:
    """How long a worker waits after its lease calls fail: doubling from 0.2 s up
    to 2 s, with jitter, and back to the start once a claim is answered. Without
    it, the workers idle at the tail of a run retry a faulted store several times
    a second each, and their abandoned calls keep its connections busy."""

    FIRST_S = 0.2
    MOST_S = 2.0

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._failures = 0

    def answered(self) -> None:
        self._failures = 0

    def failed(self) -> float:
        wait: float = min(self.MOST_S, self.FIRST_S * 2.0**self._failures)
        self._failures += 1
        return wait * self._rng.uniform(0.5, 1.0)


async def _one_job(
    ctx: RunContext,
    rng: random.Random,
    store: WorkerLeaseStore,
    clock: Callable[[], float],
    owner: str,
    job: str,
    index: int,
    backoff: LeaseBackoff,
) -> None:
    tally = ctx.tally
    freeze = _freeze_plan(ctx, rng)
    lease: Lease | None = None
    try:
        async with hold(store, job, owner, ctx.ttl, on_exit="complete", monotonic=clock) as lease:
            backoff.answered()
            await _work_job(ctx, rng, store, lease, freeze, index)
        tally.completions.setdefault(job, []).append(lease.generation)
        ctx.done.add(job)
    except LeaseHeld as exc:
        # Try again about when the holder's lease could run out, as a worker
        # reading the answer's `expires_in` would (not sooner than 0.2 s).
        backoff.answered()
        tally.claim_conflicts += 1
        await asyncio.sleep(min(max(exc.expires_in, 0.2), ctx.ttl) * rng.uniform(1.0, 1.5))
    except JobCompleted:
        tally.claims_of_completed += 1
        ctx.done.add(job)
    except LeaseLost as exc:
        if freeze.zombie is not None:
            await _wake_as_zombie(ctx, store, freeze.zombie)
        else:
            tally.leases_lost[exc.reason] += 1
            await _confirm_completion(ctx, store, lease)
    except StaleWrite as exc:
        # A write inside the hold refused as stale: e.g. a slow clock let the body
        # run past the store's lease while a renewal was failing.
        tally.writes_rejected_in_hold[exc.reason] += 1
    except StoreUnavailable:
        tally.lease_calls_failed += 1
        await _confirm_completion(ctx, store, lease)
        await asyncio.sleep(backoff.failed())
    except GatewayRejected as exc:
        tally.unexpected.append(f"{job}: {exc!r}")
    finally:
        store.thaw()


@dataclass
class _Freeze:
    """Whether a worker freezes during one job, before which step, for how long;
    and, once it has, what it wakes up with."""

    paused: bool
    at_step: int
    seconds: float
    zombie: _Zombie | None = None


def _freeze_plan(ctx: RunContext, rng: random.Random) -> _Freeze:
    pause_at = rng.randrange(1, ctx.steps) if ctx.steps > 1 else 0
    if ctx.late_write:  # the late write is step pause_at: a newer generation writes after it
        pause_at = rng.randrange(0, ctx.steps - 1)
    paused = rng.random() < ctx.pause_rate
    # Long enough that even the slowest clock's local deadline has passed.
    pause_min = ctx.ttl * 1.3 / (1.0 - ctx.clock_skew)
    pause = rng.uniform(pause_min, max(ctx.max_pause, pause_min + 0.1))
    return _Freeze(paused, pause_at, pause)


async def _work_job(
    ctx: RunContext,
    rng: random.Random,
    store: WorkerLeaseStore,
    lease: Lease,
    freeze: _Freeze,
    index: int,
) -> None:
    """The body of the hold: the job's writes, or a freeze past the lease."""
    tally = ctx.tally
    job = lease.job_id
    tally.claims += 1
    tally.granted.setdefault(job, []).append(lease.generation)
    writers = Writers(ctx, lease, start=index)
    for step in range(ctx.steps):
        await asyncio.sleep(rng.uniform(0.5, 1.5) * ctx.step_work)
        if freeze.paused and step == freeze.at_step:
            if ctx.late_write:
                late = ctx.late_write(_plain(lease), step, index)
                ctx.background.append(asyncio.create_task(late))
            wake_at = asyncio.get_running_loop().time() + freeze.seconds
            freeze.zombie = _Zombie(_plain(lease), step, wake_at)
            tally.pauses_past_lease += 1
            store.freeze()
            await asyncio.sleep(freeze.seconds)  # hold() cancels us: LeaseLost
            raise LeaseLost(job, lease.generation, "paused")
        await _write_step(ctx, writers, job, step)


async def _write_step(ctx: RunContext, writers: Writers, job: str, step: int) -> None:
    """Write one effect until it is applied, replayed, or its outcome is unknown.

    Retries with the same key after anything transient, as a real worker would.
    `StaleWrite` propagates: the lease is gone, the job is someone else's.
    """
    tally = ctx.tally
    key = derive_key(job, step_name(step))
    while True:
        tally.writes_sent += 1
        try:
            result = await writers.post(job, step)
        except DuplicateWrite as exc:
            if exc.reason == Reason.OUTCOME_UNKNOWN:
                tally.unknown_keys.add(key)
                return  # the effect may have been applied: that is the contract
            if exc.reason == Reason.IDEMPOTENCY_KEY_REUSED:
                tally.unexpected.append(f"{job} step {step}: {exc}")
                return
            tally.retries[exc.reason] += 1
            await asyncio.sleep(0.3)
            continue
        except GatewayUnavailable as exc:
            tally.retries[exc.reason] += 1
            if exc.reason in UNKNOWN_REASONS:
                tally.unknown_keys.add(key)
            if exc.reason == "store_unavailable":
                _store_refusal(tally, exc)
            await asyncio.sleep(0.2)
            continue
        except BadWrite as exc:
            tally.unexpected.append(f"{job} step {step}: {exc}")
            return
        if result.status in _RETRYABLE_STATUSES:
            tally.retries[f"upstream_{result.status}"] += 1
            await asyncio.sleep(0.2)
            continue
        if 200 <= result.status < 300:
            tally.acknowledged[key] = asyncio.get_running_loop().time()
            if result.replayed:
                tally.duplicates_replayed += 1
            else:
                tally.writes_applied += 1
            return
        tally.unexpected.append(f"{job} step {step}: upstream answered {result.status}")
        return


def _store_refusal(tally: Tally, exc: GatewayUnavailable) -> None:
    tally.store_refusals.append(asyncio.get_running_loop().time())
    if exc.retry_after is None:
        tally.store_refusals_without_retry_after += 1


async def _wake_as_zombie(ctx: RunContext, store: WorkerLeaseStore, zombie: _Zombie) -> None:
    """The frozen worker wakes and goes on as if nothing happened: writes with its
    old generation (no Hold to stop it), then tries to complete."""
    tally = ctx.tally
    await asyncio.sleep(max(0.0, zombie.wake_at - asyncio.get_running_loop().time()))
    store.thaw()
    writers = Writers(ctx, zombie.lease, start=zombie.step)
    job = zombie.lease.job_id
    for step in range(zombie.step, ctx.steps):
        tally.stale_writes_attempted += 1
        for _ in range(5):  # a few tries past transient errors; a refusal is final
            try:
                result = await writers.post(job, step)
            except StaleWrite as exc:
                tally.stale_writes_rejected[exc.reason] += 1
            except (GatewayUnavailable, DuplicateWrite) as exc:
                if exc.reason in UNKNOWN_REASONS | {Reason.OUTCOME_UNKNOWN}:
                    tally.stale_writes_rejected[f"other:{exc.reason}"] += 1
                    break
                await asyncio.sleep(0.2)
                continue
            except BadWrite as exc:
                tally.unexpected.append(f"zombie {job}: {exc}")
            else:
                # An answer at all is the destination's (the gateway's own refusals
                # are raised above): the stale write went past the fence, whatever
                # its status, and is not sent again.
                tally.stale_writes_accepted += 1
                replayed = " (a replay)" if result.replayed else ""
                tally.stale_accepted.append(
                    f"zombie of {job} (generation {zombie.lease.generation}) step {step}: "
                    f"answered {result.status}{replayed}"
                )
                if 200 <= result.status < 300:
                    key = derive_key(job, step_name(step))
                    tally.acknowledged[key] = asyncio.get_running_loop().time()
            break
    tally.stale_completions_attempted += 1
    try:
        await store.complete(zombie.lease)
    except LeaseLost as exc:
        tally.stale_completions_rejected[exc.reason] += 1
    except StoreUnavailable:
        tally.stale_completions_rejected[Reason.STORE_UNAVAILABLE] += 1
    else:
        tally.stale_completions_accepted += 1
        tally.stale_accepted.append(
            f"zombie of {job} (generation {zombie.lease.generation}): completion acknowledged"
        )
        tally.completions.setdefault(job, []).append(zombie.lease.generation)


async def _confirm_completion(
    ctx: RunContext, store: WorkerLeaseStore, lease: Lease | None
) -> None:
    """After a completion whose answer was lost (or refused as `job_completed` by a
    failover retry of our own request), read the store: done with our generation
    and owner means ours went through."""
    if lease is None:
        return
    for _ in range(10):
        try:
            current = await store.get(lease.job_id)
        except StoreUnavailable:
            await asyncio.sleep(0.5)
            continue
        if (
            current is not None
            and current.state == "done"
            and current.generation == lease.generation
            and current.owner == lease.owner
            and lease.job_id not in ctx.done
        ):
            ctx.tally.completions_confirmed[lease.job_id] = lease.generation
            ctx.done.add(lease.job_id)
        return
