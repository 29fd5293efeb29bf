"""A forward's body checks its bound once, as its first byte is written, however
the client library reaches it."""

from __future__ import annotations

import time

import pytest
from aiohttp import payload

from gateway.write import upstream
from gateway.write.upstream import TooLateToSend


class _Writer:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    async def write(self, chunk: bytes) -> None:
        self.chunks.append(bytes(chunk))


async def test_a_body_written_through_write_is_checked_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The base `Payload.write_with_length` (a library version whose bytes payload
    does not override it) writes through `write`: checked twice, every forward
    was refused as written twice."""
    monkeypatch.setattr(
        payload.BytesPayload, "write_with_length", payload.Payload.write_with_length
    )
    body = upstream._SentBy(b"abc", send_by=time.perf_counter() + 60)
    writer = _Writer()
    await body.write_with_length(writer, None)  # type: ignore[arg-type]
    assert writer.chunks == [b"abc"] and body.started


async def test_a_body_past_its_bound_writes_nothing() -> None:
    body = upstream._SentBy(b"abc", send_by=time.perf_counter() - 1)
    writer = _Writer()
    with pytest.raises(TooLateToSend):
        await body.write_with_length(writer, 3)  # type: ignore[arg-type]
    assert writer.chunks == [] and not body.started
