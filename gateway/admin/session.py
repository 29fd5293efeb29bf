"""Who may use /admin: the bearer token, or a signed session cookie from the page's sign-in.

Both are checked in constant time. The session is an expiry, a random nonce and
an HMAC of both under the admin token, so rotating the token signs everyone out
and nothing is stored server-side; signing out removes the browser's cookie, and
a copy of it stays valid until its expiry.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import socket
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from gateway.admin.query import DECIMAL_ID
from gateway.config.reader import is_loopback
from gateway.errors import Rejection
from gateway.http.auth import authorization, cross_site
from gateway.http.problem import problem_response
from leases.reasons import Reason

log = structlog.get_logger("sinkgate.admin")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SESSION_COOKIE = "sinkgate_admin"
SESSION_TTL_S = 12 * 3600
_NONCE = re.compile(r"[0-9a-f]{16}")


def wants_html(request: web.Request) -> bool:
    """The page routes answer HTML; everything else problem+json."""
    return request.path in ("/admin", "/admin/", "/admin/queue") or (
        request.query.get("format") == "html"
    )


class SessionAuth:
    """Bearer token or session cookie, both checked in constant time."""

    def __init__(
        self,
        token: str | None,
        clock: Callable[[], float],
        *,
        login_page: Callable[[web.Request], web.StreamResponse],
    ) -> None:
        self._token = None if not token else token.encode("utf-8", "surrogatepass")
        self._clock = clock
        self._login_page = login_page  # what a browser gets instead of a 401 problem

    @property
    def open(self) -> bool:
        return self._token is None

    @property
    def secret(self) -> bytes:
        """The key of the page's HMACs (sessions, CSRF tokens); only with a token."""
        assert self._token is not None
        return self._token

    def check_token(self, presented: str) -> bool:
        if self._token is None:
            return True
        return hmac.compare_digest(presented.encode("utf-8", "surrogatepass"), self._token)

    def new_session(self) -> str:
        """`expiry.nonce.mac`: the nonce makes every sign-in's session (and so its
        CSRF token) its own, also two in the same second."""
        expiry = int(self._clock()) + SESSION_TTL_S
        nonce = secrets.token_hex(8)
        return f"{expiry}.{nonce}.{self._mac(expiry, nonce)}"

    def authenticated(self, request: web.Request) -> bool:
        if self._token is None:
            return True
        scheme, _, credentials = authorization(request.headers).partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            return self.check_token(credentials.strip())
        return self._valid_session(request.cookies.get(SESSION_COOKIE, ""))

    def _valid_session(self, value: str) -> bool:
        expiry, _, rest = value.partition(".")
        nonce, _, mac = rest.partition(".")
        if not DECIMAL_ID.fullmatch(expiry) or int(expiry) <= self._clock():
            return False
        if not _NONCE.fullmatch(nonce):
            return False
        expected = self._mac(int(expiry), nonce).encode()
        return hmac.compare_digest(mac.encode("ascii", "replace"), expected)

    def _mac(self, expiry: int, nonce: str) -> str:
        assert self._token is not None
        message = f"sinkgate-admin-session:{expiry}:{nonce}".encode()
        return hmac.new(self._token, message, hashlib.sha256).hexdigest()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        guarded = path == "/admin" or path.startswith("/admin/")
        if guarded and self._token is None and not loopback_host(request.host):
            # No token: the listener is on loopback only, and a page whose name a
            # DNS rebinding points at 127.0.0.1 must not be served as if it were us.
            return _forbidden(
                "admin_host_refused",
                request,
                "without an admin token only a loopback host name is served",
            )
        if guarded and cross_site(request):
            return _forbidden(
                "admin_cross_site_refused",
                request,
                "a browser request from another site may not change anything here",
            )
        if not guarded or path == "/admin/login" or self.authenticated(request):
            return await handler(request)
        log.warning("admin_unauthorized", path=path, remote=request.remote)
        if wants_html(request):
            return self._login_page(request)
        response = problem_response(
            Rejection(Reason.UNAUTHORIZED, "this route needs Authorization: Bearer <admin token>")
        )
        response.headers["WWW-Authenticate"] = 'Bearer realm="sinkgate-admin"'
        return response


def _forbidden(event: str, request: web.Request, detail: str) -> web.Response:
    log.warning(event, path=request.path, remote=request.remote)
    return problem_response(Rejection(Reason.UNAUTHORIZED, detail, status=403))


_HOSTNAME = socket.gethostname().lower()


def loopback_host(host: str) -> bool:
    """Whether a `Host` header names this machine's loopback: `localhost` (or a name
    below it), the machine's own name, a 127.0.0.0/8 address or `[::1]`, with any
    port. Not a name resolved: a rebound name resolves to loopback too."""
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    else:
        name = name.rpartition(":")[0] if name.count(":") == 1 else name
    if name.endswith(".localhost") or name == _HOSTNAME:
        return True  # the machine's own name: its /etc/hosts points it at loopback
    return is_loopback(name)
