"""Why a call to the gateway got no answer, in words a person reads: the
client library's repr (its connection key, ssl flags and proxy) says little."""

from __future__ import annotations

import errno

import aiohttp


def network_words(exc: BaseException) -> str:
    """`cannot connect to HOST:PORT: ECONNREFUSED`, `... the host name did not
    resolve`, `the connection closed before the answer`, ...; the exception's
    own words for anything else."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        where = f"cannot connect to {exc.host}:{exc.port}"
        if isinstance(exc, aiohttp.ClientConnectorDNSError):
            return f"{where}: the host name did not resolve"
        if isinstance(exc, aiohttp.ClientConnectorCertificateError):
            return f"{where}: the TLS certificate was not accepted ({exc.certificate_error})"
        if isinstance(exc, aiohttp.ClientConnectorSSLError):
            return f"{where}: the TLS handshake failed ({exc.os_error})"
        return f"{where}: {_os_words(exc.os_error)}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the connection closed before the answer"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the answer's body was cut short or malformed"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"an answer that could not be read ({exc.message})"
    if isinstance(exc, OSError):
        return _os_words(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _os_words(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno) if exc.errno is not None else None
    return name or exc.strerror or f"{type(exc).__name__}: {exc}"
