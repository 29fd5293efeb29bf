"""The fence as an aiohttp middleware (imported only when it is asked for)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from .core import Fence
from .gate import FenceGate, Refusal, fencing_of

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AiohttpFence:
    """`web.Application(middlewares=[aiohttp_middleware(fence, url)])`.

    A request carrying `Fencing-Job`/`Fencing-Token` is checked in a committed
    transaction of its own, then handled with the job's lock held; a stale one
    gets 409 `stale_generation` and its handler is never called. Requests
    without the headers pass through untouched, and so do requests no route
    serves (aiohttp's 404 and 405 answer them). `close` (also usable as an
    `on_cleanup` callback) closes the database.
    """

    def __init__(self, fence: Fence, database_url: str) -> None:
        self.gate = FenceGate(fence, database_url)
        self.__middleware_version__ = 1  # a new-style aiohttp middleware

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.match_info.http_exception is not None:
            # No route serves it (404, 405): no effect can follow, so it must not
            # raise the job's mark and fence off the generations below it.
            return await handler(request)
        fencing = fencing_of(
            request.headers.getall("Fencing-Job", []), request.headers.getall("Fencing-Token", [])
        )
        if fencing is None:
            return await handler(request)
        if isinstance(fencing, Refusal):
            return _answer(fencing)
        async with self.gate.admit(*fencing) as refused:
            if refused is not None:
                return _answer(refused)
            return await handler(request)

    async def close(self, _app: web.Application | None = None) -> None:
        """Close the fence's database connection(s)."""
        await self.gate.close()


def aiohttp_middleware(fence: Fence, database_url: str) -> AiohttpFence:
    """An aiohttp middleware checking `fence` in the database at `database_url`
    (`sqlite:///path` or `postgresql://...`) for every fenced request."""
    return AiohttpFence(fence, database_url)


def _answer(refusal: Refusal) -> web.Response:
    return web.Response(status=refusal.status, body=refusal.body, headers=refusal.headers)
