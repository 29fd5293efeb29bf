"""Group commit: the operations that arrive while a batch is on its way ride the next.

`GroupCommit(run)` queues each `submit(item)`; a flusher hands the queue to
`run(items)` in batches of up to `max_batch`, at most `in_flight` batches at a
time, and answers each caller with its own entry of the list `run` returns: a
value, or an exception raised to that caller alone. An exception `run` itself
raises fails every operation of that batch.

An operation whose caller was cancelled before its batch began is dropped when
`drop_cancelled` (a write decision nobody waits for must not reserve a key);
otherwise it is still run (an outcome must be recorded all the same). The queue's
setting, unless `submit` says otherwise for its item.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from leases.errors import StoreUnavailable

I = TypeVar("I")  # noqa: E741 - the item type

MAX_BATCH = 256

Run = Callable[[list[I]], Awaitable[list[Any]]]


class GroupCommit(Generic[I]):
    """One queue of operations and the batches it is flushed in."""

    def __init__(
        self,
        run: Run[I],
        *,
        name: str,
        max_batch: int = MAX_BATCH,
        in_flight: int = 1,
        drop_cancelled: bool = False,
    ) -> None:
        self._run = run
        self._name = name
        self._max_batch = max_batch
        self._in_flight = in_flight
        self._drop_cancelled = drop_cancelled
        self._pending: list[tuple[I, asyncio.Future[Any], bool]] = []
        self._flushers: set[asyncio.Task[None]] = set()
        self._running = 0
        self._closed = False
        self.batches = 0
        self.operations = 0

    async def submit(self, item: I, *, drop_cancelled: bool | None = None) -> Any:
        """Run `item` in the next batch; its answer, once that batch is done.
        `drop_cancelled`: this item's own setting (None: the queue's)."""
        if self._closed:
            raise StoreUnavailable("store is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.enqueue(item, future, drop_cancelled=drop_cancelled)
        return await future

    def enqueue(
        self, item: I, future: asyncio.Future[Any], *, drop_cancelled: bool | None = None
    ) -> None:
        """`submit` without awaiting: `item`'s answer (or failure) is set on
        `future`, which its owner awaits, or cancels to drop the item."""
        if self._closed:
            future.set_exception(StoreUnavailable("store is closed"))
            return
        drop = self._drop_cancelled if drop_cancelled is None else drop_cancelled
        self._pending.append((item, future, drop))
        if self._running < self._in_flight:
            # Counted from here to the loop's last step (not to the task's done
            # callback, which runs later): a caller answered by the last batch and
            # submitting at once must not find the finishing flusher still counted.
            self._running += 1
            task = asyncio.create_task(self._flush_loop(), name=self._name)
            self._flushers.add(task)
            task.add_done_callback(self._flushers.discard)

    async def _flush_loop(self) -> None:
        try:
            await self._flush()
        finally:
            self._running -= 1

    async def _flush(self) -> None:
        while self._pending:
            batch = self._pending[: self._max_batch]
            del self._pending[: self._max_batch]
            batch = [op for op in batch if not (op[2] and op[1].done())]
            if not batch:
                continue
            try:
                answers = await self._run([item for item, _, _ in batch])
            except asyncio.CancelledError:
                for _, future, _ in batch:
                    future.cancel()
                raise
            except Exception as exc:
                for _, future, _ in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            self.batches += 1
            self.operations += len(batch)
            for (_, future, _), answer in zip(batch, answers, strict=True):
                if future.done():
                    continue
                if isinstance(answer, BaseException):
                    future.set_exception(answer)
                else:
                    future.set_result(answer)

    async def close(self) -> None:
        """Refuse new operations; wait for the queued ones to be answered."""
        self._closed = True
        if self._flushers:
            await asyncio.gather(*self._flushers, return_exceptions=True)
