"""read_body: the size limit holds whether the body is already buffered or still arriving."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
from aiohttp import streams
from aiohttp.test_utils import make_mocked_request

from gateway.errors import Rejection
from gateway.http.bodies import read_body


def _request(chunks: list[bytes], *, eof: bool) -> tuple[object, streams.StreamReader]:
    protocol = mock.Mock(_reading_paused=False)
    content = streams.StreamReader(protocol, 2**16, loop=asyncio.get_running_loop())
    for chunk in chunks:
        content.feed_data(chunk)
    if eof:
        content.feed_eof()
    # No Content-Length: a chunked body, whose size is only known by reading it.
    return make_mocked_request("POST", "/to/x/y", payload=content), content


async def test_a_buffered_body_within_the_limit_is_returned_whole() -> None:
    request, _ = _request([b"abc", b"def"], eof=True)
    assert await read_body(request, 6) == b"abcdef"  # type: ignore[arg-type]


async def test_a_buffered_body_over_the_limit_is_413() -> None:
    request, _ = _request([b"abc", b"defg"], eof=True)
    with pytest.raises(Rejection) as caught:
        await read_body(request, 6, destination="d")  # type: ignore[arg-type]
    assert (caught.value.reason, caught.value.members["destination"]) == ("body_too_large", "d")


async def test_a_body_still_arriving_is_cut_off_at_the_limit() -> None:
    request, content = _request([b"x" * 5], eof=False)
    reading = asyncio.ensure_future(read_body(request, 6))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert not reading.done()  # waits for the rest
    content.feed_data(b"x" * 5)  # 10 bytes > 6: refused before the end arrives
    with pytest.raises(Rejection) as caught:
        await reading
    assert caught.value.reason == "body_too_large"


async def test_a_body_that_stops_arriving_is_408_at_the_deadline() -> None:
    request, _ = _request([b"x"], eof=False)
    with pytest.raises(Rejection) as caught:
        await read_body(request, 100, deadline_s=0.05)  # type: ignore[arg-type]
    assert caught.value.reason == "request_timeout"
