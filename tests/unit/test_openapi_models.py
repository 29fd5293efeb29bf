"""The OpenAPI document and the handlers' answers come from one set of models:
every model is documented, and what the handlers build validates against the
schema the document gives its route."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator, FormatChecker, ValidationError

import gateway
from gateway.admin import models as admin_models
from gateway.admin.audit import audit_page
from gateway.admin.jobs import job_view
from gateway.admin.keys import key_view, resolved_view
from gateway.admin.rejections import rejection_item, rejection_page, summary_view
from gateway.errors import Rejection
from gateway.http import models
from gateway.http.leases import lease_json
from gateway.http.schema import to_json
from gateway.openapi.document import build_document
from gateway.policy.decision import KeyRecord, KeyState
from gateway.policy.records import RejectionRecord
from gateway.store.admin_records import AuditEntry, Resolution, Summary
from gateway.store.records import JobState, StoredRejection
from gateway.write import route
from leases.model import Lease, LeaseRow, State
from leases.reasons import Reason

DOCUMENT = build_document()
NOW = 1_800_000_000.25


def _validate(body: Any, schema: dict[str, Any]) -> None:
    """`body` against `schema`, whose `$ref`s point into the document."""
    root = {"allOf": [schema], "components": DOCUMENT["components"]}
    validator = Draft202012Validator(root, format_checker=FormatChecker())
    validator.validate(json.loads(json.dumps(body)))


def _answer_schema(path: str, method: str = "get", status: str = "200") -> dict[str, Any]:
    responses = DOCUMENT["paths"][path][method]["responses"][status]
    content = responses["content"]
    return next(iter(content.values()))["schema"]


def _models_of(module: Any) -> set[type]:
    return {
        value
        for value in vars(module).values()
        if dataclasses.is_dataclass(value)
        and isinstance(value, type)
        and value.__module__ == module.__name__
    }


def test_every_model_of_an_answer_or_a_body_is_in_the_document() -> None:
    declared = _models_of(models) | _models_of(admin_models)
    assert {m.__name__ for m in declared} <= DOCUMENT["components"]["schemas"].keys()


def test_every_component_is_used_by_a_route() -> None:
    text = json.dumps(DOCUMENT["paths"])
    schemas = DOCUMENT["components"]["schemas"]
    held = json.dumps(schemas)
    for name in schemas:
        ref = f'"#/components/schemas/{name}"'
        assert ref in text or ref in held, name


def _lease() -> Lease:
    row = LeaseRow("job-1", "worker-a", 3, State.ACTIVE, NOW + 30, 30.0)
    return Lease.from_row(row, NOW)


def _rejection() -> StoredRejection:
    record = RejectionRecord(
        reason=Reason.STALE_GENERATION,
        detail="generation 1 is older than 3",
        destination="pay",
        method="POST",
        path="/x",
        job_id="job-1",
        generation=1,
        owner="w",
        idempotency_key="k",
        current_generation=3,
        highest_generation=3,
        remote="127.0.0.1",
        body_sha256="ab" * 32,
        body_bytes=2,
    )
    return StoredRejection(7, NOW, record)


def _key(state: KeyState = KeyState.UNKNOWN) -> KeyRecord:
    return KeyRecord(
        destination="pay",
        key="k-1",
        state=state,
        fingerprint="f" * 64,
        attempt="a" * 32,
        attempts=1,
        job_id="job-1",
        generation=3,
        owner=None,
        created_at=NOW - 5,
        updated_at=NOW - 4,
        deadline=NOW - 1,
        completed_at=NOW - 2 if state is KeyState.COMPLETED else None,
        status=201 if state is KeyState.COMPLETED else None,
        headers=(("Content-Type", "application/json"),),
        body=b"{}",
    )


def test_a_lease_answer_validates_against_the_lease_routes() -> None:
    body = lease_json(_lease(), NOW)
    for op in ("claim", "renew", "complete", "release"):
        _validate(body, _answer_schema(f"/leases/{{job_id}}/{op}", "post"))
    _validate(body, _answer_schema("/leases/{job_id}"))


def test_the_admin_answers_validate_against_their_routes() -> None:
    lease_row = LeaseRow("job-1", "worker-a", 3, State.ACTIVE, NOW + 30, 30.0)
    in_flight = {"attempt": "a" * 32, "generation": 3, "destination": "pay", "key": "k-1"}
    state = JobState("job-1", lease_row, 3, ({**in_flight, "started_at": NOW},), (_rejection(),))
    summary = Summary(NOW - 60, NOW, 30, NOW - 60, {"stale_generation": 2}, {"pay": 2},
                      {"pay": {"unknown": 1}}, {0: {"stale_generation": 2}})  # fmt: skip
    audit = [
        AuditEntry(n, NOW, "resolve_applied", "pay", "k", "a", "why", None, "alice") for n in (2, 1)
    ]
    applied = Resolution("pay", "k-1", "a" * 32, True, "checked upstream")
    released = dataclasses.replace(applied, applied=False)
    answers = [
        (rejection_page([_rejection()], "cursor"), "/admin/rejections"),
        (rejection_item(_rejection()), "/admin/rejections/{id}"),
        (job_view(state, NOW), "/admin/jobs/{job_id}"),
        (job_view(JobState("job-2", None, None), NOW), "/admin/jobs/{job_id}"),
        (key_view(_key(), NOW), "/admin/keys/{destination}/{key}"),
        (audit_page(audit, 1), "/admin/audit"),
        (summary_view(summary), "/admin/summary"),
    ]
    for body, path in answers:
        _validate(body, _answer_schema(path))
    resolve = "/admin/keys/{destination}/{key}/resolve"
    resolved = _answer_schema(resolve, "post")
    _validate(resolved_view(_key(KeyState.COMPLETED), applied, NOW), resolved)
    _validate(resolved_view(_key(), released, NOW), resolved)
    reloaded = to_json(admin_models.ReloadAnswer(True, ["pay"]))
    _validate(reloaded, _answer_schema("/admin/reload", "post"))
    _validate(to_json(models.OK), _answer_schema("/healthz"))


def test_a_member_the_model_does_not_declare_fails_validation() -> None:
    """The check above can fail: an answer that drifts from its model is caught."""
    body = {**lease_json(_lease(), NOW), "ttl": 30.0}
    with pytest.raises(ValidationError, match="ttl"):
        _validate(body, _answer_schema("/leases/{job_id}"))
    key = key_view(_key(), NOW)
    del key["attempts"]
    with pytest.raises(ValidationError, match="attempts"):
        _validate(key, _answer_schema("/admin/keys/{destination}/{key}"))


def test_problem_bodies_validate_with_every_member_a_rejection_carries() -> None:
    rejection = Rejection(
        Reason.LEASE_HELD,
        "held by w until ...",
        job_id="job-1",
        owner="w",
        expires_in=2.5,
        current_generation=3,
    )
    _validate(rejection.problem(), _answer_schema("/leases/{job_id}/claim", "post", "409"))
    refused = Rejection(Reason.ATTEMPT_MISMATCH, "x", destination="pay", attempt="a", state="b")
    resolve = "/admin/keys/{destination}/{key}/resolve"
    _validate(refused.problem(), _answer_schema(resolve, "post", "409"))
    bad_config = Rejection(Reason.INVALID_CONFIG, "x", errors=["a.toml: timeout: ..."])
    _validate(bad_config.problem(), _answer_schema("/admin/reload", "post", "400"))
    with pytest.raises(ValidationError):  # a reason the route does not list
        _validate(refused.problem(), _answer_schema("/leases/{job_id}/claim", "post", "409"))


def _member_names() -> set[str]:
    """Every keyword a `Rejection` is built with anywhere in the gateway."""
    options = {"status", "retry_after", "headers", "close"}  # the answer's, not the body's
    names: set[str] = set()
    builders = {"Rejection", "invalid_request", "read_body"}
    for path in Path(gateway.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if call and node.func.id in builders:  # type: ignore[attr-defined]
                names |= {k.arg for k in node.keywords if k.arg} - options
    return names - {"deadline_s", "budget"}  # read_body's own


def test_every_member_a_rejection_carries_is_a_field_of_the_problem_model() -> None:
    documented = set(DOCUMENT["components"]["schemas"]["Problem"]["properties"])
    found = _member_names()
    assert {"job_id", "current_generation", "errors", "attempt"} <= found
    assert found <= documented
    assert _write_members_keys() <= documented


def _write_members_keys() -> set[str]:
    """The members the write route adds from its facts (passed as `**members`)."""
    tree = ast.parse(Path(route.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "_write_members":
            returned = next(n for n in ast.walk(node) if isinstance(n, ast.Dict))
            return {k.value for k in returned.keys if isinstance(k, ast.Constant)}
    raise AssertionError("gateway.write.route._write_members is gone")
