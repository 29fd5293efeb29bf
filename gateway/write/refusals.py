"""Every refusal the write route answers itself, declared once (SPEC 2).

The OpenAPI document lists these (`gateway.openapi.write`), one answer per
status; a test holds the route's modules to them, so a refusal added to the
route without its place here fails before it is left undocumented.
"""

from __future__ import annotations

from leases.model import LOST_REASONS
from leases.reasons import Reason

# (what the refusals of one status mean, the reasons they carry), by status.
REFUSALS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "fencing headers, key or path malformed, or a request the HTTP parser refuses",
        (
            Reason.MISSING_FENCING_TOKEN,
            Reason.INVALID_FENCING_TOKEN,
            Reason.MISSING_IDEMPOTENCY_KEY,
            Reason.INVALID_IDEMPOTENCY_KEY,
            Reason.INVALID_PATH,
            Reason.INVALID_REQUEST,
        ),
    ),
    ("worker token missing or wrong", (Reason.UNAUTHORIZED,)),
    ("unknown destination", (Reason.UNKNOWN_DESTINATION,)),
    ("method not allowed for this destination", (Reason.METHOD_NOT_ALLOWED,)),
    ("the body did not arrive in time", (Reason.REQUEST_TIMEOUT,)),
    (
        "refused by the fence, the barrier or the key's state",
        (
            *LOST_REASONS,
            Reason.OLDER_GENERATION_IN_FLIGHT,
            Reason.REQUEST_IN_PROGRESS,
            Reason.OUTCOME_UNKNOWN,
        ),
    ),
    ("body over the destination's max_body", (Reason.BODY_TOO_LARGE,)),
    ("key reused with another request", (Reason.IDEMPOTENCY_KEY_REUSED,)),
    (
        "the upstream could not be reached or dropped the connection",
        (Reason.UPSTREAM_UNREACHABLE, Reason.UPSTREAM_DISCONNECTED),
    ),
    ("overloaded or the store is down", (Reason.OVERLOADED, Reason.STORE_UNAVAILABLE)),
    ("no upstream answer within the timeout", (Reason.UPSTREAM_TIMEOUT,)),
)
