"""Why a call over the network got no answer, in fixed words a person reads:
the host and port, an errno's name, what failed. Never an exception's str or
repr: the client library's name the connection key, its ssl flags and proxy,
and on the gateway's forwards they quote the request, secret headers included.
The gateway's forwards (`gateway.write.upstream`) and the clients share them."""

from __future__ import annotations

import errno

import aiohttp


def errno_name(exc: BaseException) -> str | None:
    """`ECONNREFUSED` and the like, or None where the exception carries no errno."""
    number = getattr(exc, "errno", None)
    return errno.errorcode.get(number) if isinstance(number, int) else None


def cannot_connect(exc: aiohttp.ClientConnectorError, where: str) -> str:
    """Why no connection to `where` (HOST:PORT) was made."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return f"cannot connect to {where}: its TLS certificate was not accepted"
    if isinstance(exc, aiohttp.ClientSSLError):
        return f"cannot connect to {where}: the TLS handshake failed"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"cannot connect to {where}: the host name did not resolve"
    name = errno_name(exc.os_error)
    return f"cannot connect to {where}" + (f": {name}" if name else "")


def network_words(exc: BaseException) -> str:
    """A client's call to the gateway that got no answer: `cannot connect to
    HOST:PORT: ECONNREFUSED`, `... the host name did not resolve`, `the
    connection closed before the answer`, ...; the exception's class otherwise."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return cannot_connect(exc, f"{exc.host}:{exc.port}")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the connection closed before the answer"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the answer's body was cut short or malformed"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"an answer that could not be read ({exc.message})"
    return errno_name(exc) or type(exc).__name__
