"""The OpenAPI 3.1 document of the lease API, the admin API and the write route,
served at `GET /openapi.json` on the main listener.

Every schema in it is walked from the models the handlers build their answers
from (`gateway.http.models`, `gateway.admin.models`, by `gateway.http.schema`),
and every reason list comes from the tables the handlers use (reason codes and
their statuses), so the document cannot drift from the wire silently. This
module holds the paths; `tests/e2e/test_openapi.py` runs schemathesis against a
live gateway to check that the server answers what the document says.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from aiohttp import web

from gateway.admin import models as admin_models
from gateway.http import models
from gateway.http.leases import LEASE_REQUESTS
from gateway.http.schema import Components, ref
from gateway.openapi.admin import admin_paths
from gateway.openapi.parts import (
    FROM_A_PAGE,
    INVALID,
    JOB_ID_PARAM,
    STORE_DOWN,
    json_answer,
    json_body,
    problem,
)
from gateway.openapi.write import write_operation
from leases.model import LOST_REASONS
from leases.reasons import Reason

# Every model an answer or a request body of the document has; the models they
# hold are added with them.
DOCUMENTED: tuple[type, ...] = (
    models.Problem,
    models.Status,
    models.Lease,
    *LEASE_REQUESTS.values(),
    admin_models.RejectionPage,
    admin_models.JobState,
    admin_models.KeyPage,
    admin_models.ResolveRequest,
    admin_models.ResolvedKey,
    admin_models.AuditPage,
    admin_models.Summary,
    admin_models.ReloadAnswer,
)

# What each lease verb is, and the refusals it can answer besides the common ones.
_LEASE_VERBS: dict[str, tuple[str, tuple[str, ...]]] = {
    "claim": ("claim the job (generation + 1)", (Reason.LEASE_HELD, Reason.JOB_COMPLETED)),
    "renew": ("renew a held lease", LOST_REASONS),
    "complete": ("mark the job done", LOST_REASONS),
    "release": ("give the lease up (state free)", LOST_REASONS),
}


# Lease calls need a token only where `[server] lease_tokens_env` is set.
_LEASE_SECURITY: list[dict[str, list[str]]] = [{}, {"leaseToken": []}]
_LEASE_REFUSED = {
    "401": problem("lease API token missing or wrong", Reason.UNAUTHORIZED),
    "403": FROM_A_PAGE,
}


def components() -> Components:
    """The schemas of every documented model."""
    found = Components()
    for model in DOCUMENTED:
        found.add(model)
    return found


def _lease_verb(op: str) -> dict[str, Any]:
    summary, failures = _LEASE_VERBS[op]
    return {
        "post": {
            "summary": summary,
            "tags": ["leases"],
            "security": _LEASE_SECURITY,
            "parameters": [JOB_ID_PARAM],
            "requestBody": json_body(LEASE_REQUESTS[op]),
            "responses": {
                "200": json_answer("the lease after the operation", ref(models.Lease)),
                "400": INVALID,
                **_LEASE_REFUSED,
                "409": problem("refused; the lease is unchanged", *failures),
                "413": problem("body over 64 KiB", Reason.BODY_TOO_LARGE),
                "503": STORE_DOWN,
            },
        }
    }


def _lease_paths() -> dict[str, Any]:
    get = {
        "summary": "the job's lease",
        "tags": ["leases"],
        "security": _LEASE_SECURITY,
        "parameters": [JOB_ID_PARAM],
        "responses": {
            "200": json_answer("the lease", ref(models.Lease)),
            "400": INVALID,
            **_LEASE_REFUSED,
            "404": problem("never claimed", Reason.LEASE_NOT_HELD),
            "503": STORE_DOWN,
        },
    }
    return {
        "/leases/{job_id}": {"get": get},
        **{f"/leases/{{job_id}}/{op}": _lease_verb(op) for op in _LEASE_VERBS},
    }


def _health(summary: str) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "tags": ["health"],
            "responses": {"200": json_answer("ok", ref(models.Status)), "503": STORE_DOWN},
        }
    }


def _main_paths() -> dict[str, Any]:
    """The main listener's paths: leases, writes, health, this document."""
    return {
        **_lease_paths(),
        "/to/{destination}/{path}": {
            method: write_operation(method) for method in ("post", "put", "patch", "delete")
        },
        "/healthz": _health("liveness (main listener; also on the admin one)"),
        "/readyz": _health("readiness: the store answers"),
        "/openapi.json": {
            "get": {
                "summary": "this document",
                "tags": ["meta"],
                "responses": {"200": json_answer("OpenAPI 3.1", {"type": "object"})},
            }
        },
    }


@dataclass(frozen=True, slots=True)
class Listeners:
    """The base URLs of a gateway's two listeners (scheme, host and port)."""

    main: str
    admin: str


def build_document(listeners: Listeners | None = None) -> dict[str, Any]:
    """The whole OpenAPI 3.1 document as a fresh dict; with `listeners`, as a
    gateway serves it, its `servers` naming that gateway's own listeners. Without,
    the defaults (`127.0.0.1:8480`, and the admin listener as a server variable)."""
    document = _document()
    return document if listeners is None else _served_at(document, listeners)


def _served_at(document: dict[str, Any], listeners: Listeners) -> dict[str, Any]:
    """`document` with every `servers` list naming `listeners`: the top-level one
    (the main listener) and those of the admin paths and operations."""
    document["servers"] = [{"url": listeners.main, "description": "the main listener"}]
    admin = [{"url": listeners.admin, "description": "the admin listener, not the main one"}]
    for item in document["paths"].values():
        for part in (item, *(op for op in item.values() if isinstance(op, dict))):
            if "servers" in part:
                part["servers"] = admin
    return document


def _document() -> dict[str, Any]:
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
        "paths": {**_main_paths(), **admin_paths()},
        "components": {
            "schemas": components().schemas,
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
                "leaseToken": {"type": "http", "scheme": "bearer"},
            },
        },
    }


@lru_cache(maxsize=16)  # one gateway has one pair, or a few with wildcard listeners
def _serialized(listeners: Listeners) -> bytes:
    return json.dumps(build_document(listeners), separators=(",", ":")).encode()


def add_openapi_route(app: web.Application, listeners: Callable[[web.Request], Listeners]) -> None:
    """Serve the document at `GET /openapi.json`, its `servers` the `listeners` of
    the gateway the request reached."""

    async def openapi(request: web.Request) -> web.Response:
        body = _serialized(listeners(request))
        return web.Response(body=body, content_type="application/json")

    app.router.add_get("/openapi.json", openapi)
