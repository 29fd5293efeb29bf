"""Where the admin commands find the admin listener (SPEC 6): `--admin`, then
`$SINKGATE_ADMIN_URL`, then the config file's `admin_listen` (https:// under
TLS), then the default; `--cacert` for an HTTPS listener, and what an http://
URL against one says."""

from __future__ import annotations

import asyncio
import io
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trustme
from aiohttp import web

from gateway import cli as gateway_cli
from gateway.admin.app import create_admin_app
from gateway.admin.cli import rejections
from gateway.admin.cli.client import CliError, connect
from gateway.http.server import GatewayRunner
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.metrics import Metrics
from tests.e2e.test_tls import ca_file, write_pems

TOKEN = "cli-tls-test-token-0123"


def parse(*argv: str):
    return gateway_cli._parser().parse_args(["rejections", *argv])


def config(directory: Path, server: str) -> Path:
    path = directory / "gateway.toml"
    path.write_text(f"[server]\n{server}\n")
    return path


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path) -> None:
    for name in ("SINKGATE_ADMIN_URL", "SINKGATE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SINKGATE_ADMIN_TOKEN", TOKEN)
    monkeypatch.chdir(tmp_path)


def test_the_config_names_the_listener_and_its_scheme(tmp_path):
    plain = config(tmp_path, 'admin_listen = "127.0.0.1:9001"')
    assert connect(parse("--config", str(plain))).base == "http://127.0.0.1:9001"
    tls = config(tmp_path, 'admin_listen = "0.0.0.0:9002"\ntls_cert = "a.crt"\ntls_key = "a.key"')
    # Listening everywhere: reached on loopback; TLS on: https.
    assert connect(parse("--config", str(tls))).base == "https://127.0.0.1:9002"
    v6 = config(tmp_path, 'admin_listen = "[::]:9003"')
    assert connect(parse("--config", str(v6))).base == "http://[::1]:9003"


def test_the_order_is_option_then_variable_then_config_then_default(tmp_path, monkeypatch):
    assert connect(parse()).base == "http://127.0.0.1:8481"  # no config/gateway.toml here
    (tmp_path / "config").mkdir()
    config(tmp_path / "config", 'admin_listen = "127.0.0.1:9004"')
    assert connect(parse()).base == "http://127.0.0.1:9004"  # config/gateway.toml
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("SINKGATE_CONFIG", str(config(other, 'admin_listen = "127.0.0.1:9005"')))
    assert connect(parse()).base == "http://127.0.0.1:9005"
    monkeypatch.setenv("SINKGATE_ADMIN_URL", "http://127.0.0.1:9006")
    assert connect(parse()).base == "http://127.0.0.1:9006"
    assert connect(parse("--admin", "http://127.0.0.1:9007")).base == "http://127.0.0.1:9007"


def test_a_config_it_cannot_use_is_one_line(tmp_path):
    with pytest.raises(CliError, match="cannot read the config"):
        connect(parse("--config", str(tmp_path / "missing.toml")))
    bad = config(tmp_path, 'admin_listen = "nowhere"')
    with pytest.raises(CliError, match=r"server\.admin_listen"):
        connect(parse("--config", str(bad)))


def test_keys_resolve_takes_the_options_before_or_after_its_name():
    parser = gateway_cli._parser()
    before = parser.parse_args(
        ["keys", "--admin", "http://a:1", "resolve", "d", "k", "--applied", "--note", "n"]
    )
    after = parser.parse_args(
        ["keys", "resolve", "d", "k", "--applied", "--note", "n", "--admin", "http://a:1"]
    )
    assert before.admin == after.admin == "http://a:1"


@pytest.fixture
async def tls_admin(tmp_path) -> AsyncIterator[tuple[int, Path, Path]]:
    """An admin listener serving HTTPS only: (port, its config file, its CA file)."""
    ca = trustme.CA()
    cert, key = write_pems(tmp_path, ca, "admin")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    store = await SQLiteStore.open("sqlite:///" + str(tmp_path / "t.db"))
    runner = GatewayRunner(create_admin_app(store, Metrics(), token=TOKEN, gauge_interval=None))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
    port = runner.addresses[0][1]
    path = config(
        tmp_path,
        f'admin_listen = "127.0.0.1:{port}"\ntls_cert = "{cert}"\ntls_key = "{key}"',
    )
    yield port, path, ca_file(tmp_path, ca)
    await runner.cleanup()
    await store.close()


async def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(rejections.main, parse(*argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


async def test_an_https_listener_from_the_config_with_its_ca(tls_admin):
    _, path, ca = tls_admin
    code, out, err = await run("--config", str(path), "--cacert", str(ca))
    assert code == 0, err
    assert out.strip() == "no rejections match"


async def test_an_unknown_ca_says_to_name_it(tls_admin):
    _, path, _ = tls_admin
    code, _, err = await run("--config", str(path))
    assert code == 1
    assert "its certificate was not accepted" in err and "--cacert FILE" in err
    assert err.count("\n") == 1


async def test_an_http_url_against_tls_says_it_speaks_https(tls_admin):
    port, _, _ = tls_admin
    code, _, err = await run("--admin", f"http://127.0.0.1:{port}")
    assert code == 1
    assert f"this listener speaks HTTPS: use https://127.0.0.1:{port}" in err
    assert "Remote end closed" not in err and err.count("\n") == 1


async def test_a_name_the_certificate_lacks_says_to_use_one_it_has(tls_admin):
    # The CA is the right one: naming it again would not help (`127.1` is
    # 127.0.0.1 to the resolver, but not a name the certificate carries).
    port, _, ca = tls_admin
    code, _, err = await run("--admin", f"https://127.1:{port}", "--cacert", str(ca))
    assert code == 1
    assert "its certificate does not name 127.1" in err and "--cacert" not in err, err
    assert "(from --admin)" in err
