"""The OpenAPI 3.1 document of the lease API, the admin API and the write route,
served at `GET /openapi.json` on the main listener.

Built from the same tables the handlers use (reason codes and their statuses,
the id alphabet, the ttl range), so the document cannot drift from them
silently; `tests/e2e/test_openapi.py` runs schemathesis against a live gateway to
check that the server answers what the document says.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from aiohttp import web

from gateway.errors import STATUS_BY_REASON
from gateway.store.admin_records import AUDIT_ACTIONS
from leases.model import LOST_REASONS, MAX_GENERATION, TTL_MAX, TTL_MIN
from leases.reasons import Reason

IDENT_PATTERN = "^[\\x21-\\x7e]{1,256}$"
PROBLEM_JSON = "application/problem+json"

# Every reason a gateway answer can carry (a replay is not an error).
_REASONS = sorted(set(STATUS_BY_REASON) - {Reason.DUPLICATE})
_LEASE_FAILURES = LOST_REASONS


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    kind = schema["type"]
    return {**schema, "type": [kind, "null"]}


def _problem(description: str, *reasons: str) -> dict[str, Any]:
    """A problem+json answer; `reasons` lists the reason codes it can carry."""
    schema: dict[str, Any] = _ref("Problem")
    if reasons:
        schema = {"allOf": [schema, {"properties": {"reason": {"enum": list(reasons)}}}]}
    return {
        "description": description,
        "headers": {"Sinkgate-Rejected": {"$ref": "#/components/headers/SinkgateRejected"}},
        "content": {PROBLEM_JSON: {"schema": schema}},
    }


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_STRING = {"type": "string"}
_INT = {"type": "integer"}
_GENERATION = {"type": "integer", "minimum": 1, "maximum": MAX_GENERATION}
_TIME = {"type": "string", "format": "date-time"}
_OWNER = {"type": "string", "pattern": IDENT_PATTERN}
_TTL = {"type": "number", "minimum": TTL_MIN, "maximum": TTL_MAX}

# Relative times (SPEC 4): a duration back from now, as the CLI accepts.
_DURATION = {"type": "string", "pattern": "^[0-9]{1,9}(\\.[0-9]{1,6})?[smhdw]$"}
_WHEN = {"anyOf": [{"type": "string", "format": "date-time"}, _DURATION]}
_KEY_STATES = ["in_flight", "completed", "unknown"]
_COUNTS = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}}

_OPS_SCHEMAS: dict[str, Any] = {
    "KeyPage": {
        "type": "object",
        "required": ["items", "next_cursor"],
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/components/schemas/KeyRecord"}},
            "next_cursor": {"type": ["string", "null"]},
        },
    },
    "ResolveRequest": {
        "type": "object",
        "required": ["outcome", "attempt", "note"],
        "additionalProperties": False,
        "properties": {
            "outcome": {"type": "string", "enum": ["applied", "not_applied"]},
            "attempt": {"type": "string", "pattern": IDENT_PATTERN},
            "note": {"type": "string", "minLength": 1, "maxLength": 1000, "pattern": "\\S"},
            "status": {"type": "integer", "minimum": 200, "maximum": 599},
            "body": {"type": "string"},
            "content_type": {"type": "string", "pattern": "^[\\x21-\\x7e][\\x20-\\x7e]{0,254}$"},
        },
    },
    "ResolvedKey": {
        "type": "object",
        "description": "The key after the change; a released key is shown as it was.",
        "required": ["destination", "key", "state", "attempt"],
        "properties": {
            "destination": {"type": "string"},
            "key": {"type": "string"},
            "state": {"type": "string", "enum": ["completed", "released"]},
            "attempt": {"type": "string"},
            "status": {"type": ["integer", "null"]},
        },
    },
    "AuditEntry": {
        "type": "object",
        "required": ["id", "at", "action", "destination", "key", "attempt", "note", "remote"],
        "properties": {
            "id": {"type": "integer"},
            "at": {"type": "string", "format": "date-time"},
            "action": {"type": "string", "enum": list(AUDIT_ACTIONS)},
            "destination": {"type": ["string", "null"]},
            "key": {"type": ["string", "null"]},
            "attempt": {"type": ["string", "null"]},
            "note": {"type": ["string", "null"]},
            "remote": {"type": ["string", "null"]},
        },
    },
    "AuditPage": {
        "type": "object",
        "required": ["items", "next_cursor"],
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/components/schemas/AuditEntry"}},
            "next_cursor": {"type": ["string", "null"]},
        },
    },
    "Summary": {
        "type": "object",
        "required": [
            "since",
            "until",
            "rejections_by_reason",
            "rejections_by_destination",
            "keys_by_state",
            "series",
        ],
        "properties": {
            "since": {"type": "string", "format": "date-time"},
            "until": {"type": "string", "format": "date-time"},
            "rejections_by_reason": _COUNTS,
            "rejections_by_destination": _COUNTS,
            "keys_by_state": {"type": "object", "additionalProperties": _COUNTS},
            "bucket_seconds": {"type": "integer", "minimum": 1},
            "series": {
                "type": "object",
                "required": ["bucket_seconds", "buckets"],
                "properties": {
                    "bucket_seconds": {"type": "integer", "minimum": 1},
                    "buckets": {
                        "type": "array",
                        "maxItems": 200,
                        "items": {
                            "type": "object",
                            "required": ["at", "counts"],
                            "properties": {
                                "at": {"type": "string", "format": "date-time"},
                                "counts": _COUNTS,
                            },
                        },
                    },
                },
            },
        },
    },
}

_SCHEMAS: dict[str, Any] = {
    "Problem": {
        "type": "object",
        "description": "RFC 9457 problem details; every error the gateway makes itself.",
        "required": ["type", "title", "status", "detail", "reason"],
        "properties": {
            "type": {"type": "string", "format": "uri"},
            "title": _STRING,
            "status": {"type": "integer", "minimum": 400, "maximum": 599},
            "detail": _STRING,
            "reason": {"type": "string", "enum": _REASONS},
            "destination": _STRING,
            "job_id": _STRING,
            "owner": _STRING,
            "generation": _INT,
            "current_generation": _INT,
            "highest_generation": _INT,
            "rejection_id": _INT,
            "expires_in": {"type": "number", "minimum": 0},
            "field": _STRING,
        },
    },
    "Lease": {
        "type": "object",
        "required": [
            "job_id",
            "owner",
            "generation",
            "state",
            "lease_until",
            "expires_in",
            "server_time",
        ],
        "additionalProperties": False,
        "properties": {
            "job_id": {"type": "string", "pattern": IDENT_PATTERN},
            "owner": _OWNER,
            "generation": _GENERATION,
            "state": {"type": "string", "enum": ["free", "active", "done"]},
            "lease_until": _TIME,
            "expires_in": {"type": "number", "minimum": 0},
            "server_time": _TIME,
        },
    },
    "ClaimRequest": {
        "type": "object",
        "required": ["owner", "ttl"],
        "additionalProperties": False,
        "properties": {"owner": _OWNER, "ttl": _TTL},
    },
    "RenewRequest": {
        "type": "object",
        "required": ["owner", "generation"],
        "additionalProperties": False,
        "properties": {
            "owner": _OWNER,
            "generation": _GENERATION,
            # null, like absent, keeps the ttl the lease was claimed with
            "ttl": {**_TTL, "type": ["number", "null"]},
        },
    },
    "HeldRequest": {
        "type": "object",
        "required": ["owner", "generation"],
        "additionalProperties": False,
        "properties": {"owner": _OWNER, "generation": _GENERATION},
    },
    "Rejection": {
        "type": "object",
        "required": ["id", "at", "reason"],
        "properties": {
            "id": _INT,
            "at": _TIME,
            "destination": _nullable(_STRING),
            "method": _nullable(_STRING),
            "path": _nullable(_STRING),
            "job_id": _nullable(_STRING),
            "generation": _nullable(_INT),
            "owner": _nullable(_STRING),
            "idempotency_key": _nullable(_STRING),
            "reason": _STRING,
            "detail": _nullable(_STRING),
            "current_generation": _nullable(_INT),
            "highest_generation": _nullable(_INT),
            "remote": _nullable(_STRING),
            "body_sha256": _nullable(_STRING),
            "body_bytes": _nullable(_INT),
        },
    },
    "RejectionPage": {
        "type": "object",
        "required": ["items", "next_cursor"],
        "properties": {
            "items": {"type": "array", "items": _ref("Rejection")},
            "next_cursor": _nullable(_STRING),
        },
    },
    "JobState": {
        "type": "object",
        "required": ["job_id", "server_time", "lease", "highest_generation", "in_flight"],
        "properties": {
            "job_id": _STRING,
            "server_time": _TIME,
            "lease": {
                "type": ["object", "null"],
                "properties": {
                    "job_id": _STRING,
                    "owner": _STRING,
                    "generation": _INT,
                    "state": {"type": "string", "enum": ["free", "active", "done"]},
                    "lease_until": _TIME,
                    "expires_in": {"type": "number", "minimum": 0},
                },
            },
            "highest_generation": _nullable(_INT),
            "in_flight": {"type": "array", "items": {"type": "object"}},
            "recent_rejections": {"type": "array", "items": _ref("Rejection")},
        },
    },
    "KeyRecord": {
        "type": "object",
        "required": ["destination", "key", "state", "fingerprint", "attempts"],
        "properties": {
            "destination": _STRING,
            "key": _STRING,
            "state": {"type": "string", "enum": ["in_flight", "completed", "unknown"]},
            "fingerprint": _STRING,
            "attempt": {"type": "string", "description": "the id of the attempt that holds it"},
            "status": _nullable(_INT),
            "attempts": _INT,
            "job_id": _STRING,
            "generation": _INT,
            "owner": _nullable(_STRING),
            "created_at": _TIME,
            "updated_at": _TIME,
            "completed_at": _nullable(_TIME),
            "deadline": _TIME,
            "response_headers": {"type": "array"},
            "body_bytes": _INT,
            "body_sha256": _nullable(_STRING),
            "body_omitted": {"type": "boolean"},
        },
    },
    **_OPS_SCHEMAS,
    "Status": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"type": "string", "enum": ["ok"]}},
    },
}

_JOB_ID_PARAM = {
    "name": "job_id",
    "in": "path",
    "required": True,
    "description": "Percent-decoded; 1-256 visible ASCII characters (0x21-0x7E).",
    "schema": {"type": "string", "pattern": IDENT_PATTERN},
}
_ADMIN_SERVERS = [
    {
        "url": "http://{admin_listen}",
        "description": "the admin listener (`[server] admin_listen`), not the main one",
        "variables": {"admin_listen": {"default": "127.0.0.1:8481"}},
    }
]
_ADMIN_SECURITY: list[dict[str, list[str]]] = [{"adminToken": []}]
_INVALID = _problem("malformed request", Reason.INVALID_REQUEST)
_STORE_DOWN = _problem("the store does not answer", Reason.STORE_UNAVAILABLE)
_UNAUTHORIZED = _problem("missing or wrong admin token", Reason.UNAUTHORIZED)
_NOT_FOUND = _problem("nothing with this id", Reason.NOT_FOUND)


def _lease_verb(summary: str, body: str, failures: tuple[str, ...]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "tags": ["leases"],
            "parameters": [_JOB_ID_PARAM],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(body)}},
            },
            "responses": {
                "200": _json("the lease after the operation", _ref("Lease")),
                "400": _INVALID,
                "409": _problem("refused; the lease is unchanged", *failures),
                "413": _problem("body over 64 KiB", Reason.BODY_TOO_LARGE),
                "503": _STORE_DOWN,
            },
        }
    }


def _admin_get(
    summary: str, schema: dict[str, Any], params: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "servers": _ADMIN_SERVERS,
        "get": {
            "summary": summary,
            "tags": ["admin"],
            "security": _ADMIN_SECURITY,
            "parameters": params,
            "responses": {
                "200": _json(summary, schema),
                "400": _INVALID,
                "401": _UNAUTHORIZED,
                "404": _NOT_FOUND,
                "503": _STORE_DOWN,
            },
        },
    }


def _or_empty(schema: dict[str, Any]) -> dict[str, Any]:
    """An empty filter means "not set", as an HTML form sends it."""
    return {"anyOf": [schema, {"type": "string", "maxLength": 0}]}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


def _write_operation(method: str) -> dict[str, Any]:
    header = _fencing_header_params()
    gateway_refusals = {
        "400": _problem(
            "fencing headers, key or path malformed, or a request the HTTP parser refuses",
            Reason.MISSING_FENCING_TOKEN,
            Reason.INVALID_FENCING_TOKEN,
            Reason.MISSING_IDEMPOTENCY_KEY,
            Reason.INVALID_IDEMPOTENCY_KEY,
            Reason.INVALID_PATH,
            Reason.INVALID_REQUEST,
        ),
        "401": _problem("worker token missing or wrong", Reason.UNAUTHORIZED),
        "404": _problem("unknown destination", Reason.UNKNOWN_DESTINATION),
        "405": _problem("method not allowed for this destination", Reason.METHOD_NOT_ALLOWED),
        "408": _problem("the body did not arrive in time", Reason.REQUEST_TIMEOUT),
        "409": _problem(
            "refused by the fence, the barrier or the key's state",
            *_LEASE_FAILURES,
            Reason.OLDER_GENERATION_IN_FLIGHT,
            Reason.REQUEST_IN_PROGRESS,
            Reason.OUTCOME_UNKNOWN,
        ),
        "413": _problem("body over the destination's max_body", Reason.BODY_TOO_LARGE),
        "422": _problem("key reused with another request", Reason.IDEMPOTENCY_KEY_REUSED),
        "502": _problem(
            "the upstream could not be reached or dropped the connection",
            Reason.UPSTREAM_UNREACHABLE,
            Reason.UPSTREAM_DISCONNECTED,
        ),
        "503": _problem(
            "overloaded or the store is down", Reason.OVERLOADED, Reason.STORE_UNAVAILABLE
        ),
        "504": _problem("no upstream answer within the timeout", Reason.UPSTREAM_TIMEOUT),
    }
    return {
        "summary": f"{method.upper()} a write through the gateway",
        "description": (
            "Forwarded to `{upstream}/{path}?{query}` of the destination after the fence "
            "and idempotency checks (SPEC 2). `path` may contain `/` and may be empty. "
            "Answers carrying `Sinkgate-Rejected` are the gateway's own (problem+json); "
            "every other answer, of any status, is the upstream's, relayed as it is "
            "(`Idempotent-Replayed: true` on a replay)."
        ),
        "tags": ["writes"],
        "security": [{}, {"workerToken": []}],
        "parameters": [
            {"name": "destination", "in": "path", "required": True, "schema": _STRING},
            {"name": "path", "in": "path", "required": True, "schema": _STRING},
            *header,
        ],
        "requestBody": {"required": False, "content": {"*/*": {"schema": {}}}},
        "responses": {
            **gateway_refusals,
            "default": {
                "description": "the upstream's answer, relayed (or replayed)",
                "headers": {
                    "Idempotent-Replayed": {
                        "description": "`true` on a replay of a stored answer",
                        "schema": {"type": "string", "enum": ["true"]},
                    }
                },
            },
        },
    }


def _fencing_header_params() -> list[dict[str, Any]]:
    return [
        {
            "name": "Fencing-Job",
            "in": "header",
            "required": True,
            "schema": {"type": "string", "pattern": IDENT_PATTERN},
        },
        {
            "name": "Fencing-Token",
            "in": "header",
            "required": True,
            "description": "The lease generation: `[1-9][0-9]*`, at most 2^63-1.",
            "schema": {"type": "string", "pattern": "^[1-9][0-9]{0,18}$"},
        },
        {
            "name": "Fencing-Owner",
            "in": "header",
            "required": False,
            "schema": {"type": "string", "pattern": IDENT_PATTERN},
        },
        {
            "name": "Idempotency-Key",
            "in": "header",
            "required": False,
            "description": "Required unless the destination sets require_idempotency_key = false.",
            "schema": {"type": "string", "pattern": '^("?)[\\x21-\\x7e]{1,255}\\1$'},
        },
    ]


def _rejections_route() -> dict[str, Any]:
    route = _admin_get(
        "rejected writes, newest first; format=csv or ndjson streams every match",
        _ref("RejectionPage"),
        [
            _query("destination", _or_empty({"type": "string", "pattern": IDENT_PATTERN})),
            _query("job_id", _or_empty({"type": "string", "pattern": IDENT_PATTERN})),
            _query("reason", _or_empty({"type": "string", "enum": sorted(STATUS_BY_REASON)})),
            _query("since", _or_empty(_WHEN)),
            _query("until", _or_empty(_WHEN)),
            _query("limit", _or_empty({"type": "integer", "minimum": 1, "maximum": 1000})),
            _query("cursor", {"type": "string"}),
            _query("format", {"type": "string", "enum": ["json", "csv", "ndjson"]}),
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
    """The operator's routes of SPEC 4 v3: keys, resolve, audit, summary."""
    ident = _or_empty({"type": "string", "pattern": IDENT_PATTERN})
    limit = _or_empty({"type": "integer", "minimum": 1, "maximum": 1000})
    window = [_query("since", _or_empty(_WHEN)), _query("until", _or_empty(_WHEN))]
    key_params = [
        {"name": "destination", "in": "path", "required": True, "schema": _STRING},
        {"name": "key", "in": "path", "required": True, "schema": _STRING},
    ]
    return {
        "/admin/keys": _admin_get(
            "idempotency records, newest first (state: the effective state)",
            _ref("KeyPage"),
            [
                _query("destination", ident),
                _query("state", _or_empty({"type": "string", "enum": _KEY_STATES})),
                _query("job_id", ident),
                *window,
                _query("limit", limit),
                _query("cursor", {"type": "string"}),
            ],
        ),
        "/admin/keys/{destination}/{key}/resolve": {
            "servers": _ADMIN_SERVERS,
            # Keys may hold `/`: a GET here reads the key named `{key}/resolve`.
            "get": _admin_get(
                "the idempotency record of the key named `{key}/resolve`",
                _ref("KeyRecord"),
                key_params,
            )["get"],
            "post": {
                "summary": "settle an unknown outcome (recorded in the audit log)",
                "tags": ["admin"],
                "security": _ADMIN_SECURITY,
                "parameters": key_params,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref("ResolveRequest")}},
                },
                "responses": {
                    "200": _json("the key after the change", _ref("ResolvedKey")),
                    "400": _INVALID,
                    "401": _UNAUTHORIZED,
                    "404": _NOT_FOUND,
                    "409": _problem(
                        "the key is not unknown, or another attempt holds it",
                        Reason.KEY_NOT_UNKNOWN,
                        Reason.ATTEMPT_MISMATCH,
                    ),
                    "413": _problem("body too large", Reason.BODY_TOO_LARGE),
                    "503": _STORE_DOWN,
                },
            },
        },
        "/admin/audit": _admin_get(
            "operator actions, newest first",
            _ref("AuditPage"),
            [*window, _query("limit", limit), _query("cursor", {"type": "string"})],
        ),
        "/admin/summary": _admin_get(
            "rejection counts over a window (default 24 h), keys by state, a time series",
            _ref("Summary"),
            window,
        ),
        "/admin/reload": {
            "servers": _ADMIN_SERVERS,
            "post": {
                "summary": "re-read the destination files and [retention], as SIGHUP does",
                "tags": ["admin"],
                "security": _ADMIN_SECURITY,
                "responses": {
                    "200": _json(
                        "the reload was applied",
                        {
                            "type": "object",
                            "required": ["reloaded", "destinations"],
                            "properties": {
                                "reloaded": {"type": "boolean", "enum": [True]},
                                "destinations": {"type": "array", "items": _STRING},
                            },
                        },
                    ),
                    "400": _problem("the files do not validate", Reason.INVALID_CONFIG),
                    "401": _UNAUTHORIZED,
                },
            },
        },
    }


def _health(summary: str, admin: bool) -> dict[str, Any]:
    path: dict[str, Any] = {
        "get": {
            "summary": summary,
            "tags": ["health"],
            "responses": {"200": _json("ok", _ref("Status")), "503": _STORE_DOWN},
        }
    }
    if admin:
        path["servers"] = _ADMIN_SERVERS
    return path


def build_document() -> dict[str, Any]:
    """The whole OpenAPI 3.1 document as a fresh dict."""
    renew_failures = _LEASE_FAILURES
    paths: dict[str, Any] = {
        "/leases/{job_id}": {
            "get": {
                "summary": "the job's lease",
                "tags": ["leases"],
                "parameters": [_JOB_ID_PARAM],
                "responses": {
                    "200": _json("the lease", _ref("Lease")),
                    "400": _INVALID,
                    "404": _problem("never claimed", Reason.LEASE_NOT_HELD),
                    "503": _STORE_DOWN,
                },
            }
        },
        "/leases/{job_id}/claim": _lease_verb(
            "claim the job (generation + 1)",
            "ClaimRequest",
            (Reason.LEASE_HELD, Reason.JOB_COMPLETED),
        ),
        "/leases/{job_id}/renew": _lease_verb("renew a held lease", "RenewRequest", renew_failures),
        "/leases/{job_id}/complete": _lease_verb(
            "mark the job done", "HeldRequest", renew_failures
        ),
        "/leases/{job_id}/release": _lease_verb(
            "give the lease up (state free)", "HeldRequest", renew_failures
        ),
        "/to/{destination}/{path}": {
            m: _write_operation(m) for m in ("post", "put", "patch", "delete")
        },
        "/healthz": _health("liveness (main listener; also on the admin one)", admin=False),
        "/readyz": _health("readiness: the store answers", admin=False),
        "/openapi.json": {
            "get": {
                "summary": "this document",
                "tags": ["meta"],
                "responses": {"200": _json("OpenAPI 3.1", {"type": "object"})},
            }
        },
        "/admin/rejections": _rejections_route(),
        "/admin/rejections/{id}": _admin_get(
            "one rejected write",
            _ref("Rejection"),
            [{"name": "id", "in": "path", "required": True, "schema": _STRING}],
        ),
        "/admin/jobs/{job_id}": _admin_get(
            "the lease and fence state of a job", _ref("JobState"), [_JOB_ID_PARAM]
        ),
        "/admin/keys/{destination}/{key}": _admin_get(
            "an idempotency record",
            _ref("KeyRecord"),
            [
                {"name": "destination", "in": "path", "required": True, "schema": _STRING},
                {"name": "key", "in": "path", "required": True, "schema": _STRING},
            ],
        ),
        **_ops_paths(),
        "/metrics": {
            "servers": _ADMIN_SERVERS,
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
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "sinkgate",
            "version": "1",
            "description": (
                "A fencing-aware, idempotent sink gateway. The lease API, the write route and "
                "this document are on the main listener; /admin and /metrics on the admin "
                "listener."
            ),
        },
        "servers": [{"url": "http://127.0.0.1:8480", "description": "the main listener"}],
        "paths": paths,
        "components": {
            "schemas": _SCHEMAS,
            "headers": {
                "SinkgateRejected": {
                    "description": "the reason code: this answer is the gateway's own",
                    "required": True,
                    "schema": {"type": "string"},
                }
            },
            "securitySchemes": {
                "adminToken": {"type": "http", "scheme": "bearer"},
                "workerToken": {"type": "http", "scheme": "bearer"},
            },
        },
    }


@cache
def _serialized() -> bytes:
    return json.dumps(build_document(), separators=(",", ":")).encode()


def add_openapi_route(app: web.Application) -> None:
    """Serve the document at `GET /openapi.json`."""

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=_serialized(), content_type="application/json")

    app.router.add_get("/openapi.json", openapi)
