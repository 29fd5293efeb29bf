"""Relaying an upstream answer too long to buffer (over `max_replay_body`).

Such an answer's outcome is recorded as soon as its status and headers have
arrived (`completed`, body not stored: SPEC 2), before any of it is relayed; the
body then streams through in chunks, so the gateway holds at most the buffered
first part plus a chunk per write, whatever the upstream sends. A worker that
goes away mid-stream only ends the relay; an upstream that breaks off mid-body
gets the worker's connection aborted, so the worker sees a cut body (never a
complete-looking one).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from gateway.write.upstream import UpstreamAnswer

log = structlog.get_logger("gateway.write")

CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class Relayed:
    """The answer as sent, how many body bytes went out, and what broke it off."""

    response: web.StreamResponse
    relayed_bytes: int
    relay_error: str | None = None


async def relay(request: web.Request, answer: UpstreamAnswer) -> Relayed:
    """Send `answer`'s status, headers, buffered part and the rest of its body."""
    rest = answer.rest
    assert rest is not None
    response = web.StreamResponse(status=answer.status, headers=answer.headers)
    if answer.content_length is not None:
        response.content_length = answer.content_length
    relayed = 0
    error: str | None = None
    try:
        await response.prepare(request)
        await response.write(answer.body)
        relayed = len(answer.body)
        async for chunk in rest.content.iter_chunked(CHUNK):
            await response.write(chunk)
            relayed += len(chunk)
        await response.write_eof()
        rest.release()
    except aiohttp.ClientError as exc:  # the upstream broke off mid-body
        # Fixed words: a client error's repr quotes the forwarded request's headers.
        error = f"upstream: {type(exc).__name__}"
        _abort(request)
    except ConnectionError as exc:  # the worker went away: nothing more to send
        error = f"worker: {type(exc).__name__}"
        _abort(request)
    finally:
        rest.close()  # no-op after release(); else the connection is not reused
    return Relayed(response, relayed, error)


def _abort(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


def close_stream(task: asyncio.Future[Any]) -> None:
    """Done-callback of a forward whose handler was cancelled: close an answer
    left to relay (its outcome is recorded; only its bytes are dropped). The
    forward's result is (answer, reason, sent)."""
    if task.cancelled() or task.exception() is not None:
        return
    answer = task.result()[0]
    if isinstance(answer, UpstreamAnswer) and answer.rest is not None:
        answer.rest.close()
