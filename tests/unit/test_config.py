"""The config loader: shipped files load, defaults, parse helpers, and errors that
name the file and the dotted key (SPEC 5)."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from types import MappingProxyType

import pytest

from gateway.config import model, reader
from gateway.config.model import (
    Config,
    DestinationConfig,
    format_duration,
    format_size,
    load_config,
    parse_duration,
    parse_listen,
    parse_size,
    parse_upstream,
    redact_url,
    reread_config,
)
from gateway.errors import ConfigError
from gateway.policy.decision import Fencing
from leases.urls import split_statement_cache

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "config" / "gateway.toml"
SECRET = "s3cr3t-value-that-must-not-leak"


def write_config(tmp_path: Path, gateway: str = "", **destinations: str) -> Path:
    """A config dir with gateway.toml and destinations/<name>.toml files."""
    (tmp_path / "destinations").mkdir(exist_ok=True)
    (tmp_path / "gateway.toml").write_text(gateway)
    for name, text in destinations.items():
        (tmp_path / "destinations" / f"{name}.toml").write_text(text)
    return tmp_path / "gateway.toml"


def config_error(path: Path, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, environ or {})
    return str(info.value)


UPSTREAM = 'upstream = "http://127.0.0.1:9000/api"\n'


# --- shipped files and defaults ---------------------------------------------------


def test_shipped_config_loads_without_any_environment() -> None:
    config = load_config(SHIPPED, environ={})
    assert config.listen == ("127.0.0.1", 8480)
    assert config.admin_listen == ("127.0.0.1", 8481)
    assert config.store_url == "sqlite:///" + str(SHIPPED.parent / "data" / "sinkgate.db")
    assert config.admin_token is None
    assert list(config.destinations) == ["payments"]
    payments = config.destinations["payments"]
    assert payments.upstream == "http://127.0.0.1:9000/api"
    assert payments.source == SHIPPED.parent / "destinations" / "payments.toml"
    assert payments.worker_tokens is None


def test_config_path_defaults_to_the_environment_variable(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[server]\nlisten = "127.0.0.1:0"\n')
    config = load_config(environ={"SINKGATE_CONFIG": str(path)})
    assert config.source == path
    assert config.listen == ("127.0.0.1", 0)


def test_an_empty_gateway_file_gets_every_default(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    config = load_config(path, environ={})
    assert config == Config(
        source=path,
        listen=("127.0.0.1", 8480),
        admin_listen=("127.0.0.1", 8481),
        store_url="sqlite:///" + str(tmp_path / "data" / "sinkgate.db"),
        store_pool_size=10,
        admin_token=None,
        admin_token_env="SINKGATE_ADMIN_TOKEN",
        idempotency_ttl=24 * 3600.0,
        rejections_ttl=7 * 24 * 3600.0,
        destinations=MappingProxyType({}),
        max_in_flight=4096,
        shutdown_grace=30.0,
    )


def test_no_destinations_directory_means_zero_destinations(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text("")
    assert dict(load_config(path, environ={}).destinations) == {}


def test_a_destination_with_only_upstream_gets_every_default(tmp_path: Path) -> None:
    path = write_config(tmp_path, orders=UPSTREAM)
    orders = load_config(path, environ={}).destinations["orders"]
    assert orders == DestinationConfig(
        name="orders",
        upstream="http://127.0.0.1:9000/api",
        fencing=Fencing.LEASE,
        require_idempotency_key=True,
        upstream_idempotent=False,
        methods=frozenset({"POST", "PUT", "PATCH", "DELETE"}),
        timeout=10.0,
        connect_timeout=2.0,
        max_body=1024 * 1024,
        max_replay_body=1024 * 1024,
        retryable_statuses=frozenset({429, 502, 503, 504}),
        replay_headers=("Content-Type", "Location", "ETag", "Content-Location"),
        forward_fencing_headers=True,
        worker_tokens=None,
        upstream_headers=(),
        max_in_flight=256,
        source=tmp_path / "destinations" / "orders.toml",
    )


def test_every_destination_key_is_read(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        orders=UPSTREAM
        + """
fencing = "monotonic"
require_idempotency_key = false
upstream_idempotent = true
methods = ["post", "GET"]
timeout = "30s"
connect_timeout = "500ms"
max_body = "512KiB"
max_replay_body = 0
retryable_statuses = [503]
replay_headers = ["Content-Type", "X-Request-Id", "content-type"]
forward_fencing_headers = false
worker_tokens_env = "ORDERS_TOKENS"
max_in_flight = 8
max_wait = "0s"

[upstream_headers]
Authorization = { env = "ORDERS_API_TOKEN", format = "Bearer {}" }
X-Api-Key = { env = "ORDERS_KEY" }
X-Client = "sinkgate"
""",
    )
    environ = {"ORDERS_TOKENS": " a, b ,,a", "ORDERS_API_TOKEN": "tok\n", "ORDERS_KEY": "k"}
    orders = load_config(path, environ=environ).destinations["orders"]
    assert orders.fencing is Fencing.MONOTONIC
    assert not orders.require_idempotency_key and orders.upstream_idempotent
    assert orders.methods == {"POST", "GET"}
    assert (orders.timeout, orders.connect_timeout) == (30.0, 0.5)
    assert (orders.max_body, orders.max_replay_body) == (512 * 1024, 0)
    assert orders.retryable_statuses == {503}
    assert orders.replay_headers == ("Content-Type", "X-Request-Id")
    assert not orders.forward_fencing_headers
    assert orders.worker_tokens == ("a", "b")
    assert orders.upstream_headers == (
        ("Authorization", "Bearer tok"),
        ("X-Api-Key", "k"),
        ("X-Client", "sinkgate"),
    )
    assert orders.upstream_header_names == ("Authorization", "X-Api-Key", "X-Client")
    assert orders.max_in_flight == 8
    assert orders.max_wait == 0.0


def test_every_gateway_key_is_read(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        """
[server]
listen = "[::1]:0"
admin_listen = "0.0.0.0:9001"
max_in_flight = 10
shutdown_grace = "0s"
max_waiting = 0
[store]
url = "postgresql://sinkgate@db.internal:5432/sinkgate"
pool_size = 3
[admin]
token_env = "MY_ADMIN_TOKEN"
[retention]
idempotency_ttl = "1h"
rejections_ttl = "30d"
[destinations]
dir = "dests"
""",
    )
    (tmp_path / "dests").mkdir()
    (tmp_path / "dests" / "a.b_c-1.toml").write_text(UPSTREAM)
    (tmp_path / "dests" / ".#a.b_c-1.toml").write_text("editor lock file")
    config = load_config(path, environ={"MY_ADMIN_TOKEN": SECRET})
    assert config.listen == ("::1", 0)
    assert config.admin_listen == ("0.0.0.0", 9001)
    assert (config.max_in_flight, config.shutdown_grace) == (10, 0.0)
    assert config.max_waiting == 0
    assert config.store_url == "postgresql://sinkgate@db.internal:5432/sinkgate"
    assert config.store_pool_size == 3
    assert (config.admin_token, config.admin_token_env) == (SECRET, "MY_ADMIN_TOKEN")
    assert (config.idempotency_ttl, config.rejections_ttl) == (3600.0, 30 * 86400.0)
    assert list(config.destinations) == ["a.b_c-1"]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("sqlite:///data/x.db", "sqlite:///{dir}/data/x.db"),
        ("sqlite:///../x.db", "sqlite:///{parent}/x.db"),
        ("sqlite:////abs/x.db", "sqlite:////abs/x.db"),
        ("postgres://h/db", "postgres://h/db"),
        # the forms asyncpg takes pass the port check: several hosts, IPv6, a socket
        ("postgresql://u@h1:5432,h2:5433/db", "postgresql://u@h1:5432,h2:5433/db"),
        ("postgresql://u@[::1]:5432/db", "postgresql://u@[::1]:5432/db"),
        ("postgresql:///db?host=/run/postgresql", "postgresql:///db?host=/run/postgresql"),
        # a socket directory in the authority is a path, not a host name
        ("postgresql://%2Frun%2Fpg..x/db", "postgresql://%2Frun%2Fpg..x/db"),
        ("POSTGRESQL://h/db", "POSTGRESQL://h/db"),
    ],
)
def test_sqlite_urls_are_made_absolute_relative_to_the_config_file(
    tmp_path: Path, url: str, expected: str
) -> None:
    path = write_config(tmp_path, f'[store]\nurl = "{url}"\n')
    got = load_config(path, environ={}).store_url
    assert got == expected.format(dir=tmp_path, parent=tmp_path.parent)


def test_empty_admin_token_variable_means_no_token(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    assert load_config(path, environ={"SINKGATE_ADMIN_TOKEN": ""}).admin_token is None
    assert load_config(path, environ={"SINKGATE_ADMIN_TOKEN": " \t "}).admin_token is None
    assert load_config(path, environ={"SINKGATE_ADMIN_TOKEN": " tok "}).admin_token == "tok"


def test_a_blank_admin_token_does_not_open_a_listener_beyond_loopback(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[server]\nadmin_listen = "0.0.0.0:8481"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={"SINKGATE_ADMIN_TOKEN": "   "})
    assert "listens beyond loopback" in str(info.value)


def test_config_objects_are_frozen_and_destinations_read_only() -> None:
    config = load_config(SHIPPED, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.listen = ("0.0.0.0", 1)  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.destinations["x"] = config.destinations["payments"]  # type: ignore[index]


def test_secrets_never_appear_in_repr_or_str(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        '[store]\nurl = "postgresql://u:pgpass-secret@h/db"\n',
        orders=UPSTREAM
        + 'worker_tokens_env = "T"\n[upstream_headers]\n'
        + 'Authorization = { env = "A", format = "Bearer {}" }\nX-Static = "static-secret"\n',
    )
    environ = {"T": SECRET + "-worker", "A": SECRET + "-api", "SINKGATE_ADMIN_TOKEN": SECRET}
    config = load_config(path, environ=environ)
    for text in (repr(config), str(config), repr(config.destinations["orders"])):
        assert SECRET not in text
        assert "static-secret" not in text
        assert "pgpass-secret" not in text
    assert "orders" in repr(config)
    assert redact_url(config.store_url) == "postgresql://u:***@h/db"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:pw@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u@h:5432/db?password=qpw", "postgresql://u@h:5432/db?password=***"),
        (
            "postgresql://h/db?sslmode=require&sslpassword=x",
            "postgresql://h/db?sslmode=require&sslpassword=***",
        ),
        # passwords a URL parser reads wrongly (`#`: a fragment) or refuses (`[`)
        ("postgresql://u:HASH#pw@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:BR[pw@127.0.0.1/db", "postgresql://u:***@127.0.0.1/db"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("sqlite:///data/x.db", "sqlite:///data/x.db"),
        # a name the driver decodes to `password` before it reads it
        ("postgresql://u@h/db?pass%77ord=qpw&a=1", "postgresql://u@h/db?pass%77ord=***&a=1"),
        ("postgresql://u@h/db?SSL%50ASSWORD=x", "postgresql://u@h/db?SSL%50ASSWORD=***"),
        ("postgresql://u@h/db?passwords=kept", "postgresql://u@h/db?passwords=kept"),
    ],
)
def test_redact_url_hides_every_password_and_never_raises(url: str, shown: str) -> None:
    assert redact_url(url) == shown


# --- parse helpers ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("250ms", 0.25),
        ("10s", 10.0),
        ("1.5s", 1.5),
        ("5m", 300.0),
        ("24h", 86400.0),
        ("7d", 604800.0),
        ("0s", 0.0),
    ],
)
def test_parse_duration_accepts_units(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value",
    [
        "ten",
        "10",
        "10 s",
        "-1s",
        "1w",
        "",
        "s",
        "1e3s",
        True,
        [1],
        "\u0663s",
        "\uff13s",
        "1.\u0665s",
    ],
)
def test_parse_duration_refuses_anything_else(value: object) -> None:
    with pytest.raises(ValueError, match='expected a duration like "10s"'):
        parse_duration(value)


@pytest.mark.parametrize("value", [10, 2.5])
def test_parse_duration_refuses_a_bare_number_and_says_to_add_a_unit(value: object) -> None:
    with pytest.raises(ValueError, match=f'bare number has no unit, write "{value}s"'):
        parse_duration(value)


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ("10B", 10),
        ("512KiB", 512 * 1024),
        ("1MiB", 1024**2),
        ("1GiB", 1024**3),
        (4096, 4096),
        (0, 0),
    ],
)
def test_parse_size_accepts_binary_units_and_plain_bytes(value: object, size: int) -> None:
    assert parse_size(value) == size


@pytest.mark.parametrize(
    "value", ["1MB", "1 MiB", "1.5MiB", "1mib", "1024", "-1B", -1, True, 1.0, "\uff12MiB"]
)
def test_parse_size_refuses_anything_else(value: object) -> None:
    with pytest.raises(ValueError, match='expected a size like "1MiB"'):
        parse_size(value)


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.25, "250ms"), (10, "10s"), (300, "5m"), (7200, "2h"), (604800, "7d")]
)
def test_format_duration_round_trips(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("size", "text"), [(10, "10B"), (1536, "1536B"), (2048, "2KiB"), (1024**2, "1MiB")]
)
def test_format_size_uses_the_largest_exact_unit(size: int, text: str) -> None:
    assert format_size(size) == text


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("127.0.0.1:8480", ("127.0.0.1", 8480)),
        ("[::1]:8480", ("::1", 8480)),
        ("0.0.0.0:8480", ("0.0.0.0", 8480)),
        ("localhost:0", ("localhost", 0)),
        ("gw.internal:65535", ("gw.internal", 65535)),
    ],
)
def test_parse_listen_accepts_host_and_port(text: str, address: tuple[str, int]) -> None:
    assert parse_listen(text) == address


@pytest.mark.parametrize(
    "text",
    [
        "127.0.0.1",
        ":8480",
        "::1:8480",
        "[::1]8480",
        "[1.2.3.4]:80",
        "1.2.3.400:80",
        "h:65536",
        "h:-1",
        "h:",
        "a b:1",
        8480,
    ],
)
def test_parse_listen_refuses_malformed_addresses(text: object) -> None:
    with pytest.raises(ValueError, match='expected "host:port"'):
        parse_listen(text)


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("http://127.0.0.1:9000/api/", "http://127.0.0.1:9000/api"),
        ("HTTPS://payments.internal:8443", "https://payments.internal:8443"),
        ("http://[::1]:9000/a%2Fb/", "http://[::1]:9000/a%2Fb"),
    ],
)
def test_parse_upstream_normalises(text: str, url: str) -> None:
    assert parse_upstream(text) == url


@pytest.mark.parametrize(
    "text",
    [
        "ftp://h/x",
        "/api",
        "http://",
        "http://h/x?q=1",
        "http://h/x?",
        "http://h/#f",
        "http://u:p@h/x",
        "http://u:p@h:99999/x",  # the port fails first: the URL was echoed, password and all
        "ftp://u:p@h/x",
        "http://u:p @h/x",
        "http://h/a/../b",
        "http://h:99999/",
        "http://h:0/",
        "http://h/a b",
        "http://a..b/api",
        "http://.h/",
        f"http://{'a' * 64}.example/api",
    ],
)
def test_parse_upstream_refuses(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_upstream(text)
    assert "u:p" not in str(info.value)


# --- errors name the file and the dotted key --------------------------------------


@pytest.mark.parametrize(
    ("gateway", "message"),
    [
        ("colour = 1\n", "colour: unknown key"),
        (
            '[server]\nlisten = "127.0.0.1:1"\nlistn = 2\n',
            'server.listn: unknown key (did you mean "listen"?)',
        ),
        ('[server]\nlisten = "8480"\n', 'server.listen: expected "host:port"'),
        (
            '[server]\nadmin_listen = "127.0.0.1:8480"\n',
            "server.admin_listen: must differ",
        ),
        (  # one socket spelled twice: with --workers N the kernel split the connections
            '[server]\nadmin_listen = "localhost:8480"\n',
            "server.admin_listen: must differ from server.listen "
            "(localhost and 127.0.0.1 share port 8480)",
        ),
        (
            '[server]\nlisten = "0.0.0.0:8480"\nadmin_listen = "127.0.0.1:8480"\n',
            "server.admin_listen: must differ from server.listen (127.0.0.1 and 0.0.0.0",
        ),
        (
            '[server]\nadmin_listen = "0.0.0.0:8481"\n',
            "server.admin_listen: listens beyond loopback",
        ),
        (
            "[server]\nmax_in_flight = 0\n",
            "server.max_in_flight: must be >= 1, got 0",
        ),
        ("server = 1\n", "server: expected a table, got 1"),
        (
            '[store]\nurl = "mysql://u:pw@h/db"\n',
            'store.url: expected sqlite:///path or postgresql://..., got a "mysql" URL',
        ),
        (
            '[store]\nurl = "sqlite://x.db"\n',
            "store.url: expected sqlite:///relative/path",
        ),
        (  # the scheme in any case: the in-memory check still applies
            '[store]\nurl = "SQLITE:///:memory:"\n',
            "store.url: an in-memory SQLite database cannot be the store: name a file",
        ),
        (  # every connection its own empty database: reads found no tables
            '[store]\nurl = "sqlite:///:memory:"\n',
            "store.url: an in-memory SQLite database cannot be the store: name a file",
        ),
        (  # a bare path: not echoed (lower-cased, as a scheme it was)
            '[store]\nurl = "/Var/Lib/Sinkgate.db"\n',
            "store.url: expected sqlite:///path or postgresql://..., got a value without scheme://",
        ),
        (  # what comes before :// is not a scheme: not echoed (it could hold a secret)
            '[store]\nurl = "u:secret@db://x"\n',
            "store.url: expected sqlite:///path or postgresql://..., got a value without scheme://",
        ),
        (  # asyncpg would refuse it only at start-up, with a traceback
            '[store]\nurl = "postgresql://postgres:pw@127.0.0.1:notaport/test"\n',
            "store.url: the URL cannot be read: a port in it is not a number from 1 to 65535",
        ),
        (
            '[store]\nurl = "postgres://h1:5432,h2:99999/db"\n',
            "store.url: the URL cannot be read: a port in it is not a number from 1 to 65535",
        ),
        (  # asyncpg reads it with urllib: a ValueError traceback in check-config --connect
            '[store]\nurl = "postgresql://postgres:pw@[::1/db"\n',
            "store.url: the URL cannot be read: a host in [ ] is not an IPv6 address",
        ),
        (
            '[store]\nurl = "postgresql://postgres:pw@[zz]/db"\n',
            "store.url: the URL cannot be read: a host in [ ] is not an IPv6 address",
        ),
        (  # urllib's own words quote the password: never shown
            '[store]\nurl = "postgresql://u:s3cret\uff03x@db.internal/x"\n',
            "store.url: the URL cannot be read: a character in it reads as a URL delimiter",
        ),
        (  # the driver would send it to the server as a setting, which refuses it
            '[store]\nurl = "postgresql://u:pw@db.internal/x?statement_cache_size=off"\n',
            "store.url: the URL cannot be read: statement_cache_size in its query must be "
            "one integer >= 0",
        ),
        (
            '[store]\nurl = "postgresql://db/x?statement_cache_size=0&statement_cache_size=9"\n',
            "store.url: the URL cannot be read: statement_cache_size in its query must be",
        ),
        (  # the resolver refuses it: asyncpg would fail with a UnicodeError traceback
            '[store]\nurl = "postgresql://postgres:pw@a..b:5432/x"\n',
            'store.url: "a..b" in the URL is not a host name: a label between dots is empty',
        ),
        (
            f'[store]\nurl = "postgres://h1,{"a" * 64}.example/db"\n',
            f'store.url: "{"a" * 64}.example" in the URL is not a host name: a label',
        ),
        (
            '[store]\npool_size = "10"\n',
            'store.pool_size: expected an integer, got "10"',
        ),
        (
            '[admin]\ntoken_env = "not a name"\n',
            "admin.token_env: expected an environment variable name",
        ),
        (  # a token pasted in by mistake is never repeated
            '[admin]\ntoken_env = "f00dbabe-my-admin-secret"\n',
            "admin.token_env: expected an environment variable name (letters, digits and _, "
            "not starting with a digit); the value is not shown",
        ),
        (
            "[retention]\nidempotency_ttl = 3600\n",
            'retention.idempotency_ttl: expected a duration like "10s"',
        ),
        (
            '[retention]\nrejections_ttl = "0s"\n',
            'retention.rejections_ttl: must be > 0, got "0s"',
        ),
        (
            '[destinations]\ndir = "nowhere"\n',
            'destinations.dir: no such directory: "nowhere"',
        ),
        (
            '[destinations]\ndir = "gateway.toml"\n',
            'destinations.dir: a file, not a directory: "gateway.toml"',
        ),
        ("[server\n", "line 1, column 8: invalid TOML:"),
        (
            "a = 1\na = 2\n",
            "line 2, column 6: invalid TOML: Cannot overwrite a value",
        ),
    ],
)
def test_gateway_file_errors_name_file_and_key(tmp_path: Path, gateway: str, message: str) -> None:
    message = "gateway.toml: " + message
    error = config_error(write_config(tmp_path, gateway))
    assert error.startswith(message)
    assert "s3cret" not in error  # a password in a URL is never echoed


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (("127.0.0.1", 8480), ("localhost", 8480), True),
        (("::", 8480), ("::1", 8480), True),
        (("127.0.0.1", 8480), ("127.0.0.2", 8480), False),  # two addresses, two sockets
        (("127.0.0.1", 8480), ("localhost", 8481), False),
        (("127.0.0.1", 0), ("localhost", 0), False),  # two ports the system picks
        (("gw.internal", 8480), ("127.0.0.1", 8480), True),
        (("gw.unknown", 8480), ("127.0.0.1", 8480), False),  # serve says it
    ],
)
def test_listen_addresses_are_compared_as_sockets(
    a: tuple[str, int], b: tuple[str, int], same: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = {"localhost": ["127.0.0.1", "::1"], "gw.internal": ["127.0.0.1"]}

    def resolve(host: str, port: int, **_: object) -> list[tuple[object, ...]]:
        if host in names:
            return [(0, 0, 0, "", (address, port)) for address in names[host]]
        if host[0].isdigit() or ":" in host:
            return [(0, 0, 0, "", (host, port))]
        raise socket.gaierror(host)

    monkeypatch.setattr(reader.socket, "getaddrinfo", resolve)  # no resolver needed
    assert reader.same_socket(a, b) is same


def test_a_reload_looks_up_no_listen_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The addresses wait for a restart: a lookup at each reload blocked the event
    loop, and a DNS change nobody made in the file failed every reload."""
    gateway = '[server]\nlisten = "gw.internal:8480"\nadmin_listen = "127.0.0.1:8480"\n'
    looked_up: list[str] = []

    def resolve(host: str, port: int, **_: object) -> list[tuple[object, ...]]:
        looked_up.append(host)
        return [(0, 0, 0, "", ("10.0.0.5" if host == "gw.internal" else host, port))]

    monkeypatch.setattr(reader.socket, "getaddrinfo", resolve)
    running = load_config(write_config(tmp_path, gateway), {})
    assert looked_up == ["gw.internal", "127.0.0.1"]
    looked_up.clear()
    reread_config(running, {})
    assert looked_up == []


def test_a_destinations_dir_that_cannot_be_listed_is_an_error_not_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read as empty (glob hides the error), it made a reload remove every
    destination. Listing is refused by mode bits for anyone but root, so the
    refusal is what `os.listdir` raises for them."""
    path = write_config(tmp_path, pay=UPSTREAM)
    real = os.listdir

    def refused(target: object) -> list[str]:
        if Path(str(target)) == tmp_path / "destinations":
            raise PermissionError(13, "Permission denied")
        return real(target)  # type: ignore[arg-type]

    monkeypatch.setattr(model.os, "listdir", refused)
    assert config_error(path) == (
        'gateway.toml: destinations.dir: cannot read "destinations": Permission denied'
    )


@pytest.mark.parametrize(("timeout", "expected"), [("1s", 1.0), ("1500ms", 1.5), ("10s", 2.0)])
def test_the_connect_timeout_default_never_exceeds_a_shorter_timeout(
    tmp_path: Path, timeout: str, expected: float
) -> None:
    """Only an explicit connect_timeout above timeout is an error: a destination
    that sets a short timeout alone must load."""
    path = write_config(tmp_path, pay=UPSTREAM + f'timeout = "{timeout}"\n')
    assert load_config(path, environ={}).destinations["pay"].connect_timeout == expected


@pytest.mark.parametrize(
    ("destination", "message"),
    [
        ('fencing = "lease"\n', "upstream: missing"),
        (UPSTREAM + "colour = 1\n", "colour: unknown key"),
        (
            UPSTREAM + 'timout = "1s"\n',
            'timout: unknown key (did you mean "timeout"?)',
        ),
        (
            UPSTREAM + 'timeout = "ten"\n',
            'timeout: expected a duration like "10s" (units ms, s, m, h, d), got "ten"',
        ),
        (
            UPSTREAM + "timeout = 10\n",
            'timeout: expected a duration like "10s" (units ms, s, m, h, d), got 10: '
            'a bare number has no unit, write "10s"',
        ),
        (UPSTREAM + 'timeout = "0s"\n', "timeout: must be > 0"),
        (
            UPSTREAM + 'connect_timeout = "20s"\n',
            "connect_timeout: must not exceed timeout (10s)",
        ),
        (
            UPSTREAM + 'max_body = "1MB"\n',
            'max_body: expected a size like "1MiB"',
        ),
        (UPSTREAM + "max_body = 0\n", "max_body: must be > 0"),
        (
            UPSTREAM + 'fencing = "strict"\n',
            'fencing: expected "lease" or "monotonic", got "strict"',
        ),
        (
            UPSTREAM + 'require_idempotency_key = "yes"\n',
            'require_idempotency_key: expected true or false, got "yes"',
        ),
        (
            UPSTREAM + "methods = []\n",
            "methods: expected at least one method",
        ),
        (
            UPSTREAM + 'methods = ["PO ST"]\n',
            'methods: not a method that can be forwarded: "PO ST"',
        ),
        (
            UPSTREAM + 'methods = ["POST", "trace"]\n',  # echoes the added credentials
            'methods: not a method that can be forwarded: "trace"',
        ),
        (
            UPSTREAM + 'methods = ["CONNECT"]\n',
            'methods: not a method that can be forwarded: "CONNECT"',
        ),
        (
            UPSTREAM + "retryable_statuses = [600]\n",
            "retryable_statuses: expected status codes 100..599, got 600",
        ),
        (
            UPSTREAM + 'replay_headers = ["Transfer-Encoding"]\n',
            "replay_headers: Transfer-Encoding is hop-by-hop",
        ),
        (
            UPSTREAM + "max_in_flight = 0\n",
            "max_in_flight: must be >= 1",
        ),
        (
            UPSTREAM + 'max_wait = "-1s"\n',
            "max_wait:",
        ),
        (
            'upstream = "ftp://h/x"\n',
            'upstream: expected an absolute http:// or https:// URL, got "ftp://h/x"',
        ),
        (
            'upstream = "http://h/x?a=1"\n',
            "upstream: must not have a query or fragment",
        ),
        (
            UPSTREAM + '[upstream_headers]\nConnection = "close"\n',
            "upstream_headers.Connection: hop-by-hop",
        ),
        (
            UPSTREAM + '[upstream_headers]\nHost = "x"\n',
            "upstream_headers.Host: hop-by-hop",
        ),
        (
            UPSTREAM + '[upstream_headers]\n"Bad Name" = "x"\n',
            'upstream_headers."Bad Name": not a valid header name',
        ),
        (
            UPSTREAM + "[upstream_headers]\nX-A = 1\n",
            "upstream_headers.X-A: expected a string or",
        ),
        (
            UPSTREAM + '[upstream_headers]\nX-A = { env = "V", fmt = "{}" }\n',
            "upstream_headers.X-A.fmt: unknown key",
        ),
        (
            UPSTREAM + '[upstream_headers]\nX-A = { env = "V", format = "Bearer" }\n',
            'upstream_headers.X-A.format: must contain "{}" exactly once',
        ),
        (
            UPSTREAM + '[upstream_headers]\nX-A = { format = "{}" }\n',
            "upstream_headers.X-A: expected { env",
        ),
        (UPSTREAM + "x = \n", "line 2, column 5: invalid TOML"),
        (
            UPSTREAM + 'max_wait = "500ms"\n',  # whole seconds: it would turn waiting off
            'max_wait: must be "0s" (never wait) or at least 1s',
        ),
    ],
)
def test_destination_file_errors_name_file_and_key(
    tmp_path: Path, destination: str, message: str
) -> None:
    path = write_config(tmp_path, payments=destination)
    message = "destinations/payments.toml: " + message
    assert config_error(path, {"V": "v"}).startswith(message)


@pytest.mark.parametrize(("text", "seconds"), [("0s", 0.0), ("1s", 1.0), ("1500ms", 1.5)])
def test_max_wait_is_0s_or_at_least_a_second(tmp_path: Path, text: str, seconds: float) -> None:
    path = write_config(tmp_path, payments=UPSTREAM + f'max_wait = "{text}"\n')
    assert load_config(path, environ={}).destinations["payments"].max_wait == seconds


def test_an_upstream_with_a_query_is_named_without_it(tmp_path: Path) -> None:
    """A query is where an upstream's API key would be put: the error (which goes
    to the terminal and the logs) names the URL without it."""
    path = write_config(tmp_path, payments='upstream = "https://h/api?api_key=sk-secret#f"\n')
    message = config_error(path)
    assert message == (
        "destinations/payments.toml: upstream: must not have a query or fragment, "
        'got "https://h/api" with one'
    )
    assert "sk-secret" not in message


@pytest.mark.parametrize("host", ["a..b", "x" * 64 + ".example"])
def test_an_upstream_host_the_resolver_refuses_is_a_config_error(tmp_path: Path, host: str) -> None:
    """Python cannot even look such a name up (a UnicodeError, not a failed lookup):
    the loader says so, rather than the first forward or `check-config --connect`."""
    path = write_config(tmp_path, payments=f'upstream = "http://{host}/api"\n')
    assert config_error(path) == (
        f'destinations/payments.toml: upstream: "{host}" is not a host name: '
        "a label between dots is empty or longer than 63 characters"
    )


def test_a_store_host_the_resolver_refuses_is_named_without_the_password(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[store]\nurl = "postgresql://u:pgpass-secret@a..b/db"\n')
    message = config_error(path)
    assert message.startswith('gateway.toml: store.url: "a..b" in the URL is not a host name')
    assert "pgpass-secret" not in message


def test_unset_upstream_header_variable_is_an_error(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        payments=UPSTREAM
        + "[upstream_headers]\n"
        + 'Authorization = { env = "PAYMENTS_API_TOKEN", format = "Bearer {}" }\n',
    )
    assert config_error(path) == (
        "destinations/payments.toml: upstream_headers.Authorization: "
        "environment variable PAYMENTS_API_TOKEN is not set"
    )


def test_worker_tokens_env_with_an_empty_variable_is_an_error(tmp_path: Path) -> None:
    path = write_config(
        tmp_path, payments=UPSTREAM + 'worker_tokens_env = "PAYMENTS_WORKER_TOKENS"\n'
    )
    expected = (
        "destinations/payments.toml: worker_tokens_env: environment variable PAYMENTS_WORKER_TOKENS"
    )
    assert config_error(path, {"PAYMENTS_WORKER_TOKENS": ""}) == f"{expected} is empty"
    assert config_error(path, {"PAYMENTS_WORKER_TOKENS": " , "}) == f"{expected} holds no tokens"
    assert config_error(path) == f"{expected} is not set"


def test_errors_about_secret_values_do_not_echo_them(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        payments=UPSTREAM + 'worker_tokens_env = "T"\n[upstream_headers]\nX-A = { env = "A" }\n',
    )
    message = config_error(path, {"T": "ok," + SECRET + " x", "A": "v"})
    assert "token 2 has characters other than visible ASCII" in message
    assert SECRET not in message
    message = config_error(path, {"T": "ok", "A": SECRET + "\r\nX-Evil: 1"})
    assert message.startswith("destinations/payments.toml: upstream_headers.X-A: the value has")
    assert SECRET not in message


def test_bad_destination_file_name_is_an_error(tmp_path: Path) -> None:
    path = write_config(tmp_path, **{"pay ments": UPSTREAM})
    assert config_error(path).startswith("destinations/pay ments.toml: the file name gives")


def test_missing_config_file_is_named_as_given(tmp_path: Path) -> None:
    assert (
        config_error(tmp_path / "nope.toml")
        == f"{tmp_path / 'nope.toml'}: cannot read: no such file"
    )


def test_an_env_key_holding_something_else_is_not_quoted(tmp_path: Path) -> None:
    # The value is most likely the secret itself; errors go to logs and reload answers.
    pasted = '[admin]\ntoken_env = "f00dbabe-my-admin-secret"\n'
    error = config_error(write_config(tmp_path, pasted))
    assert "f00dbabe" not in error


def test_an_upstream_port_out_of_range_is_named() -> None:
    with pytest.raises(ValueError, match=r"the port must be 1\.\.65535"):
        parse_upstream("http://127.0.0.1:99999/pay")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u:pw@h/db", ("postgresql://u:pw@h/db", None)),
        ("postgresql://h/db?statement_cache_size=0", ("postgresql://h/db", 0)),
        (  # the driver's parameters are left as they were written
            "postgresql://h/db?sslmode=require&statement_cache_size=25&application_name=a%20b",
            ("postgresql://h/db?sslmode=require&application_name=a%20b", 25),
        ),
        ("postgresql://h/db?statement_%63ache_size=0", ("postgresql://h/db", 0)),
        (  # one the config check refuses is left for the driver to refuse too
            "postgresql://h/db?statement_cache_size=-1",
            ("postgresql://h/db?statement_cache_size=-1", None),
        ),
    ],
)
def test_the_statement_cache_is_taken_off_the_store_url(
    url: str, expected: tuple[str, int | None]
) -> None:
    assert split_statement_cache(url) == expected
