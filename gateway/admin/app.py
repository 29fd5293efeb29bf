"""The admin listener: rejected-write inspection (JSON and an HTML page), metrics, health.

Every route under `/admin` needs the admin token: `Authorization: Bearer <token>`,
or, for an operator's browser, the session cookie that `POST /admin/login` sets
after checking the same token (HttpOnly, SameSite=Strict, path /admin, 12 hours,
an HMAC of its expiry keyed by the token, so changing the token ends every
session). Tokens are never accepted in a query string: URLs end up in logs and
browser history. `/healthz`, `/readyz` and `/metrics` are open.

This module composes the listener: the routes, the errors middleware and health.
Each resource has its module, holding its filters, its JSON shapes and its JSON
routes: `rejections` (with the summary and the export), `keys` (with resolve),
`jobs`, `audit`; `query` holds what their filters share; `session` says who may
come in; `page/` is the HTML page over the same parsing and shapes; `cli/` the
commands that read these routes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from functools import partial
from typing import Any

import structlog
from aiohttp import web

from gateway.admin.audit import AuditApi
from gateway.admin.jobs import JobsApi
from gateway.admin.keys import KeysApi
from gateway.admin.page.listing import Page
from gateway.admin.page.operator import OperatorPage
from gateway.admin.page.signin import SignIn, login_page
from gateway.admin.query import only_params
from gateway.admin.rejections import RejectionsApi
from gateway.admin.session import LOGIN_PATH, LOGOUT_PATH, SessionAuth
from gateway.admin.throttle import FailureThrottle
from gateway.errors import Rejection, StoreUnavailable
from gateway.http.leases import JOB_SEGMENT
from gateway.http.models import OK
from gateway.http.problem import problem_response, router_refusal
from gateway.http.schema import to_json
from gateway.store.protocol import AdminOpsStore, AdminStore
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.refusals import store_unavailable
from gateway.telemetry.tasks import watched
from gateway.telemetry.unknown_keys import REFRESH_INTERVAL_S, UnknownKeysGauge
from leases.reasons import Reason

log = structlog.get_logger("gateway.admin")

READY_TIMEOUT_S = 2.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Refused = Callable[[web.Request, Rejection], web.StreamResponse]


# --- the factory -------------------------------------------------------------------------


def create_admin_app(
    store: AdminOpsStore,
    metrics: Metrics,
    *,
    token: str | None,
    operators: tuple[tuple[str, str], ...] = (),
    clock: Callable[[], float] = time.time,
    gauge_interval: float | None = REFRESH_INTERVAL_S,
    throttle: FailureThrottle | None = None,
) -> web.Application:
    """The admin listener's app. `token=None` and no `operators` (name, token)
    leave /admin open (loopback only, see `admin_bind_allowed`). `clock` times
    login sessions and the failed-authentication `throttle`. The unknown-keys
    gauge is refreshed every `gauge_interval` seconds while the app runs (None:
    only after a resolve)."""
    auth = SessionAuth(
        token,
        clock,
        login_page=_signin_instead,
        operators=operators,
        metrics=metrics,
        throttle=throttle,
    )
    app = web.Application(middlewares=[_errors_middleware(metrics), auth.middleware])
    app.on_response_prepare.append(_not_stored)
    add_health_routes(app, lambda: store)
    app.router.add_get("/favicon.ico", _no_icon)
    gauge = UnknownKeysGauge(store, metrics)
    if gauge_interval is not None:
        app.cleanup_ctx.append(_background(gauge.run(gauge_interval)))

    async def metrics_handler(request: web.Request) -> web.Response:
        body, content_type = metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    keys = KeysApi(store, gauge)
    rejections, jobs, audit = RejectionsApi(store), JobsApi(store), AuditApi(store)
    operator = OperatorPage(store, auth, resolve=keys.apply, metrics=metrics)
    page = Page(store, auth, glance=operator.glance)
    one = partial(_one, refused=operator.refused)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/admin", page.redirect_to_page)
    app.router.add_get("/admin/", page.listing)
    signin = SignIn(auth)
    app.router.add_get(LOGIN_PATH, signin.login_form)
    app.router.add_post(LOGIN_PATH, signin.login)
    app.router.add_post(LOGOUT_PATH, signin.logout)
    app.router.add_get("/admin/rejections", rejections.list)
    app.router.add_get("/admin/rejections/{id}", one(rejections.get, page=page.detail))
    app.router.add_get(f"/admin/jobs/{JOB_SEGMENT}", one(jobs.get, page=operator.job))
    app.router.add_get("/admin/keys", keys.list)
    app.router.add_post("/admin/keys/{destination}/{key:.+}/resolve", keys.resolve)
    app.router.add_get(
        "/admin/audit", _or_page(audit.list, page=operator.audit, refused=operator.refused)
    )
    app.router.add_get("/admin/summary", rejections.summary)
    operator.add_routes(app)
    app.router.add_get("/admin/keys/{destination}/{key:.+}", one(keys.get, page=operator.key))
    return app


async def _not_stored(request: web.Request, response: web.StreamResponse) -> None:
    """No answer under /admin is kept by a browser or a proxy: the JSON routes take
    the page's session cookie too, and what they show is operators' data."""
    if request.path == "/admin" or request.path.startswith("/admin/"):
        response.headers.setdefault("Cache-Control", "no-store")


def _background(job: Coroutine[Any, Any, None]) -> Callable[[web.Application], Any]:
    """A cleanup context running `job` while the app runs."""

    async def context(app: web.Application) -> AsyncIterator[None]:
        task = watched(job, "unknown-keys-gauge")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    return context


def _or_page(json_view: Handler, *, page: Handler, refused: Refused) -> Handler:
    """A route answering JSON, or its page for `?format=html`; a refusal of the
    page (a key or job not there, an id that is none) is a page too, by `refused`:
    audit rows outlive the keys and jobs they link to."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.query.get("format") == "html":
            try:
                return await page(request)
            except Rejection as rejection:
                return refused(request, rejection)
        return await json_view(request)

    return handler


def _one(json_view: Handler, *, page: Handler, refused: Refused) -> Handler:
    """The route of one thing (a rejection, a job, a key): no query but `format`."""
    either = _or_page(json_view, page=page, refused=refused)

    async def handler(request: web.Request) -> web.StreamResponse:
        only_params(request.query, (), formats=("html",))
        return await either(request)

    return handler


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
            # No token guards this route (and the write listener has it too): the
            # driver's words, which name the database, go to the log, at a bounded
            # rate (anybody can ask).
            store_unavailable("ready", str(exc) or "timed out")
            return problem_response(
                Rejection(Reason.STORE_UNAVAILABLE, "the store does not answer")
            )
        return web.json_response(to_json(OK))

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)


async def _no_icon(request: web.Request) -> web.Response:
    """A browser asks for an icon with the page's first load; a 404 there is an
    error in its console for an operator to wonder about."""
    return web.Response(status=204)


def admin_bind_allowed(host: str, token: str | bool | None) -> bool:
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
