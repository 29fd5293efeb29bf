"""The gateway's refusals of a write, as the client sees them: one exception per
family (stale, duplicate, bad, unavailable) built from an answer carrying
`Sinkgate-Rejected` and its problem+json body."""

from __future__ import annotations

import json as jsonlib
import math
from collections.abc import Mapping
from typing import Any

from .reasons import REASONS, Family, Reason, ReasonInfo

__all__ = [
    "BadWrite",
    "DuplicateWrite",
    "GatewayRejected",
    "GatewayUnavailable",
    "StaleWrite",
    "rejection_from_response",
]


class GatewayRejected(Exception):
    """The gateway refused the write itself (the answer carried `Sinkgate-Rejected`).

    Carries the problem+json members callers branch on; `problem` is the whole body.
    """

    def __init__(
        self,
        reason: str,
        status: int | None,
        detail: str = "",
        *,
        job_id: str | None = None,
        generation: int | None = None,
        current_generation: int | None = None,
        highest_generation: int | None = None,
        rejection_id: int | None = None,
        retry_after: float | None = None,
        problem: Mapping[str, Any] | None = None,
    ) -> None:
        said = reason if status is None else f"{status} {reason}"  # None: no answer at all
        super().__init__(f"{said}: {detail}" if detail else said)
        self.reason = reason
        self.status = status
        self.detail = detail
        self.job_id = job_id
        self.generation = generation
        self.current_generation = current_generation
        self.highest_generation = highest_generation
        self.rejection_id = rejection_id
        self.retry_after = retry_after
        self.problem: Mapping[str, Any] = problem or {}


class StaleWrite(GatewayRejected):
    """The write's lease is not the job's current one: stop, another worker has it."""


class DuplicateWrite(GatewayRejected):
    """The key is taken: reused with another payload, in flight, of unknown outcome,
    or an older generation of the job is still on the wire."""


class BadWrite(GatewayRejected):
    """The request itself is wrong (route, method, auth, size, headers, path)."""


class GatewayUnavailable(GatewayRejected):
    """The gateway, its store or the upstream could not be reached; the write may be
    retried with the same key (the gateway keeps at most one effect per key)."""


# Reasons the client itself reports when it cannot reach the gateway at all.
GATEWAY_UNREACHABLE = "gateway_unreachable"


GATEWAY_TIMEOUT = "gateway_timeout"


def _family_of(reason: Reason, info: ReasonInfo) -> type[GatewayRejected] | None:
    if info.family is Family.FENCE:
        # a fence refusal is final for this lease; the barrier is "not yet"
        return DuplicateWrite if info.retry_later else StaleWrite
    if info.family is Family.IDEMPOTENCY:
        return None if reason is Reason.DUPLICATE else DuplicateWrite
    if info.family in (Family.UPSTREAM, Family.GATEWAY) and reason is not Reason.INTERNAL_ERROR:
        return GatewayUnavailable
    return None  # request-shape reasons (and internal_error) are classified by status


_FAMILY: dict[str, type[GatewayRejected]] = {
    **{
        reason: family
        for reason, info in REASONS.items()
        if reason is not Reason.LEASE_HELD and (family := _family_of(reason, info)) is not None
    },
    GATEWAY_UNREACHABLE: GatewayUnavailable,
    GATEWAY_TIMEOUT: GatewayUnavailable,
}


def rejection_from_response(
    status: int, headers: Mapping[str, str], body: bytes
) -> GatewayRejected:
    """The typed exception for a gateway answer carrying `Sinkgate-Rejected`."""
    try:
        problem = jsonlib.loads(body)
    except (ValueError, RecursionError):
        problem = None
    if not isinstance(problem, dict):
        problem = {}
    reason = headers.get("Sinkgate-Rejected") or _str(problem.get("reason")) or "unknown"
    family = _FAMILY.get(reason)
    if family is None:  # a reason newer than this client: classify by status
        family = GatewayUnavailable if status >= 500 else BadWrite
    return family(
        reason,
        status,
        _str(problem.get("detail")) or "",
        job_id=_str(problem.get("job_id")),
        generation=_int(problem.get("generation")),
        current_generation=_int(problem.get("current_generation")),
        highest_generation=_int(problem.get("highest_generation")),
        rejection_id=_int(problem.get("rejection_id")),
        retry_after=_retry_after(headers.get("Retry-After")),
        problem=problem,
    )


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _retry_after(value: str | None) -> float | None:
    """Delta-seconds only; an HTTP-date falls back to the writer's own backoff."""
    if value is None or not (value.strip().isascii() and value.strip().isdigit()):
        return None
    seconds = float(value.strip())
    return seconds if math.isfinite(seconds) else None
