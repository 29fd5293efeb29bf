"""Config keys declared once (gateway.config.keys), every error reported in one
load, and the TLS keys' rules (SPEC 5)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import trustme

from gateway.cli import summary
from gateway.config import keys
from gateway.config.model import Config, DestinationConfig, load_config
from gateway.errors import ConfigError

UPSTREAM = 'upstream = "http://127.0.0.1:9000/api"\n'
HTTPS = 'upstream = "https://127.0.0.1:9443/api"\n'


def write_config(tmp_path: Path, gateway: str = "", **destinations: str) -> Path:
    (tmp_path / "destinations").mkdir(exist_ok=True)
    (tmp_path / "gateway.toml").write_text(gateway)
    for name, text in destinations.items():
        (tmp_path / "destinations" / f"{name}.toml").write_text(text)
    return tmp_path / "gateway.toml"


def errors(path: Path, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=environ or {})
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


def test_every_declared_key_has_help_and_is_a_dataclass_default() -> None:
    fields = {f.name: f for f in dataclasses.fields(DestinationConfig)}
    for name, key in keys.DESTINATION.keys.items():
        assert key.help, name
        field = fields[key.config_field]
        if name != "upstream":
            assert field.default == key.default, name
    config_fields = {f.name: f for f in dataclasses.fields(Config)}
    assert config_fields["max_in_flight"].default == keys.SERVER.defaults["max_in_flight"]
    assert config_fields["rejections_ttl"].default == keys.RETENTION.defaults["rejections_ttl"]


def test_one_load_reports_every_error_of_every_file(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        '[server]\nlisten = "nope"\nmax_in_flight = 0\n[retention]\nrejections_ttl = "0s"\n',
        a=UPSTREAM + 'timout = "1s"\nmax_body = 0\n',
        b="x = 1\n",
        c="x = \n",
    )
    assert errors(path) == (
        'gateway.toml: server.listen: expected "host:port" like "127.0.0.1:8480" or '
        '"[::1]:8480", got "nope"',
        "gateway.toml: server.max_in_flight: must be >= 1, got 0",
        'gateway.toml: retention.rejections_ttl: must be > 0, got "0s"',
        'destinations/a.toml: timout: unknown key (did you mean "timeout"?)',
        "destinations/a.toml: max_body: must be > 0, got 0",
        "destinations/b.toml: x: unknown key",
        'destinations/b.toml: upstream: missing: expected a URL like "https://payments.internal/api"',
        "destinations/c.toml: line 1, column 5: invalid TOML: Invalid value",
    )


def test_every_bad_entry_of_a_list_or_table_is_said_at_once(tmp_path: Path) -> None:
    """check-config stopped at the first bad entry of [upstream_headers] or of a list:
    four rounds of fix-and-run for one file."""
    path = write_config(
        tmp_path,
        a=UPSTREAM
        + "retryable_statuses = [999, 201]\n"
        + '[upstream_headers]\n"Bad Header" = "x"\nHost = "h"\nX-Num = 5\n'
        + 'X-Fmt = { env = "V", format = "none" }\n',
    )
    assert errors(path, {"V": "v"}) == (
        "destinations/a.toml: retryable_statuses: expected status codes 100..599, got 999",
        "destinations/a.toml: retryable_statuses: 201 is a success, not a status to retry",
        'destinations/a.toml: upstream_headers."Bad Header": not a valid header name',
        "destinations/a.toml: upstream_headers.Host: hop-by-hop or set by the gateway; "
        "it cannot be configured",
        'destinations/a.toml: upstream_headers.X-Num: expected a string or { env = "VAR" }, got 5',
        'destinations/a.toml: upstream_headers.X-Fmt.format: must contain "{}" exactly once, '
        'got "none"',
    )


def test_an_expectation_cannot_be_set_on_forwarded_requests(tmp_path: Path) -> None:
    """`Expect: 100-continue` sent on makes the client write the request's head and
    wait for a 100 before the body, where the late-verdict check is made: a head
    (the whole of a bodiless DELETE) could leave after the write's barrier."""
    path = write_config(tmp_path, a=UPSTREAM + '[upstream_headers]\nExpect = "100-continue"\n')
    assert errors(path) == (
        "destinations/a.toml: upstream_headers.Expect: hop-by-hop or set by the gateway; "
        "it cannot be configured",
    )


def test_a_key_that_failed_is_not_compared_with_its_default(tmp_path: Path) -> None:
    """`timeout = "-5s"` also said connect_timeout "must not exceed timeout (10s)",
    the default; an ftp:// upstream with tls_verify = false said "not None"."""
    path = write_config(
        tmp_path,
        a=UPSTREAM + 'timeout = "-5s"\nconnect_timeout = "20s"\n',
        b='upstream = "ftp://x/y"\ntls_verify = false\n',
    )
    found = errors(path)
    assert len(found) == 2 and "exceed" not in " ".join(found) and "None" not in " ".join(found)
    (tmp_path / "server").mkdir()
    server = write_config(
        tmp_path / "server", '[server]\nlisten = "nonsense:xx"\nadmin_listen = "127.0.0.1:8480"\n'
    )
    [only] = errors(server)  # not also "must differ from server.listen", the default
    assert only.startswith("gateway.toml: server.listen:")


def test_the_audit_log_outlives_the_rejections(tmp_path: Path) -> None:
    """audit_ttl = "1ms" took the audit log with the next purge, the row of the
    reload that set it too; shorter than rejections_ttl, the noise outlived what
    operators wrote."""
    short = write_config(tmp_path, '[retention]\naudit_ttl = "1h"\n', a=UPSTREAM)
    assert errors(short) == (
        "gateway.toml: retention.audit_ttl: must be at least 1d: it is what operators "
        'answer for, got "1h"',
    )
    longer = write_config(tmp_path, '[retention]\nrejections_ttl = "400d"\n', a=UPSTREAM)
    assert load_config(longer, {}).audit_ttl == 400 * 86400  # not set: as long as those
    below = write_config(
        tmp_path, '[retention]\nrejections_ttl = "400d"\naudit_ttl = "365d"\n', a=UPSTREAM
    )
    assert errors(below) == (
        "gateway.toml: retention.audit_ttl: must be at least rejections_ttl (400d): "
        "operators' actions outlive the rejections",
    )


def test_a_duration_past_100_years_is_refused(tmp_path: Path) -> None:
    """Such a timeout put a key's deadline past the year 9999: the admin views of
    that key answered 500."""
    path = write_config(
        tmp_path,
        '[retention]\nrejections_ttl = "36500d"\naudit_ttl = "36500d"\n',
        a=UPSTREAM + 'timeout = "36500.5d"\nconnect_timeout = "1s"\n',
        b=UPSTREAM + 'timeout = "99999999999999999999d"\n',
    )
    assert errors(path) == (
        'destinations/a.toml: timeout: must be at most 36500d (100 years), got "36500.5d"',
        "destinations/b.toml: timeout: must be at most 36500d (100 years), "
        'got "99999999999999999999d"',
    )


def test_files_are_named_as_the_caller_shows_them(tmp_path: Path) -> None:
    path = write_config(tmp_path, "colour = 1\n", a="x = 1\n" + UPSTREAM)
    assert errors_shown(path, "./conf/gateway.toml") == (
        "./conf/gateway.toml: colour: unknown key",
        "./conf/destinations/a.toml: x: unknown key",
    )


def errors_shown(path: Path, display: str) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={}, display=display)
    return info.value.errors


@pytest.mark.parametrize("status", [200, 204, 299])
def test_a_2xx_status_is_not_retryable(tmp_path: Path, status: int) -> None:
    path = write_config(tmp_path, a=UPSTREAM + f"retryable_statuses = [503, {status}]\n")
    assert errors(path) == (
        f"destinations/a.toml: retryable_statuses: {status} is a success, not a status to retry",
    )


# --- TLS keys -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def pem(directory: Path, ca: trustme.CA) -> None:
    (directory / "tls").mkdir(parents=True, exist_ok=True)
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(directory / "tls" / "both.pem"))
    cert.cert_chain_pems[0].write_to_path(str(directory / "tls" / "cert.pem"))
    cert.private_key_pem.write_to_path(str(directory / "tls" / "key.pem"))
    ca.cert_pem.write_to_path(str(directory / "tls" / "ca.pem"))


def test_tls_files_load_relative_to_the_file_naming_them(tmp_path: Path, ca: trustme.CA) -> None:
    pem(tmp_path, ca)
    pem(tmp_path / "destinations", ca)
    path = write_config(
        tmp_path,
        '[server]\ntls_cert = "tls/cert.pem"\ntls_key = "tls/key.pem"\n',
        a=HTTPS + 'ca_file = "tls/ca.pem"\nclient_cert = "tls/cert.pem"\n'
        'client_key = "tls/key.pem"\n',
        b=HTTPS + "tls_verify = false\n",
    )
    config = load_config(path, environ={})
    assert config.tls_cert == tmp_path / "tls" / "cert.pem"
    assert config.destinations["a"].ca_file == tmp_path / "destinations" / "tls" / "ca.pem"
    assert config.destinations["a"].client_key == tmp_path / "destinations" / "tls" / "key.pem"
    assert config.destinations["b"].tls_verify is False
    shown = summary(config)
    assert f"tls           both listeners serve HTTPS only ({tmp_path}/tls/cert.pem)" in shown
    assert "  tls=ca_file,client_cert" in shown and "  tls=not verified" in shown


@pytest.mark.parametrize(
    ("gateway", "destination", "message"),
    [
        (
            '[server]\ntls_cert = "tls/cert.pem"\n',
            UPSTREAM,
            "gateway.toml: server.tls_key: missing: server.tls_cert is set, so server.tls_key "
            "must be too",
        ),
        (
            '[server]\ntls_cert = "tls/none.pem"\ntls_key = "tls/key.pem"\n',
            UPSTREAM,
            'gateway.toml: server.tls_cert: cannot read "tls/none.pem": No such file or directory',
        ),
        (
            '[server]\ntls_cert = "gateway.toml"\ntls_key = "tls/key.pem"\n',
            UPSTREAM,
            'gateway.toml: server.tls_cert: "gateway.toml" is not a PEM file',
        ),
        (
            '[server]\ntls_cert = "tls/ca.pem"\ntls_key = "tls/key.pem"\n',
            UPSTREAM,
            "gateway.toml: server.tls_cert: cannot be used with tls_key: key values mismatch",
        ),
        (
            "",
            UPSTREAM + 'ca_file = "../tls/ca.pem"\n',
            "destinations/a.toml: ca_file: only for an https:// upstream, not "
            "http://127.0.0.1:9000/api",
        ),
        (
            "",
            'upstream = "https://partner.example/api"\ntls_verify = false\n',
            "destinations/a.toml: tls_verify: false is only allowed for an upstream on "
            "loopback, not partner.example",
        ),
        (
            "",
            HTTPS + 'client_key = "../tls/key.pem"\n',
            "destinations/a.toml: client_cert: missing: client_key is set, so client_cert "
            "must be too",
        ),
        (
            "",
            HTTPS + 'ca_file = "../tls/key.pem"\n',
            "destinations/a.toml: ca_file: not a usable CA bundle",
        ),
    ],
)
def test_tls_key_errors(
    tmp_path: Path, ca: trustme.CA, gateway: str, destination: str, message: str
) -> None:
    pem(tmp_path, ca)
    path = write_config(tmp_path, gateway, a=destination)
    found = errors(path)
    assert len(found) == 1 and found[0].startswith(message), found


# What the loader computes rather than reads from one key of the gateway file.
# overridden: set by the command line (`serve --workers`), not by a key
LOADER_OWN = {"source", "destinations", "admin_token", "display", "overridden", "unread_files"}


def test_every_config_field_comes_from_one_key_or_the_loader() -> None:
    """A key added to keys.py without its `Config` field (or the other way) fails here."""
    from_keys = [
        key.config_field
        for section in keys.GATEWAY_FILE
        for key in section.keys.values()
        if key.config_field
    ]
    assert len(from_keys) == len(set(from_keys))
    assert set(from_keys) | LOADER_OWN == {f.name for f in dataclasses.fields(Config)}


def test_a_key_is_either_applied_by_a_reload_or_refused_until_a_restart() -> None:
    restart_fields = {field for field, _ in keys.RESTART_ONLY}
    assert restart_fields.isdisjoint(keys.RELOADED)
    assert ("workers", "server.workers") in keys.RESTART_ONLY
    assert ("store_url", "store.url") in keys.RESTART_ONLY
    assert set(keys.RELOADED) >= {"idempotency_ttl", "rejections_ttl"}


def test_every_destination_field_comes_from_one_key_or_the_loader() -> None:
    from_keys = {k.config_field for k in keys.DESTINATION.keys.values()}
    loader_own = {"name", "source", "tls_digest"}
    assert from_keys | loader_own == {f.name for f in dataclasses.fields(DestinationConfig)}
