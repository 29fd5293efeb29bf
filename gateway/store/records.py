"""What goes in and out of the gateway's store: records, queries, row shapes, attempt ids.

Shared by the role protocols (`protocol`) and both backends (`sqlite`, `postgres`),
so that the two backends read and write the same columns in the same order.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.policy.decision import Decision, KeyRecord, KeyState, Reject, Replay, WriteFacts
from leases.model import LeaseRow
from leases.reasons import Reason

Clock = Callable[[], float]


class AttemptIds:
    """Ids for forward attempts: 32 hex digits, unique across processes and restarts.

    A random 64-bit prefix per process, then a counter. Cheaper than `uuid4()`
    (which was 7 % of the SQLite thread's time under load), and consecutive ids
    land next to each other in the attempts table's key index. A forked child
    draws its own prefix, so parent and child never hand out the same id.
    """

    def __init__(self) -> None:
        self._reseed()
        os.register_at_fork(after_in_child=self._reseed)

    def _reseed(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count(1)

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._counter):016x}"


new_attempt_id = AttemptIds()


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


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of a forwarded attempt (SPEC 2 step 8).

    kind: "completed" (store status/headers/body with the key), "released" (the
    request could not have been sent, or the status is retryable: the key is
    freed) or "unknown" (it may have reached the upstream).
    """

    kind: str
    status: int | None = None
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    body_omitted: bool = False


@dataclass(frozen=True, slots=True)
class RejectionQuery:
    destination: str | None = None
    job_id: str | None = None
    reason: str | None = None
    since: float | None = None
    until: float | None = None
    limit: int = 100
    before_id: int | None = None  # cursor: only ids below this one


@dataclass(frozen=True, slots=True)
class StoredRejection:
    id: int
    at: float
    record: RejectionRecord


@dataclass(frozen=True, slots=True)
class JobState:
    job_id: str
    lease: LeaseRow | None
    highest_generation: int | None
    in_flight: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    recent_rejections: tuple[StoredRejection, ...] = field(default_factory=tuple)


# --- row shapes shared by the backends: same columns, same order ----------------------

KEY_COLUMNS = (
    "destination", "key", "state", "fingerprint", "attempt", "attempts", "job_id",
    "generation", "owner", "created_at", "updated_at", "deadline", "completed_at", "status",
    "headers", "body", "body_omitted",
)  # fmt: skip
KEY_COLUMNS_SQL = ", ".join(KEY_COLUMNS)
REJECTION_FIELDS = tuple(RejectionRecord.__dataclass_fields__)
REJECTION_COLUMNS_SQL = ", ".join(REJECTION_FIELDS)


def key_record(values: Sequence[Any]) -> KeyRecord:
    """A KeyRecord from the values of `KEY_COLUMNS`, in that order (headers as JSON)."""
    row = dict(zip(KEY_COLUMNS, values, strict=True))  # the names are KeyRecord's fields
    headers = row["headers"]
    row.update(
        state=KeyState(row["state"]),
        headers=tuple((str(n), str(v)) for n, v in json.loads(headers)) if headers else (),
        body=bytes(row["body"] or b""),
        body_omitted=bool(row["body_omitted"]),
    )
    return KeyRecord(**row)


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
        return RejectionRecord(
            reason=Reason.DUPLICATE, detail="replayed the stored response", **common
        )
    return RejectionRecord(
        reason=decision.reason,
        detail=decision.detail,
        current_generation=decision.current_generation,
        highest_generation=decision.highest_generation,
        **common,
    )


def rejection_values(record: RejectionRecord) -> list[Any]:
    return [getattr(record, name) for name in REJECTION_FIELDS]


def where_set(conditions: Sequence[tuple[str, Any]], *, numbered: bool) -> tuple[str, list[Any]]:
    """`WHERE a = ? AND b >= ? ` for the conditions whose value is set (`"a ="`,
    value), and those values in order; `numbered` writes PostgreSQL's `$1, $2, ...`.
    The one filter builder of the admin listings, on both backends."""
    clauses: list[str] = []
    params: list[Any] = []
    for condition, value in conditions:
        if value is not None:
            params.append(value)
            clauses.append(f"{condition} ${len(params)}" if numbered else f"{condition} ?")
    return (f"WHERE {' AND '.join(clauses)} " if clauses else ""), params


def rejection_filters(query: RejectionQuery) -> tuple[tuple[str, Any], ...]:
    """The rejection log's filters (SPEC 4), for `where_set`."""
    return (
        ("destination =", query.destination),
        ("job_id =", query.job_id),
        ("reason =", query.reason),
        ("at >=", query.since),
        ("at <=", query.until),
        ("id <", query.before_id),
    )
