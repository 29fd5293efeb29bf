"""The event loop's own work for N writes woken at once, in one process, without
the network: what `bench.waiting --waiters N` measures less the server stack,
the client and the sockets.

    python3 -m bench.woken_loop                    # 1,000 writes, 7 rounds
    python3 -m bench.woken_loop --waiters 1000 --rounds 9

A `WriteGateway` on a SQLite store in a temporary directory, JSON log lines to
/dev/null (the configuration `serve` makes when stderr is not a terminal), the
garbage collector tuned as `serve` tunes it. Each round claims a job, reserves
a key (the original, never sent), and hands N requests for it with
`Prefer: wait=30` to `WriteGateway.handle`, built by aiohttp's
`make_mocked_request`; once all are held, the original's outcome is recorded
and `Waiters.settled` called. Figures: the main thread's CPU (the event loop)
and the process's (with the store's thread) from that call until every handler
has returned its replay. The mocks of the held requests are frozen out of the
collector first, so that no collection of theirs falls in the figure. Run it
from the tree whose gateway it measures (the working directory comes first on
`sys.path`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

from aiohttp import streams
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from . import run as bench
from ._proc import install_loop

BODY = b"{}"


def held_request(headers: dict[str, str]) -> Any:
    protocol = mock.Mock(_reading_paused=False)
    content = streams.StreamReader(protocol, 2**16, loop=asyncio.get_running_loop())
    content.feed_data(BODY)
    content.feed_eof()
    transport = mock.Mock()
    transport.get_extra_info.return_value = ("127.0.0.1", 40000)
    all_headers = CIMultiDict(headers)
    all_headers["Content-Length"] = str(len(BODY))
    return make_mocked_request(
        "POST", "/to/bench/items", headers=all_headers, payload=content, transport=transport
    )


async def _until(condition: Any) -> None:
    while True:
        if condition():
            return
        await asyncio.sleep(0.01)


async def measure(waiters: int, rounds: int) -> tuple[list[float], list[float]]:
    # Imported here: the gateway of the working directory's tree, once logging is set.
    from gateway.config.model import load_config
    from gateway.policy.outcome import Answered
    from gateway.policy.outcome import outcome as policy_outcome
    from gateway.policy.records import WriteContext
    from gateway.store.sqlite import SQLiteStore
    from gateway.telemetry.metrics import Metrics
    from gateway.write.request import parse_target, write_facts
    from gateway.write.route import WriteGateway
    from gateway.write.upstream import Upstreams
    from gateway.write.waiting import Waiters

    tmp = Path(tempfile.mkdtemp(prefix="sinkgate-woken-"))
    url = f"sqlite:///{tmp / 'data' / 'sinkgate.db'}"
    config = load_config(bench.write_gateway_config(tmp, 1, 2, url, "http://127.0.0.1:9"))
    store = await SQLiteStore.open(url)
    metrics = Metrics()
    waiting = Waiters(limit=config.max_waiting, metrics=metrics)
    gateway = WriteGateway(config, store, Upstreams(config.destinations), metrics, waiting)
    destination = config.destinations["bench"]
    digest = hashlib.sha256(BODY).digest()
    context = WriteContext(remote="127.0.0.1", body_sha256=digest.hex(), body_bytes=len(BODY))
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)  # as `serve` does
    loop_ms: list[float] = []
    process_ms: list[float] = []
    try:
        for n in range(rounds):
            lease = await store.claim(f"job-{n}", owner="bench", ttl=120)
            headers = {
                "Content-Type": "application/json",
                "Fencing-Job": lease.job_id,
                "Fencing-Token": str(lease.generation),
                "Idempotency-Key": f"key-{n}",
            }
            original = held_request(headers)
            target = parse_target(original.raw_path)
            assert target is not None
            facts = write_facts(original, target, destination, digest)
            reserved = await store.decide_write(facts, context)
            assert reserved.attempt is not None
            held = [
                asyncio.ensure_future(
                    gateway.handle(held_request({**headers, "Prefer": "wait=30"}), target)
                )
                for _ in range(waiters)
            ]
            await _until(lambda: waiting.count >= waiters)
            answered = Answered(200, [("Content-Type", "application/json")], b'{"ok":1}', False)
            await store.record_outcome(
                facts, reserved.attempt, policy_outcome(answered, destination)
            )
            await asyncio.sleep(0.05)
            gc.collect()
            gc.freeze()
            loop0, process0 = time.thread_time(), time.process_time()
            waiting.settled(facts.destination, facts.key, facts.job_id)
            answers = await asyncio.gather(*held)
            loop_ms.append((time.thread_time() - loop0) * 1000)
            process_ms.append((time.process_time() - process0) * 1000)
            assert all(a.headers.get("Idempotent-Replayed") == "true" for a in answers)
            await asyncio.sleep(0.2)
    finally:
        await store.close()
    return loop_ms, process_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    from gateway.telemetry.logs import configure_logging

    stderr, sys.stderr = sys.stderr, open(os.devnull, "w")  # the lines' sink
    try:
        configure_logging("info", json=True)
        install_loop()
        loop_ms, process_ms = asyncio.run(measure(args.waiters, args.rounds))
    finally:
        sys.stderr = stderr
    print(
        f"{args.waiters} woken writes: event loop median {statistics.median(loop_ms):.1f} ms "
        f"(min {min(loop_ms):.1f}), process median {statistics.median(process_ms):.1f} ms "
        f"(min {min(process_ms):.1f}), {args.rounds} rounds"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
