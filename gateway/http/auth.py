"""Bearer tokens, compared in constant time; requests a browser sends for a page."""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Iterable
from functools import lru_cache

from aiohttp import web
from multidict import CIMultiDictProxy


def authorization(headers: CIMultiDictProxy[str]) -> str:
    """The request's one `Authorization` value; "" when it has none or several
    (RFC 9110 allows one: which of two a check reads must not matter)."""
    values = headers.getall("Authorization", [])
    return values[0] if len(values) == 1 else ""


def bearer_matches(authorization: str, tokens: Iterable[str]) -> bool:
    """Whether `Authorization: Bearer <token>` names one of `tokens`.

    Every configured token is compared, with no early exit, so the time taken
    says nothing about which token (or how much of one) matched.
    """
    scheme, _, presented = authorization.partition(" ")
    given = presented.strip().encode("utf-8", "surrogateescape")
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(given, token.encode())
    return scheme.lower() == "bearer" and bool(given) and matched


_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def sent_for_a_page(headers: CIMultiDictProxy[str]) -> bool:
    """Whether a browser sent this request for a web page (its script or form).

    Workers are programs, which send neither `Sec-Fetch-Site` nor `Origin`; a
    browser marks every request a page makes with one or both, a same-origin one
    too. Same-origin is no proof of being ours on the main listener: a page whose
    host name a DNS rebinding points at the gateway is same-origin with it, and
    no page of ours calls the lease API or the write route. `Sec-Fetch-Site: none`
    is the user's own navigation (a URL typed in), which no page caused."""
    site = headers.get("Sec-Fetch-Site")
    if site is not None:
        return site != "none"
    return "Origin" in headers


def cross_site(request: web.Request, *, null_origin_is_own: bool = True) -> bool:
    """A state-changing request a browser sent from another page's origin (CSRF).

    Browsers tell: `Sec-Fetch-Site` (anything but `same-origin`, or `none` for
    what the user typed) and, before it, `Origin` on a cross-origin POST, which
    must then name this listener. The session cookie's `SameSite=Strict` does not
    cover a page on another port of the same host, which counts as the same site,
    nor a listener without a token, which needs no cookie at all. Programs (the
    CLI, curl) send neither header and are not affected.

    `Origin: null` is what the admin page's own forms send under its
    `Referrer-Policy: no-referrer`; an API no page of ours calls passes
    `null_origin_is_own=False`, since a sandboxed iframe sends `null` too."""
    if request.method in _SAFE_METHODS:
        return False
    fetch_site = request.headers.get("Sec-Fetch-Site")
    if fetch_site is not None:
        return fetch_site not in ("same-origin", "none")
    # An older browser (or a plain-HTTP, non-loopback host): only `Origin`.
    origin = request.headers.get("Origin")
    if origin is None:
        return False
    if origin == "null":
        return not null_origin_is_own
    scheme, _, rest = origin.partition("://")
    return rest.lower() != request.host.lower() or scheme.lower() != request.scheme


_HOSTNAME = socket.gethostname().lower()
NOT_LOOPBACK = (
    "this listener is on loopback only and, without a token, serves loopback host "
    "names only (a page whose name a DNS rebinding points here sends its own): a "
    "proxy in front passes a loopback Host, or set lease/worker tokens"
)


@lru_cache(maxsize=256)  # a listener sees a few Host values; parsing one takes ~8 us
def loopback_host(host: str) -> bool:
    """Whether a `Host` header names this machine's loopback: `localhost` (or a name
    below it), the machine's own name, a 127.0.0.0/8 address, `[::1]`, or `0.0.0.0`
    and `[::]` (which a client can connect to), with any port. Not a name resolved:
    a rebound name resolves to loopback too.

    A listener on loopback only serves these: a page whose host name a DNS
    rebinding points at 127.0.0.1 sends its own name, and from a plain-HTTP host
    that is not loopback a browser sends no `Sec-Fetch-*` (nor `Origin` on a GET)."""
    name = host.strip().lower()
    if name.startswith("["):
        name, _, port = name[1:].partition("]")
        if port and not (port[0] == ":" and port[1:].isdigit()):
            return False  # `[::1]:80@evil.example`: no browser sends it, nor is it ours
    elif name.count(":") == 1:
        name, _, port = name.rpartition(":")
        if not port.isdigit():
            return False  # `127.0.0.1:80@evil.example`
    name = name.removesuffix(".")  # a fully qualified name: `localhost.`
    if name == "localhost" or name.endswith(".localhost") or name == _HOSTNAME:
        return True  # the machine's own name: its /etc/hosts points it at loopback
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # [::ffff:127.0.0.1], which Python reads as no loopback
    # 0.0.0.0 and [::] reach this machine too, as a destination: no name a
    # rebinding could have put there (its page sends the attacker's own name).
    return address.is_loopback or address.is_unspecified
