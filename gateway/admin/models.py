"""The JSON shapes of the admin API (SPEC 4), each declared once.

The resource modules (`rejections`, `keys`, `jobs`, `audit`) build their answers
from these models (the pages read the same dicts), and `gateway.openapi.document`
documents them; the resolve route takes the fields `ResolveRequest` declares.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from gateway.http.models import IDENT_PATTERN, LeaseState, Seconds, Time
from gateway.http.schema import Meta
from gateway.policy.decision import KeyState
from gateway.store import admin_records
from gateway.store.admin_records import AUDIT_ACTIONS, MAX_BUCKETS, RESOLVE_OUTCOMES

NOTE_MAX = 1000
# A media type as a header carries it (RFC 9110 8.3.1): type/subtype, then any
# parameters; at most 255 characters.
CONTENT_TYPE = (
    r"(?=[\x20-\x7e]{3,255}$)[!#$%&'*+.^_`|~0-9A-Za-z-]+/[!#$%&'*+.^_`|~0-9A-Za-z-]+"
    r"(?:[ \t]*;[\x20-\x7e]*)?"
)

Count = Annotated[int, Meta(minimum=0)]
Counts = dict[str, Count]
Cursor = str | None  # None on the last page
Header = Annotated[list[str], Meta(description="[name, value]", min_items=2, max_items=2)]


@dataclass(frozen=True, slots=True)
class Rejection:
    """A rejected write, field for field (SPEC 4)."""

    id: int
    at: Time
    destination: str | None
    method: str | None
    path: str | None
    job_id: str | None
    generation: int | None
    owner: str | None
    idempotency_key: str | None
    reason: str
    detail: str | None
    current_generation: int | None
    highest_generation: int | None
    remote: str | None
    body_sha256: str | None
    body_bytes: int | None


@dataclass(frozen=True, slots=True)
class RejectionPage:
    items: list[Rejection]
    next_cursor: Cursor


@dataclass(frozen=True, slots=True)
class JobLease:
    """The job's lease as the store holds it."""

    job_id: str
    owner: str
    generation: int
    state: LeaseState
    lease_until: Time
    expires_in: Seconds


@dataclass(frozen=True, slots=True)
class InFlightAttempt:
    """An attempt of the job whose write is on the wire."""

    attempt: str | None
    generation: int | None
    destination: str | None
    key: str | None
    started_at: Time | None
    deadline: Time | None


@dataclass(frozen=True, slots=True)
class JobState:
    """The lease and fence state of a job."""

    job_id: str
    server_time: Time
    lease: JobLease | None
    highest_generation: int | None
    in_flight: list[InFlightAttempt]
    recent_rejections: list[Rejection]


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """An idempotency record without its stored body: its size and hash say whether
    two replays match."""

    destination: str
    key: str
    state: KeyState
    fingerprint: str
    attempt: Annotated[str, Meta(description="the id of the attempt that holds it")]
    status: int | None
    attempts: int
    job_id: str
    generation: int
    owner: str | None
    created_at: Time
    updated_at: Time
    completed_at: Time | None
    deadline: Time
    response_headers: list[Header]
    body_bytes: Count
    body_sha256: str | None
    body_omitted: bool


@dataclass(frozen=True)
class ResolvedKey(KeyRecord):
    """The key after the change; a released key is shown as it was."""

    state: Literal["completed", "released"]  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class KeyPage:
    items: list[KeyRecord]
    next_cursor: Cursor


@dataclass(frozen=True, slots=True)
class ResolveRequest:
    """The body of `POST /admin/keys/{destination}/{key}/resolve`; status, body and
    content_type (the answer to store) only go with `applied`, and a status of 204,
    205 or 304 only with an empty body (such an answer has no content)."""

    outcome: Annotated[str, Meta(enum=RESOLVE_OUTCOMES)]
    attempt: Annotated[str, Meta(pattern=IDENT_PATTERN)]
    note: Annotated[str, Meta(min_length=1, max_length=NOTE_MAX, pattern="\\S")]
    status: Annotated[int, Meta(minimum=200, maximum=599)] = 200
    body: str = ""
    content_type: Annotated[str, Meta(pattern=f"^{CONTENT_TYPE}$")] = "application/json"


def _as_json(record: type, doc: str, **types: Any) -> type:
    """A model with `record`'s fields, in order, some given another type (a time
    in epoch seconds as RFC 3339): the record is declared once, its JSON with it."""
    hints = typing.get_type_hints(record, include_extras=True)
    members = [(f.name, types.get(f.name, hints[f.name])) for f in dataclasses.fields(record)]
    model = dataclasses.make_dataclass(record.__name__, members, frozen=True, slots=True)
    model.__doc__ = doc
    return model


AuditEntry = _as_json(
    admin_records.AuditEntry,
    "An operator action; `operator` names whose token made the call.",
    at=Time,
    action=Annotated[str, Meta(enum=AUDIT_ACTIONS)],
)


@dataclass(frozen=True, slots=True)
class AuditPage:
    items: list[AuditEntry]  # type: ignore[valid-type]  # derived above
    next_cursor: Cursor


@dataclass(frozen=True, slots=True)
class SummaryBucket:
    at: Time
    counts: Counts


@dataclass(frozen=True, slots=True)
class SummarySeries:
    """Every bucket of the window, empty ones included, oldest first."""

    bucket_seconds: Annotated[int, Meta(minimum=1)]
    buckets: Annotated[list[SummaryBucket], Meta(max_items=MAX_BUCKETS)]


@dataclass(frozen=True, slots=True)
class Summary:
    """Rejection counts over a window, keys by state, a time series."""

    since: Time
    until: Time
    rejections_by_reason: Counts
    rejections_by_destination: Counts
    keys_by_state: dict[str, Counts]
    bucket_seconds: Annotated[int, Meta(minimum=1)]
    series: SummarySeries


@dataclass(frozen=True, slots=True)
class ReloadAnswer:
    """The answer of `POST /admin/reload`: the destinations now served."""

    reloaded: Literal[True]
    destinations: list[str]
