"""The lease protocol as pure functions: stored row + request + now -> verdict.

Nothing here does I/O or reads a clock. Every backend (SQLite, PostgreSQL) reads
the row inside its own transaction, asks these functions, and writes the result;
the pure functions are the readable statement of the policy, and the tests pin
them down with plain tables.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from .reasons import LOST_REASONS as LOST_REASONS
from .reasons import Reason as Reason

TTL_MIN = 0.05
TTL_MAX = 86400.0
MAX_GENERATION = 2**63 - 1

# Visible ASCII (RFC 9110 tokens, header values without spaces): keys, tokens,
# owners; IDENT adds the 1-256 length of job ids and owners (SPEC 2 step 5).
VISIBLE = re.compile(r"[\x21-\x7e]+")
IDENT = re.compile(r"[\x21-\x7e]{1,256}")
# An Idempotency-Key (SPEC 2 step 5; the gateway also takes it quoted).
MAX_KEY_LENGTH = 255
KEY = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_LENGTH}}}")
# A Fencing-Token: a decimal generation, no sign or leading zero, at most 19
# digits; `generation_of` also holds it to MAX_GENERATION (SPEC 2 step 5).
TOKEN = re.compile(r"[1-9][0-9]{0,18}")


def generation_of(token: str) -> int | None:
    """The generation a Fencing-Token names, if it is a valid one; else None."""
    if not TOKEN.fullmatch(token):
        return None
    generation = int(token)
    return generation if generation <= MAX_GENERATION else None


class State(StrEnum):
    FREE = "free"
    ACTIVE = "active"
    DONE = "done"


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """A lease as the store keeps it; `lease_until` is seconds since the epoch."""

    job_id: str
    owner: str
    generation: int
    state: State
    lease_until: float
    ttl: float


@dataclass(frozen=True, slots=True)
class LeaseRef:
    """Which lease a renew/complete/release names: the job, its owner, its generation.

    Everything else is decided by the stored row, never by what the caller
    claims it holds; a `Lease` is also accepted wherever a `LeaseRef` is.
    """

    job_id: str
    owner: str
    generation: int


@dataclass(frozen=True, slots=True)
class Lease:
    """An immutable view of a lease as of the store's `now`."""

    job_id: str
    owner: str
    generation: int
    state: str
    lease_until: datetime
    expires_in: float

    @classmethod
    def from_row(cls, row: LeaseRow, now: float) -> Lease:
        return cls(
            job_id=row.job_id,
            owner=row.owner,
            generation=row.generation,
            state=str(row.state),
            lease_until=datetime.fromtimestamp(row.lease_until, UTC),
            expires_in=expires_in(row, now),
        )


def expires_in(row: LeaseRow, now: float) -> float:
    """Seconds the lease has left by the store's clock; 0 once expired or not active."""
    if row.state is not State.ACTIVE:
        return 0.0
    return max(0.0, round(row.lease_until - now, 6))


# --- argument validation -------------------------------------------------------------


def validate_ident(value: object, what: str) -> str:
    """A job or owner id: 1-256 visible ASCII characters (0x21-0x7E)."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, not {type(value).__name__}")
    if not IDENT.fullmatch(value):
        raise ValueError(f"{what} must be 1-256 visible ASCII characters (0x21-0x7E)")
    return value


def validate_seconds(name: str, value: object) -> float:
    """A duration argument in seconds: a real number above 0 and finite (an int
    past the floats' range counts as infinite)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a positive number of seconds")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if not 0 < seconds < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds")
    return seconds


def validate_ttl(value: object) -> float:
    """A ttl in seconds: a real number from 0.05 to 86400."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"ttl must be a number of seconds, not {type(value).__name__}")
    try:
        ttl = float(value)
    except OverflowError:  # an int past the floats' range: out of range all the same
        ttl = math.inf
    if not math.isfinite(ttl) or not TTL_MIN <= ttl <= TTL_MAX:
        raise ValueError(f"ttl must be between {TTL_MIN} and {TTL_MAX:g} seconds")
    return ttl


def validate_generation(value: object, name: str = "generation") -> int:
    """A generation (or a fencing token, named `name`): an int, not a bool, from 1
    to 2**63-1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, not {type(value).__name__}")
    if not 1 <= value <= MAX_GENERATION:
        raise ValueError(f"{name} must be between 1 and 2**63-1")
    return value


def lease_fields(lease: object) -> tuple[str, str, int]:
    """(job_id, owner, generation) of a `Lease` or `LeaseRef` passed to renew/complete/release."""
    if not isinstance(lease, Lease | LeaseRef):
        raise ValueError(f"expected a Lease, not {type(lease).__name__}")
    return (
        validate_ident(lease.job_id, "job_id"),
        validate_ident(lease.owner, "owner"),
        validate_generation(lease.generation),
    )


def default_owner() -> str:
    """An owner id unique to this process lifetime: host, pid and a random part.

    A restarted worker gets a new id and so never inherits its old leases.
    """
    host = re.sub(r"[^\x21-\x7e]", "_", socket.gethostname())[:64] or "host"
    return f"{host}:{os.getpid()}:{secrets.token_hex(4)}"


# --- transitions ---------------------------------------------------------------------


def claim_refusal(row: LeaseRow | None, now: float) -> Reason | None:
    """Why a claim must be refused, or None when the job may be claimed now.

    Claimable: never seen, `free`, or `active` with its lease expired by `now`.
    """
    if row is None or row.state is State.FREE:
        return None
    if row.state is State.DONE:
        return Reason.JOB_COMPLETED
    if row.lease_until <= now:
        return None
    return Reason.LEASE_HELD


def hold_refusal(
    row: LeaseRow | None, generation: int, owner: str | None, now: float
) -> Reason | None:
    """Why (owner, generation) does not hold the lease at `now`, or None if it does.

    The order is the contract's (SPEC 2 step 6); renew, complete, release and the
    gateway's lease-mode fence all use it. `owner=None` skips the owner check
    (a write without `Fencing-Owner`).
    """
    if row is None:
        return Reason.LEASE_NOT_HELD
    if generation < row.generation:
        return Reason.STALE_GENERATION
    if generation > row.generation:
        return Reason.UNKNOWN_GENERATION
    if row.state is State.DONE:
        return Reason.JOB_COMPLETED
    if row.state is State.FREE:
        return Reason.LEASE_NOT_HELD
    if row.lease_until <= now:
        return Reason.LEASE_EXPIRED
    if owner is not None and owner != row.owner:
        return Reason.OWNER_MISMATCH
    return None


def claimed(row: LeaseRow | None, job_id: str, owner: str, ttl: float, now: float) -> LeaseRow:
    """The row after a successful claim: the generation is bumped by one."""
    generation = 1 if row is None else row.generation + 1
    return LeaseRow(job_id, owner, generation, State.ACTIVE, now + ttl, ttl)


def held_row(
    current: LeaseRow | None, op: str, generation: int, owner: str, ttl: float | None, now: float
) -> LeaseRow | Reason:
    """The row after renew/complete/release, or the reason it is refused.

    A renewal without a ttl extends by the ttl stored on the row.
    """
    refusal = hold_refusal(current, generation, owner, now)
    if refusal is not None:
        return refusal
    assert current is not None
    if op == "renew":
        return renewed(current, current.ttl if ttl is None else ttl, now)
    if op == "complete":
        return completed(current, now)
    if op == "release":
        return released(current, now)
    raise ValueError(f"unknown lease operation {op!r}")


def renewed(row: LeaseRow, ttl: float, now: float) -> LeaseRow:
    return LeaseRow(row.job_id, row.owner, row.generation, State.ACTIVE, now + ttl, ttl)


def completed(row: LeaseRow, now: float) -> LeaseRow:
    return LeaseRow(row.job_id, row.owner, row.generation, State.DONE, now, row.ttl)


def released(row: LeaseRow, now: float) -> LeaseRow:
    return LeaseRow(row.job_id, row.owner, row.generation, State.FREE, now, row.ttl)
