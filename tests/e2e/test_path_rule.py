"""The path rule through a real gateway (SPEC 2 "Paths"): refused paths reach no
upstream; encoded look-alikes are forwarded exactly as sent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.harness import (
    Gateway,
    RecordingUpstream,
    destination,
    make_config,
    recording_upstream,
    running_gateway,
)


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    async with recording_upstream() as up:
        yield up


@pytest.fixture
async def gw(tmp_path: Path, upstream: RecordingUpstream) -> AsyncIterator[Gateway]:
    config = make_config(tmp_path, destination("pay", upstream.url + "/api"))
    async with running_gateway(config) as gateway:
        yield gateway


@pytest.mark.parametrize(
    "path",
    [
        *("/\\host/x", "/\\\\host", "/\\/host", "//host", "/http://host/x", "/https:\\\\h"),
        *("/x/..//host/steal", "/.//host/steal", "/..;/x"),
    ],
)
async def test_a_path_naming_another_host_is_400_and_not_forwarded(
    gw: Gateway, upstream: RecordingUpstream, path: str
) -> None:
    await gw.claim("job-1")
    status, headers, body = await gw.write("/to/pay" + path)
    assert status == 400, body
    assert headers["Sinkgate-Rejected"] == "invalid_path"
    assert json.loads(body)["reason"] == "invalid_path"
    assert upstream.received == []


@pytest.mark.parametrize("path", ["/http:%2F%2Fhost", "/@host", "/%40host"])
async def test_encoded_look_alikes_are_forwarded_as_they_are(
    gw: Gateway, upstream: RecordingUpstream, path: str
) -> None:
    await gw.claim("job-1")
    status, _, body = await gw.write("/to/pay" + path)
    assert status == 201, body
    assert upstream.paths() == ["/api" + path]


async def raw_status(gw: Gateway, target: str) -> tuple[int, bytes]:
    """A write sent byte for byte (an HTTP client would drop a `#` and what follows)."""
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            f"POST {target} HTTP/1.1\r\nHost: x\r\nFencing-Job: job-1\r\nFencing-Token: 1\r\n"
            "Idempotency-Key: k-frag\r\nContent-Length: 1\r\nConnection: close\r\n\r\nA".encode()
        )
        answer = await reader.read()
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest


@pytest.mark.parametrize(
    "target",
    [
        "/to/pay/..#x",  # the fragment dropped, `..` climbed above /api
        "/to/pay/%2e%2e#",
        "/to/pay/a/../..#",
        "http://e/to/pay/..#x",
        "/to/pay/x#a",  # fingerprinted with its fragment, forwarded without
        "/to/pay/x?q=1#f",
    ],
)
async def test_a_target_with_a_fragment_is_400_and_not_forwarded(
    gw: Gateway, upstream: RecordingUpstream, target: str
) -> None:
    await gw.claim("job-1")
    status, rest = await raw_status(gw, target)
    assert status == 400 and b"invalid_path" in rest, rest
    assert upstream.received == []
