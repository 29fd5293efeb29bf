"""The admin listener: rejected-write inspection (JSON and an HTML page), metrics, health.

Every route under `/admin` needs the admin token: `Authorization: Bearer <token>`,
or, for an operator's browser, the session cookie that `POST /admin/login` sets
after checking the same token (HttpOnly, SameSite=Strict, path /admin, 12 hours,
an HMAC of its expiry keyed by the token, so changing the token ends every
session). Tokens are never accepted in a query string: URLs end up in logs and
browser history. `/healthz`, `/readyz` and `/metrics` are open.

This module holds the app factory, auth, the errors middleware, the JSON API's
handlers and health. The rejection filters, the reads behind them and the JSON
shapes are in `admin_views`, shared with the HTML page; the page and its sign-in
handlers are in `admin_page`, which imports the session settings here (so this
module imports it only where it is used).
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import structlog
from aiohttp import web

from gateway.admin.ops_api import EXPORT_TYPES, OpsApi, add_ops_routes
from gateway.admin.page.listing import Page, login_page
from gateway.admin.page.operator import OpsPage
from gateway.admin.session import SessionAuth
from gateway.admin.views import (
    fetch_page,
    find_rejection,
    job_view,
    key_view,
    only_params,
    parse_rejection_query,
    rejection_item,
    rejection_page,
)
from gateway.errors import Rejection, StoreUnavailable
from gateway.http.models import OK
from gateway.http.problem import problem_response, router_refusal
from gateway.http.schema import to_json
from gateway.store.protocol import AdminOpsStore, AdminStore
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.unknown_keys import REFRESH_INTERVAL_S, UnknownKeysGauge
from leases.model import IDENT
from leases.reasons import Reason

log = structlog.get_logger("sinkgate.admin")

READY_TIMEOUT_S = 2.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --- the factory -------------------------------------------------------------------------


def create_admin_app(
    store: AdminOpsStore,
    metrics: Metrics,
    *,
    token: str | None,
    clock: Callable[[], float] = time.time,
    gauge_interval: float | None = REFRESH_INTERVAL_S,
) -> web.Application:
    """The admin listener's app. `token=None` leaves /admin open (loopback only,
    see `admin_bind_allowed`). `clock` only times login sessions. The unknown-keys
    gauge is refreshed every `gauge_interval` seconds while the app runs (None:
    only after a resolve)."""
    auth = SessionAuth(token, clock, login_page=_signin_instead)
    app = web.Application(middlewares=[_errors_middleware(metrics), auth.middleware])
    add_health_routes(app, lambda: store)
    ops = OpsApi(store, UnknownKeysGauge(store, metrics))
    if gauge_interval is not None:
        app.cleanup_ctx.append(_background(ops.gauge.run(gauge_interval)))

    async def metrics_handler(request: web.Request) -> web.Response:
        body, content_type = metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    ops_page = OpsPage(store, auth, ops)
    page = Page(store, auth, glance=ops_page.glance)
    api = _Api(store, page, ops, ops_page)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/admin", page.redirect_to_page)
    app.router.add_get("/admin/", page.listing)
    app.router.add_get("/admin/login", page.login_form)
    app.router.add_post("/admin/login", page.login)
    app.router.add_post("/admin/logout", page.logout)
    app.router.add_get("/admin/rejections", api.list_rejections)
    app.router.add_get("/admin/rejections/{id}", api.get_rejection)
    app.router.add_get("/admin/jobs/{job_id}", api.get_job)
    add_ops_routes(app, ops, audit_page=ops_page.audit)
    ops_page.add_routes(app)
    app.router.add_get("/admin/keys/{destination}/{key:.+}", api.get_key)
    return app


def _background(job: Coroutine[Any, Any, None]) -> Callable[[web.Application], Any]:
    """A cleanup context running `job` while the app runs."""

    async def context(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(job, name="unknown-keys-gauge")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    return context


def _signin_instead(request: web.Request) -> web.StreamResponse:
    """What a browser that is not signed in gets instead of a 401 problem."""
    return login_page(request, status=401, message=None)


def add_health_routes(app: web.Application, store_of: Callable[[], AdminStore]) -> None:
    """`/healthz` (the process answers) and `/readyz` (the store can take a write
    within `READY_TIMEOUT_S`).

    `store_of` is asked at each probe: the main app opens its store on startup,
    after its routes are fixed.
    """

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response(to_json(OK))

    async def readyz(request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await store_of().ping()
        except (StoreUnavailable, TimeoutError) as exc:
            return problem_response(
                Rejection(Reason.STORE_UNAVAILABLE, f"the store does not answer: {exc}")
            )
        return web.json_response(to_json(OK))

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
            return problem_response(Rejection(Reason.STORE_UNAVAILABLE, str(exc)))
        except web.HTTPException as exc:
            refusal = router_refusal(request, exc)
            if refusal is None:
                raise
            return refusal

    return errors


# --- the JSON API ------------------------------------------------------------------------


class _Api:
    def __init__(self, store: AdminOpsStore, page: Page, ops: OpsApi, ops_page: OpsPage) -> None:
        self._store = store
        self.page = page
        self._ops = ops
        self._ops_page = ops_page

    async def list_rejections(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("format") in EXPORT_TYPES:
            return await self._ops.export(request)
        # Any other format is refused naming all this route takes, the exports too.
        formats = tuple(EXPORT_TYPES)
        query = parse_rejection_query(request.query, self._store.clock(), formats=formats)
        items, next_cursor = await fetch_page(self._store, query)
        return web.json_response(rejection_page(items, next_cursor))

    async def get_rejection(self, request: web.Request) -> web.Response:
        only_params(request.query, (), formats=("html",))
        if request.query.get("format") == "html":
            return await self.page.detail(request)
        found = await find_rejection(self._store, request.match_info["id"])
        return web.json_response(rejection_item(found))

    async def get_job(self, request: web.Request) -> web.Response:
        only_params(request.query, (), formats=("html",))
        if request.query.get("format") == "html":
            return await self._ops_page.job(request)
        job_id = request.match_info["job_id"]
        state = None
        if IDENT.fullmatch(job_id):
            state = await self._store.job_state(job_id)
        if state is None:
            raise Rejection(Reason.NOT_FOUND, "no lease, fence, attempt or rejection for this job")
        return web.json_response(job_view(state, self._store.clock()))

    async def get_key(self, request: web.Request) -> web.Response:
        only_params(request.query, (), formats=("html",))
        if request.query.get("format") == "html":
            return await self._ops_page.key(request)
        destination, key = request.match_info["destination"], request.match_info["key"]
        record = await self._store.key_record(destination, key)
        if record is None:
            raise Rejection(Reason.NOT_FOUND, "no idempotency record for this destination and key")
        return web.json_response(key_view(record, self._store.clock()))
