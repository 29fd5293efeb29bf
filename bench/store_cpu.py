"""CPU per write of the SQLite gateway store alone, without HTTP.

    python3 -m bench.store_cpu                  # 20,000 writes, 32 concurrent
    python3 -m bench.store_cpu --writes 50000 --concurrency 128 --src DIR

Each simulated write is what the handler asks of the store: `decide_write`
(lease-mode fencing, a unique key) then `record_outcome` (completed). Prints
the process CPU per write, split into the event-loop thread and the rest (the
SQLite worker threads), and the batches' mean size. `--src DIR` imports the
gateway from another source tree (e.g. `git archive` of an older revision), to
compare two revisions in one sitting.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time


def thread_cpu(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(writes: int, concurrency: int) -> dict:
    from gateway.policy.decision import Fencing, WriteFacts
    from gateway.policy.records import Outcome, WriteContext
    from gateway.store.sqlite import SQLiteStore

    with tempfile.TemporaryDirectory() as tmp:
        store = await SQLiteStore.open(f"sqlite:///{tmp}/s.db")
        jobs = 64
        leases = [await store.claim(f"job-{j}", owner="w", ttl=3600) for j in range(jobs)]
        context = WriteContext(remote="127.0.0.1", body_sha256="0" * 64, body_bytes=20)
        outcome = Outcome(
            "completed", status=200, headers=(("Content-Type", "application/json"),), body=b"{}"
        )
        counter = iter(range(writes))

        async def worker(w: int) -> None:
            for n in counter:
                lease = leases[n % jobs]
                facts = WriteFacts(
                    destination="bench",
                    method="POST",
                    path="/items",
                    query="",
                    job_id=lease.job_id,
                    generation=lease.generation,
                    owner="w",
                    key=f"k-{n}",
                    fingerprint=f"{n:064x}",
                    fencing=Fencing.LEASE,
                    upstream_idempotent=False,
                    timeout=10.0,
                )
                verdict = await store.decide_write(facts, context)
                assert verdict.attempt is not None, verdict
                await asyncio.sleep(0)
                assert await store.record_outcome(facts, verdict.attempt, outcome)

        executor = store._executor
        batches0, ops0 = executor.batches, executor.operations
        main = threading.get_native_id()
        cpu0, main0, wall0 = time.process_time(), thread_cpu(main), time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        cpu, main_cpu = time.process_time() - cpu0, thread_cpu(main) - main0
        wall = time.perf_counter() - wall0
        batches, ops = executor.batches - batches0, executor.operations - ops0
        await store.close()
    return {
        "writes/s": writes / wall,
        "cpu ms/write": cpu * 1000 / writes,
        "loop ms/write": main_cpu * 1000 / writes,
        "other threads ms/write": (cpu - main_cpu) * 1000 / writes,
        "ops/batch": ops / max(1, batches),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writes", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--src", help="import gateway/ and leases/ from this directory")
    p.add_argument("--no-uvloop", action="store_true")
    args = p.parse_args(argv)
    if args.src:
        sys.path.insert(0, os.path.abspath(args.src))
    factory = None
    if not args.no_uvloop:
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:
            pass
    with asyncio.Runner(loop_factory=factory) as runner:
        report = runner.run(run(args.writes, args.concurrency))
    print(
        "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in report.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
