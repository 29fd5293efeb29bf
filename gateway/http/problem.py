"""problem+json answers (RFC 9457) for every error the gateway makes itself."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from gateway.errors import Rejection
from leases.reasons import Reason

PROBLEM_JSON = "application/problem+json"


def problem_response(rejection: Rejection) -> web.Response:
    """The answer for `rejection`, with `Sinkgate-Rejected` and `Retry-After` headers."""
    headers = {**rejection.headers, "Sinkgate-Rejected": rejection.reason}
    if rejection.retry_after is not None:
        headers["Retry-After"] = str(rejection.retry_after)
    response = web.Response(
        status=rejection.status,
        body=json.dumps(rejection.problem(), separators=(",", ":")).encode(),
        content_type=PROBLEM_JSON,
        headers=headers,
    )
    if rejection.close or rejection.reason == Reason.REQUEST_TIMEOUT:
        response.force_close()  # the rest of the body is never read: `Connection: close`
    return response


def invalid_request(detail: str, **members: Any) -> Rejection:
    return Rejection(Reason.INVALID_REQUEST, detail, **members)


def router_refusal(request: web.Request, exc: web.HTTPException) -> web.Response | None:
    """The router's own 404 and 405 as problem+json (405 keeps its `Allow`); None
    for any other `HTTPException`, which the caller re-raises."""
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allow = ", ".join(sorted(exc.allowed_methods))
        return problem_response(
            Rejection(
                Reason.METHOD_NOT_ALLOWED,
                f"{request.method} is not allowed here",
                headers={"Allow": allow},
            )
        )
    if isinstance(exc, web.HTTPNotFound):
        return problem_response(Rejection(Reason.NOT_FOUND, f"no route {request.path[:200]}"))
    return None
