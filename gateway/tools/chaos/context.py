"""What the chaos run's workers share: the run's settings and connections
(`RunContext`), the counts of what they saw (`Tally`), and the keys of a job's
effects as every worker derives them."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from leases import Lease
from leases.http import HTTPLeaseStore
from leases.reasons import Reason
from leases.writer import derive_key

DESTINATION = "sink"
# Answers the writer reports as "the key's outcome is unknown" (SPEC 2 step 8).
UNKNOWN_REASONS = frozenset(
    {Reason.OUTCOME_UNKNOWN, Reason.UPSTREAM_TIMEOUT, Reason.UPSTREAM_DISCONNECTED}
)


def step_name(step: int) -> str:
    return f"effect-{step}"


def job_keys(job_id: str, steps: int) -> list[str]:
    """The idempotency keys of a job's effects, as every worker derives them."""
    return [derive_key(job_id, step_name(s)) for s in range(steps)]


@dataclass
class Tally:
    """What the workers saw and did; shared by all of them (one event loop)."""

    claims: int = 0
    claim_conflicts: int = 0
    claims_of_completed: int = 0
    granted: dict[str, list[int]] = field(default_factory=dict)
    pauses_past_lease: int = 0
    stale_writes_attempted: int = 0
    stale_writes_rejected: Counter[str] = field(default_factory=Counter)
    stale_writes_accepted: int = 0
    stale_completions_attempted: int = 0
    stale_completions_rejected: Counter[str] = field(default_factory=Counter)
    stale_completions_accepted: int = 0
    stale_accepted: list[str] = field(default_factory=list)  # what was taken, in words
    writes_rejected_in_hold: Counter[str] = field(default_factory=Counter)
    writes_sent: int = 0
    writes_applied: int = 0
    duplicates_replayed: int = 0
    unknown_keys: set[str] = field(default_factory=set)
    retries: Counter[str] = field(default_factory=Counter)
    lease_calls_failed: int = 0  # a claim or completion no gateway answered
    leases_lost: Counter[str] = field(default_factory=Counter)
    # Completions the store acknowledged (200), per job, with their generation.
    completions: dict[str, list[int]] = field(default_factory=dict)
    # Answer lost, then found done with our generation and owner: job -> generation.
    completions_confirmed: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    clock_rates: list[float] = field(default_factory=list)
    late_writes_sent: int = 0  # --late-writes
    late_write_answers: Counter[str] = field(default_factory=Counter)
    # Keys a worker got a 2xx for (applied or replayed), with the loop time.
    acknowledged: dict[str, float] = field(default_factory=dict)
    # Loop times of `store_unavailable` answers, and how many lacked Retry-After.
    store_refusals: list[float] = field(default_factory=list)
    store_refusals_without_retry_after: int = 0
    # Every answer that carried `Sinkgate-Rejected`, by reason: writes and lease
    # calls, the refusals the writer retries by itself included (`count_rejections`).
    rejections: Counter[str] = field(default_factory=Counter)


@dataclass
class RunContext:
    """Everything the workers share."""

    jobs: list[str]
    steps: int
    ttl: float
    pause_rate: float
    max_pause: float
    clock_skew: float
    step_work: float
    write_urls: list[str]  # the gateways, or the destination with --bypass-gateway
    lease_stores: list[HTTPLeaseStore]
    session: aiohttp.ClientSession
    seed: int
    deadline: float  # loop time after which no new job is started
    write_timeout: float
    tally: Tally = field(default_factory=Tally)
    # --late-writes: a freezing worker leaves one write stuck on the wire (late.py)
    late_write: Callable[[Lease, int, int], Coroutine[Any, Any, None]] | None = None
    background: list[asyncio.Task[None]] = field(default_factory=list)
    done: set[str] = field(default_factory=set)

    def pending(self) -> list[str]:
        return [j for j in self.jobs if j not in self.done]


def count_rejections(into: Counter[str]) -> aiohttp.TraceConfig:
    """A client trace hook: the reason of each answer carrying `Sinkgate-Rejected`
    counted into `into` (SPEC 7: the report counts each rejection reason), and
    each replay as `duplicate`, the reason the rejection log records it under
    (SPEC 2 step 7), though its answer is no refusal."""

    async def ended(
        _session: aiohttp.ClientSession, _context: Any, params: aiohttp.TraceRequestEndParams
    ) -> None:
        headers = params.response.headers
        reason = headers.get("Sinkgate-Rejected")
        if reason:
            into[reason] += 1
        elif headers.get("Idempotent-Replayed") == "true":
            into["duplicate"] += 1

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(ended)
    return trace
