"""What the operator's verbs of the store take and give (SPEC 4: keys, resolve, audit,
summary), shared by both backends' admin modules (`sqlite_admin`, `postgres_admin`).

The verbs themselves are declared in `OperatorStore` (beside the read-only
`protocol.AdminStore`); `SQLiteStore` and
`PostgresStore` implement them through mixins, apart from the write path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.errors import GatewayError
from gateway.policy.decision import KeyRecord, KeyState

AUDIT_ACTIONS = ("resolve_applied", "resolve_not_applied", "reload")
RESOLVE_OUTCOMES = ("applied", "not_applied")

# A bucket width is picked from these (seconds), the smallest that keeps a window
# within MAX_BUCKETS: round widths make a chart's axis readable.
_BUCKET_WIDTHS = (
    1, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
)  # fmt: skip
MAX_BUCKETS = 200


@dataclass(frozen=True, slots=True)
class KeyQuery:
    """Filters of `GET /admin/keys`; `state` is the effective state."""

    destination: str | None = None
    state: KeyState | None = None
    job_id: str | None = None
    since: float | None = None  # on updated_at
    until: float | None = None
    limit: int = 100
    after: tuple[float, str, str] | None = None  # cursor: (updated_at, destination, key)


@dataclass(frozen=True, slots=True)
class AuditQuery:
    since: float | None = None
    until: float | None = None
    limit: int = 100
    before_id: int | None = None


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """An operator action: one row of the audit log, and (with `at` as RFC 3339)
    an item of `GET /admin/audit` (SPEC 4), whose model `admin.models` derives
    from this one. `operator` is the name whose token made the call (`admin` for
    the shared token), None for a reload by SIGHUP."""

    id: int
    at: float
    action: str
    destination: str | None
    key: str | None
    attempt: str | None
    note: str | None
    remote: str | None
    operator: str | None


@dataclass(frozen=True, slots=True)
class Resolution:
    """An operator's verdict on an unknown outcome, as `resolve_key` applies it.

    `applied`: the key becomes completed with `status`, `body` and `content_type`
    (its retries replay that); otherwise the key is released.
    """

    destination: str
    key: str
    attempt: str
    applied: bool
    note: str
    remote: str | None = None
    operator: str | None = None  # who settled it (SPEC 4 `[admin.operators]`)
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"


class ResolveRefused(GatewayError):
    """The key could not be resolved; `reason` is `not_found`, `key_not_unknown` or
    `attempt_mismatch`, `record` the key as it is (None when there is none)."""

    def __init__(self, reason: str, record: KeyRecord | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.record = record


@dataclass(frozen=True, slots=True)
class Summary:
    """Counts over [since, until] (SPEC 4 `GET /admin/summary`)."""

    since: float
    until: float
    bucket_seconds: int
    first_bucket: float
    by_reason: dict[str, int] = field(default_factory=dict)
    by_destination: dict[str, int] = field(default_factory=dict)
    keys_by_state: dict[str, dict[str, int]] = field(default_factory=dict)
    # bucket index -> reason -> count; buckets without rejections are absent
    series: dict[int, dict[str, int]] = field(default_factory=dict)

    @property
    def bucket_count(self) -> int:
        return max(1, math.ceil((self.until - self.first_bucket) / self.bucket_seconds))


def bucket_width(since: float, until: float) -> tuple[int, float]:
    """(width, start of the first bucket): buckets are aligned to multiples of the
    width, so a chart redrawn a minute later keeps its bars where they were, and
    at most MAX_BUCKETS cover [since, until]."""
    for width in _BUCKET_WIDTHS:
        start = math.floor(since / width) * width
        if math.ceil((until - start) / width) <= MAX_BUCKETS:
            return width, start
    width = math.ceil((until - since) / (MAX_BUCKETS - 1) / 86400) * 86400
    return width, math.floor(since / width) * width


# The first and last second a date can name (0001-01-01, 9999-12-31 UTC), epoch s.
FIRST_DATE_S = -62135596800.0
LAST_DATE_S = 253402300799.0


def summary_fits(since: float, until: float) -> bool:
    """Whether every bucket of the summary of [since, until] starts and ends at a
    date that can be named: buckets are aligned before `since`, and the last one
    ends after `until`."""
    width, start = bucket_width(since, until)
    count = max(1, math.ceil((until - start) / width))
    return start >= FIRST_DATE_S and start + count * width <= LAST_DATE_S


class OperatorStore(Protocol):
    """The operator's verbs of a gateway store. Each is one short transaction."""

    async def list_keys(self, query: KeyQuery) -> list[KeyRecord]:
        """Idempotency records, newest `updated_at` first."""
        ...

    async def resolve_key(self, resolution: Resolution) -> KeyRecord:
        """Settle an unknown outcome and write its audit row, in one transaction.

        Returns the record after the change (`applied`), or as it was when it was
        released (`not_applied`: the key no longer exists); raises
        `ResolveRefused` (nothing changed) unless the key's effective state is
        `unknown` and its attempt is `resolution.attempt` at that instant."""
        ...

    async def record_audit(
        self,
        *,
        action: str,
        destination: str | None = None,
        key: str | None = None,
        attempt: str | None = None,
        note: str | None = None,
        remote: str | None = None,
        operator: str | None = None,
    ) -> int:
        """Append an operator action to the audit log; returns its id."""
        ...

    async def list_audit(self, query: AuditQuery) -> list[AuditEntry]:
        """Audit rows, newest first."""
        ...

    async def summary(self, since: float, until: float) -> Summary:
        """Rejection counts over the window and current key counts."""
        ...

    async def unknown_counts(self) -> dict[str, int]:
        """Keys whose effective state is `unknown`, per destination (indexed: reads
        only in-flight and unknown rows)."""
        ...


def audit_filters(query: AuditQuery) -> tuple[tuple[str, Any], ...]:
    """The audit log's filters (SPEC 4), for `where_set`."""
    return (("at >=", query.since), ("at <=", query.until), ("id <", query.before_id))
