"""Reading request bodies with a size limit enforced while reading, and a deadline."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import HttpVersion11, hdrs, web

from gateway.errors import Rejection
from leases.reasons import Reason

# A body that trickles in slower than this ties up a connection and a slot for
# nothing: 408 (RFC 9110 15.5.9), problem+json like every refusal; the
# connection is closed with the rest of the body unread.
BODY_READ_TIMEOUT_S = 30.0
_READ_CHUNK = 64 * 1024


class BodyBudget:
    """The bytes that request bodies still arriving may hold at once: each such
    read takes its `Content-Length` (or its limit, when chunked) until it is
    done, so that many slow bodies cannot grow the process without bound. One
    read is let through alone whatever its size, so a body the limit allows is
    never refused for good."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, size: int) -> bool:
        if self.used and self.used + size > self.limit:
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        self.used -= size


async def read_body(
    request: web.Request,
    limit: int,
    *,
    deadline_s: float | None = None,
    budget: BodyBudget | None = None,
    **members: Any,
) -> bytes:
    """The whole body, or `Rejection` body_too_large (413) / request_timeout (408),
    or overloaded (503, the connection closed) when `budget` has no room for a
    body still arriving."""
    deadline_s = BODY_READ_TIMEOUT_S if deadline_s is None else deadline_s
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit, members)
    content = request.content
    if content.is_eof():
        # The whole body is already buffered (the common case for small writes):
        # nothing to wait for, so no deadline timer to set up and cancel.
        body = await content.read()
        if len(body) > limit:
            raise _too_large(limit, members)
        return body
    need = limit if request.content_length is None else request.content_length
    if budget is not None and not budget.take(need):
        raise Rejection(
            Reason.OVERLOADED,
            "too many request bodies are arriving at once",
            close=True,  # the body is not read: the connection cannot be kept
            **members,
        )
    try:
        return await _read_chunks(content, limit, deadline_s, members)
    finally:
        if budget is not None:
            budget.give(need)


async def _read_chunks(
    content: Any, limit: int, deadline_s: float, members: dict[str, Any]
) -> bytes:
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(deadline_s):
            while chunk := await content.read(_READ_CHUNK):
                size += len(chunk)
                if size > limit:  # enforced while reading, not after
                    raise _too_large(limit, members)
                chunks.append(chunk)
    except TimeoutError:
        raise Rejection(
            Reason.REQUEST_TIMEOUT, f"the body did not arrive within {deadline_s:g} s", **members
        ) from None
    return b"".join(chunks)


async def read_uncoded_body(request: web.Request, limit: int) -> bytes:
    """`read_body` for a body the gateway reads itself (the lease API's JSON, the
    admin's forms and JSON): as sent, so one in a content coding is refused (400)
    rather than read as if it were not (the listeners do not inflate bodies)."""
    coding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
    if coding not in ("", "identity"):
        raise Rejection(Reason.INVALID_REQUEST, "a body in a content coding is not accepted here")
    return await read_body(request, limit)


async def continue_if_expected(request: web.Request, limit: int, **members: Any) -> None:
    """Answer `Expect: 100-continue` (RFC 9110 10.1.1) once the request may send its
    body: a body announced over `limit` is refused first, so the client never sends
    it. Any other expectation is a 417 (`invalid_request`)."""
    expect = request.headers.get(hdrs.EXPECT)
    if expect is None:
        return
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit, members)
    if expect.lower() != "100-continue":
        raise Rejection(
            Reason.INVALID_REQUEST,
            "the only expectation understood is 100-continue",
            status=417,
            **members,
        )
    if request.version >= HttpVersion11:  # an HTTP/1.0 client does not wait for it
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer proper has not started


def _too_large(limit: int, members: dict[str, Any]) -> Rejection:
    return Rejection(Reason.BODY_TOO_LARGE, f"the body exceeds {limit} bytes", **members)
