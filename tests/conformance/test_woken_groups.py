"""A group of one key's writes decided in one transaction (`GroupDecisions`, the
SQLite store) gets the decisions the same writes get decided one by one.

The woken writes of a key are decided this way (`gateway.write.woken`); a woken
write must be decided as if it had just arrived. Each scenario runs the same
writes on two stores at the same instant: one by one with `decide_write`, and
as one group; the verdicts and the rejection rows must be the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.policy.decision import Forward, Reject, Replay, WriteFacts
from gateway.policy.records import Outcome, Verdict, WriteContext
from gateway.store.protocol import GroupDecisions
from gateway.store.records import RejectionQuery
from gateway.store.sqlite import SQLiteStore
from tests.conformance.test_store_conformance import CONTEXT, write
from tests.harness import FakeClock

COMPLETED = Outcome(
    "completed", status=201, headers=(("Content-Type", "application/json"),), body=b"{}"
)
RELEASED = Outcome("released")


@dataclass
class Queued:
    facts: WriteFacts
    context: WriteContext = CONTEXT
    dropped: bool = False


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[tuple[SQLiteStore, SQLiteStore]]:
    clock = FakeClock()
    one = await SQLiteStore.open(f"sqlite:///{tmp_path / 'one.db'}", clock=clock)
    group = await SQLiteStore.open(f"sqlite:///{tmp_path / 'group.db'}", clock=clock)
    try:
        yield one, group
    finally:
        await one.close()
        await group.close()


def summary(verdict: Verdict | None) -> tuple[str, str | None, bool] | None:
    """What a verdict decided: its kind, its refusal's reason, whether it reserved."""
    if verdict is None:
        return None
    decision = verdict.decision
    reason = str(decision.reason) if isinstance(decision, Reject) else None
    return type(decision).__name__, reason, verdict.attempt is not None


async def rows(store: SQLiteStore) -> list[tuple[str, str | None, str | None]]:
    logged = await store.list_rejections(RejectionQuery(limit=100))
    return [(r.record.reason, r.record.owner, r.record.idempotency_key) for r in logged]


async def both(
    stores: tuple[SQLiteStore, SQLiteStore], writes: Sequence[WriteFacts]
) -> list[Verdict | None]:
    """`writes` one by one on the first store and as one group on the second: the
    same decisions and rejection rows on both; the group's verdicts."""
    one, group = stores
    alone = [await one.decide_write(facts, CONTEXT) for facts in writes]
    grouped = await group.decide_group([Queued(facts) for facts in writes])
    assert [summary(v) for v in grouped] == [summary(v) for v in alone]
    assert await rows(group) == await rows(one)
    return grouped


async def on_both(stores: tuple[SQLiteStore, SQLiteStore], outcome: Outcome | None) -> None:
    """The key reserved by a first write on both stores, then `outcome` recorded."""
    for store in stores:
        first = await store.decide_write(write(), CONTEXT)
        assert first.attempt is not None
        if outcome is not None:
            assert await store.record_outcome(write(), first.attempt, outcome) is True


def duplicates(n: int) -> list[WriteFacts]:
    """The same write from `n` workers, the last one with another payload."""
    writes = [write(owner=f"worker-{i}") for i in range(n)]
    writes[-1] = dataclasses.replace(writes[-1], fingerprint="fp-other")
    return writes


def test_the_sqlite_store_decides_groups() -> None:
    assert issubclass(SQLiteStore, GroupDecisions)


async def test_a_completed_key_replays_to_each_with_its_own_duplicate_row(
    stores: tuple[SQLiteStore, SQLiteStore],
) -> None:
    await on_both(stores, COMPLETED)
    grouped = await both(stores, duplicates(5))
    assert [summary(v) for v in grouped] == [
        *[("Replay", None, False)] * 4,
        ("Reject", "idempotency_key_reused", False),
    ]
    ids = [v.rejection_id for v in grouped if v is not None]
    assert len(set(ids)) == 5  # one row each
    assert all(isinstance(v.decision, Replay) for v in grouped[:4] if v is not None)


async def test_a_released_key_is_forwarded_to_the_first_only(
    stores: tuple[SQLiteStore, SQLiteStore],
) -> None:
    """The first of the group reserves the key; the ones after it find it in flight."""
    await on_both(stores, RELEASED)
    grouped = await both(stores, duplicates(4))
    assert [summary(v) for v in grouped] == [
        ("Forward", None, True),
        ("Reject", "request_in_progress", False),
        ("Reject", "request_in_progress", False),
        ("Reject", "idempotency_key_reused", False),
    ]
    record = await stores[1].key_record("pay", "key-1")
    assert record is not None and grouped[0] is not None
    assert record.attempt == grouped[0].attempt and record.owner == "worker-0"


async def test_a_key_still_in_flight_refuses_each(
    stores: tuple[SQLiteStore, SQLiteStore],
) -> None:
    await on_both(stores, None)
    grouped = await both(stores, duplicates(3))
    assert [summary(v) for v in grouped] == [
        ("Reject", "request_in_progress", False),
        ("Reject", "request_in_progress", False),
        ("Reject", "idempotency_key_reused", False),
    ]


async def test_a_dropped_write_is_not_decided_and_reserves_nothing(
    stores: tuple[SQLiteStore, SQLiteStore],
) -> None:
    """A caller gone before the group's transaction began: its write is not taken,
    so the key it would have reserved goes to the next write of the group.
    (Decided all the same, the first write would hold the key and the second get
    `request_in_progress`.)"""
    await on_both(stores, RELEASED)
    group = stores[1]
    gone, live = Queued(write(owner="gone"), dropped=True), Queued(write(owner="live"))
    verdicts = await group.decide_group([gone, live])
    assert verdicts[0] is None
    assert verdicts[1] is not None and isinstance(verdicts[1].decision, Forward)
    record = await group.key_record("pay", "key-1")
    assert record is not None and record.owner == "live"
    assert record.attempt == verdicts[1].attempt
    everyone_gone = await group.decide_group([Queued(write(), dropped=True)])
    assert everyone_gone == [None]
