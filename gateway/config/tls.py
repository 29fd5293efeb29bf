"""TLS settings (SPEC 5): the listeners' certificate and each destination's trust,
client certificate and `tls_verify`, checked when the config loads by building
the very SSL contexts the gateway then uses."""

from __future__ import annotations

import hashlib
import ssl
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from gateway.config.reader import Table, is_loopback


class UpstreamTLS(Protocol):
    """What `upstream_context` reads: a `DestinationConfig`."""

    @property
    def upstream(self) -> str: ...
    @property
    def ca_file(self) -> Path | None: ...
    @property
    def client_cert(self) -> Path | None: ...
    @property
    def client_key(self) -> Path | None: ...
    @property
    def tls_verify(self) -> bool: ...


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The context both listeners serve HTTPS with."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def upstream_context(
    ca_file: Path | None, client_cert: Path | None, client_key: Path | None, verify: bool
) -> ssl.SSLContext:
    """The context a destination's pool connects with: its own CA bundle instead
    of the system's if given, a client certificate for mutual TLS if given."""
    context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    if client_cert is not None and client_key is not None:
        context.load_cert_chain(client_cert, client_key)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def destination_context(destination: UpstreamTLS) -> ssl.SSLContext | None:
    """The SSL context for an https:// destination with TLS settings; None: defaults."""
    if not destination.upstream.startswith("https://"):
        return None
    return upstream_context(
        destination.ca_file,
        destination.client_cert,
        destination.client_key,
        destination.tls_verify,
    )


def tls_digest(*files: Path | None) -> str:
    """A digest of the PEM files' contents (those set), to tell a renewed one;
    "" when none is set."""
    if all(path is None for path in files):
        return ""
    digest = hashlib.sha256()
    for path in files:
        if path is not None:
            try:
                digest.update(path.read_bytes())
            except OSError:
                pass  # checked when the config loaded; a pool made now reports it
        digest.update(b"\0")
    return digest.hexdigest()


def _pair(t: Table, values: dict[str, Any], cert: str, key: str) -> bool:
    """Both of `cert` and `key` or neither; True when both are set (and readable)."""
    for one, other in ((cert, key), (key, cert)):
        if one in t.data and other not in t.data:
            t.report(other, f"missing: {t.key(one)} is set, so {t.key(other)} must be too")
            return False
    return values[cert] is not None and values[key] is not None


def check_server_tls(t: Table, values: dict[str, Any]) -> None:
    """`[server] tls_cert` and `tls_key`: a pair that loads as a certificate chain."""
    if not _pair(t, values, "tls_cert", "tls_key"):
        return
    try:
        server_context(values["tls_cert"], values["tls_key"])
    except (ssl.SSLError, OSError) as exc:
        t.report("tls_cert", f"cannot be used with tls_key: {_why(exc)}")


def check_destination_tls(t: Table, values: dict[str, Any]) -> None:
    """`ca_file`, `client_cert`/`client_key`, `tls_verify` of one destination."""
    if "upstream" in t.failed:
        return  # said already: its TLS keys are not checked against no upstream
    upstream = values["upstream"]
    parts = urlsplit(upstream)
    https = parts.scheme == "https"
    for name in ("ca_file", "client_cert", "client_key", "tls_verify"):
        if name in t.data and upstream and not https:
            t.report(name, f"only for an https:// upstream, not {upstream}")
            return
    if not values["tls_verify"] and not is_loopback(parts.hostname or ""):
        t.report(
            "tls_verify",
            f"false is only allowed for an upstream on loopback, not {parts.hostname}",
        )
    client = _pair(t, values, "client_cert", "client_key")
    if "ca_file" in t.data and values["ca_file"] is not None:
        try:
            upstream_context(values["ca_file"], None, None, True)
        except (ssl.SSLError, OSError) as exc:
            t.report("ca_file", f"not a usable CA bundle: {_why(exc)}")
    if client:
        try:
            upstream_context(None, values["client_cert"], values["client_key"], True)
        except (ssl.SSLError, OSError) as exc:
            t.report("client_cert", f"cannot be used with client_key: {_why(exc)}")


def _why(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason or exc.args[-1] if exc.args else exc).lower().replace("_", " ")
