"""What goes in and out of the gateway's store: records, queries, row shapes, attempt ids.

Shared by the role protocols (`protocol`) and both backends (`sqlite`, `postgres`),
so that the two backends read and write the same columns in the same order.
"""

from __future__ import annotations

import itertools
import json
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.policy.decision import KeyRecord, KeyState
from gateway.policy.records import RejectionRecord
from leases.model import LeaseRow

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


_REJECTION_VALUES = operator.attrgetter(*REJECTION_FIELDS)


def rejection_values(record: RejectionRecord) -> tuple[Any, ...]:
    """The row's values in `REJECTION_FIELDS`' order (one C call: a woken key's
    group inserts a row for each of its writes in the store's thread)."""
    values: tuple[Any, ...] = _REJECTION_VALUES(record)
    return values


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


def schema_line(store: str, before: int | None, version: int) -> None:
    """The log line of a gateway schema that `open` created or migrated (none when it
    was current): an upgrade leaves a trace of what the database held before."""
    if before == version:
        return
    event = "schema_created" if before is None else "schema_migrated"
    structlog.get_logger("gateway.store").info(
        event, store=store, component="gateway", from_version=before, version=version
    )
