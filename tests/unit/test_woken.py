"""`WokenDecisions`: the woken writes of one key that ask in one turn of the event
loop are decided together, in transactions of at most `group` writes, each
caller getting its own verdict; a caller gone before its group began is
marked dropped; a store failure reaches every caller of the group."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pytest

from gateway.policy.decision import Fencing, Forward, WriteFacts
from gateway.policy.records import Verdict, WriteContext
from gateway.store.protocol import Queued
from gateway.write.woken import WokenDecisions
from leases.errors import StoreUnavailable

CONTEXT = WriteContext(remote="127.0.0.1", body_sha256="ab" * 32, body_bytes=2)
FACTS = WriteFacts(
    destination="pay",
    method="POST",
    path="/x",
    query="",
    job_id="job-1",
    generation=1,
    owner=None,
    key="k",
    fingerprint="fp",
    fencing=Fencing.MONOTONIC,
    upstream_idempotent=False,
    timeout=5.0,
)


class GroupStore:
    """Answers each write of a group with a verdict naming its owner."""

    def __init__(self, fail: bool = False) -> None:
        self.groups: list[list[tuple[str | None, bool]]] = []
        self.fail = fail

    async def decide_group(self, writes: Sequence[Queued]) -> list[Verdict | None]:
        self.groups.append([(w.facts.owner, w.dropped) for w in writes])
        await asyncio.sleep(0)
        if self.fail:
            raise StoreUnavailable("down")
        return [None if w.dropped else Verdict(Forward(), attempt=w.facts.owner) for w in writes]


def facts(owner: str, **changes: object) -> WriteFacts:
    return dataclasses.replace(FACTS, owner=owner, **changes)  # type: ignore[arg-type]


async def test_one_turn_of_one_key_is_one_group_in_transactions_of_at_most_group() -> None:
    store = GroupStore()
    woken = WokenDecisions(store, group=2)
    owners = ["a", "b", "c", "d", "e"]
    verdicts = await asyncio.gather(*(woken.decide(facts(o), CONTEXT) for o in owners))
    assert [v.attempt for v in verdicts] == owners  # each its own, in order
    assert store.groups == [
        [("a", False), ("b", False)],
        [("c", False), ("d", False)],
        [("e", False)],
    ]
    assert woken.transactions == 3


async def test_other_keys_and_generations_are_other_groups() -> None:
    store = GroupStore()
    woken = WokenDecisions(store)
    await asyncio.gather(
        woken.decide(facts("a"), CONTEXT),
        woken.decide(facts("b", key="other"), CONTEXT),
        woken.decide(facts("c", generation=2), CONTEXT),
        woken.decide(facts("d"), CONTEXT),
    )
    assert sorted(store.groups) == [[("a", False), ("d", False)], [("b", False)], [("c", False)]]


async def test_a_caller_gone_before_its_group_began_is_dropped() -> None:
    store = GroupStore()
    woken = WokenDecisions(store)
    gone = asyncio.ensure_future(woken.decide(facts("gone"), CONTEXT))
    live = asyncio.ensure_future(woken.decide(facts("live"), CONTEXT))
    await asyncio.sleep(0)  # both queued, the group not begun
    gone.cancel()
    assert (await live).attempt == "live"
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert store.groups == [[("gone", True), ("live", False)]]


async def test_a_store_failure_reaches_every_caller_of_the_group() -> None:
    woken = WokenDecisions(GroupStore(fail=True))
    results = await asyncio.gather(
        *(woken.decide(facts(o), CONTEXT) for o in "ab"), return_exceptions=True
    )
    assert [type(r) for r in results] == [StoreUnavailable, StoreUnavailable]
    assert woken.transactions == 0
