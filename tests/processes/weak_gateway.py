"""A deliberately weakened gateway, for the chaos controls only (never shipped).

    python -m tests.processes.weak_gateway WEAKNESS[,WEAKNESS] serve --config ...

runs the real gateway with one protection switched off, so a test can show that
a fault kind of `sinkgate chaos` does reach what the protection guards:

- `fail_open`: a write whose decision could not be made durable (the store
  failed: a backend terminated, the connection cut, the database refusing,
  a lock wait given up, a failed SQLite commit) is forwarded anyway, without a
  reservation (a woken write whose decision its wake started too) - the gateway that
  forwards before its reservation commits; the
  PostgreSQL store's second try of a batch that failed before COMMIT is off too,
  or it would hide most of those failures from the weakness;
- `impatient`: gives up on SQLite's write lock after 0.2 s instead of
  `BUSY_TIMEOUT_S` (with `fail_open`: a held write lock then reaches it);
- `forget_lost_answers`: a forward whose answer was lost (connection reset,
  timeout) is recorded as released instead of unknown, so it is sent again.
"""

from __future__ import annotations

import sys
from typing import Any

WEAKNESSES = ("fail_open", "impatient", "forget_lost_answers")


def _fail_open() -> None:
    import asyncio

    import gateway.store.postgres
    from gateway.policy.decision import Forward
    from gateway.policy.records import Verdict
    from gateway.store.postgres import PostgresStore
    from gateway.store.records import new_attempt_id
    from gateway.store.sqlite import SQLiteStore
    from leases.errors import StoreUnavailable

    for cls in (PostgresStore, SQLiteStore):
        decide = cls.decide_write

        async def weak(self: Any, facts: Any, context: Any, _decide: Any = decide) -> Any:
            try:
                return await _decide(self, facts, context)
            except StoreUnavailable:
                return Verdict(Forward(), attempt=new_attempt_id())

        cls.decide_write = weak  # type: ignore[method-assign]

    group = SQLiteStore.decide_group

    async def weak_group(self: Any, writes: Any, _group: Any = group) -> Any:
        try:
            return await _group(self, writes)
        except StoreUnavailable:
            return [
                None if w.dropped else Verdict(Forward(), attempt=new_attempt_id()) for w in writes
            ]

    SQLiteStore.decide_group = weak_group  # type: ignore[method-assign]

    start = PostgresStore.start_decision

    def weak_start(self: Any, facts: Any, context: Any, answer: Any, _start: Any = start) -> None:
        inner = asyncio.get_running_loop().create_future()
        answer.add_done_callback(lambda a: inner.cancel() if a.cancelled() else None)

        def done(f: Any) -> None:
            if answer.done():
                return
            if f.cancelled():
                answer.cancel()
            elif isinstance(f.exception(), StoreUnavailable):
                answer.set_result(Verdict(Forward(), attempt=new_attempt_id()))
            elif f.exception() is not None:
                answer.set_exception(f.exception())
            else:
                answer.set_result(f.result())

        inner.add_done_callback(done)
        _start(self, facts, context, inner)

    PostgresStore.start_decision = weak_start  # type: ignore[method-assign]
    gateway.store.postgres.DECISION_TRIES = 1


def _impatient() -> None:
    import leases.sqlite

    leases.sqlite.BUSY_TIMEOUT_S = 0.2


def _forget_lost_answers() -> None:
    from gateway.write.upstream import SendFailure

    SendFailure.maybe_sent = property(lambda self: False)  # type: ignore[assignment, method-assign]


def main(argv: list[str]) -> int:
    weaknesses = argv[0].split(",")
    for name in weaknesses:
        if name not in WEAKNESSES:
            print(f"unknown weakness {name!r}", file=sys.stderr)
            return 2
        globals()[f"_{name}"]()
    from gateway.cli import main as gateway_main

    return int(gateway_main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
