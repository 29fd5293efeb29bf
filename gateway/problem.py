"""problem+json answers (RFC 9457) for every error the gateway makes itself."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from .errors import Rejection

PROBLEM_JSON = "application/problem+json"


def problem_response(rejection: Rejection) -> web.Response:
    """The answer for `rejection`, with `Sinkgate-Rejected` and `Retry-After` headers."""
    headers = {"Sinkgate-Rejected": rejection.reason}
    if rejection.retry_after is not None:
        headers["Retry-After"] = str(rejection.retry_after)
    return web.Response(
        status=rejection.status,
        body=json.dumps(rejection.problem(), separators=(",", ":")).encode(),
        content_type=PROBLEM_JSON,
        headers=headers,
    )


def invalid_request(detail: str, **members: Any) -> Rejection:
    return Rejection("invalid_request", detail, **members)
