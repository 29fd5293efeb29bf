"""bench.parts: py-spy stacks bucketed by part, for all threads or one."""

from __future__ import annotations

from pathlib import Path

from bench import parts

RAW = (
    "thread (1): MainThread;run (asyncio/runners.py:1);handle (gateway/write/route.py:9) 3\n"
    "thread (1): MainThread;run (asyncio/runners.py:1);_request (aiohttp/client.py:5) 1\n"
    "thread (2): Thread-1 (_connection_worker_thread);_write_batch (leases/sqlite.py:7) 4\n"
)


def test_a_thread_filter_counts_only_that_threads_samples(tmp_path: Path) -> None:
    raw = tmp_path / "gateway-c32.txt"
    raw.write_text(RAW)
    every, total = parts.breakdown(raw)
    assert total == 8 and every["store, BEGIN/COMMIT + fsync (C)"] == 0.5
    loop, loop_total = parts.breakdown(raw, thread="MainThread")
    assert loop_total == 4
    assert loop["write-route handling (checks, facts, fingerprint, answer)"] == 0.75
    assert loop["upstream client (aiohttp client)"] == 0.25
    assert loop["store, BEGIN/COMMIT + fsync (C)"] == 0
    table = parts.table([raw], [0.2], thread="MainThread")
    route = "write-route handling (checks, facts, fingerprint, answer)"
    assert f"| {route} | 75.0 % (0.150 ms) |" in table
