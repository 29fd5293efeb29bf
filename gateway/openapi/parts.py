"""The pieces the OpenAPI document's paths are made of: answers, parameters, the
admin listener's server and security, relative times."""

from __future__ import annotations

from typing import Any

from gateway.http.models import IDENT_PATTERN, Problem
from gateway.http.schema import ref
from leases.reasons import Reason

PROBLEM_JSON = "application/problem+json"
STRING: dict[str, Any] = {"type": "string"}
IDENT: dict[str, Any] = {"type": "string", "pattern": IDENT_PATTERN}

# Relative times (SPEC 4): a duration back from now, as the CLI accepts.
DURATION = {"type": "string", "pattern": "^[0-9]{1,9}(\\.[0-9]{1,6})?[smhdw]$"}
WHEN = {"anyOf": [{"type": "string", "format": "date-time"}, DURATION]}
LIMIT = {"type": "integer", "minimum": 1, "maximum": 1000}

JOB_ID_PARAM = {
    "name": "job_id",
    "in": "path",
    "required": True,
    "description": "Percent-decoded; 1-256 visible ASCII characters (0x21-0x7E).",
    "schema": IDENT,
}
ADMIN_SERVERS = [
    {
        "url": "http://{admin_listen}",
        "description": "the admin listener (`[server] admin_listen`), not the main one",
        "variables": {"admin_listen": {"default": "127.0.0.1:8481"}},
    }
]
ADMIN_SECURITY: list[dict[str, list[str]]] = [{"adminToken": []}]


def problem(description: str, *reasons: str) -> dict[str, Any]:
    """A problem+json answer; `reasons` lists the reason codes it can carry."""
    schema: dict[str, Any] = ref(Problem)
    if reasons:
        schema = {"allOf": [schema, {"properties": {"reason": {"enum": list(reasons)}}}]}
    return {
        "description": description,
        "headers": {"Sinkgate-Rejected": {"$ref": "#/components/headers/SinkgateRejected"}},
        "content": {PROBLEM_JSON: {"schema": schema}},
    }


def json_answer(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def json_body(model: type) -> dict[str, Any]:
    """A required JSON request body of `model`'s shape."""
    return {"required": True, "content": {"application/json": {"schema": ref(model)}}}


INVALID = problem("malformed request", Reason.INVALID_REQUEST)
STORE_DOWN = problem("the store does not answer", Reason.STORE_UNAVAILABLE)
UNAUTHORIZED = problem("missing or wrong admin token", Reason.UNAUTHORIZED)
THROTTLED = problem(
    "too many failed authentications from this address; see Retry-After", Reason.UNAUTHORIZED
)
NOT_FOUND = problem("nothing with this id", Reason.NOT_FOUND)
# The main listener refuses what a browser sends for a web page (`Sec-Fetch-Site`
# or `Origin`): no page of ours calls it, and a rebound one would be same-origin;
# on loopback only, without a token, a host name that is not loopback's too.
FROM_A_PAGE = problem(
    "a request a browser sent for a web page, or, on a listener on loopback only "
    "and without a token, one naming a host that is not loopback's",
    Reason.UNAUTHORIZED,
)


def or_empty(schema: dict[str, Any]) -> dict[str, Any]:
    """An empty filter means "not set", as an HTML form sends it."""
    return {"anyOf": [schema, {"type": "string", "maxLength": 0}]}


def query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


def path_param(name: str, schema: dict[str, Any] = STRING) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": schema}
