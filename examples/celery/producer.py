"""Send orders to the Celery example's worker and print what each run returned.

    python3 -m examples.celery.producer 1001 1999 [--twice]

`--twice` sends the same order as two messages, which the worker's processes may
run at once: one charges it, and the other returns
`{"sinkgate": "job_completed", ...}` instead of charging again. Either may print first.
"""

from __future__ import annotations

import argparse

from .tasks import ship_order


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("order_id", type=int)
    parser.add_argument("amount", type=int)
    parser.add_argument("--twice", action="store_true", help="send the order twice")
    args = parser.parse_args(argv)
    sent = [ship_order.delay(args.order_id, args.amount) for _ in range(2 if args.twice else 1)]
    for result in sent:
        print(f"order {args.order_id}, task {result.id}: {result.get(timeout=60)}")


if __name__ == "__main__":
    main()
