"""TLS (SPEC 5): HTTPS on both listeners, and per destination its own CA, a
client certificate (mutual TLS), and tls_verify = false on loopback; all with
certificates made here. A wrong CA is 502 upstream_unreachable, nothing reserved."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
import trustme
from aiohttp import web

from tests.harness import (
    Gateway,
    RecordingUpstream,
    catch_all,
    destination,
    make_config,
    running_gateway,
)
from tests.served import served


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def write_pems(directory: Path, ca: trustme.CA, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by `ca`: (chain, key) files."""
    cert = ca.issue_cert("127.0.0.1", "localhost")
    chain, key = directory / f"{name}.crt", directory / f"{name}.key"
    chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key))
    return chain, key


def ca_file(directory: Path, ca: trustme.CA, name: str = "ca") -> Path:
    path = directory / f"{name}.pem"
    ca.cert_pem.write_to_path(str(path))
    return path


@asynccontextmanager
async def https_upstream(
    tmp_path: Path, ca: trustme.CA, *, client_ca: trustme.CA | None = None
) -> AsyncIterator[RecordingUpstream]:
    """A recording upstream on HTTPS; with `client_ca`, it requires a client
    certificate signed by it."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        client_ca.configure_trust(context)
    upstream = RecordingUpstream()
    runner = web.AppRunner(catch_all(upstream.handle))
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
        upstream.url = f"https://127.0.0.1:{runner.addresses[0][1]}"
        yield upstream
    finally:
        upstream.release.set()
        await runner.cleanup()


@asynccontextmanager
async def gateway_to(tmp_path: Path, upstream: str, **tls: object) -> AsyncIterator[Gateway]:
    config = make_config(tmp_path, destination("pay", upstream + "/api", **tls))
    async with running_gateway(config) as gw:
        yield gw


# --- the listeners ---------------------------------------------------------------------


async def test_both_listeners_serve_https_only(tmp_path: Path, ca: trustme.CA) -> None:
    cert, key = write_pems(tmp_path, ca, "gateway")
    config = replace(make_config(tmp_path), tls_cert=cert, tls_key=key)
    trust = ssl.create_default_context(cafile=str(ca_file(tmp_path, ca)))
    async with served(config) as info, aiohttp.ClientSession() as session:
        assert info["tls"] is True
        # The served OpenAPI document sends tools to these listeners, over HTTPS.
        async with session.get(f"https://{info['listen']}/openapi.json", ssl=trust) as resp:
            document = await resp.json()
        assert document["servers"][0]["url"] == f"https://{info['listen']}"
        admin_servers = document["paths"]["/admin/rejections"]["servers"]
        assert admin_servers[0]["url"] == f"https://{info['admin_listen']}"
        for address, path in ((info["listen"], "/healthz"), (info["admin_listen"], "/metrics")):
            async with session.get(f"https://{address}{path}", ssl=trust) as resp:
                assert resp.status == 200
            with pytest.raises(aiohttp.ClientError):
                async with session.get(f"http://{address}{path}") as resp:
                    await resp.read()
            # Someone else's certificate authority is not trusted: the chain is ours.
            other = ssl.create_default_context(cafile=str(ca_file(tmp_path, trustme.CA(), "x")))
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with session.get(f"https://{address}{path}", ssl=other) as resp:
                    await resp.read()


# --- upstream TLS ----------------------------------------------------------------------


async def test_an_upstream_signed_by_the_destinations_ca_file_is_reached(
    tmp_path: Path, ca: trustme.CA
) -> None:
    async with (
        https_upstream(tmp_path, ca) as up,
        gateway_to(tmp_path, up.url, ca_file=ca_file(tmp_path, ca)) as gw,
    ):
        await gw.claim("job-1")
        status, _, body = await gw.write("/to/pay/charges", key="k-ca")
        assert status == 201, body
        assert up.paths() == ["/api/charges"]


@pytest.mark.parametrize("trust", ["another CA", "the system's CAs"])
async def test_a_wrong_ca_is_unreachable_and_reserves_nothing(
    tmp_path: Path, ca: trustme.CA, trust: str
) -> None:
    wrong = {"ca_file": ca_file(tmp_path, trustme.CA(), "wrong")} if trust == "another CA" else {}
    async with https_upstream(tmp_path, ca) as up, gateway_to(tmp_path, up.url, **wrong) as gw:
        await gw.claim("job-1")
        status, headers, _ = await gw.write("/to/pay/charges", key="k-wrong")
        assert status == 502 and headers["Sinkgate-Rejected"] == "upstream_unreachable"
        assert up.received == []
        # Never sent, so the key is released: the worker may retry with it.
        assert await gw.store.key_record("pay", "k-wrong") is None


async def test_mutual_tls_presents_the_client_certificate(tmp_path: Path, ca: trustme.CA) -> None:
    clients = trustme.CA()
    cert, key = write_pems(tmp_path, clients, "client")
    async with https_upstream(tmp_path, ca, client_ca=clients) as up:
        trusted = {"ca_file": ca_file(tmp_path, ca)}
        async with gateway_to(tmp_path, up.url, client_cert=cert, client_key=key, **trusted) as gw:
            await gw.claim("job-1")
            status, _, body = await gw.write("/to/pay/x", key="k-mtls")
            assert status == 201, body
        async with gateway_to(tmp_path, up.url, **trusted) as gw:
            await gw.claim("job-2")
            status, _, _ = await gw.write("/to/pay/x", job="job-2", key="k-no-cert")
            assert status == 502  # the upstream refused the handshake
        assert up.paths() == ["/api/x"]


async def test_tls_verify_false_reaches_a_loopback_upstream_with_an_unknown_ca(
    tmp_path: Path, ca: trustme.CA
) -> None:
    async with (
        https_upstream(tmp_path, ca) as up,
        gateway_to(tmp_path, up.url, tls_verify=False) as gw,
    ):
        await gw.claim("job-1")
        status, _, body = await gw.write("/to/pay/x", key="k-noverify")
        assert status == 201, body


async def test_a_ca_file_renewed_in_place_is_used_after_a_reload(
    tmp_path: Path, ca: trustme.CA
) -> None:
    """Certificates are renewed in place: the destination file does not change, its
    `ca_file`'s contents do. A reload then gives the destination a new connection
    pool, which trusts the new CA; without one it would go on refusing."""
    from gateway.app import RELOADER
    from gateway.config.model import load_config

    (tmp_path / "destinations").mkdir()
    (tmp_path / "gateway.toml").write_text(
        '[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
    )
    trust = ca_file(tmp_path, trustme.CA(), "trust")  # not the upstream's CA yet
    async with https_upstream(tmp_path, ca) as up:
        (tmp_path / "destinations" / "pay.toml").write_text(
            f'upstream = "{up.url}/api"\nca_file = "../trust.pem"\n'
        )
        async with running_gateway(load_config(tmp_path / "gateway.toml", {})) as gw:
            await gw.claim("job-1")
            status, headers, _ = await gw.write("/to/pay/x", key="k-before")
            assert status == 502 and headers["Sinkgate-Rejected"] == "upstream_unreachable"
            ca.cert_pem.write_to_path(str(trust))  # renewed: now the upstream's CA
            result = await gw.app[RELOADER].reload("test")
            assert result.changed == ("pay",)
            status, _, body = await gw.write("/to/pay/x", key="k-after")
            assert status == 201, body
        assert up.paths() == ["/api/x"]
