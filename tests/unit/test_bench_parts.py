"""bench.parts: py-spy stacks bucketed by part, for all threads or one."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def test_the_command_prints_the_table_and_refuses_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = tmp_path / "gateway-c32.txt"
    raw.write_text(RAW)
    assert parts.main([str(raw), "--thread", "MainThread", "--cpu", "0.2"]) == 0
    assert "75.0 % (0.150 ms)" in capsys.readouterr().out
    for argv, message in (
        ([str(tmp_path / "missing.txt")], "no such file"),
        ([str(raw), "--cpu", "0.2,0.3"], "--cpu gives 2 figures for 1 files"),
        ([str(raw), "--cpu", "fast"], "invalid ms_per_write value"),
    ):
        with pytest.raises(SystemExit) as exited:
            parts.main(argv)
        assert exited.value.code == 2
        assert message in capsys.readouterr().err
