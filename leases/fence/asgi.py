"""The fence as ASGI middleware, for any ASGI framework (no dependency of its own)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .core import Fence
from .gate import FenceGate, Refusal, fencing_of

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ASGIFence:
    """`app = ASGIFence(app, Fence(), "sqlite:///ledger.db")`.

    HTTP requests carrying `Fencing-Job`/`Fencing-Token` are checked in a
    committed transaction of their own, then passed to `app` with the job's lock
    held until `app` returns; a stale one gets 409 `stale_generation` and `app`
    never sees it. Other requests, websockets and lifespan events pass through;
    on `lifespan.shutdown` (or `close()`) the fence's database is closed.
    """

    def __init__(self, app: ASGIApp, fence: Fence, database_url: str) -> None:
        if not callable(app):
            raise ValueError("app must be an ASGI application")
        self.app = app
        self.gate = FenceGate(fence, database_url)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, self._closing_on_shutdown(receive), send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        fencing = fencing_of(*_fencing_headers(scope))
        if fencing is None:
            await self.app(scope, receive, send)
            return
        if isinstance(fencing, Refusal):
            await _answer(send, fencing)
            return
        async with self.gate.admit(*fencing) as refused:
            if refused is not None:
                await _answer(send, refused)
                return
            await self.app(scope, receive, send)

    def _closing_on_shutdown(self, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message.get("type") == "lifespan.shutdown":
                await self.close()
            return message

        return wrapped

    async def close(self) -> None:
        """Close the fence's database connection(s)."""
        await self.gate.close()


# The space around a field value (RFC 9110 5.5); str.strip() would also take
# U+00A0 and U+0085 off a latin-1 value, making `a\xa0` the job `a`.
_OWS = " \t"


def _fencing_headers(scope: Scope) -> tuple[list[str], list[str]]:
    jobs: list[str] = []
    tokens: list[str] = []
    for name, value in scope.get("headers", ()):
        lowered = bytes(name).lower()
        if lowered == b"fencing-job":
            jobs.append(bytes(value).decode("latin-1").strip(_OWS))
        elif lowered == b"fencing-token":
            tokens.append(bytes(value).decode("latin-1").strip(_OWS))
    return jobs, tokens


async def _answer(send: Send, refusal: Refusal) -> None:
    headers = [(k.lower().encode(), v.encode()) for k, v in refusal.headers.items()]
    headers.append((b"content-length", str(len(refusal.body)).encode()))
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": refusal.body})
