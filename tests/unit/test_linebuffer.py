"""Log lines from the event loop are written once per loop turn, in order;
lines with no loop running are written at once."""

from __future__ import annotations

import asyncio
import io

from gateway.telemetry.linebuffer import TurnBufferedLoggerFactory


class CountingFile(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes += 1
        return super().write(data)


def test_without_a_loop_each_line_is_written_at_once() -> None:
    out = CountingFile()
    logger = TurnBufferedLoggerFactory(out)("x")
    logger.info(b"one")
    assert (out.getvalue(), out.writes) == (b"one\n", 1)


async def test_lines_of_one_loop_turn_share_one_write() -> None:
    out = CountingFile()
    logger = TurnBufferedLoggerFactory(out)("x")
    for n in range(5):
        logger.info(b"line %d" % n)
    assert out.writes == 0  # not before the turn ends
    await asyncio.sleep(0)
    assert out.writes == 1
    assert out.getvalue() == b"".join(b"line %d\n" % n for n in range(5))


async def test_a_large_turn_is_written_before_it_ends() -> None:
    out = CountingFile()
    logger = TurnBufferedLoggerFactory(out)("x")
    for _ in range(100):
        logger.info(b"y" * 1000)
    assert out.writes >= 1 and len(out.getvalue()) >= 64 * 1000
