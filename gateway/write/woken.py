"""The decisions of woken writes, taken by key in groups (`GroupDecisions`).

A settlement wakes every write held on its key at once (`gateway.write.waiting`),
and each is decided again as if it had just arrived. Decided one by one, that is
one store operation each, each reading the same rows again. Here the woken
writes of one job generation and key that ask within one turn of the event loop
join one group, decided in arrival order in transactions of `GROUP` writes: the
stored state read once per transaction, each write still getting its own
decision (a replay, a forward, a refusal) and its own rejection row, as if
decided alone just after the one before it. One transaction's answers go out
while the next one is decided.

A write whose caller goes away before its group's transaction begins (its
answer's future cancelled) is `dropped` and not decided, as the group commit
drops a cancelled decision.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gateway.policy.decision import WriteFacts
from gateway.policy.records import Verdict, WriteContext
from gateway.store.protocol import GroupDecisions

# Writes per transaction: small enough that the first answers leave while the
# rest are decided, large enough that the rows are read once for many.
GROUP = 100

_Ident = tuple[str, str | None, str, int]  # destination, key, job, generation


@dataclass(eq=False, slots=True)
class _Queued:
    facts: WriteFacts
    context: WriteContext
    answer: asyncio.Future[Verdict | None] = field(repr=False)

    @property
    def dropped(self) -> bool:
        """Its caller went away: awaiting the answer, it cancelled it."""
        return self.answer.cancelled()


class WokenDecisions:
    """Groups the decisions of woken writes by key, for a `GroupDecisions` store."""

    def __init__(self, store: GroupDecisions, group: int = GROUP) -> None:
        self._store = store
        self._group = group
        self._forming: dict[_Ident, list[_Queued]] = {}
        self._runs: set[asyncio.Task[None]] = set()
        self.transactions = 0  # how many transactions the groups took (tests read it)

    def decide(
        self,
        facts: WriteFacts,
        context: WriteContext,
        answer: asyncio.Future[Verdict | None] | None = None,
    ) -> asyncio.Future[Verdict | None]:
        """`facts`' decision, taken with the others of its key woken in this turn,
        set on `answer` (a new future if None; the held write's own, when its wake
        starts the decision). A future, not a coroutine: a caller cancelled while
        awaiting it cancels it, which drops the decision (one coroutine less for
        each of hundreds of woken writes)."""
        loop = asyncio.get_running_loop()
        ident = (facts.destination, facts.key, facts.job_id, facts.generation)
        forming = self._forming.get(ident)
        if forming is None:
            forming = self._forming[ident] = []
            loop.call_soon(self._start, ident)  # once the turn's woken writes have asked
        if answer is None:
            answer = loop.create_future()
        forming.append(_Queued(facts, context, answer))
        return answer

    def _start(self, ident: _Ident) -> None:
        run = asyncio.ensure_future(self._run(self._forming.pop(ident)))
        self._runs.add(run)
        run.add_done_callback(self._runs.discard)

    async def _run(self, queued: list[_Queued]) -> None:
        try:
            for start in range(0, len(queued), self._group):
                group = queued[start : start + self._group]
                try:
                    verdicts = await self._store.decide_group(group)
                except Exception as exc:  # each caller gets it, as from `decide_write`
                    for q in group:
                        if not q.answer.done():
                            q.answer.set_exception(exc)
                    continue
                self.transactions += 1
                for q, verdict in zip(group, verdicts, strict=True):
                    if verdict is not None and not q.answer.done():
                        q.answer.set_result(verdict)
        finally:  # cancelled (the gateway stopping): nobody is left waiting
            for q in queued:
                if not q.answer.done():
                    q.answer.cancel()
