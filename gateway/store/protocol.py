"""The gateway's storage seam: domain verbs, backends picked by URL scheme.

A gateway store is also a lease store (the lease API and the lease-mode fence
must read one and the same lease table). Backends: `sqlite_store.SQLiteStore`,
`postgres_store.PostgresStore`. Handlers only ever see `Store`.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.write.decision import Decision, KeyRecord, KeyState, Reject, Replay, WriteFacts
from leases.model import Lease, LeaseRef, LeaseRow
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


class Store(Protocol):
    """Domain verbs of the gateway's store. Every verb is one short transaction."""

    clock: Clock

    async def decide_write(self, facts: WriteFacts, context: WriteContext) -> Verdict:
        """Fence + barrier + idempotency check, atomically, and apply the verdict:
        reserve the key, register the attempt and raise the mark on Forward;
        record a rejection (or `duplicate` on Replay). Durable on return."""
        ...

    async def record_outcome(self, facts: WriteFacts, attempt: str, outcome: Outcome) -> bool:
        """Record what became of `attempt`; False when it no longer holds the key."""
        ...

    async def record_rejection(self, record: RejectionRecord) -> int:
        """Log a rejection decided outside `decide_write` (steps 3 and 5)."""
        ...

    async def claim(self, job_id: str, *, owner: str | None = None, ttl: float) -> Lease: ...
    async def renew(self, lease: Lease | LeaseRef, *, ttl: float | None = None) -> Lease: ...
    async def complete(self, lease: Lease | LeaseRef) -> Lease: ...
    async def release(self, lease: Lease | LeaseRef) -> Lease: ...
    async def get(self, job_id: str) -> Lease | None: ...

    async def list_rejections(self, query: RejectionQuery) -> list[StoredRejection]: ...
    async def get_rejection(self, rejection_id: int) -> StoredRejection | None: ...
    async def job_state(self, job_id: str) -> JobState | None: ...
    async def key_record(self, destination: str, key: str) -> KeyRecord | None: ...

    async def purge(
        self, *, completed_before: float, rejections_before: float, batch: int
    ) -> tuple[int, int]:
        """Delete up to `batch` completed keys and rejections older than the cutoffs;
        never in-flight or unknown records. Returns (keys, rejections) deleted."""
        ...

    async def ping(self) -> None:
        """Raise `StoreUnavailable` unless the store answers."""
        ...

    async def close(self) -> None: ...


async def open_store(
    url: str, *, clock: Clock = time.time, pool_size: int | None = None, **options: Any
) -> Store:
    """Open the backend named by `url`'s scheme; imports are lazy.

    `pool_size` (config `store.pool_size`) caps a PostgreSQL store's connection
    pool; SQLite has one writer connection and ignores it. PostgreSQL decides by
    the server's clock, so `clock` applies to SQLite only.
    """
    scheme = url.split(":", 1)[0].lower()
    if scheme == "sqlite":
        from gateway.store.sqlite import SQLiteStore

        return await SQLiteStore.open(url, clock=clock, **options)
    if scheme in ("postgresql", "postgres"):
        from gateway.store.postgres import PostgresStore

        if pool_size is not None:
            options.setdefault("max_size", pool_size)
        return await PostgresStore.open(url, **options)
    raise ValueError(f"unsupported store URL {url!r} (sqlite:///path or postgresql://...)")
