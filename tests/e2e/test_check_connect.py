"""`sinkgate check-config --connect` (SPEC 6): the store's schema (current, older,
missing) and a connection to each upstream, one line each; a failure exits 1
saying what to check. And `serve` on a PostgreSQL database that does not exist."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import sqlite3
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import trustme

from gateway import cli
from gateway.config.model import load_config
from gateway.store.probe import ProbeFailed, store_status
from gateway.store.sqlite import GATEWAY_SCHEMA_VERSION, SQLiteStore
from gateway.write.probe import UpstreamUnreachable, upstream_status
from tests.e2e.test_init import sinkgate
from tests.pg import PG_ADMIN_URL, database_url, fresh_database, pg_skip_reason, skip_or_fail


@pytest.fixture
def listening() -> Iterator[int]:
    """A port something listens on (the kernel accepts; nothing is read)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(tmp_path: Path, store: str, **upstreams: str) -> Path:
    (tmp_path / "destinations").mkdir(exist_ok=True)
    for name, url in upstreams.items():
        (tmp_path / "destinations" / f"{name}.toml").write_text(f'upstream = "{url}"\n')
    path = tmp_path / "gateway.toml"
    path.write_text(f'[store]\nurl = "{store}"\n')
    return path


async def check(path: Path, capfd: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = await asyncio.to_thread(cli.main, ["check-config", "--config", str(path), "--connect"])
    out, err = capfd.readouterr()
    return code, out, err


async def test_a_reachable_upstream_and_a_missing_sqlite_file(tmp_path, listening, capfd):
    path = config(tmp_path, "sqlite:///data.db", pay=f"http://127.0.0.1:{listening}/api")
    code, out, err = await check(path, capfd)
    assert code == 0, err
    assert "connect       store SQLite file" in out and "file missing: serve creates it" in out
    assert f"  pay  http://127.0.0.1:{listening}/api: connected (TCP)" in out


async def test_schema_current_and_older(tmp_path, listening, capfd):
    path = config(tmp_path, "sqlite:///data.db", pay=f"http://127.0.0.1:{listening}/")
    await (await SQLiteStore.open(f"sqlite:///{tmp_path / 'data.db'}")).close()
    code, out, _ = await check(path, capfd)
    assert code == 0 and f"schema current (v{GATEWAY_SCHEMA_VERSION})" in out
    with sqlite3.connect(tmp_path / "data.db") as conn:
        conn.execute("UPDATE sinkgate_schema SET version = 2 WHERE component = 'gateway'")
    code, out, _ = await check(path, capfd)
    assert code == 0 and "schema older (v2): serve upgrades it" in out


async def test_the_lease_stores_schema_is_checked_too(tmp_path, listening, capfd):
    """`serve` refuses a database whose `leases` schema is newer than it knows;
    --connect read only the gateway's row and called such a store current."""
    path = config(tmp_path, "sqlite:///data.db", pay=f"http://127.0.0.1:{listening}/")
    await (await SQLiteStore.open(f"sqlite:///{tmp_path / 'data.db'}")).close()
    with sqlite3.connect(tmp_path / "data.db") as conn:
        conn.execute("UPDATE sinkgate_schema SET version = 9 WHERE component = 'leases'")
    code, out, err = await check(path, capfd)
    assert code == 1, out
    assert "its leases schema is v9, newer than this release's v1" in err
    with sqlite3.connect(tmp_path / "data.db") as conn:
        conn.execute("UPDATE sinkgate_schema SET version = 0 WHERE component = 'leases'")
    code, out, _ = await check(path, capfd)
    assert code == 0
    assert f"schema current (v{GATEWAY_SCHEMA_VERSION}); leases schema older (v0)" in out


async def test_a_missing_data_directory_is_made_by_serve_not_a_failure(tmp_path, listening, capfd):
    """As `sinkgate init` leaves it: `data/` does not exist yet, and `serve` makes it."""
    path = config(tmp_path, "sqlite:///data/sub/sinkgate.db", pay=f"http://127.0.0.1:{listening}/")
    code, out, err = await check(path, capfd)
    assert code == 0, err
    assert "file missing: serve creates it and its directory, with the schema" in out
    assert not (tmp_path / "data").exists()  # read-only: nothing made
    (tmp_path / "data").write_text("")  # a file where the directory would go
    code, _, err = await check(path, capfd)
    assert code == 1 and "is in the way of its directory" in err
    # The file's own directory in the way (`parents` alone leaves it out), and a
    # dangling link there.
    (tmp_path / "data").unlink()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sub").write_text("")
    code, _, err = await check(path, capfd)
    assert code == 1 and "is in the way of its directory" in err
    (tmp_path / "data" / "sub").unlink()
    (tmp_path / "data" / "sub").symlink_to(tmp_path / "nowhere")
    code, _, err = await check(path, capfd)
    assert code == 1 and "is in the way of its directory" in err


async def test_a_dangling_link_as_the_sqlite_file_is_judged_where_it_points(
    tmp_path, listening, capfd
):
    """`serve` opens through the link: SQLite creates the file where it points,
    and fails when that directory does not exist (this said "serve creates it")."""
    path = config(tmp_path, "sqlite:///data/s.db", pay=f"http://127.0.0.1:{listening}/")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "s.db").symlink_to(tmp_path / "missing" / "x.db")
    code, _, err = await check(path, capfd)
    assert code == 1 and f"a link to {tmp_path / 'missing' / 'x.db'}" in err
    (tmp_path / "missing").mkdir()
    code, out, err = await check(path, capfd)
    assert code == 0, err
    assert "file missing: serve creates it with the schema" in out


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("postgresql://postgres:pw-secret@[::1/db", "a host in [ ] is not an IPv6 address"),
        # urllib's own message quotes the user and password here
        ("postgresql://u:pw-secret\uff03x@db.internal/x", "a character in it reads as a URL"),
    ],
)
async def test_a_postgres_url_asyncpg_cannot_read_is_a_probe_failure_without_its_password(
    url: str, words: str
) -> None:
    with pytest.raises(ProbeFailed) as info:
        await store_status(url)
    assert f"cannot read the URL: {words}" in str(info.value)
    assert "pw-secret" not in str(info.value)


async def test_an_unreachable_upstream_exits_1_naming_it(tmp_path, capfd):
    port = closed_port()
    path = config(tmp_path, "sqlite:///data.db", pay=f"http://127.0.0.1:{port}/")
    code, _, err = await check(path, capfd)
    assert code == 1
    assert f"destination pay: upstream http://127.0.0.1:{port}: cannot connect to " in err
    assert "(Connection refused)" in err
    assert "is the upstream running, and is the port right?" in err


async def test_an_untrusted_tls_upstream_says_to_check_ca_file(tmp_path, listening, capfd):
    """A TCP listener that never answers the handshake is not TLS: it times out or
    fails; a refused certificate is tested by the upstream TLS tests. Here: an
    https:// upstream on a port speaking nothing reports a failure, not a crash."""
    path = config(tmp_path, "sqlite:///data.db", pay=f"https://127.0.0.1:{listening}/")
    (tmp_path / "destinations" / "pay.toml").write_text(
        f'upstream = "https://127.0.0.1:{listening}/"\nconnect_timeout = "250ms"\ntimeout = "1s"\n'
    )
    code, _, err = await check(path, capfd)
    assert code == 1 and "destination pay: upstream https://" in err
    # TCP connected: it is the handshake that did not finish, not the connection
    assert f"connected to 127.0.0.1:{listening}, but the TLS handshake did not finish" in err
    assert "within connect_timeout: does it speak HTTPS" in err


@pytest.mark.parametrize("hang_up", ["at_once", "on_the_client_hello"])
async def test_a_tls_upstream_that_hangs_up_in_the_handshake_is_named_as_such(
    tmp_path, capfd, hang_up
):
    """A server that closes the connection instead of answering the ClientHello
    (one that does not speak TLS, say): the reason is given, never empty, and the
    hint is about TLS, not whether the upstream runs."""

    async def close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if hang_up == "on_the_client_hello":
            await reader.read(1)
            writer.transport.abort()  # a reset: asyncio's bare ConnectionResetError()
        writer.close()

    server = await asyncio.start_server(close, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        path = config(tmp_path, "sqlite:///data.db", pay=f"https://127.0.0.1:{port}/")
        code, _, err = await check(path, capfd)
    assert code == 1
    assert f"the connection to 127.0.0.1:{port} was closed during the TLS handshake (" in err
    assert "handshake ()" not in err and "is the upstream running" not in err
    assert f"does it speak HTTPS on port {port}?" in err


async def test_postgres_schema_missing_then_current(tmp_path, listening, capfd):
    async with fresh_database() as url:
        path = config(tmp_path, url, pay=f"http://127.0.0.1:{listening}/")
        code, out, err = await check(path, capfd)
        assert code == 0, err
        assert "schema missing: serve creates it" in out
        from gateway.store.postgres import PostgresStore
        from gateway.store.postgres_schema import GATEWAY_SCHEMA_VERSION as current

        await (await PostgresStore.open(url)).close()
        code, out, _ = await check(path, capfd)
        assert code == 0 and f"schema current (v{current})" in out


async def missing_database_url() -> str:
    reason = await pg_skip_reason()
    if reason is not None:
        skip_or_fail(reason)
    return database_url("sinkgate_no_such_database")


async def test_a_missing_postgres_database_is_named_with_how_to_create_it(tmp_path, capfd):
    url = await missing_database_url()
    path = config(tmp_path, url)
    code, _, err = await check(path, capfd)
    assert code == 1
    assert 'database "sinkgate_no_such_database" does not exist on 127.0.0.1:5432' in err
    assert "createdb -h 127.0.0.1 -p 5432 -U postgres sinkgate_no_such_database" in err


async def test_serve_on_a_missing_postgres_database_says_which_and_how(tmp_path, capfd):
    url = await missing_database_url()
    path = config(tmp_path, url)
    result = await asyncio.to_thread(sinkgate, tmp_path, "serve", "--config", str(path))
    err = result.stderr
    assert result.returncode == 1
    (line,) = [line for line in err.splitlines() if line.startswith("sinkgate: store")]
    assert 'database "sinkgate_no_such_database" does not exist' in line
    assert "createdb" in line and "InvalidCatalogNameError" not in line


def test_the_admin_url_of_the_pg_tests_is_what_these_expect() -> None:
    assert PG_ADMIN_URL.startswith("postgresql://postgres@127.0.0.1:5432/")


@pytest.mark.parametrize("directory", ["da#ta", "da?ta", "da%23ta"])
async def test_a_sqlite_path_with_uri_characters_is_read_as_itself(tmp_path, capfd, directory):
    """The store is read through a `file:` URI (read-only): `#`, `?` and `%` in its
    path are encoded, so the file read is the store's own and no other is created."""
    (tmp_path / directory).mkdir()
    await (await SQLiteStore.open(f"sqlite:///{tmp_path / directory / 's.db'}")).close()
    path = config(tmp_path, f"sqlite:///{directory}/s.db")
    before = set(tmp_path.rglob("*"))
    code, out, err = await check(path, capfd)
    assert code == 0, err
    assert f"schema current (v{GATEWAY_SCHEMA_VERSION})" in out
    # SQLite's own shared-memory and log files of a WAL database may appear beside it.
    beside = {tmp_path / directory / f"s.db-{suffix}" for suffix in ("wal", "shm")}
    assert set(tmp_path.rglob("*")) - before <= beside


async def test_a_host_name_the_resolver_refuses_is_a_config_error_not_a_traceback(tmp_path, capfd):
    """`check-config` (with --connect or not) refuses `a..b` as it loads the file;
    before, it said OK and --connect ended in a UnicodeError traceback."""
    path = config(tmp_path, "sqlite:///data.db", pay="http://a..b/api")
    for extra in ([], ["--connect"]):
        args = ["check-config", "--config", str(path), *extra]
        code = await asyncio.to_thread(cli.main, args)
        out, err = capfd.readouterr()
        assert code == 1 and "Traceback" not in err and "OK" not in out
        assert 'upstream: "a..b" is not a host name: a label between dots is empty' in err


async def test_the_probes_report_a_host_name_the_resolver_refuses(tmp_path):
    """Past the loader (a config built otherwise), each probe's failure says what is
    wrong with the name, and no UnicodeError escapes."""
    path = config(tmp_path, "sqlite:///data.db", pay="http://127.0.0.1:1/api")
    dest = load_config(path, environ={}).destinations["pay"]
    for host in ("a..b", "a" * 64 + ".example"):
        bad = dataclasses.replace(dest, upstream=f"http://{host}/api")
        with pytest.raises(UpstreamUnreachable) as info:
            await upstream_status(bad)
        assert str(info.value) == (
            f"cannot resolve {host}: a label between dots is empty or longer than 63 "
            "characters: check the host name"
        )
    with pytest.raises(ProbeFailed) as failed:
        await store_status("postgresql://postgres:pw-secret@a..b:5432/x")
    assert "cannot resolve the host of a..b:5432 (label empty or too long)" in str(failed.value)
    assert "pw-secret" not in str(failed.value)


async def test_a_name_nobody_resolves_and_a_refused_port_say_what_to_check(tmp_path):
    """`.invalid` never resolves (RFC 6761). The upstream's line named the
    resolver's error only; PostgreSQL's asked whether PostgreSQL ran there
    (the name is what is wrong), and a refused port read `Connect call failed
    ('127.0.0.1', N)`."""
    path = config(tmp_path, "sqlite:///data.db", pay="http://nohost.invalid/api")
    with pytest.raises(UpstreamUnreachable) as upstream:
        await upstream_status(load_config(path, environ={}).destinations["pay"])
    assert str(upstream.value).startswith("cannot resolve nohost.invalid (")
    assert str(upstream.value).endswith("): check the host name and this machine's DNS")
    with pytest.raises(ProbeFailed) as unresolved:
        await store_status("postgresql://postgres@nohost.invalid:5432/x")
    assert "cannot resolve the host of nohost.invalid:5432 (" in str(unresolved.value)
    assert str(unresolved.value).endswith("): check the URL's host name")
    port = closed_port()
    with pytest.raises(ProbeFailed) as refused:
        await store_status(f"postgresql://postgres@127.0.0.1:{port}/x")
    assert f"cannot connect to 127.0.0.1:{port} (Connection refused): is PostgreSQL" in str(
        refused.value
    )


def client_ca_server(ca: trustme.CA) -> ssl.SSLContext:
    """A TLS 1.3-only server context that wants a client certificate signed by `ca`."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    ca.issue_cert("127.0.0.1").configure_cert(context)
    context.verify_mode = ssl.CERT_REQUIRED
    ca.configure_trust(context)
    return context


@contextmanager
def alerting_upstream(context: ssl.SSLContext, connections: int) -> Iterator[int]:
    """A blocking TLS server on a thread: OpenSSL sends the refusal's alert, as
    nginx and the like do (asyncio's server only closes)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)

    def serve() -> None:
        for _ in range(connections):
            try:
                conn, _ = server.accept()
                with context.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)  # the client's certificate is checked here
            except (OSError, ssl.SSLError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        thread.join(timeout=10)


async def test_a_tls_13_upstream_refusing_the_client_certificate_is_a_failure(tmp_path, capfd):
    """Under TLS 1.3 a server that wants a client certificate refuses it after the
    handshake: without the late read (`_refused_late` returning at once) this
    reported `connected` for an upstream every forward would fail on."""
    from tests.e2e.test_tls import ca_file, write_pems

    ca = trustme.CA()
    context = client_ca_server(ca)
    trust = ca_file(tmp_path, ca)
    chain, key = write_pems(tmp_path, ca, "client")
    path = config(tmp_path, "sqlite:///data.db")
    pay = tmp_path / "destinations" / "pay.toml"
    with alerting_upstream(context, connections=2) as port:
        pay.write_text(f'upstream = "https://127.0.0.1:{port}/api"\nca_file = "{trust}"\n')
        code, _, err = await check(path, capfd)
        assert code == 1
        assert "TLS: the upstream refused the connection once the handshake was done" in err
        assert "TLSV13_ALERT_CERTIFICATE_REQUIRED" in err
        pay.write_text(
            f'upstream = "https://127.0.0.1:{port}/api"\nca_file = "{trust}"\n'
            f'client_cert = "{chain}"\nclient_key = "{key}"\n'
        )
        code, out, err = await check(path, capfd)
        assert code == 0, err
        assert f"pay  https://127.0.0.1:{port}/api: connected (TLS, certificate verified)\n" in out


async def test_a_tls_13_upstream_that_only_closes_is_reported_but_not_a_failure(tmp_path, capfd):
    """asyncio's server refuses a missing client certificate by closing, no alert;
    a server dropping idle connections at once looks the same: said, exit 0."""
    from tests.e2e.test_tls import ca_file, write_pems

    ca = trustme.CA()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with suppress(ssl.SSLError, OSError):
            await reader.read(1)
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0, ssl=client_ca_server(ca))
    port = server.sockets[0].getsockname()[1]
    path = config(tmp_path, "sqlite:///data.db")
    (tmp_path / "destinations" / "pay.toml").write_text(
        f'upstream = "https://127.0.0.1:{port}/api"\nca_file = "{ca_file(tmp_path, ca)}"\n'
    )
    async with server:
        code, out, err = await check(path, capfd)
        assert code == 0, err
        assert "connected (TLS, certificate verified; but it closed the connection at once" in out
        assert "set client_cert and client_key" in out
        # A client certificate given, from a CA the server does not trust.
        chain, key = write_pems(tmp_path, trustme.CA(), "stranger")
        (tmp_path / "destinations" / "pay.toml").write_text(
            f'upstream = "https://127.0.0.1:{port}/api"\nca_file = "{ca_file(tmp_path, ca)}"\n'
            f'client_cert = "{chain}"\nclient_key = "{key}"\n'
        )
        code, out, err = await check(path, capfd)
        assert code == 0, err
        assert "check that client_cert is signed by a CA it trusts" in out


@contextmanager
def fake_postgres(answer: bytes, tls: ssl.SSLContext | None = None) -> Iterator[int]:
    """A port that answers PostgreSQL's SSLRequest with `answer` (b"N": no TLS
    here; b"S": then a TLS handshake with `tls`) and reads nothing more."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(10)

    def serve() -> None:
        with suppress(OSError), server:
            while True:
                conn, _ = server.accept()
                with conn:
                    conn.recv(8)  # the SSLRequest
                    conn.sendall(answer)
                    if tls is not None:
                        with suppress(OSError), tls.wrap_socket(conn, server_side=True):
                            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        with suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)
        server.close()


async def test_a_server_that_does_not_take_tls_is_named_as_such(tmp_path, capfd):
    """`sslmode=require` against a server without TLS: asyncpg's `ConnectionError`
    read "is PostgreSQL running there" though it answered; the line says TLS."""
    with fake_postgres(b"N") as port:
        url = f"postgresql://postgres@127.0.0.1:{port}/test?sslmode=require"
        code, _, err = await check(config(tmp_path, url), capfd)
        serve = await asyncio.to_thread(
            sinkgate, tmp_path, "serve", "--config", str(tmp_path / "gateway.toml")
        )
    assert code == 1 and "is PostgreSQL running" not in err
    assert f"127.0.0.1:{port} does not take TLS, and the URL's sslmode=require asks for it" in err
    assert serve.returncode == 1
    (line,) = [line for line in serve.stderr.splitlines() if line.startswith("sinkgate: store")]
    assert "does not take TLS" in line and "ConnectionError" not in line


async def test_a_certificate_not_for_the_host_names_sslrootcert_and_the_host(tmp_path, capfd):
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("db.example").configure_cert(server_tls)
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    with fake_postgres(b"S", server_tls) as port:
        url = (
            f"postgresql://postgres@127.0.0.1:{port}/test"
            f"?sslmode=verify-full&sslrootcert={tmp_path / 'ca.pem'}"
        )
        code, _, err = await check(config(tmp_path, url), capfd)
    assert code == 1 and "is PostgreSQL running" not in err
    assert f"127.0.0.1:{port}'s certificate was not accepted (" in err
    assert "sslrootcert must name the CA that signed it, and the URL's host a name it has" in err


@pytest.mark.parametrize(
    ("query", "says"),
    [
        (
            "sslmode=verify-full&sslrootcert={tmp}/no-ca.pem",
            "sslrootcert file {tmp}/no-ca.pem does not exist",
        ),
        (
            "sslmode=require&sslcert={tmp}/gateway.toml&sslkey={tmp}/gateway.toml",
            "TLS files (sslcert={tmp}/gateway.toml and sslkey={tmp}/gateway.toml) cannot be loaded",
        ),
        ("sslmode=verify-ca", "name the CA's certificate file with the URL's sslrootcert"),
    ],
)
async def test_a_tls_file_of_the_url_at_fault_is_named(tmp_path, capfd, monkeypatch, query, says):
    """asyncpg says a bare `No such file or directory` or `[SSL] PEM lib`, and
    libpq's `HINT:` on lines of their own: one line naming the parameter."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.postgresql/root.crt
    url = f"postgresql://postgres@127.0.0.1:{closed_port()}/test?" + query.format(tmp=tmp_path)
    code, _, err = await check(config(tmp_path, url), capfd)
    assert code == 1 and "is PostgreSQL running" not in err, err
    assert says.format(tmp=tmp_path) in err
    assert "HINT" not in err and "PEM lib" not in err
