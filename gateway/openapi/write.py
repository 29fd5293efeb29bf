"""The write route's operations in the OpenAPI document (SPEC 2): the fencing
headers, and the refusals the gateway answers itself."""

from __future__ import annotations

from typing import Any

from gateway.errors import STATUS_BY_REASON
from gateway.openapi.parts import FROM_A_PAGE, IDENT, STRING, path_param, problem
from gateway.write.refusals import REFUSALS
from leases.model import KEY, TOKEN
from leases.reasons import REASONS, Reason

_DESCRIPTION = (
    "Forwarded to `{upstream}/{path}?{query}` of the destination after the fence "
    "and idempotency checks (SPEC 2). `path` may contain `/` and may be empty. "
    "Answers carrying `Sinkgate-Rejected` are the gateway's own (problem+json); "
    "every other answer, of any status, is the upstream's, relayed as it is "
    "(`Idempotent-Replayed: true` on a replay). With `Prefer: wait=N`, a write "
    "that would be refused `request_in_progress` or `older_generation_in_flight` "
    "is held until what blocks it settles (at most N seconds, capped by the "
    "destination's `max_wait`), then decided again: replayed, forwarded or refused."
)

# SPEC 2 "Waiting": the preference a write may send, and the answer's word that
# it was applied.
_PREFER = {
    "name": "Prefer",
    "in": "header",
    "required": False,
    "description": (
        "RFC 7240 preferences; only `wait=N` is read (N whole seconds, 1 or more; "
        "malformed or 0: no wait). Other preferences are ignored."
    ),
    "schema": {"type": "string", "examples": ["wait=10"]},
}
_PREFERENCE_APPLIED = {
    "description": (
        "`wait=M`, M the wait applied in seconds (the preference capped by the "
        "destination's `max_wait`): on every answer to a write whose `Prefer: wait` "
        "was honoured from the fence check on; absent when it was not (no or a "
        'malformed preference, `max_wait = "0s"`, or `[server] max_waiting` reached).'
    ),
    # After the upstream's own preferences applied, on a relayed or replayed answer
    # (before them where those stop being a preference list): one element of the list.
    "schema": {"type": "string", "pattern": "^(.+, )?wait=[1-9][0-9]*(, .+)?$"},
}
_RETRY_AFTER = {
    "description": "seconds to wait before trying again (SPEC 2)",
    "schema": {"type": "string", "pattern": "^[0-9]+$"},
}


def write_operation(method: str) -> dict[str, Any]:
    """`method` on `/to/{destination}/{path}`."""
    return {
        "summary": f"{method.upper()} a write through the gateway",
        "description": _DESCRIPTION,
        "tags": ["writes"],
        "security": [{}, {"workerToken": []}],
        "parameters": [
            path_param("destination", STRING),
            path_param("path", STRING),
            *_fencing_header_params(),
            _PREFER,
        ],
        "requestBody": {"required": False, "content": {"*/*": {"schema": {}}}},
        "responses": {
            **_refusals(),
            "default": {
                "description": "the upstream's answer, relayed (or replayed)",
                "headers": {
                    "Idempotent-Replayed": {
                        "description": "`true` on a replay of a stored answer",
                        "schema": {"type": "string", "enum": ["true"]},
                    },
                    "Preference-Applied": _PREFERENCE_APPLIED,
                },
            },
        },
    }


def _refusals() -> dict[str, Any]:
    """The gateway's own answers on the write route, by status; each may say a
    `Prefer: wait` was applied."""
    refusals = {}
    for description, reasons in REFUSALS:
        answer = refusals[str(STATUS_BY_REASON[reasons[0]])] = problem(description, *reasons)
        if any(REASONS[Reason(reason)].retry_later for reason in reasons):
            answer["headers"]["Retry-After"] = _RETRY_AFTER
    refusals["403"] = FROM_A_PAGE
    for status in ("409", "422", "502", "503", "504"):
        refusals[status]["headers"]["Preference-Applied"] = _PREFERENCE_APPLIED
    return dict(sorted(refusals.items()))


def _header(name: str, required: bool, schema: dict[str, Any], description: str = "") -> Any:
    param = {"name": name, "in": "header", "required": required, "schema": schema}
    if description:
        param["description"] = description
    return param


def _fencing_header_params() -> list[dict[str, Any]]:
    return [
        _header("Fencing-Job", True, IDENT),
        _header(
            "Fencing-Token",
            True,
            {"type": "string", "pattern": f"^{TOKEN.pattern}$"},
            "The lease generation: `[1-9][0-9]*`, at most 2^63-1.",
        ),
        _header("Fencing-Owner", False, IDENT),
        _header(
            "Idempotency-Key",
            False,
            {"type": "string", "pattern": f'^("?){KEY.pattern}\\1$'},
            "Required unless the destination sets require_idempotency_key = false.",
        ),
    ]
