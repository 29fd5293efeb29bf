"""PURE: the records of a decided write, shared by the policy, the stores and the write route.

The rejection-log row (`RejectionRecord`) and how a decision becomes one
(`rejection_record`), the request facts recorded with it (`WriteContext`), the
decision as applied (`Verdict`) and what became of a forwarded attempt (`Outcome`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gateway.policy.decision import Decision, Reject, Replay, WriteFacts
from leases.reasons import Reason

# The rejection-log detail of a replay (recorded as `duplicate`).
REPLAYED = "replayed the stored response"


@dataclass(frozen=True, slots=True)
class RejectionRecord:
    """One row of the rejection log (SPEC 4 item fields, minus id and at)."""

    reason: str
    detail: str
    destination: str | None = None
    method: str | None = None
    path: str | None = None
    job_id: str | None = None
    generation: int | None = None
    owner: str | None = None
    idempotency_key: str | None = None
    current_generation: int | None = None
    highest_generation: int | None = None
    remote: str | None = None
    body_sha256: str | None = None
    body_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class WriteContext:
    """Request facts recorded with a rejection, beyond the decision's own facts."""

    remote: str | None
    body_sha256: str
    body_bytes: int


@dataclass(frozen=True, slots=True)
class Verdict:
    """The decision of one write, applied in the store.

    `attempt` is set when the write is to be forwarded (the reservation's id);
    `rejection_id` when the decision was recorded in the rejection log (a
    rejection, or a replay recorded as `duplicate`).
    """

    decision: Decision
    attempt: str | None = None
    rejection_id: int | None = None


class OutcomeKind(StrEnum):
    """What became of a forwarded attempt (SPEC 2 step 8), as the key keeps it."""

    COMPLETED = "completed"  # the answer is the key's: status, headers, body stored
    RELEASED = "released"  # not sent, or a retryable status: the key is freed
    UNKNOWN = "unknown"  # it may have reached the upstream: an operator settles it


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of a forwarded attempt (SPEC 2 step 8); see `OutcomeKind`.
    Only a `completed` outcome carries the answer kept for replays."""

    kind: OutcomeKind
    status: int | None = None
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    body_omitted: bool = False


def rejection_record(
    facts: WriteFacts, context: WriteContext, decision: Replay | Reject
) -> RejectionRecord:
    """The rejection-log row of a write the store refused or replayed (`duplicate`)."""
    common: dict[str, Any] = {
        "destination": facts.destination,
        "method": facts.method,
        "path": facts.path + (f"?{facts.query}" if facts.query else ""),
        "job_id": facts.job_id,
        "generation": facts.generation,
        "owner": facts.owner,
        "idempotency_key": facts.key,
        "remote": context.remote,
        "body_sha256": context.body_sha256,
        "body_bytes": context.body_bytes,
    }
    if isinstance(decision, Replay):
        return RejectionRecord(reason=Reason.DUPLICATE, detail=REPLAYED, **common)
    return RejectionRecord(
        reason=decision.reason,
        detail=decision.detail,
        current_generation=decision.current_generation,
        highest_generation=decision.highest_generation,
        **common,
    )
