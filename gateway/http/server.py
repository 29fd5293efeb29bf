"""The aiohttp runner every listener of the gateway is served with.

aiohttp's HTTP parser refuses some requests before any application code runs (a
control character in a header, a malformed request line, a line over the
limits) and answers them itself, in plain text. SPEC 2 wants every error answer
the gateway makes to be problem+json with `Sinkgate-Rejected`, and aiohttp has
no public hook for those answers (aio-libs/aiohttp#3287). So this module, and
only this one, reaches into aiohttp's server: `GatewayRunner` builds a `Server`
whose connections use `_ProblemRequestHandler`, whose `handle_error` turns a
parse error into an `invalid_request` problem. What it relies on: aiohttp
answers a parse error through `RequestHandler.handle_error(request, 400,
<HttpProcessingError>)`, `Server.__call__` is the connection factory (built
from the server's `_loop` and `_kwargs`), and `AppRunner._make_server` makes
the `Server`. pyproject.toml bounds aiohttp to the versions this is checked
against; tests/e2e/test_hardening.py checks the answers on both listeners.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    PayloadEncodingError,
)

from gateway.errors import Rejection
from gateway.http.problem import invalid_request, problem_response

# Parser errors whose message quotes the request's own bytes: named by class
# instead, so no answer echoes what the client sent. Subclasses come first.
_ERROR_NAMES: tuple[tuple[type[HttpProcessingError], str], ...] = (
    (LineTooLong, "line too long"),
    (InvalidHeader, "invalid header"),
    (BadHttpMethod, "invalid method"),
    (BadStatusLine, "invalid request line"),
    (InvalidURLError, "invalid request target"),
    (PayloadEncodingError, "invalid body framing"),
)

_DETAIL_LIMIT = 200

log = structlog.get_logger("gateway.http")


def parse_error_rejection(status: int, exc: HttpProcessingError) -> Rejection:
    """The `invalid_request` answer for a request aiohttp's parser refused with
    `status`; the detail names what was wrong without quoting the request."""
    detail = f"malformed HTTP request: {_error_name(exc)}"
    return invalid_request(_printable(detail)[:_DETAIL_LIMIT], status=status)


def _error_name(exc: HttpProcessingError) -> str:
    """Other parser errors carry a fixed description on their first line (the C
    parser's is llhttp's own reason, with the quoted bytes below it); at most a
    header name from aiohttp's list of singletons, lower-cased here."""
    for error_class, name in _ERROR_NAMES:
        if isinstance(exc, error_class):
            return name
    first_line = exc.message.split("\n", 1)[0].rstrip(":").strip()
    return first_line.lower() or "unreadable"


def _printable(text: str) -> str:
    return "".join(c for c in text if " " <= c <= "~")


class _ProblemRequestHandler(web.RequestHandler):
    """aiohttp's connection protocol, answering parse errors as problem+json."""

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp calls this with the parser's exception and a 4xx for a request
        it could not parse, and with 500/504 for a handler that failed.

        A parse error is answered as a problem, and logged as one line without
        the parser's message or traceback: both quote the request's bytes, which
        may hold a worker's or the admin's token. A client that went away
        mid-request (its body cut short) is not a fault of the gateway's: one
        line, no traceback. Anything else is aiohttp's: logged with its traceback."""
        if isinstance(exc, HttpProcessingError) and status < 500:
            log.info(
                "request_unparsable", remote=request.remote, status=status, error=_error_name(exc)
            )
            _not_started(request)
            problem = problem_response(parse_error_rejection(status, exc))
            problem.force_close()
            return problem
        if isinstance(exc, ConnectionError) and request.transport is None:
            log.info("client_disconnected", remote=request.remote, method=request.method)
            _not_started(request)
            answer = web.Response(status=status)
            answer.force_close()
            return answer
        return super().handle_error(request, status, exc, message)


def _not_started(request: web.BaseRequest) -> None:
    """aiohttp's own check: an answer already on its way cannot be replaced."""
    if request.writer.output_size > 0:
        raise ConnectionError("an answer was already being sent")


class _ProblemServer(web.Server):
    """aiohttp's `Server`, making `_ProblemRequestHandler` connections; the same
    construction as `Server.__call__`."""

    def __call__(self) -> web.RequestHandler:
        return _ProblemRequestHandler(self, loop=self._loop, **self._kwargs)


RequestHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
# Given the application's own handler, the one the listener calls instead.
Front = Callable[[RequestHandler], RequestHandler]


class GatewayRunner(web.AppRunner):
    """`web.AppRunner` whose listener answers aiohttp's own parse errors as
    problem+json. Takes the same options, and `front`: what the listener calls
    for each request in place of the application (given the application's
    handler to fall back on), so a hot route can skip the router and the
    middleware chain."""

    def __init__(self, app: web.Application, *, front: Front | None = None, **kwargs: Any):
        # Bodies as sent: a write's body is hashed and forwarded byte for byte with
        # its Content-Encoding (aiohttp would inflate it and forward the inflated
        # bytes under the same header), and a body that is not what its coding says
        # is the upstream's to refuse, not an error in the gateway.
        kwargs.setdefault("auto_decompress", False)
        super().__init__(app, **kwargs)
        self._front = front

    async def _make_server(self) -> web.Server:
        """aiohttp's own `Server` first (it starts and freezes the app and folds in
        the runner's options), then ours from the same arguments."""
        made = await super()._make_server()
        handler = made.request_handler
        return _ProblemServer(
            handler if self._front is None else self._front(handler),
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )
