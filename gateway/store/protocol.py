"""The gateway's storage seam, by role: each part of the gateway sees only its verbs.

A gateway store is also a lease store (the lease API and the lease-mode fence
must read one and the same lease table). The write route depends on
`WriteStore`, the lease API on `LeaseVerbs`, admin on `AdminStore`, the janitor
on `PurgeStore`; only the composition root (`gateway.app`) holds a whole `Store`.
Backends: `gateway.store.sqlite.SQLiteStore`, `gateway.store.postgres.PostgresStore`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from gateway.policy.decision import KeyRecord, WriteFacts
from gateway.policy.records import Outcome, RejectionRecord, Verdict, WriteContext
from gateway.store.admin_records import OperatorStore
from gateway.store.records import Clock, JobState, RejectionQuery, StoredRejection
from leases.model import Lease, LeaseRef


class WriteStore(Protocol):
    """The write route's verbs (SPEC 2 steps 5-8). Every verb is one short transaction."""

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


class Queued(Protocol):
    """A write decision queued in a group (`GroupDecisions`). `dropped` turns true
    when its caller goes away; the store may read it from another thread."""

    @property
    def facts(self) -> WriteFacts: ...
    @property
    def context(self) -> WriteContext: ...
    @property
    def dropped(self) -> bool: ...


@runtime_checkable
class GroupDecisions(Protocol):
    """A store that decides a group of writes of one key in one transaction."""

    async def decide_group(self, writes: Sequence[Queued]) -> list[Verdict | None]:
        """`decide_write` for each of `writes`, all of one job, generation,
        destination and key, in their order and in ONE transaction: each decided
        as if it had arrived just after the one before (it sees what they
        changed, as `gateway.policy.batch_plan` plans), each with its own
        rejection row. The stored state is read once for the group. A write
        `dropped` when the group's decisions begin is not decided (None): a
        decision nobody waits for must not reserve a key. Durable on return."""
        ...


@runtime_checkable
class StartsDecisions(Protocol):
    """A store that can start a write's decision without a coroutine of its own
    (the PostgreSQL store's group commit): the wake of a held write starts it."""

    def start_decision(
        self, facts: WriteFacts, context: WriteContext, answer: asyncio.Future[Verdict | None]
    ) -> None:
        """`decide_write`, its verdict or failure set on `answer`; `answer`
        cancelled before the decision begins drops it (nothing reserved)."""
        ...


class WaitStore(Protocol):
    """What the waiter registry polls (SPEC 2 "Waiting"): reads, never a change."""

    clock: Clock

    async def key_record(self, destination: str, key: str) -> KeyRecord | None: ...
    async def job_state(self, job_id: str) -> JobState | None: ...


# Called with (destination, key or None, job_id) of each attempt that settled.
Settled = Callable[[str, str | None, str], None]
# Called with True once the settlements are heard, False while they are not.
Hearing = Callable[[bool], None]


@runtime_checkable
class SettlementFeed(Protocol):
    """A store that tells every process of the attempts settled in any of them."""

    async def watch_settlements(
        self, settled: Settled, holding: asyncio.Event, hearing: Hearing | None = None
    ) -> None:
        """Call `settled` for each attempt whose outcome is recorded or which is
        released, by any process on the store, at least while `holding` is set
        (this process holds writes: a store may tell nobody while no process
        does), and `hearing` whenever that starts or stops; runs until cancelled."""
        ...


# Called with the operation ("decide", "record") run again after the store gave no answer.
Retried = Callable[[str], None]


@runtime_checkable
class RetriesCalls(Protocol):
    """A store that runs a call again when the database gave no answer, the write
    waiting: `retried` is told of each (the app counts them)."""

    retried: Retried


class LeaseVerbs(Protocol):
    """The lease API's verbs (SPEC 3), decided by the store's clock."""

    clock: Clock

    async def claim(self, job_id: str, *, owner: str | None = None, ttl: float) -> Lease: ...
    async def renew(self, lease: Lease | LeaseRef, *, ttl: float | None = None) -> Lease: ...
    async def complete(self, lease: Lease | LeaseRef) -> Lease: ...
    async def release(self, lease: Lease | LeaseRef) -> Lease: ...
    async def get(self, job_id: str) -> Lease | None: ...


class AdminStore(Protocol):
    """What the admin API and page read (SPEC 4)."""

    clock: Clock

    async def list_rejections(self, query: RejectionQuery) -> list[StoredRejection]: ...
    async def get_rejection(self, rejection_id: int) -> StoredRejection | None: ...
    async def job_state(self, job_id: str) -> JobState | None: ...
    async def key_record(self, destination: str, key: str) -> KeyRecord | None: ...

    async def ping(self) -> None:
        """Raise `StoreUnavailable` unless the store answers."""
        ...


class PurgeStore(Protocol):
    """The janitor's verbs: retention of keys and rejections, and of the audit log."""

    clock: Clock

    async def purge(
        self, *, completed_before: float, rejections_before: float, batch: int
    ) -> tuple[int, int]:
        """Delete up to `batch` completed keys and rejections older than the cutoffs;
        never in-flight or unknown records. Returns (keys, rejections) deleted."""
        ...

    async def purge_audit(self, *, before: float, batch: int) -> int:
        """Delete up to `batch` audit rows older than `before`; returns how many."""
        ...


class AdminOpsStore(AdminStore, OperatorStore, Protocol):
    """What the admin listener needs: the read-only admin verbs and the operator's
    (keys, resolve, audit, summary; see `admin_records`)."""


class Store(WriteStore, LeaseVerbs, AdminStore, OperatorStore, PurgeStore, Protocol):
    """A whole store: every role, and closing it."""

    async def close(self) -> None: ...
