"""One policy on every backend for a caller cancelled before its batch begins.

A write decision whose caller went away (the worker disconnected, the handler
was cancelled at shutdown) before the group commit it waits for has begun is
not taken at all: nobody would forward it, and a reservation taken for it would
hold the key in flight until its deadline and then leave it `unknown`. A
rejection logged outside a decision is still logged: it happened all the same.

Checked by hand with the protection switched off: with the decision run all
the same (`drop_cancelled=False` in the SQLite store's `decide_write`, as it was
before), the first test finds the key in flight (`request_in_progress`).
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.policy.decision import Forward
from gateway.policy.records import RejectionRecord
from gateway.store.records import RejectionQuery
from tests.backends import Backend
from tests.conformance.test_store_conformance import CONTEXT, write
from tests.harness import eventually


async def _cancelled_before_its_batch(call: asyncio.Future[object] | object) -> None:
    """Queue `call`, then cancel its caller before the batch it waits for begins:
    the batch's flusher is a task that has not run yet."""
    task = asyncio.ensure_future(call)  # type: ignore[arg-type]
    await asyncio.sleep(0)  # the operation is queued, its caller waits
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_decision_cancelled_before_its_batch_reserves_nothing(
    store_backend: Backend,
) -> None:
    store = store_backend.store
    await _cancelled_before_its_batch(store.decide_write(write(generation=3), CONTEXT))
    # The next write of the key rides a later batch: it finds the key free and the
    # job's mark not raised by the write that was never taken.
    verdict = await store.decide_write(write(), CONTEXT)
    assert isinstance(verdict.decision, Forward)
    state = await store.job_state("job-1")
    assert state is not None and state.highest_generation == 1


async def test_a_rejection_cancelled_before_its_batch_is_logged_all_the_same(
    store_backend: Backend,
) -> None:
    store = store_backend.store
    record = RejectionRecord(reason="invalid_fencing", detail="x", job_id="job-9")
    await _cancelled_before_its_batch(store.record_rejection(record))

    async def logged() -> list[str]:
        # PostgreSQL runs two batches at once: the one holding the rejection may
        # commit after a later one has answered.
        rows = await store.list_rejections(RejectionQuery(job_id="job-9"))
        return [r.record.reason for r in rows]

    assert await eventually(logged, what="the rejection logged") == ["invalid_fencing"]
