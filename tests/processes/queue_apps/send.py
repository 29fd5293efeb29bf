"""Send one transfer: `python -m tests.processes.queue_apps.send celery|arq ORDER`."""

from __future__ import annotations

import asyncio
import sys


async def _enqueue_arq(order: int) -> None:
    from arq import create_pool
    from arq.connections import RedisSettings

    from . import arq_app, scenario

    pool = await create_pool(RedisSettings.from_dsn(scenario.REDIS))
    try:
        await pool.enqueue_job(
            "transfer", order, _queue_name=arq_app.QUEUE, _job_id=f"{scenario.PREFIX}arq-{order}"
        )
    finally:
        await pool.aclose()


def main() -> None:
    queue, order = sys.argv[1], int(sys.argv[2])
    if queue == "celery":
        from .celery_app import transfer

        transfer.delay(order)
    else:
        asyncio.run(_enqueue_arq(order))


if __name__ == "__main__":
    main()
