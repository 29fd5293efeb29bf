"""gateway.store.batching.GroupCommit: what a caller of a batched verb can count on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.store.batching import GroupCommit
from leases.errors import StoreUnavailable


class Recorder:
    """A `run` that records its batches and can be held at the start of each."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, items: list[Any]) -> list[Any]:
        self.batches.append(list(items))
        await self.gate.wait()
        return [ValueError(i) if i == "bad" else i * 2 for i in items]


async def test_operations_arriving_during_a_batch_ride_the_next_one_together() -> None:
    run = Recorder()
    queue: GroupCommit[Any] = GroupCommit(run, name="t")
    run.gate.clear()
    first = asyncio.create_task(queue.submit(1))
    await asyncio.sleep(0)  # the flusher takes [1] and waits at the gate
    later = [asyncio.create_task(queue.submit(n)) for n in (2, 3)]
    await asyncio.sleep(0)
    run.gate.set()
    assert await asyncio.gather(first, *later) == [2, 4, 6]
    assert run.batches == [[1], [2, 3]]


async def test_an_operation_failure_is_raised_to_its_caller_alone() -> None:
    queue: GroupCommit[Any] = GroupCommit(Recorder(), name="t")
    answers = await asyncio.gather(
        *(queue.submit(i) for i in (1, "bad", 3)), return_exceptions=True
    )
    assert answers[0] == 2 and answers[2] == 6 and isinstance(answers[1], ValueError)


async def test_a_caller_answered_by_the_last_batch_may_submit_at_once() -> None:
    """The flusher that answered it is finishing; the next operation must still
    be flushed (it once waited forever on the finished flusher)."""
    queue: GroupCommit[Any] = GroupCommit(Recorder(), name="t")
    for n in range(3):
        assert await asyncio.wait_for(queue.submit(n), timeout=5) == n * 2


async def test_a_cancelled_caller_is_dropped_before_its_batch_when_asked() -> None:
    run = Recorder()
    queue: GroupCommit[Any] = GroupCommit(run, name="t", drop_cancelled=True)
    run.gate.clear()
    first = asyncio.create_task(queue.submit(1))
    await asyncio.sleep(0)
    gone = asyncio.create_task(queue.submit(2))
    kept = asyncio.create_task(queue.submit(3))
    await asyncio.sleep(0)
    gone.cancel()
    run.gate.set()
    assert (await first, await kept) == (2, 6)
    assert run.batches == [[1], [3]]


async def test_a_failing_run_fails_its_batch_and_a_closed_queue_refuses() -> None:
    async def broken(items: list[Any]) -> list[Any]:
        raise StoreUnavailable("down")

    queue: GroupCommit[Any] = GroupCommit(broken, name="t")
    with pytest.raises(StoreUnavailable, match="down"):
        await queue.submit(1)
    await queue.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        await queue.submit(2)


async def test_an_enqueued_operation_is_answered_on_its_owners_future() -> None:
    """`enqueue`: the same batches as `submit`, the answer on the future given; a
    future cancelled before its batch begins drops the operation when asked, and
    a closed queue fails the future instead of raising."""
    run = Recorder()
    queue: GroupCommit[Any] = GroupCommit(run, name="t", drop_cancelled=True)
    loop = asyncio.get_running_loop()
    run.gate.clear()
    first = asyncio.create_task(queue.submit(1))
    for _ in range(2):  # the submit, then the flusher: it takes [1], waits at the gate
        await asyncio.sleep(0)
    assert run.batches == [[1]]
    kept, dropped, failing = loop.create_future(), loop.create_future(), loop.create_future()
    queue.enqueue(2, kept)
    queue.enqueue(3, dropped)
    queue.enqueue("bad", failing)
    dropped.cancel()
    run.gate.set()
    assert await first == 2 and await kept == 4
    with pytest.raises(ValueError):
        await failing
    assert run.batches == [[1], [2, "bad"]]
    await queue.close()
    late = loop.create_future()
    queue.enqueue(4, late)
    with pytest.raises(StoreUnavailable):
        await late
