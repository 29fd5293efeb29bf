"""The JSON shapes of the main listener: problem+json, health, the lease API.

Each is declared once, here; the handlers build their answers (and parse the
lease API's request bodies) from these models, and `openapi` documents them with
`schema.Components`. The admin API's shapes are in `gateway.admin.models`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, ClassVar, Literal

from gateway.errors import STATUS_BY_REASON
from gateway.http.schema import Check, Meta, absent
from leases.model import (
    IDENT,
    MAX_GENERATION,
    TTL_MAX,
    TTL_MIN,
    State,
    validate_generation,
    validate_ident,
    validate_ttl,
)
from leases.reasons import Reason

IDENT_PATTERN = f"^{IDENT.pattern}$"

# Every reason a gateway answer can carry (a replay is not an error).
PROBLEM_REASONS = tuple(sorted(set(STATUS_BY_REASON) - {Reason.DUPLICATE}))

# What a lease request's field is documented as (Meta) and read with (Check), on one
# line each: the check enforces exactly the bounds the document states.
Ident = Annotated[str, Meta(pattern=IDENT_PATTERN), Check(validate_ident)]
Generation = Annotated[int, Meta(minimum=1, maximum=MAX_GENERATION), Check(validate_generation)]
Time = Annotated[str, Meta(format="date-time")]
Ttl = Annotated[
    float, Meta(minimum=TTL_MIN, maximum=TTL_MAX), Check(lambda value, _: validate_ttl(value))
]
Seconds = Annotated[float, Meta(minimum=0)]
LeaseState = Annotated[str, Meta(enum=tuple(s.value for s in State))]


def rfc3339(moment: datetime) -> str:
    """`2026-11-30T13:45:00.123456Z`: UTC, always six fractional digits."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True, slots=True)
class Problem:
    """RFC 9457 problem details; every error the gateway makes itself.

    The body `gateway.errors.Rejection.problem()` builds: the five members every
    problem has, then the members its rejection carries (only those it has)."""

    open_ended: ClassVar[bool] = True

    type: Annotated[str, Meta(format="uri")]
    title: str
    status: Annotated[int, Meta(minimum=400, maximum=599)]
    detail: str
    reason: Annotated[str, Meta(enum=PROBLEM_REASONS)]
    destination: str | None = absent()
    job_id: str | None = absent()
    owner: str | None = absent()
    generation: int | None = absent()
    current_generation: int | None = absent()
    highest_generation: int | None = absent()
    rejection_id: int | None = absent()
    expires_in: Seconds | None = absent()
    field: str | None = absent()
    attempt: str | None = absent()
    state: str | None = absent()
    errors: list[str] | None = absent()


@dataclass(frozen=True, slots=True)
class Status:
    """The answer of `/healthz` and `/readyz`."""

    status: Literal["ok"]


OK = Status("ok")


# --- the lease API (SPEC 3) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lease:
    """The lease object of SPEC 3."""

    job_id: Ident
    owner: Ident
    generation: Generation
    state: LeaseState
    lease_until: Time
    expires_in: Seconds
    server_time: Time


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """The body of `POST /leases/{job_id}/claim`."""

    owner: Ident
    ttl: Ttl


@dataclass(frozen=True, slots=True)
class RenewRequest:
    """The body of `POST /leases/{job_id}/renew`; without `ttl` the lease keeps the
    ttl it was claimed (or last renewed) with. A null `ttl` is not a number: 400."""

    owner: Ident
    generation: Generation
    ttl: Ttl | None = absent()


@dataclass(frozen=True, slots=True)
class HeldRequest:
    """The body of `complete` and `release`: the lease the caller holds."""

    owner: Ident
    generation: Generation


LeaseRequest = ClaimRequest | RenewRequest | HeldRequest
