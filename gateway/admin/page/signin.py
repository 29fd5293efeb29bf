"""Signing in and out of the admin page: the form that takes a token, checks it
(`SessionAuth`: which operator, throttled per address) and sets the session
cookie, and signing out, which removes it."""

from __future__ import annotations

import html
from urllib.parse import parse_qs

import structlog
from aiohttp import web

from gateway.admin.page.render import Safe, html_response, render
from gateway.admin.session import (
    LOGIN_PATH,
    LOGOUT_PATH,
    SESSION_COOKIE,
    SESSION_TTL_S,
    SessionAuth,
)
from gateway.errors import Rejection
from gateway.http.bodies import read_uncoded_body
from leases.reasons import Reason

LOGIN_FORM_MAX = 8 * 1024  # a token and a return path
log = structlog.get_logger("gateway.admin")


class SignIn:
    """`GET/POST /admin/login`, `POST /admin/logout`."""

    def __init__(self, auth: SessionAuth) -> None:
        self._auth = auth

    async def login_form(self, request: web.Request) -> web.Response:
        if self._auth.open or self._auth.signed_in(request):
            raise web.HTTPSeeOther("/admin/")
        return login_page(request, status=200, message=None)

    async def login(self, request: web.Request) -> web.Response:
        # Bounded in size and time like every body the gateway reads: a sign-in
        # form trickling in must not hold the connection open.
        raw = await read_uncoded_body(request, LOGIN_FORM_MAX)
        try:
            form = parse_qs(raw.decode("utf-8", "replace"), max_num_fields=10)
        except ValueError:
            raise Rejection(
                Reason.INVALID_REQUEST, "the sign-in form has too many fields"
            ) from None
        token = form.get("token", [None])[0]
        if isinstance(token, str):  # pasted with a newline or a space, as a bearer is read
            token = token.strip()
        next_url = form.get("next", [None])[0]
        target = _safe_next(next_url if isinstance(next_url, str) else "/admin/")
        if self._auth.open:
            raise web.HTTPSeeOther(target)
        wait = self._auth.throttled(request)
        if wait is not None:  # the form again, in words, not a problem document
            message = f"Too many failed sign-ins from this address: try again in {wait} s."
            page = login_page(request, status=429, message=message, next_url=target)
            page.headers["Retry-After"] = str(wait)
            return page
        operator = self._auth.who(token) if isinstance(token, str) and token else None
        if operator is None:
            self._auth.failed(request, "admin_login_refused")
            message = "That token was not accepted."
            return login_page(request, status=401, message=message, next_url=target)
        response = web.HTTPSeeOther(target)
        response.set_cookie(
            SESSION_COOKIE,
            self._auth.new_session(operator),
            max_age=SESSION_TTL_S,
            path="/admin",
            httponly=True,
            samesite="Strict",
            secure=request.secure,
        )
        log.info("admin_login", operator=operator, remote=request.remote)
        raise response

    async def logout(self, request: web.Request) -> web.Response:
        response = web.HTTPSeeOther(LOGIN_PATH)
        response.del_cookie(SESSION_COOKIE, path="/admin")
        raise response


def login_page(
    request: web.Request, *, status: int, message: str | None, next_url: str | None = None
) -> web.Response:
    """The sign-in form, returning to `next_url` (default: the page asked for)."""
    if next_url is None:
        next_url = request.path_qs if request.method == "GET" else "/admin/"
    body = render(
        "admin_login.html",
        action=LOGIN_PATH,
        next=_safe_next(next_url),
        message=Safe(f'<p class="error">{html.escape(message)}</p>' if message else ""),
    )
    response = html_response("sign in", body, status=status)
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="sinkgate-admin"'
    return response


def _safe_next(url: str) -> str:
    """Only a path of this listener's page: no open redirect through the login form,
    and not the sign-in or sign-out itself (signed in, the browser would land on
    the form again)."""
    if url.partition("?")[0] in (LOGIN_PATH, LOGOUT_PATH):
        return "/admin/"
    if url.startswith(("/admin/", "/admin?")) and "\\" not in url and "//" not in url:
        return url
    return "/admin/"
