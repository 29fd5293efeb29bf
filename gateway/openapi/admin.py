"""The admin listener's paths of the OpenAPI document (SPEC 4): rejections, jobs,
keys and their resolve, audit, summary, reload, metrics."""

from __future__ import annotations

from typing import Any

from gateway.admin import models
from gateway.errors import STATUS_BY_REASON
from gateway.http.schema import ref
from gateway.openapi.parts import (
    ADMIN_SECURITY,
    ADMIN_SERVERS,
    IDENT,
    INVALID,
    JOB_ID_PARAM,
    LIMIT,
    NOT_FOUND,
    STORE_DOWN,
    THROTTLED,
    UNAUTHORIZED,
    WHEN,
    json_answer,
    json_body,
    or_empty,
    path_param,
    problem,
    query,
)
from gateway.policy.decision import KeyState
from leases.reasons import Reason

_CURSOR = query("cursor", {"type": "string"})
_WINDOW = [query("since", or_empty(WHEN)), query("until", or_empty(WHEN))]
_KEY_PARAMS = [path_param("destination"), path_param("key")]


def admin_get(summary: str, model: type, params: list[dict[str, Any]]) -> dict[str, Any]:
    """A read of the admin API, answered with `model`."""
    return {
        "servers": ADMIN_SERVERS,
        "get": {
            "summary": summary,
            "tags": ["admin"],
            "security": ADMIN_SECURITY,
            "parameters": params,
            "responses": {
                "200": json_answer(summary, ref(model)),
                "400": INVALID,
                "401": UNAUTHORIZED,
                "429": THROTTLED,
                "404": NOT_FOUND,
                "503": STORE_DOWN,
            },
        },
    }


def admin_paths() -> dict[str, Any]:
    """Every path of the admin listener but health."""
    return {
        "/admin/rejections": _rejections_route(),
        "/admin/rejections/{id}": admin_get(
            "one rejected write", models.Rejection, [path_param("id")]
        ),
        "/admin/jobs/{job_id}": admin_get(
            "the lease and fence state of a job", models.JobState, [JOB_ID_PARAM]
        ),
        "/admin/keys/{destination}/{key}": admin_get(
            "an idempotency record", models.KeyRecord, _KEY_PARAMS
        ),
        **_ops_paths(),
        "/metrics": {
            "servers": ADMIN_SERVERS,
            "get": {
                "summary": "Prometheus text format (admin listener, no token)",
                "tags": ["admin"],
                "responses": {
                    "200": {
                        "description": "metrics",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            },
        },
    }


def _rejections_route() -> dict[str, Any]:
    route = admin_get(
        "rejected writes, newest first; format=csv or ndjson streams every match",
        models.RejectionPage,
        [
            query("destination", or_empty(IDENT)),
            query("job_id", or_empty(IDENT)),
            query("reason", or_empty({"type": "string", "enum": sorted(STATUS_BY_REASON)})),
            *_WINDOW,
            query("limit", or_empty(LIMIT)),
            _CURSOR,
            query("format", {"type": "string", "enum": ["json", "csv", "ndjson"]}),
        ],
    )
    route["get"]["responses"]["200"]["content"].update(
        {
            "text/csv": {"schema": {"type": "string"}},
            "application/x-ndjson": {"schema": {"type": "string"}},
        }
    )
    return route


def _ops_paths() -> dict[str, Any]:
    """The operator's routes of SPEC 4 v3: keys, resolve, audit, summary, reload."""
    return {
        "/admin/keys": admin_get(
            "idempotency records, newest first (state: the effective state)",
            models.KeyPage,
            [
                query("destination", or_empty(IDENT)),
                query("state", or_empty({"type": "string", "enum": [s.value for s in KeyState]})),
                query("job_id", or_empty(IDENT)),
                *_WINDOW,
                query("limit", or_empty(LIMIT)),
                _CURSOR,
            ],
        ),
        "/admin/keys/{destination}/{key}/resolve": _resolve_route(),
        "/admin/audit": admin_get(
            "operator actions, newest first",
            models.AuditPage,
            [*_WINDOW, query("limit", or_empty(LIMIT)), _CURSOR],
        ),
        "/admin/summary": admin_get(
            "rejection counts over a window (default 24 h), keys by state, a time series",
            models.Summary,
            _WINDOW,
        ),
        "/admin/reload": _admin_post(
            "re-read the destination files and [retention], as SIGHUP does",
            None,
            {
                "200": json_answer("the reload was applied", ref(models.ReloadAnswer)),
                "400": problem("the files do not validate", Reason.INVALID_CONFIG),
                "401": UNAUTHORIZED,
                "429": THROTTLED,
            },
        ),
    }


def _resolve_route() -> dict[str, Any]:
    route = _admin_post(
        "settle an unknown outcome (recorded in the audit log)",
        models.ResolveRequest,
        {
            "200": json_answer("the key after the change", ref(models.ResolvedKey)),
            "400": INVALID,
            "401": UNAUTHORIZED,
            "429": THROTTLED,
            "404": NOT_FOUND,
            "409": problem(
                "the key is not unknown, or another attempt holds it",
                Reason.KEY_NOT_UNKNOWN,
                Reason.ATTEMPT_MISMATCH,
            ),
            "413": problem("body too large", Reason.BODY_TOO_LARGE),
            "503": STORE_DOWN,
        },
        params=_KEY_PARAMS,
    )
    # Keys may hold `/`: a GET here reads the key named `{key}/resolve`.
    route["get"] = admin_get(
        "the idempotency record of the key named `{key}/resolve`", models.KeyRecord, _KEY_PARAMS
    )["get"]
    return route


def _admin_post(
    summary: str,
    body: type | None,
    responses: dict[str, Any],
    *,
    params: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": summary, "tags": ["admin"], "security": ADMIN_SECURITY}
    if params is not None:
        operation["parameters"] = params
    if body is not None:
        operation["requestBody"] = json_body(body)
    operation["responses"] = responses
    return {"servers": ADMIN_SERVERS, "post": operation}
