"""Where a PostgreSQL backend's CPU goes in one decision call and one outcome call.

    python3 -m bench.pg_call_parts                    # batches of 1, 4 and 16 writes
    python3 -m bench.pg_call_parts --writes 4 --cycles 2000

A measurement for issue 33, not the store's way. One connection runs, in turn,
cycles of calls of each kind below, and the backend's CPU of each call is taken
from the scheduler's count (/proc): so every kind meets the same machine, and a
slower turn of a shared machine moves them all. Per call and per write:

- `decision`: the store's decision call for N new keys (`postgres_batch`);
- `outcome`: the store's outcome call recording them completed
  (`postgres_outcomes`);
- `outcome, not flushed`: the same function with `synchronous_commit` off, so
  the difference is what the outcome's flushed commit costs;
- `one update`: the least an outcome call could be, one `UPDATE ... FROM
  unnest(...)` of the same rows in a function with the same settings and a
  flushed commit (no row locks first, no other kinds, nothing returned);
- `flushed commit`: a function with the same settings updating one row of a
  table of one row, with a flushed commit;
- `empty call`: the same function doing nothing (no WAL, nothing to flush);
- `SELECT 1`: a round trip and a statement.

The outcomes of a cycle are those of a decision call made just before it, not
measured. Needs the PostgreSQL of the tests (`SINKGATE_TEST_PG`), on this
machine.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

from bench.shared_call import Batches, _backend_cpu, run_cli

_ONE_UPDATE = """
CREATE FUNCTION bench_one_update(text[], text[], text[], text[], int4[], text[], bytea[],
    bool[], text[], float8)
RETURNS text[] LANGUAGE plpgsql VOLATILE {settings} AS $fn$
BEGIN
    PERFORM {durable};
    UPDATE idempotency i SET state = 'completed', status = o.status, headers = o.headers,
        body = o.body, body_omitted = o.omitted, completed_at = $10, updated_at = $10,
        barrier_until = NULL
    FROM unnest($1, $2, $3, $5, $6, $7, $8)
        AS o(destination, key, attempt, status, headers, body, omitted)
    WHERE i.destination = o.destination AND i.key = o.key AND i.attempt = o.attempt;
    RETURN NULL;
END $fn$;
CREATE TABLE bench_one_row (id int PRIMARY KEY, n int);
INSERT INTO bench_one_row VALUES (1, 0);
CREATE FUNCTION bench_flushed_commit() RETURNS int LANGUAGE plpgsql VOLATILE {settings} AS $fn$
BEGIN
    PERFORM {durable};
    UPDATE bench_one_row SET n = n + 1 WHERE id = 1;
    RETURN 1;
END $fn$;
CREATE FUNCTION bench_empty_call() RETURNS int LANGUAGE plpgsql VOLATILE {settings} AS $fn$
BEGIN
    PERFORM {durable};
    RETURN 1;
END $fn$;
"""


async def measure(url: str, writes: int, cycles: int) -> None:
    import asyncpg  # type: ignore[import-untyped]

    from gateway.store import postgres_batch as pb
    from gateway.store import postgres_outcomes as po
    from gateway.store.postgres import PostgresStore
    from leases.postgres import DURABLE

    await (await PostgresStore.open(url)).close()  # the schema and the functions
    conn = await asyncpg.connect(url)
    pid = await conn.fetchval("SELECT pg_backend_pid()")
    await conn.execute(_ONE_UPDATE.format(settings=po.SET_CLAUSES, durable=DURABLE))
    not_flushed = po.OUTCOMES_FUNCTION_DDL.replace(
        po.OUTCOMES_FUNCTION, "bench_not_flushed"
    ).replace(f"PERFORM {DURABLE};", "PERFORM set_config('synchronous_commit', 'off', true);")
    assert "bench_not_flushed" in not_flushed and DURABLE not in not_flushed
    await conn.execute(not_flushed)
    batches = Batches(writes)

    decided: list[list[Any]] = []

    async def decision() -> None:
        ops = batches.new()
        await conn.fetchrow(pb._DECIDE_CALL, *batches.decision_args(ops))
        decided.append(ops)

    def outcome_by(function: str, touched: int | None) -> Callable[[], Awaitable[None]]:
        call = po._CALL_SQL.replace(po.OUTCOMES_FUNCTION, function)

        async def record() -> None:
            answer = await conn.fetchval(call, *batches.outcome_args(decided.pop()))
            assert touched is None or len(answer) == touched  # every outcome recorded

        return record

    def statement(sql: str) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            await conn.fetchval(sql)

        return run

    ways: dict[str, Callable[[], Awaitable[None]]] = {
        "decision": decision,
        "outcome": outcome_by(po.OUTCOMES_FUNCTION, writes),
        "outcome, not flushed": outcome_by("bench_not_flushed", writes),
        "one update": outcome_by("bench_one_update", None),
        "flushed commit": statement("SELECT bench_flushed_commit()"),
        "empty call": statement("SELECT bench_empty_call()"),
        "SELECT 1": statement("SELECT 1"),
    }
    outcomes = {"outcome", "outcome, not flushed", "one update"}
    cpu = dict.fromkeys(ways, 0.0)
    try:
        for n in range(30 + cycles):  # the first 30 make the plans
            for name, way in ways.items():
                if name in outcomes:
                    await decision()  # its outcomes, not measured
                started = _backend_cpu(pid)
                await way()
                if n >= 30:
                    cpu[name] += _backend_cpu(pid) - started
    finally:
        await conn.close()
    for name in ways:
        per_call = cpu[name] * 1e6 / cycles
        print(
            f"{writes:>3} writes, {name:>20}: backend CPU {per_call:7.1f} us a call, "
            f"{per_call / writes:6.1f} us a write"
        )


def main(argv: list[str] | None = None) -> int:
    return run_cli(measure, __doc__.splitlines()[0], 1000, argv)


if __name__ == "__main__":
    sys.exit(main())
