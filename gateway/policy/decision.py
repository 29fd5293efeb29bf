"""PURE: the write decision of SPEC 2 steps 6 and 7.

(request facts, stored state, now) -> Forward | Replay | Reject. The store reads
the stored state inside one transaction, calls `decide`, and applies the
verdict in the same transaction; this module is the readable statement of the
policy and is tested with plain tables. Standard library and `leases.model` only.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from enum import StrEnum

from leases.model import LeaseRow, hold_refusal
from leases.reasons import Reason

# A reservation outlives its forward's timeout by this much before another
# replica may call it dead (SPEC 2 step 8).
RESERVATION_GRACE_S = 5.0


class Fencing(StrEnum):
    LEASE = "lease"
    MONOTONIC = "monotonic"


class KeyState(StrEnum):
    IN_FLIGHT = "in_flight"
    COMPLETED = "completed"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class WriteFacts:
    """What the gateway knows of one write once its headers are valid."""

    destination: str
    method: str
    path: str  # raw path after /to/{destination}, percent-encoding kept
    query: str
    job_id: str
    generation: int
    owner: str | None
    key: str | None  # None only where the destination does not require one
    fingerprint: str
    fencing: Fencing
    upstream_idempotent: bool
    timeout: float  # the destination's forward timeout, seconds


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """An idempotency record as stored for (destination, key)."""

    destination: str
    key: str
    state: KeyState
    fingerprint: str
    attempt: str
    attempts: int
    job_id: str
    generation: int
    owner: str | None
    created_at: float
    updated_at: float
    deadline: float
    completed_at: float | None = None
    status: int | None = None
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    body_omitted: bool = False

    def state_at(self, now: float) -> KeyState:
        """An in-flight reservation past its deadline belongs to a dead attempt."""
        if self.state is KeyState.IN_FLIGHT and self.deadline <= now:
            return KeyState.UNKNOWN
        return self.state


@dataclass(frozen=True, slots=True)
class StoredState:
    """Everything `decide` needs, read in the deciding transaction."""

    lease: LeaseRow | None
    highest_generation: int | None  # the job's mark: highest generation forwarded
    older_in_flight_until: float | None  # latest deadline of an older generation on the wire
    record: KeyRecord | None


@dataclass(frozen=True, slots=True)
class Forward:
    """Forward the write; `retry_of_unknown` when re-sending an unknown outcome."""

    retry_of_unknown: bool = False


@dataclass(frozen=True, slots=True)
class Replay:
    record: KeyRecord


@dataclass(frozen=True, slots=True)
class Reject:
    reason: str
    detail: str
    current_generation: int | None = None
    highest_generation: int | None = None
    retry_after: int | None = None


Decision = Forward | Replay | Reject


def decide(facts: WriteFacts, state: StoredState, now: float) -> Decision:
    """Steps 6 (fence, barrier) then 7 (idempotency); the first refusal decides."""
    fence = check_fence(facts, state, now)
    if fence is not None:
        return fence
    if state.older_in_flight_until is not None and state.older_in_flight_until > now:
        return Reject(
            Reason.OLDER_GENERATION_IN_FLIGHT,
            DETAILS[Reason.OLDER_GENERATION_IN_FLIGHT],
            current_generation=_current(state),
            highest_generation=state.highest_generation,
            retry_after=retry_after(state.older_in_flight_until - now),
        )
    return check_key(facts, state.record, now)


def check_fence(facts: WriteFacts, state: StoredState, now: float) -> Reject | None:
    mark = state.highest_generation
    if facts.fencing is Fencing.MONOTONIC:
        if mark is not None and facts.generation < mark:
            return Reject(
                Reason.STALE_GENERATION,
                BELOW_ACCEPTED.format(generation=facts.generation, mark=mark),
                highest_generation=mark,
            )
        return None
    lease = state.lease
    refusal = hold_refusal(lease, facts.generation, facts.owner, now)
    if refusal is None:
        if mark is not None and facts.generation < mark:
            # The mark is per job across destinations: a job also written through a
            # monotonic destination with a higher token must never go back here.
            return Reject(
                Reason.STALE_GENERATION,
                BELOW_FORWARDED.format(generation=facts.generation, mark=mark),
                current_generation=lease.generation if lease is not None else None,
                highest_generation=mark,
            )
        return None
    return Reject(
        str(refusal),
        DETAILS[refusal],
        current_generation=None if lease is None else lease.generation,
        highest_generation=mark,
    )


def check_key(facts: WriteFacts, record: KeyRecord | None, now: float) -> Decision:
    if facts.key is None or record is None:
        return Forward()
    if record.fingerprint != facts.fingerprint:
        return Reject(
            Reason.IDEMPOTENCY_KEY_REUSED,
            DETAILS[Reason.IDEMPOTENCY_KEY_REUSED],
        )
    state = record.state_at(now)
    if state is KeyState.COMPLETED:
        return Replay(record)
    if state is KeyState.IN_FLIGHT:
        return Reject(
            Reason.REQUEST_IN_PROGRESS,
            DETAILS[Reason.REQUEST_IN_PROGRESS],
            retry_after=retry_after(record.deadline - now),
        )
    if facts.upstream_idempotent:
        return Forward(retry_of_unknown=True)
    return Reject(
        Reason.OUTCOME_UNKNOWN,
        DETAILS[Reason.OUTCOME_UNKNOWN],
    )


def reservation_deadline(facts: WriteFacts, now: float) -> float:
    return now + facts.timeout + RESERVATION_GRACE_S


def barrier_deadline(facts: WriteFacts, now: float) -> float:
    """An attempt bars newer generations until its answer or its timeout."""
    return now + facts.timeout


def retry_after(seconds: float) -> int:
    return max(1, math.ceil(seconds))


def fingerprint(method: str, path: str, query: str, content_type: str, body_digest: bytes) -> str:
    """Hash of what makes two requests "the same" (not the fencing headers).

    `body_digest` is the body's SHA-256: the gateway hashes each body once and
    uses the digest here and in the rejection log. The media type is compared
    case-insensitively (RFC 9110 8.3.1), its parameters as sent; a value already
    in lower case hashes as it always did.
    """
    media_type, semicolon, parameters = content_type.partition(";")
    content_type = media_type.strip().lower() + semicolon + parameters
    digest = hashlib.sha256()
    for part in (
        method.upper().encode(),
        path.encode(),
        query.encode(),
        content_type.encode(),
        body_digest,
    ):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def _current(state: StoredState) -> int | None:
    return None if state.lease is None else state.lease.generation


# The refusals' details, one text per reason (the PostgreSQL store's server-side
# statement of the policy, `postgres_batch`, is generated from these too).
DETAILS: dict[str, str] = {
    Reason.LEASE_NOT_HELD: "the job has no active lease",
    Reason.STALE_GENERATION: "a newer generation of this job has been claimed",
    Reason.UNKNOWN_GENERATION: "this generation was never issued for the job",
    Reason.JOB_COMPLETED: "the job is completed",
    Reason.LEASE_EXPIRED: "the lease of this generation has expired",
    Reason.OWNER_MISMATCH: "Fencing-Owner does not match the lease owner",
    Reason.OLDER_GENERATION_IN_FLIGHT: (
        "a write of an older generation of this job is still awaiting its upstream answer"
    ),
    Reason.IDEMPOTENCY_KEY_REUSED: "this idempotency key was used with a different request",
    Reason.REQUEST_IN_PROGRESS: "a request with this idempotency key is still in progress",
    Reason.OUTCOME_UNKNOWN: (
        "an earlier attempt with this key may have reached the upstream; its outcome is unknown"
    ),
}
# A stale generation's detail against the job's mark, by fencing mode.
BELOW_ACCEPTED = "generation {generation} is below the highest accepted ({mark})"
BELOW_FORWARDED = "generation {generation} is below the highest forwarded ({mark})"
