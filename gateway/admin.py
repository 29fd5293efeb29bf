"""The admin listener: rejected-write inspection (JSON and an HTML page), metrics, health.

Every route under `/admin` needs the admin token: `Authorization: Bearer <token>`,
or, for an operator's browser, the session cookie that `POST /admin/login` sets
after checking the same token (HttpOnly, SameSite=Strict, path /admin, 12 hours,
an HMAC of its expiry keyed by the token, so changing the token ends every
session). Tokens are never accepted in a query string: URLs end up in logs and
browser history. `/healthz`, `/readyz` and `/metrics` are open.

This module holds the app factory, auth, the JSON API and health; the HTML page
and its sign-in handlers are in `admin_page`, which builds on the query parsing
and JSON shapes here (so this module imports it only where it is used).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import ipaddress
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from leases.model import LOST_REASONS, MAX_GENERATION, expires_in

from .decision import KeyRecord
from .errors import STATUS_BY_REASON, Rejection, StoreUnavailable
from .metrics import Metrics
from .problem import invalid_request, problem_response, router_refusal
from .store import JobState, RejectionQuery, Store, StoredRejection

if TYPE_CHECKING:
    from .admin_page import Page

log = structlog.get_logger("sinkgate.admin")

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
READY_TIMEOUT_S = 2.0
SESSION_COOKIE = "sinkgate_admin"
SESSION_TTL_S = 12 * 3600
FILTERS = ("destination", "job_id", "reason", "since", "until", "limit", "cursor")

# Reasons a rejection-log row can carry, in the order of SPEC 2's checks (the
# page's reason menu). Filtering accepts any reason the gateway knows.
RECORDED_REASONS = (
    "unauthorized",
    "body_too_large",
    "missing_fencing_token",
    "invalid_fencing_token",
    "missing_idempotency_key",
    "invalid_idempotency_key",
    *LOST_REASONS,
    "older_generation_in_flight",
    "idempotency_key_reused",
    "request_in_progress",
    "outcome_unknown",
    "duplicate",
)

_RFC3339 = re.compile(
    r"(\d{4}-\d{2}-\d{2})[Tt ](\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?([Zz]|[+-]\d{2}:\d{2})"
)
_IDENT = re.compile(r"[\x21-\x7e]{1,256}")
_ID = re.compile(r"[1-9][0-9]{0,18}")
_CURSOR_PREFIX = "r1:"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --- the factory -------------------------------------------------------------------------


def create_admin_app(
    store: Store,
    metrics: Metrics,
    *,
    token: str | None,
    clock: Callable[[], float] = time.time,
) -> web.Application:
    """The admin listener's app. `token=None` leaves /admin open (loopback only,
    see `admin_bind_allowed`). `clock` only times login sessions."""
    from .admin_page import Page  # not at the top: admin_page imports this module

    auth = _Auth(token, clock)
    app = web.Application(middlewares=[_errors_middleware(metrics), auth.middleware])
    add_health_routes(app, lambda: store)

    async def metrics_handler(request: web.Request) -> web.Response:
        body, content_type = metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    page = Page(store, auth)
    api = _Api(store, page)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/admin", page.redirect_to_page)
    app.router.add_get("/admin/", page.listing)
    app.router.add_get("/admin/login", page.login_form)
    app.router.add_post("/admin/login", page.login)
    app.router.add_post("/admin/logout", page.logout)
    app.router.add_get("/admin/rejections", api.list_rejections)
    app.router.add_get("/admin/rejections/{id}", api.get_rejection)
    app.router.add_get("/admin/jobs/{job_id}", api.get_job)
    app.router.add_get("/admin/keys/{destination}/{key:.+}", api.get_key)
    return app


def add_health_routes(app: web.Application, store_of: Callable[[], Store]) -> None:
    """`/healthz` (the process answers) and `/readyz` (the store can take a write
    within `READY_TIMEOUT_S`).

    `store_of` is asked at each probe: the main app opens its store on startup,
    after its routes are fixed.
    """

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await store_of().ping()
        except (StoreUnavailable, TimeoutError) as exc:
            return problem_response(
                Rejection("store_unavailable", f"the store does not answer: {exc}")
            )
        return web.json_response({"status": "ok"})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)


def admin_bind_allowed(host: str, token: str | None) -> bool:
    """Whether the admin listener may bind `host`: always with a token, else only
    on loopback (127.0.0.0/8, ::1, localhost)."""
    if token:
        return True
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# --- auth ----------------------------------------------------------------------------------


class _Auth:
    """Bearer token or session cookie, both checked in constant time."""

    def __init__(self, token: str | None, clock: Callable[[], float]) -> None:
        self._token = None if not token else token.encode("utf-8", "surrogatepass")
        self._clock = clock

    @property
    def open(self) -> bool:
        return self._token is None

    def check_token(self, presented: str) -> bool:
        if self._token is None:
            return True
        return hmac.compare_digest(presented.encode("utf-8", "surrogatepass"), self._token)

    def new_session(self) -> str:
        expiry = int(self._clock()) + SESSION_TTL_S
        return f"{expiry}.{self._mac(expiry)}"

    def authenticated(self, request: web.Request) -> bool:
        if self._token is None:
            return True
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            return self.check_token(credentials.strip())
        return self._valid_session(request.cookies.get(SESSION_COOKIE, ""))

    def _valid_session(self, value: str) -> bool:
        expiry, _, mac = value.partition(".")
        if not _ID.fullmatch(expiry) or int(expiry) <= self._clock():
            return False
        return hmac.compare_digest(mac.encode("ascii", "replace"), self._mac(int(expiry)).encode())

    def _mac(self, expiry: int) -> str:
        assert self._token is not None
        message = f"sinkgate-admin-session:{expiry}".encode()
        return hmac.new(self._token, message, hashlib.sha256).hexdigest()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        guarded = path == "/admin" or path.startswith("/admin/")
        if not guarded or path == "/admin/login" or self.authenticated(request):
            return await handler(request)
        log.warning("admin_unauthorized", path=path, remote=request.remote)
        if wants_html(request):
            from .admin_page import login_page  # not at the top: see create_admin_app

            return login_page(request, status=401, message=None)
        response = problem_response(
            Rejection("unauthorized", "this route needs Authorization: Bearer <admin token>")
        )
        response.headers["WWW-Authenticate"] = 'Bearer realm="sinkgate-admin"'
        return response


def wants_html(request: web.Request) -> bool:
    """The page routes answer HTML; everything else problem+json."""
    return request.path in ("/admin", "/admin/") or request.query.get("format") == "html"


def _errors_middleware(metrics: Metrics) -> Any:
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Rejection as rejection:
            return problem_response(rejection)
        except StoreUnavailable as exc:
            metrics.store_errors.labels(op="admin").inc()
            log.warning("admin_store_unavailable", path=request.path, error=str(exc))
            return problem_response(Rejection("store_unavailable", str(exc)))
        except web.HTTPException as exc:
            refusal = router_refusal(request, exc)
            if refusal is None:
                raise
            return refusal

    return errors


# --- the JSON API ------------------------------------------------------------------------


class _Api:
    def __init__(self, store: Store, page: Page) -> None:
        self._store = store
        self.page = page

    async def list_rejections(self, request: web.Request) -> web.Response:
        query = parse_rejection_query(request.query)
        items, next_cursor = await fetch_page(self._store, query)
        return web.json_response(
            {"items": [rejection_item(r) for r in items], "next_cursor": next_cursor}
        )

    async def get_rejection(self, request: web.Request) -> web.Response:
        _only_params(request.query, ())
        if request.query.get("format") == "html":
            return await self.page.detail(request)
        found = await find_rejection(self._store, request.match_info["id"])
        return web.json_response(rejection_item(found))

    async def get_job(self, request: web.Request) -> web.Response:
        _only_params(request.query, ())
        job_id = request.match_info["job_id"]
        state = None
        if _IDENT.fullmatch(job_id):
            state = await self._store.job_state(job_id)
        if state is None:
            raise Rejection("not_found", "no lease, fence, attempt or rejection for this job")
        return web.json_response(job_view(state, self._store.clock()))

    async def get_key(self, request: web.Request) -> web.Response:
        _only_params(request.query, ())
        destination, key = request.match_info["destination"], request.match_info["key"]
        record = await self._store.key_record(destination, key)
        if record is None:
            raise Rejection("not_found", "no idempotency record for this destination and key")
        return web.json_response(key_view(record, self._store.clock()))


async def fetch_page(
    store: Store, query: RejectionQuery
) -> tuple[list[StoredRejection], str | None]:
    """One page, newest first, and the cursor of the next (None on the last page).

    The cursor is an id bound: rows that arrive later have higher ids, so they
    never shift the pages after the first.
    """
    rows = await store.list_rejections(replace(query, limit=query.limit + 1))
    if len(rows) <= query.limit:
        return rows, None
    rows = rows[: query.limit]
    return rows, encode_cursor(rows[-1].id)


async def find_rejection(store: Store, raw_id: str) -> StoredRejection:
    found = None
    if _ID.fullmatch(raw_id) and int(raw_id) <= MAX_GENERATION:
        found = await store.get_rejection(int(raw_id))
    if found is None:
        raise Rejection("not_found", f"no rejection with id {raw_id[:40]!r}")
    return found


def parse_rejection_query(params: Mapping[str, str]) -> RejectionQuery:
    """The filters of SPEC 4; an empty value means "not set" (as a form sends it)."""
    _only_params(params, FILTERS)
    value = {name: params.get(name, "") for name in FILTERS}
    for name in ("destination", "job_id"):
        if value[name] and not _IDENT.fullmatch(value[name]):
            raise invalid_request(f"{name} must be 1-256 visible ASCII characters")
    if value["reason"] and value["reason"] not in STATUS_BY_REASON:
        raise invalid_request(f"unknown reason {value['reason'][:60]!r}")
    since = parse_time(value["since"], "since") if value["since"] else None
    until = parse_time(value["until"], "until") if value["until"] else None
    if since is not None and until is not None and since > until:
        raise invalid_request("since is after until")
    limit = DEFAULT_LIMIT
    if value["limit"]:
        if not re.fullmatch(r"[0-9]{1,7}", value["limit"]) or not (
            1 <= int(value["limit"]) <= MAX_LIMIT
        ):
            raise invalid_request(f"limit must be an integer from 1 to {MAX_LIMIT}")
        limit = int(value["limit"])
    return RejectionQuery(
        destination=value["destination"] or None,
        job_id=value["job_id"] or None,
        reason=value["reason"] or None,
        since=since,
        until=until,
        limit=limit,
        before_id=decode_cursor(value["cursor"]) if value["cursor"] else None,
    )


def _only_params(params: Mapping[str, str], allowed: tuple[str, ...]) -> None:
    names = [name for name, _ in params.items()]
    unknown = sorted({n for n in names if n not in allowed and n != "format"})
    if unknown:
        raise invalid_request(f"unknown query parameter(s): {', '.join(unknown)[:200]}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise invalid_request(f"query parameter(s) given twice: {', '.join(repeated)}")
    if params.get("format", "json") not in ("json", "html"):
        raise invalid_request("format must be json or html")


def parse_time(text: str, name: str) -> float:
    """RFC 3339 date-time with an offset (`Z` or `+hh:mm`) -> seconds since the epoch."""
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise invalid_request(f"{name} must be an RFC 3339 date-time, e.g. 2024-05-01T12:00:00Z")
    day, clock, fraction, offset = match.groups()
    offset = "+00:00" if offset in ("Z", "z") else offset
    iso = f"{day}T{clock}{'.' + (fraction + '00000')[:6] if fraction else ''}{offset}"
    try:
        return datetime.fromisoformat(iso).timestamp()
    except (ValueError, OverflowError) as exc:
        raise invalid_request(f"{name} is not a valid date-time: {exc}") from exc


def rfc3339(ts: float | None) -> str | None:
    if ts is None:
        return None
    moment = datetime.fromtimestamp(ts, UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def encode_cursor(before_id: int) -> str:
    raw = f"{_CURSOR_PREFIX}{before_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        if len(cursor) > 64:
            raise ValueError("too long")
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raw = ""
    number = raw.removeprefix(_CURSOR_PREFIX)
    if not raw.startswith(_CURSOR_PREFIX) or not _ID.fullmatch(number):
        raise invalid_request("cursor is not one this server handed out")
    if int(number) > MAX_GENERATION:
        raise invalid_request("cursor is not one this server handed out")
    return int(number)


# --- JSON shapes ---------------------------------------------------------------------------


def rejection_item(row: StoredRejection) -> dict[str, Any]:
    """An item of SPEC 4, field for field."""
    r = row.record
    return {
        "id": row.id,
        "at": rfc3339(row.at),
        "destination": r.destination,
        "method": r.method,
        "path": r.path,
        "job_id": r.job_id,
        "generation": r.generation,
        "owner": r.owner,
        "idempotency_key": r.idempotency_key,
        "reason": r.reason,
        "detail": r.detail,
        "current_generation": r.current_generation,
        "highest_generation": r.highest_generation,
        "remote": r.remote,
        "body_sha256": r.body_sha256,
        "body_bytes": r.body_bytes,
    }


def job_view(state: JobState, now: float) -> dict[str, Any]:
    lease = state.lease
    return {
        "job_id": state.job_id,
        "server_time": rfc3339(now),
        "lease": None
        if lease is None
        else {
            "job_id": lease.job_id,
            "owner": lease.owner,
            "generation": lease.generation,
            "state": str(lease.state),
            "lease_until": rfc3339(lease.lease_until),
            "expires_in": expires_in(lease, now),
        },
        "highest_generation": state.highest_generation,
        "in_flight": [
            {
                "attempt": a.get("attempt"),
                "generation": a.get("generation"),
                "destination": a.get("destination"),
                "key": a.get("key"),
                "started_at": rfc3339(a.get("started_at")),
                "deadline": rfc3339(a.get("deadline")),
            }
            for a in state.in_flight
        ],
        "recent_rejections": [rejection_item(r) for r in state.recent_rejections],
    }


def key_view(record: KeyRecord, now: float) -> dict[str, Any]:
    """The idempotency record without its stored body: replayed bodies can hold
    anything an upstream answered (tokens, personal data); its size and hash say
    whether two replays match."""
    return {
        "destination": record.destination,
        "key": record.key,
        "state": str(record.state_at(now)),
        "fingerprint": record.fingerprint,
        "status": record.status,
        "attempts": record.attempts,
        "job_id": record.job_id,
        "generation": record.generation,
        "owner": record.owner,
        "created_at": rfc3339(record.created_at),
        "updated_at": rfc3339(record.updated_at),
        "completed_at": rfc3339(record.completed_at),
        "deadline": rfc3339(record.deadline),
        "response_headers": [[name, value] for name, value in record.headers],
        "body_bytes": len(record.body),
        "body_sha256": hashlib.sha256(record.body).hexdigest() if record.body else None,
        "body_omitted": record.body_omitted,
    }
