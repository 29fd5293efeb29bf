"""Every reason code of the contract, once: status, family, title, whether it is logged.

The gateway's answers (problem+json `reason`, `Sinkgate-Rejected`), the lease API's
refusals, the rejection log and the worker-side exceptions all speak these codes.
The table lives in `leases` because both packages need it and `leases` never
imports `gateway`; everything else derives from it: the gateway's status table,
the OpenAPI lists, the admin page's reason menu and colours, the fenced writer's
exception families and the lease model's refusal order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Reason(StrEnum):
    """Reason codes of the contract (SPEC 2, 3 and 4), shared by every part."""

    # SPEC 2 steps 1-5 and the request edge
    UNKNOWN_DESTINATION = "unknown_destination"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNAUTHORIZED = "unauthorized"
    BODY_TOO_LARGE = "body_too_large"
    REQUEST_TIMEOUT = "request_timeout"
    MISSING_FENCING_TOKEN = "missing_fencing_token"
    INVALID_FENCING_TOKEN = "invalid_fencing_token"
    MISSING_IDEMPOTENCY_KEY = "missing_idempotency_key"
    INVALID_IDEMPOTENCY_KEY = "invalid_idempotency_key"
    INVALID_PATH = "invalid_path"
    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    INVALID_CONFIG = "invalid_config"
    # SPEC 2 step 6: the fence, in the contract's order, and the barrier
    LEASE_NOT_HELD = "lease_not_held"
    STALE_GENERATION = "stale_generation"
    UNKNOWN_GENERATION = "unknown_generation"
    JOB_COMPLETED = "job_completed"
    LEASE_EXPIRED = "lease_expired"
    OWNER_MISMATCH = "owner_mismatch"
    LEASE_HELD = "lease_held"
    OLDER_GENERATION_IN_FLIGHT = "older_generation_in_flight"
    # SPEC 2 step 7: idempotency
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
    REQUEST_IN_PROGRESS = "request_in_progress"
    OUTCOME_UNKNOWN = "outcome_unknown"
    DUPLICATE = "duplicate"
    # SPEC 4: an operator's resolve of an unknown outcome
    KEY_NOT_UNKNOWN = "key_not_unknown"
    ATTEMPT_MISMATCH = "attempt_mismatch"
    # SPEC 2 step 8: the forward
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UPSTREAM_DISCONNECTED = "upstream_disconnected"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    # the gateway itself
    STORE_UNAVAILABLE = "store_unavailable"
    OVERLOADED = "overloaded"
    INTERNAL_ERROR = "internal_error"


class Family(StrEnum):
    """What a reason is about: where in SPEC 2's order it is decided."""

    REQUEST = "request"  # the request's shape, steps 1-5
    FENCE = "fence"  # the lease or the highest generation, step 6
    IDEMPOTENCY = "idempotency"  # the key's record, step 7
    UPSTREAM = "upstream"  # the forward, step 8
    GATEWAY = "gateway"  # the gateway or its store could not decide


@dataclass(frozen=True, slots=True)
class ReasonInfo:
    """One row of the table.

    recorded: a write refused for it is kept in the rejection log (SPEC 2: steps
    5-7 and `unauthorized`; `duplicate` is the replay's entry). retry_later: the
    answer carries `Retry-After` and the same write may succeed later.
    """

    status: int
    family: Family
    recorded: bool = False
    retry_later: bool = False


R, F = Reason, Family

REASONS: dict[Reason, ReasonInfo] = {
    R.UNKNOWN_DESTINATION: ReasonInfo(404, F.REQUEST),
    R.METHOD_NOT_ALLOWED: ReasonInfo(405, F.REQUEST),
    R.UNAUTHORIZED: ReasonInfo(401, F.REQUEST, recorded=True),
    R.BODY_TOO_LARGE: ReasonInfo(413, F.REQUEST),  # step 4: before the request is known
    R.REQUEST_TIMEOUT: ReasonInfo(408, F.REQUEST),
    R.MISSING_FENCING_TOKEN: ReasonInfo(400, F.REQUEST, recorded=True),
    R.INVALID_FENCING_TOKEN: ReasonInfo(400, F.REQUEST, recorded=True),
    R.MISSING_IDEMPOTENCY_KEY: ReasonInfo(400, F.REQUEST, recorded=True),
    R.INVALID_IDEMPOTENCY_KEY: ReasonInfo(400, F.REQUEST, recorded=True),
    R.INVALID_PATH: ReasonInfo(400, F.REQUEST),
    R.INVALID_REQUEST: ReasonInfo(400, F.REQUEST),
    R.NOT_FOUND: ReasonInfo(404, F.REQUEST),
    R.INVALID_CONFIG: ReasonInfo(400, F.REQUEST),  # a reload whose files do not validate
    R.LEASE_NOT_HELD: ReasonInfo(409, F.FENCE, recorded=True),
    R.STALE_GENERATION: ReasonInfo(409, F.FENCE, recorded=True),
    R.UNKNOWN_GENERATION: ReasonInfo(409, F.FENCE, recorded=True),
    R.JOB_COMPLETED: ReasonInfo(409, F.FENCE, recorded=True),
    R.LEASE_EXPIRED: ReasonInfo(409, F.FENCE, recorded=True),
    R.OWNER_MISMATCH: ReasonInfo(409, F.FENCE, recorded=True),
    R.LEASE_HELD: ReasonInfo(409, F.FENCE, retry_later=True),
    R.OLDER_GENERATION_IN_FLIGHT: ReasonInfo(409, F.FENCE, recorded=True, retry_later=True),
    R.IDEMPOTENCY_KEY_REUSED: ReasonInfo(422, F.IDEMPOTENCY, recorded=True),
    R.REQUEST_IN_PROGRESS: ReasonInfo(409, F.IDEMPOTENCY, recorded=True, retry_later=True),
    R.OUTCOME_UNKNOWN: ReasonInfo(409, F.IDEMPOTENCY, recorded=True),
    R.DUPLICATE: ReasonInfo(200, F.IDEMPOTENCY, recorded=True),
    R.KEY_NOT_UNKNOWN: ReasonInfo(409, F.IDEMPOTENCY),
    R.ATTEMPT_MISMATCH: ReasonInfo(409, F.IDEMPOTENCY),
    R.UPSTREAM_UNREACHABLE: ReasonInfo(502, F.UPSTREAM),
    R.UPSTREAM_DISCONNECTED: ReasonInfo(502, F.UPSTREAM),
    R.UPSTREAM_TIMEOUT: ReasonInfo(504, F.UPSTREAM),
    R.STORE_UNAVAILABLE: ReasonInfo(503, F.GATEWAY, retry_later=True),
    R.OVERLOADED: ReasonInfo(503, F.GATEWAY, retry_later=True),
    R.INTERNAL_ERROR: ReasonInfo(500, F.GATEWAY),
}

del R, F

# What renew/complete/release (and a lease-mode fence) can be refused for, in
# the contract's order (SPEC 2 step 6).
LOST_REASONS: tuple[Reason, ...] = tuple(
    r
    for r, info in REASONS.items()
    if info.family is Family.FENCE and info.recorded and not info.retry_later
)

# A write refused for one of these never reaches the store, and is in no
# rejection-log row (steps 1-4 of SPEC 2: the request's own shape).
BEFORE_THE_FENCE: tuple[Reason, ...] = tuple(
    r for r, info in REASONS.items() if info.family is Family.REQUEST and not info.recorded
)

# Reasons a rejection-log row can carry, in the order of SPEC 2's checks.
RECORDED_REASONS: tuple[Reason, ...] = tuple(r for r, info in REASONS.items() if info.recorded)


def title_of(reason: str) -> str:
    """The problem+json `title` of a reason: its words, capitalised."""
    return reason.replace("_", " ").capitalize()


def status_of(reason: str) -> int:
    """The HTTP status the gateway answers `reason` with."""
    return REASONS[Reason(reason)].status
