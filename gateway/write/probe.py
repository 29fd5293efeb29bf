"""`check-config --connect`'s look at each destination's upstream (SPEC 6): a TCP
connection, and a TLS handshake where the upstream is `https://`, with the
destination's CA bundle and client certificate, as its forwards would make.
Nothing is sent: the connection is closed once it is made (under TLS 1.3, once a
refusal of the client certificate would have arrived: see `_refused_late`)."""

from __future__ import annotations

import asyncio
import socket
import ssl
from urllib.parse import urlsplit

from gateway.config.model import DestinationConfig
from gateway.config.reader import host_name_problem
from gateway.config.tls import destination_context
from gateway.errors import GatewayError, os_error_words


class UpstreamUnreachable(GatewayError):
    """No connection to the upstream; the message says what to check."""


class _HandshakeTimeout(TimeoutError):
    """The TCP connection was made; the TLS handshake did not finish in time."""


async def _connect(
    host: str, port: int, context: ssl.SSLContext | None, within: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """TCP, then TLS when `context` is given, both within `within` seconds; the two
    apart, so that a server that takes the connection and never answers the
    ClientHello is told from one that cannot be reached."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(within):
            reader, writer = await asyncio.open_connection(host, port)
            if context is not None:
                await writer.start_tls(context, server_hostname=host)
    except TimeoutError:
        if writer is None:
            raise
        writer.close()
        raise _HandshakeTimeout from None
    except BaseException:
        if writer is not None:
            writer.close()
        raise
    return reader, writer


async def upstream_status(dest: DestinationConfig) -> str:
    """`connected (TCP)` or `connected (TLS, certificate verified)`; raises
    `UpstreamUnreachable` saying what failed and what to check."""
    parts = urlsplit(dest.upstream)
    host = parts.hostname or ""
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    context = destination_context(dest) if tls else None
    if tls and context is None:
        context = ssl.create_default_context()
    try:
        reader, writer = await _connect(host, port, context, dest.connect_timeout)
    except ssl.SSLCertVerificationError as exc:
        raise UpstreamUnreachable(
            f"TLS: its certificate was not accepted ({exc.verify_message}): check ca_file "
            "(the CA the upstream's certificate chains to) and the host name"
        ) from exc
    except ssl.SSLError as exc:
        raise UpstreamUnreachable(
            f"TLS handshake failed ({exc.reason or exc}): does it speak HTTPS on port {port}? "
            "A client certificate it wants goes in client_cert and client_key"
        ) from exc
    except _HandshakeTimeout as exc:
        raise UpstreamUnreachable(
            f"connected to {host}:{port}, but the TLS handshake did not finish within "
            f"connect_timeout: does it speak HTTPS on port {port}?"
        ) from exc
    except TimeoutError as exc:
        raise UpstreamUnreachable(
            f"no connection to {host}:{port} within connect_timeout: check the host, the port "
            "and any firewall"
        ) from exc
    except socket.gaierror as exc:
        raise UpstreamUnreachable(
            f"cannot resolve {host} ({exc.strerror}): check the host name and this machine's DNS"
        ) from exc
    except UnicodeError as exc:  # the loader refuses these; a name built otherwise
        raise UpstreamUnreachable(
            f"cannot resolve {host}: {host_name_problem(host) or exc}: check the host name"
        ) from exc
    except OSError as exc:
        if tls and isinstance(exc, _DROPPED):
            # The TCP connection was made (a refusal is ConnectionRefusedError): the
            # upstream hung up on the ClientHello, as a server not speaking TLS does.
            raise UpstreamUnreachable(
                f"the connection to {host}:{port} was closed during the TLS handshake "
                f"({os_error_words(exc)}): does it speak HTTPS on port {port}? A client "
                "certificate it wants goes in client_cert and client_key"
            ) from exc
        raise UpstreamUnreachable(
            f"cannot connect to {host}:{port} ({os_error_words(exc)}): is the upstream "
            "running, and is the port right?"
        ) from exc
    closed = ""
    try:
        if tls:
            wait = min(LATE_REFUSAL_S, dest.connect_timeout)
            closed = await _refused_late(reader, writer, wait, dest.client_cert is not None)
    finally:
        writer.close()
    try:
        await writer.wait_closed()
    except (OSError, ssl.SSLError):
        pass  # closing is all that is left
    if not tls:
        return "connected (TCP)"
    verified = "certificate verified" if dest.tls_verify else "certificate NOT verified"
    return f"connected (TLS, {verified}{closed})"


_DROPPED = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)

# How long a TLS 1.3 connection is watched for the server's refusal of the client
# certificate once the handshake is done (a round trip; it comes at once on a LAN).
LATE_REFUSAL_S = 0.5


async def _refused_late(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, wait: float, client_cert: bool
) -> str:
    """Under TLS 1.3 the server checks the client's certificate after the client's
    handshake is over, so a missing or refused one arrives as an alert on the
    first read, not as a failed handshake: read for `wait` seconds, and raise
    `UpstreamUnreachable` on an alert or a reset. Silence or data: the server took
    the connection (an HTTP server waits for the request): "". A plain close
    may be a refusal (some servers, asyncio's among them, close without sending
    the alert) or a server that drops idle connections at once: not a failure,
    but the words that say so."""
    ssl_object = writer.get_extra_info("ssl_object")
    if ssl_object is None or ssl_object.version() != "TLSv1.3":
        return ""
    try:
        async with asyncio.timeout(wait):
            if await reader.read(1):
                return ""
    except TimeoutError:
        return ""
    except (ssl.SSLError, *_DROPPED) as exc:
        why = exc.reason if isinstance(exc, ssl.SSLError) and exc.reason else os_error_words(exc)
        raise UpstreamUnreachable(
            f"TLS: the upstream refused the connection once the handshake was done ({why}): "
            "a client certificate it wants goes in client_cert and client_key, signed by a "
            "CA it trusts"
        ) from exc
    advice = (
        "checks client certificates, check that client_cert is signed by a CA it trusts"
        if client_cert
        else "wants a client certificate, set client_cert and client_key"
    )
    return f"; but it closed the connection at once: if it {advice}"
