"""The lease API over HTTP (SPEC 3): claim, renew, complete, release and get.

Thin handlers: parse and validate the path and the JSON body, call one lease
verb of the store, and turn its answer or its typed error into a lease object
or problem+json. Nothing is written unless the request is valid.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import unquote

import structlog
from aiohttp import web

from gateway.errors import WORKER_CHALLENGE, Rejection
from gateway.http import models
from gateway.http.appkeys import METRICS, STORE
from gateway.http.auth import (
    NOT_LOOPBACK,
    authorization,
    bearer_matches,
    loopback_host,
    sent_for_a_page,
)
from gateway.http.bodies import read_uncoded_body
from gateway.http.models import ClaimRequest, HeldRequest, LeaseRequest, RenewRequest, rfc3339
from gateway.http.problem import invalid_request, problem_response
from gateway.http.schema import field_checks, field_names, required_names, to_json
from gateway.store.protocol import LeaseVerbs
from gateway.telemetry import traces
from gateway.telemetry.refusals import store_unavailable
from leases import model
from leases.errors import JobCompleted, LeaseHeld, LeaseLost, StoreUnavailable
from leases.model import Lease, LeaseRef
from leases.reasons import Reason

log = structlog.get_logger("gateway.http")

MAX_BODY = 64 * 1024
# A job id as a path segment: any characters but `/` (aiohttp's default pattern
# leaves out `{` and `}`, which the job id alphabet has).
JOB_SEGMENT = "{job_id:[^/]+}"

# The body each verb takes (gateway.http.models): any other field is refused, so a
# typo ("tll") fails loudly instead of silently falling back to a default.
LEASE_REQUESTS: dict[str, type[LeaseRequest]] = {
    "claim": ClaimRequest,
    "renew": RenewRequest,
    "complete": HeldRequest,
    "release": HeldRequest,
}


LEASE_TOKENS: web.AppKey[tuple[str, ...]] = web.AppKey("lease_tokens", tuple)
# The listener is on loopback only: a Host naming anything else is a rebound page's.
LOOPBACK_ONLY: web.AppKey[bool] = web.AppKey("loopback_only", bool)


def add_lease_routes(
    app: web.Application, *, tokens: tuple[str, ...] | None = None, loopback_only: bool = False
) -> None:
    """Register the lease API on `app`, which must hold `STORE` and `METRICS`.

    With `tokens`, every call needs `Authorization: Bearer <one of them>`; with
    `loopback_only` (the listener's address is loopback), a loopback `Host`.
    """
    if tokens:
        app[LEASE_TOKENS] = tokens
    app[LOOPBACK_ONLY] = loopback_only
    traced = traces.traced_lease_handler  # the handler itself when tracing is off
    app.router.add_get(f"/leases/{JOB_SEGMENT}", traced(_get))
    app.router.add_post(f"/leases/{JOB_SEGMENT}/{{op}}", traced(_post))
    # Any other method on a verb's path still gets problem+json, never aiohttp's text.
    app.router.add_route("*", f"/leases/{JOB_SEGMENT}/{{op}}", traced(_wrong_method))


def lease_json(lease: Lease, now: float) -> dict[str, Any]:
    """The lease object of SPEC 3 (`models.Lease`). `server_time` is the store's
    now that `expires_in` counts from (the lease's own, while it runs), so that
    `lease_until - server_time == expires_in`; `now` for any other lease."""
    moment = datetime.fromtimestamp(now, UTC)
    if lease.expires_in > 0:
        moment = lease.lease_until - timedelta(seconds=lease.expires_in)
    return to_json(
        models.Lease(
            job_id=lease.job_id,
            owner=lease.owner,
            generation=lease.generation,
            state=lease.state,
            lease_until=rfc3339(lease.lease_until),
            expires_in=lease.expires_in,
            server_time=rfc3339(moment),
        )
    )


# --- handlers --------------------------------------------------------------------------


def _authorize(request: web.Request) -> None:
    tokens = request.app.get(LEASE_TOKENS)
    if tokens and not bearer_matches(authorization(request.headers), tokens):
        raise Rejection(
            Reason.UNAUTHORIZED, "missing or wrong lease API token", headers=WORKER_CHALLENGE
        )
    if not tokens and request.app.get(LOOPBACK_ONLY) and not loopback_host(request.host):
        # No token to tell a worker from a rebound page (whose name it sends).
        raise Rejection(Reason.UNAUTHORIZED, NOT_LOOPBACK, status=403)
    if sent_for_a_page(request.headers):
        # A page in a browser can POST a JSON text as text/plain without asking
        # first: without tokens it could claim (or complete) a job, and read a
        # lease's owner and generation to write in its holder's stead.
        raise Rejection(
            Reason.UNAUTHORIZED,
            "a request a browser sends for a web page may not call the lease API",
            status=403,
        )


async def _get(request: web.Request) -> web.StreamResponse:
    async def run(store: LeaseVerbs, job_id: str, _: LeaseRequest | None) -> Lease:
        lease = await store.get(job_id)
        if lease is None:
            raise Rejection(
                Reason.LEASE_NOT_HELD,
                f"job {job_id!r} has never been claimed",
                status=404,
                job_id=job_id,
            )
        return lease

    return await _answer(request, "get", run)


OTHER_OP = "(other)"
_KNOWN_OPS = frozenset({*LEASE_REQUESTS, "get"})


async def _post(request: web.Request) -> web.StreamResponse:
    op = request.match_info["op"]
    if op not in LEASE_REQUESTS:
        return _reject(request, op, Rejection(Reason.NOT_FOUND, f"no lease operation {op!r}"))
    return await _answer(request, op, _VERBS[op])


async def _wrong_method(request: web.Request) -> web.StreamResponse:
    op = request.match_info["op"]
    if op not in LEASE_REQUESTS:
        return _reject(request, op, Rejection(Reason.NOT_FOUND, f"no lease operation {op!r}"))
    refusal = Rejection(
        Reason.METHOD_NOT_ALLOWED,
        f"{request.method} is not allowed here; use POST",
        headers={"Allow": "POST"},
    )
    return _finish(request, op, problem_response(refusal), Reason.METHOD_NOT_ALLOWED, {})


async def _claim(store: LeaseVerbs, job_id: str, body: LeaseRequest | None) -> Lease:
    assert isinstance(body, ClaimRequest)
    return await store.claim(job_id, owner=body.owner, ttl=body.ttl)


async def _renew(store: LeaseVerbs, job_id: str, body: LeaseRequest | None) -> Lease:
    assert isinstance(body, RenewRequest)
    return await store.renew(_named(job_id, body), ttl=body.ttl)


async def _complete(store: LeaseVerbs, job_id: str, body: LeaseRequest | None) -> Lease:
    assert isinstance(body, HeldRequest)
    return await store.complete(_named(job_id, body))


async def _release(store: LeaseVerbs, job_id: str, body: LeaseRequest | None) -> Lease:
    assert isinstance(body, HeldRequest)
    return await store.release(_named(job_id, body))


Verb = Callable[[LeaseVerbs, str, LeaseRequest | None], Awaitable[Lease]]
_VERBS: dict[str, Verb] = {
    "claim": _claim,
    "renew": _renew,
    "complete": _complete,
    "release": _release,
}


def _named(job_id: str, body: RenewRequest | HeldRequest) -> LeaseRef:
    return LeaseRef(job_id, body.owner, body.generation)


async def _answer(request: web.Request, op: str, verb: Verb) -> web.StreamResponse:
    store = request.app[STORE]
    facts: dict[str, Any] = {}
    try:
        try:
            _authorize(request)
        except Rejection:
            # the line and the answer name the path's job where it is valid, as a
            # write refused for its token does
            with contextlib.suppress(Rejection):
                facts["job_id"] = _job_id(request)
            raise
        facts["job_id"] = job_id = _job_id(request)
        body = await _body(request, op) if op in LEASE_REQUESTS else None
        facts.update(
            owner=getattr(body, "owner", None), generation=getattr(body, "generation", None)
        )
        started = time.perf_counter()
        try:
            lease = await verb(store, job_id, body)
        finally:
            elapsed = time.perf_counter() - started
            request.app[METRICS].store_latency.labels(op=f"lease_{op}").observe(elapsed)
            facts["store_ms"] = round(elapsed * 1000, 3)
    except (Rejection, ValueError, LeaseHeld, JobCompleted, LeaseLost, StoreUnavailable) as exc:
        if isinstance(exc, StoreUnavailable):
            request.app[METRICS].store_errors.labels(op=f"lease_{op}").inc()
            # The driver's words are logged, not answered: they name the database
            # (the lease API needs no token unless configured to).
            store_unavailable(f"lease_{op}", str(exc), job_id=facts.get("job_id"))
        return _reject(request, op, _refusal(exc, facts.get("job_id")), facts)
    now = store.clock()
    facts.update(owner=lease.owner, generation=lease.generation)
    return _finish(request, op, web.json_response(lease_json(lease, now)), "ok", facts)


def _refusal(exc: Exception, job_id: str | None) -> Rejection:
    """The answer to a refused call: the request's own problem, or the store's."""
    if isinstance(exc, Rejection):
        if job_id is not None:
            exc.members.setdefault("job_id", job_id)  # the path's job, once it is valid
        return exc
    if isinstance(exc, LeaseHeld):
        return Rejection(
            Reason.LEASE_HELD,
            str(exc),
            retry_after=max(1, math.ceil(exc.expires_in)),
            job_id=exc.job_id,
            owner=exc.owner,
            expires_in=exc.expires_in,
            current_generation=exc.current_generation,
        )
    if isinstance(exc, JobCompleted):
        return Rejection(
            Reason.JOB_COMPLETED,
            str(exc),
            job_id=exc.job_id,
            current_generation=exc.current_generation,
        )
    if isinstance(exc, LeaseLost):
        return Rejection(
            exc.reason,
            str(exc),
            job_id=exc.job_id,
            generation=exc.generation,
            current_generation=exc.current_generation,
        )
    if isinstance(exc, StoreUnavailable):
        return Rejection(
            Reason.STORE_UNAVAILABLE, "the lease store did not answer; retry", job_id=job_id
        )
    # ValueError: the store's own argument check; nothing was written
    return invalid_request(str(exc), job_id=job_id)


def _reject(
    request: web.Request, op: str, rejection: Rejection, facts: dict[str, Any] | None = None
) -> web.StreamResponse:
    return _finish(request, op, problem_response(rejection), rejection.reason, facts or {})


def _finish(
    request: web.Request,
    op: str,
    response: web.StreamResponse,
    result: str,
    facts: dict[str, Any],
) -> web.StreamResponse:
    # An operation no route has (POST /leases/j/anything) is "(other)" in the metric,
    # the line and the span: the raw path segment would be a series per request, for
    # anybody (it is refused before the token is checked).
    op = op if op in _KNOWN_OPS else OTHER_OP
    request.app[METRICS].lease_ops.labels(op=op, result=result).inc()
    ok = result == "ok"
    fields = {
        "op": op,
        "result": result,
        "status": response.status,
        "job_id": facts.get("job_id"),
        "owner": facts.get("owner"),
        "generation": facts.get("generation"),
        # SPEC 10's fields on every decision's line, as a write's line has them
        "key": None,
        "decision": "ok" if ok else "rejected",
        "reason": None if ok else result,
        # how long the store took (null: refused before the store was asked), as a
        # write's line has it: a store slowing down shows here before it fails
        "store_ms": facts.get("store_ms"),
    }
    if traces.TRACER is not None:
        traces.annotate_lease(fields)
    log.info("lease_decision", **fields)
    return response


# --- parsing ---------------------------------------------------------------------------


_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def _job_id(request: web.Request) -> str:
    job_id = request.match_info["job_id"]
    # aiohttp leaves an escape that is not UTF-8 (%FF) undecoded; refuse it instead of
    # reading "%FF" as a job id of its own.
    # A `%` that starts no escape (`x%zz`) is kept as it is by both, which would
    # make `x%zz` and `x%25zz` one job: refused too.
    raw = request.rel_url.raw_parts[2] if len(request.rel_url.raw_parts) > 2 else job_id
    try:
        strict = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        strict = None
    if strict != job_id or _BAD_ESCAPE.search(raw):
        raise invalid_request("job_id in the path is not valid percent-encoded UTF-8")
    try:
        return model.validate_ident(job_id, "job_id")
    except ValueError as exc:
        raise invalid_request(str(exc)) from None


async def _body(request: web.Request, op: str) -> LeaseRequest:
    raw = await read_uncoded_body(request, MAX_BODY)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise invalid_request("the body is not valid JSON (UTF-8)") from None
    if not isinstance(body, dict):
        raise invalid_request(f"the body must be a JSON object, not {json_kind(body)}")
    shape = LEASE_REQUESTS[op]
    allowed = field_names(shape)
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise invalid_request(
            f"unknown field {unknown[0]!r}; {op} takes {', '.join(allowed)}", field=unknown[0]
        )
    for name in required_names(shape):
        if name not in body:  # a null one is refused by its check, as renew's null ttl
            raise invalid_request(f"missing field {name!r}", field=name)
    checks = field_checks(shape)  # as gateway.http.models documents each field
    parsed: dict[str, Any] = {}
    for name in allowed:
        if name not in body:
            continue  # only an optional field can be absent here (renew's ttl)
        value = body[name]
        try:
            parsed[name] = checks[name](value, name)
        except ValueError as exc:
            # The checks are the Python API's, which name Python's types; a JSON
            # client sent JSON's ("not null", not "not NoneType").
            detail = str(exc).replace(f"not {type(value).__name__}", f"not {json_kind(value)}")
            raise invalid_request(detail, field=name) from None
    return shape(**parsed)


def json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float):
        return repr(value)  # "generation must be an integer, not 1.0"
    if isinstance(value, int):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"
