"""Who may use /admin, and who they are: a bearer token, or a signed session
cookie from the page's sign-in.

Tokens are the shared `[admin] token_env` one, which acts as `admin`, and one
per named operator (`[admin.operators]`); a presented token is compared with
every one of them in constant time, with no early exit, and names the operator
it matched (`request["operator"]`, for the audit log and the log lines). The
session is an expiry, a random nonce, the operator's name and an HMAC of them
under a key derived from every token, so changing any token signs everyone out
and nothing is stored server-side; signing out removes the browser's cookie, and
a copy of it stays valid until its expiry.

Failed authentications (a wrong bearer token, a wrong token in the sign-in form)
are counted per remote address by a `FailureThrottle`: past its limit, further
attempts from that address get 429 with Retry-After until its window passes.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable

import structlog
from aiohttp import web

from gateway.admin.query import DECIMAL_ID
from gateway.admin.throttle import FailureThrottle
from gateway.config.keys import SHARED_OPERATOR
from gateway.errors import Rejection
from gateway.http.auth import authorization, cross_site, loopback_host
from gateway.http.problem import problem_response
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.refusals import LineBudget
from leases.reasons import Reason

log = structlog.get_logger("gateway.admin")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SESSION_COOKIE = "sinkgate_admin"
SESSION_TTL_S = 12 * 3600
# The name the request authenticated as.
OPERATOR: web.RequestKey[str] = web.RequestKey("operator", str)
_NONCE = re.compile(r"[0-9a-f]{16}")
# Where the page's own forms post (their routes are added at these paths): their
# `Origin` is `null` under the page's `Referrer-Policy: no-referrer`. Anywhere
# else `null` is a sandboxed frame's.
LOGIN_PATH = "/admin/login"
LOGOUT_PATH = "/admin/logout"
RESOLVE_FORM_PATH = "/admin/queue/resolve"
PAGE_FORMS = frozenset({LOGIN_PATH, LOGOUT_PATH, RESOLVE_FORM_PATH})


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
        operators: Iterable[tuple[str, str]] = (),
        metrics: Metrics | None = None,
        throttle: FailureThrottle | None = None,
    ) -> None:
        named = [(SHARED_OPERATOR, token)] if token else []
        named += list(operators)
        self._tokens = tuple((n, t.encode("utf-8", "surrogatepass")) for n, t in named)
        self._names = frozenset(n for n, _ in named)
        self._clock = clock
        self._login_page = login_page  # what a browser gets instead of a 401 problem
        self._metrics = metrics or Metrics()
        self.throttle = throttle or FailureThrottle()
        # Warnings anybody who reaches the listener can cause: rate-limited, as
        # write_refused is, and the path cut (it is the caller's).
        self._warnings = LineBudget()  # monotonic: `clock` is the wall's, for sessions
        self._key = hashlib.sha256(
            b"sinkgate-admin-key\0" + b"\0".join(n.encode() + b"=" + t for n, t in self._tokens)
        ).digest()

    @property
    def open(self) -> bool:
        return not self._tokens

    @property
    def secret(self) -> bytes:
        """The key of the page's HMACs (sessions, CSRF tokens), derived from every
        token; only with a token."""
        assert self._tokens
        return self._key

    def who(self, presented: str) -> str | None:
        """The operator whose token `presented` is, or None. Every token is compared
        whichever matches, so the time taken says nothing about which one did."""
        given = presented.encode("utf-8", "surrogatepass")
        found = None
        for name, token in self._tokens:
            if hmac.compare_digest(given, token):
                found = name
        return found

    def new_session(self, operator: str) -> str:
        """`expiry.nonce.mac.operator`: the nonce makes every sign-in's session (and
        so its CSRF token) its own, also two in the same second."""
        expiry = int(self._clock()) + SESSION_TTL_S
        nonce = secrets.token_hex(8)
        return f"{expiry}.{nonce}.{self._mac(expiry, nonce, operator)}.{operator}"

    def throttled(self, request: web.Request) -> int | None:
        """Seconds until the request's address may try again when it is past its
        failure limit (counted and logged), else None."""
        wait = self.throttle.retry_after(request.remote or "", self._clock())
        if wait is None:
            return None
        self._metrics.admin_auth_failures.labels(result="throttled").inc()
        self._warn("admin_auth_throttled", request)
        return wait

    def refused(self, request: web.Request) -> web.Response | None:
        """429 when the request's address is past its failure limit, else None."""
        wait = self.throttled(request)
        if wait is None:
            return None
        response = problem_response(
            Rejection(
                Reason.UNAUTHORIZED,
                f"too many failed authentications from this address; retry after {wait} s",
                status=429,
            )
        )
        response.headers["Retry-After"] = str(wait)
        return response

    def failed(self, request: web.Request, event: str) -> None:
        """Count and log a failed authentication of the request's address."""
        self.throttle.failed(request.remote or "", self._clock())
        self._metrics.admin_auth_failures.labels(result="refused").inc()
        self._warn(event, request)

    def signed_in(self, request: web.Request) -> bool:
        """Whether the request carries a valid session cookie."""
        return self._session_operator(request.cookies.get(SESSION_COOKIE, "")) is not None

    def _session_operator(self, value: str) -> str | None:
        expiry, _, rest = value.partition(".")
        nonce, _, rest = rest.partition(".")
        mac, _, name = rest.partition(".")
        if not DECIMAL_ID.fullmatch(expiry) or int(expiry) <= self._clock():
            return None
        if not _NONCE.fullmatch(nonce) or name not in self._names:
            return None
        expected = self._mac(int(expiry), nonce, name).encode()
        return name if hmac.compare_digest(mac.encode("ascii", "replace"), expected) else None

    def _mac(self, expiry: int, nonce: str, operator: str) -> str:
        message = f"sinkgate-admin-session:{expiry}:{nonce}:{operator}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        guarded = path == "/admin" or path.startswith("/admin/")
        if self.open and not loopback_host(request.host):
            # No token: the listener is on loopback only, and a page whose name a
            # DNS rebinding points at 127.0.0.1 must not be served as if it were us;
            # nor read /metrics (its labels name destinations a 404 keeps to itself).
            self._warn("admin_host_refused", request)
            return _forbidden("without an admin token only a loopback host name is served")
        if guarded and cross_site(request, null_origin_is_own=path in PAGE_FORMS):
            self._warn("admin_cross_site_refused", request)
            return _forbidden("a browser request from another site may not change anything here")
        if not guarded or path == LOGIN_PATH or self.open:
            return await handler(request)
        scheme, _, credentials = authorization(request.headers).partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            refusal = self.refused(request)
            if refusal is not None:
                return refusal
            operator = self.who(credentials.strip())
            if operator is None:
                self.failed(request, "admin_unauthorized")
                return self._unauthorized(request)
        else:
            operator = self._session_operator(request.cookies.get(SESSION_COOKIE, ""))
            if operator is None:
                self._warn("admin_unauthorized", request)
                return self._unauthorized(request)
        request[OPERATOR] = operator
        structlog.contextvars.bind_contextvars(operator=operator)
        try:
            return await handler(request)
        finally:
            structlog.contextvars.unbind_contextvars("operator")

    def _warn(self, event: str, request: web.Request) -> None:
        extra = self._warnings.allow()
        if extra is not None:
            log.warning(event, path=request.path[:PATH_SHOWN], remote=request.remote, **extra)

    def _unauthorized(self, request: web.Request) -> web.StreamResponse:
        if wants_html(request):
            return self._login_page(request)
        response = problem_response(
            Rejection(Reason.UNAUTHORIZED, "this route needs Authorization: Bearer <admin token>")
        )
        response.headers["WWW-Authenticate"] = 'Bearer realm="sinkgate-admin"'
        return response


PATH_SHOWN = 200  # characters of a refused request's path in its warning


def operator_of(request: web.Request) -> str | None:
    """The operator the request authenticated as (None on an open listener)."""
    return request.get(OPERATOR)


def _forbidden(detail: str) -> web.Response:
    return problem_response(Rejection(Reason.UNAUTHORIZED, detail, status=403))
