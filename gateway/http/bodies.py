"""Reading request bodies with a size limit enforced while reading, and a deadline."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from gateway.errors import Rejection
from leases.reasons import Reason

# A body that trickles in slower than this ties up a connection and a slot for
# nothing: 408 (RFC 9110 15.5.9), problem+json like every refusal; the
# connection is closed with the rest of the body unread.
BODY_READ_TIMEOUT_S = 30.0
_READ_CHUNK = 64 * 1024


async def read_body(
    request: web.Request,
    limit: int,
    *,
    deadline_s: float | None = None,
    **members: Any,
) -> bytes:
    """The whole body, or `Rejection` body_too_large (413) / request_timeout (408)."""
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


def _too_large(limit: int, members: dict[str, Any]) -> Rejection:
    return Rejection(Reason.BODY_TOO_LARGE, f"the body exceeds {limit} bytes", **members)
