"""One exception root for the gateway and the table of rejection reasons.

Each reason the gateway can answer with has exactly one HTTP status here; the
handlers raise `Rejection` and one place turns it into problem+json.
"""

from __future__ import annotations

from typing import Any

# The store boundary raises the lease module's StoreUnavailable for every driver
# or I/O failure, in both packages; the gateway answers it with 503 and fails closed.
from leases.errors import StoreUnavailable as StoreUnavailable

STATUS_BY_REASON: dict[str, int] = {
    "unknown_destination": 404,
    "method_not_allowed": 405,
    "unauthorized": 401,
    "body_too_large": 413,
    "request_timeout": 408,
    "missing_fencing_token": 400,
    "invalid_fencing_token": 400,
    "missing_idempotency_key": 400,
    "invalid_idempotency_key": 400,
    "invalid_path": 400,
    "invalid_request": 400,
    "lease_not_held": 409,
    "stale_generation": 409,
    "unknown_generation": 409,
    "job_completed": 409,
    "lease_expired": 409,
    "owner_mismatch": 409,
    "lease_held": 409,
    "older_generation_in_flight": 409,
    "idempotency_key_reused": 422,
    "request_in_progress": 409,
    "outcome_unknown": 409,
    "upstream_unreachable": 502,
    "upstream_disconnected": 502,
    "upstream_timeout": 504,
    "store_unavailable": 503,
    "overloaded": 503,
    "not_found": 404,
    "duplicate": 200,
}

TITLE_BY_REASON: dict[str, str] = {
    reason: reason.replace("_", " ").capitalize() for reason in STATUS_BY_REASON
}

# The challenge a 401 carries (RFC 9110 11.6.1): worker and lease API tokens.
WORKER_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="sinkgate"'}

# A URN: stable and ours, and never mistaken for a page someone should fetch.
PROBLEM_TYPE_BASE = "urn:sinkgate:problem:"


class GatewayError(Exception):
    """Root of the errors the gateway raises on purpose."""


class ConfigError(GatewayError):
    """The configuration is invalid; the message names the file and the key."""


class Rejection(GatewayError):
    """An answer the gateway makes itself: problem+json with `Sinkgate-Rejected`."""

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        status: int | None = None,
        retry_after: int | None = None,
        headers: dict[str, str] | None = None,
        **members: Any,
    ) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.status = status if status is not None else STATUS_BY_REASON[reason]
        self.retry_after = retry_after
        self.headers = headers or {}  # ones HTTP requires with the status (Allow, ...)
        self.members = {k: v for k, v in members.items() if v is not None}

    def problem(self) -> dict[str, Any]:
        """The RFC 9457 body."""
        return {
            "type": PROBLEM_TYPE_BASE + self.reason,
            "title": TITLE_BY_REASON.get(self.reason, self.reason),
            "status": self.status,
            "detail": self.detail,
            "reason": self.reason,
            **self.members,
        }
