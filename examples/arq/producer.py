"""Enqueue orders for the arq example's worker and print what each run returned.

    python3 -m examples.arq.producer 1001 1999 [--twice]

`--twice` enqueues the same order as two jobs, which arq may run at once: one
charges it, and the other returns `{"sinkgate": "job_completed", ...}` instead of
charging again. Either may print first.
"""

from __future__ import annotations

import argparse
import asyncio

from arq import create_pool

from .jobs import WorkerSettings


async def send(order_id: int, amount: int, times: int) -> None:
    pool = await create_pool(WorkerSettings.redis_settings)
    try:
        jobs = [await pool.enqueue_job("ship_order", order_id, amount) for _ in range(times)]
        for job in jobs:
            assert job is not None
            print(f"order {order_id}, arq job {job.job_id}: {await job.result(timeout=60)}")
    finally:
        await pool.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("order_id", type=int)
    parser.add_argument("amount", type=int)
    parser.add_argument("--twice", action="store_true", help="enqueue the order twice")
    args = parser.parse_args(argv)
    asyncio.run(send(args.order_id, args.amount, 2 if args.twice else 1))


if __name__ == "__main__":
    main()
