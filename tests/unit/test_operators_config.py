"""`[admin.operators]`, `[retention] audit_ttl` and the token length rule (SPEC 5,
issue 36.3): what loads, and the one-line errors of what does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import open_access_warnings, summary
from gateway.config.keys import RESTART_ONLY
from gateway.config.model import load_config, reread_config
from gateway.config.notices import config_warnings
from gateway.errors import ConfigError
from tests.unit.test_config import config_error, write_config

LONG = "a-token-long-enough-0123"
ENV = {"TOKEN_ALICE": "alice-" + LONG, "TOKEN_BOB": "bob-" + LONG}


def test_operators_are_read_by_name_and_audit_ttl_defaults_to_a_year(tmp_path: Path) -> None:
    path = write_config(
        tmp_path, '[admin.operators]\nalice = "TOKEN_ALICE"\n"bob.smith" = "TOKEN_BOB"\n'
    )
    config = load_config(path, ENV)
    assert config.admin_operators == (
        ("alice", ENV["TOKEN_ALICE"]),
        ("bob.smith", ENV["TOKEN_BOB"]),
    )
    assert config.audit_ttl == 365 * 86400
    assert "alice-" not in repr(config)  # tokens never in a repr
    assert ("admin_operators", "admin.operators") in RESTART_ONLY  # as [admin]: restart


def test_audit_ttl_is_read(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[retention]\naudit_ttl = "30d"\n')
    assert load_config(path, {}).audit_ttl == 30 * 86400


@pytest.mark.parametrize(
    ("operators", "env", "message"),
    [
        ('"al ice" = "TOKEN_ALICE"', ENV, "an operator's name is 1-64 characters"),
        ('admin = "TOKEN_ALICE"', ENV, "is the name of the shared admin.token_env token"),
        ('ADMIN = "TOKEN_ALICE"', ENV, "is the name of the shared admin.token_env token"),
        ('alice = "TOKEN_NONE"', ENV, "environment variable TOKEN_NONE is not set"),
        ('alice = "TOKEN_ALICE"', {"TOKEN_ALICE": " "}, "variable TOKEN_ALICE is empty"),
        ('alice = "TOKEN_ALICE"\nbob = "TOKEN_BOB"', {"TOKEN_ALICE": LONG, "TOKEN_BOB": LONG},
         "admin.operators.bob: has the same token as operator 'alice'"),
        ('alice = 3', ENV, "expected a string"),
        ('alice = "TOKEN_ALICE"\nAlice = "TOKEN_BOB"', ENV,
         "admin.operators.Alice: is operator 'alice' in other case"),
    ],
)  # fmt: skip
def test_operator_errors_name_the_key(tmp_path: Path, operators: str, env, message: str) -> None:
    path = write_config(tmp_path, f"[admin.operators]\n{operators}\n")
    error = config_error(path, env)
    assert message in error and error.startswith("gateway.toml: admin.operators")
    assert LONG not in error  # a token is never echoed


def test_every_operators_error_is_said_not_only_the_first(tmp_path: Path) -> None:
    """check-config prints every error: one per bad operator, each naming its key."""
    operators = (
        'bob = "NOPE_1"\ncarol = "NOPE_2"\n"bad name" = "TOKEN_ALICE"\nalice = "TOKEN_ALICE"'
    )
    error = config_error(write_config(tmp_path, f"[admin.operators]\n{operators}\n"), ENV)
    assert error.splitlines() == [
        "gateway.toml: admin.operators.bob: environment variable NOPE_1 is not set",
        "gateway.toml: admin.operators.carol: environment variable NOPE_2 is not set",
        'gateway.toml: admin.operators."bad name": an operator\'s name is 1-64 characters'
        " of A-Za-z0-9._-",
    ]


def test_an_operator_may_not_share_the_admin_token(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[admin.operators]\nalice = "TOKEN_ALICE"\n')
    env = {"SINKGATE_ADMIN_TOKEN": ENV["TOKEN_ALICE"], **ENV}
    assert "admin.operators.alice: has the same token as admin.token_env" in config_error(path, env)


@pytest.mark.parametrize(
    ("gateway", "payments", "said"),
    [
        ('[server]\nlease_tokens_env = "TOKEN_BOB"\n', "",
         "admin.operators.alice: has the same token as server.lease_tokens_env"),
        ("", 'worker_tokens_env = "TOKEN_BOB"\n',
         "admin.operators.alice: has the same token as destinations \"payments\"'s "
         "worker_tokens_env"),
    ],
)  # fmt: skip
def test_an_operator_token_is_nobody_elses(
    tmp_path: Path, gateway: str, payments: str, said: str
) -> None:
    """An operator token that was also a worker's let that worker resolve keys in
    the operator's name; a worker's lease and worker tokens may still be one."""
    env = {**ENV, "TOKEN_BOB": ENV["TOKEN_ALICE"]}
    operators = '[admin.operators]\nalice = "TOKEN_ALICE"\n'
    path = write_config(
        tmp_path, gateway + operators, payments='upstream = "http://127.0.0.1:9000"\n' + payments
    )
    error = config_error(path, env)
    assert said in error and "whoever holds it there could act here" in error
    assert LONG not in error
    (tmp_path / "gateway.toml").write_text(gateway)  # without the operator: loads
    assert load_config(path, env).admin_operators == ()


def test_a_reload_compares_worker_tokens_with_the_running_admin_tokens(tmp_path: Path) -> None:
    """The admin token's change waits for the restart: a destination given the
    running admin token in the same edit was reloaded, and its workers could act
    as the admin until then."""
    path = write_config(tmp_path, "", pay='upstream = "http://127.0.0.1:9000"\n')
    env = {"SINKGATE_ADMIN_TOKEN": "admin-" + LONG, "OTHER": "other-" + LONG}
    running = load_config(path, env)
    write_config(
        tmp_path,
        '[admin]\ntoken_env = "OTHER"\n',
        pay='upstream = "http://127.0.0.1:9000"\nworker_tokens_env = "SINKGATE_ADMIN_TOKEN"\n',
    )
    with pytest.raises(ConfigError) as refused:
        reread_config(running, env)
    assert 'admin.token_env: has the same token as destinations "pay"\'s' in str(refused.value)
    assert LONG not in str(refused.value)


def test_operators_alone_protect_a_listener_beyond_loopback(tmp_path: Path) -> None:
    server = '[server]\nadmin_listen = "0.0.0.0:8481"\n'
    path = write_config(tmp_path, server + '[admin.operators]\nalice = "TOKEN_ALICE"\n')
    assert load_config(path, ENV).admin_token is None


@pytest.mark.parametrize(
    ("gateway", "env", "where"),
    [
        ('[server]\nadmin_listen = "0.0.0.0:8481"\n', {"SINKGATE_ADMIN_TOKEN": "tiny-admin"},
         "gateway.toml: admin.token_env"),
        ('[server]\nadmin_listen = "10.1.2.3:8481"\n[admin.operators]\nalice = "T"\n',
         {"T": "tiny-alice"}, "gateway.toml: admin.operators.alice"),
        ('[server]\nlisten = "0.0.0.0:8480"\nlease_tokens_env = "L"\n', {"L": "tiny-1,tiny-2"},
         "gateway.toml: server.lease_tokens_env"),
    ],
)  # fmt: skip
def test_a_short_token_is_refused_beyond_loopback(tmp_path, gateway, env, where) -> None:
    error = config_error(write_config(tmp_path, gateway), env)
    assert error.startswith(f"{where}: a token is shorter than 16 characters")
    assert "reaches beyond loopback" in error
    assert "tiny" not in error  # a token is never echoed


def test_a_short_worker_token_is_refused_beyond_loopback(tmp_path: Path) -> None:
    destination = 'upstream = "http://127.0.0.1:9/"\nworker_tokens_env = "W"\n'
    path = write_config(tmp_path, '[server]\nlisten = "0.0.0.0:8480"\n', pay=destination)
    error = config_error(path, {"W": "w1"})
    assert "destinations/pay.toml: worker_tokens_env: a token is shorter than 16" in error


def test_a_short_token_on_loopback_is_a_warning(tmp_path: Path) -> None:
    path = write_config(tmp_path, "")
    config = load_config(path, {"SINKGATE_ADMIN_TOKEN": "change-me"})
    (warning,) = config_warnings(config)
    assert warning.startswith("gateway.toml: admin.token_env: a token is shorter than 16")
    assert "server.admin_listen is loopback-only" in warning
    assert config_warnings(load_config(path, {"SINKGATE_ADMIN_TOKEN": LONG})) == []


def test_a_reload_refuses_an_operators_short_token_beyond_loopback_as_check_config_does(
    tmp_path: Path,
) -> None:
    """What only this process's variables fail in [admin] is refused by a reload
    (the restart checks it), as an unset variable is; check-config refuses it."""
    server = '[server]\nadmin_listen = "0.0.0.0:8481"\n'
    path = write_config(tmp_path, server + '[admin.operators]\nalice = "TOKEN_ALICE"\n')
    running = load_config(path, ENV)
    write_config(tmp_path, server + '[admin.operators]\nalice = "TOKEN_ALICE"\ncarol = "TOKEN_C"\n')
    env = {**ENV, "TOKEN_C": "tiny-carol"}
    reread = reread_config(running, env)
    assert [e.key for e in reread.unread] == ["admin.operators.carol"]
    assert "a token is shorter than 16 characters" in str(reread.unread[0])
    assert "shorter than 16" in config_error(path, env)
    unset = reread_config(running, ENV)  # carol's variable not set at all
    assert [str(e) for e in unset.unread] == [
        "gateway.toml: admin.operators.carol: environment variable TOKEN_C is not set"
    ]


def test_a_reload_that_fails_says_every_error_as_check_config_does(tmp_path: Path) -> None:
    """A file error fails the reload; its lines, the variables' errors among them,
    come in check-config's order."""
    path = write_config(tmp_path, '[admin.operators]\nalice = "TOKEN_ALICE"\n')
    running = load_config(path, ENV)
    broken = (
        '[server]\nmax_in_flight = "many"\n[admin.operators]\nalice = "TOKEN_ALICE"\n'
        'carol = "TOKEN_C"\n[retention]\nbogus = 1\n'
    )
    write_config(tmp_path, broken)
    with pytest.raises(ConfigError) as reloaded:
        reread_config(running, ENV)
    lines = config_error(path, ENV).splitlines()
    assert list(reloaded.value.errors) == lines
    assert [line.split(": ")[1] for line in lines] == [
        "retention.bogus",  # unknown keys are found as their table opens
        "server.max_in_flight",
        "admin.operators.carol",
    ]


def test_a_reload_names_an_operator_removed_beside_one_it_cannot_read(tmp_path: Path) -> None:
    from gateway.reload import _refused

    path = write_config(tmp_path, '[admin.operators]\nalice = "TOKEN_ALICE"\nbob = "TOKEN_BOB"\n')
    running = load_config(path, ENV)
    write_config(tmp_path, '[admin.operators]\nalice = "TOKEN_ALICE"\ncarol = "TOKEN_C"\n')
    assert _refused(running, reread_config(running, ENV)) == (
        "admin.operators.carol",
        "admin.operators",
    )


def test_a_reload_judges_a_worker_tokens_reach_by_the_address_still_served(
    tmp_path: Path,
) -> None:
    """A new listen address waits for the restart: a short worker token added by a
    reload faces the address served now, beyond loopback, and is refused."""
    path = write_config(tmp_path, '[server]\nlisten = "0.0.0.0:8480"\n')
    running = load_config(path, ENV)
    destination = 'upstream = "http://127.0.0.1:9/"\nworker_tokens_env = "W"\n'
    write_config(tmp_path, '[server]\nlisten = "127.0.0.1:8480"\n', pay=destination)
    env = {**ENV, "W": "w-short"}
    assert load_config(tmp_path / "gateway.toml", env)  # on its own address: a warning
    with pytest.raises(ConfigError, match="worker_tokens_env: a token is shorter than 16"):
        reread_config(running, env)


def test_serve_says_at_start_what_it_lets_in_without_a_token(tmp_path: Path) -> None:
    destination = 'upstream = "http://127.0.0.1:9/"\n'
    on_loopback = load_config(write_config(tmp_path, "", pay=destination), {})
    (admin,) = open_access_warnings(on_loopback)
    assert admin.startswith("the admin listener has no token ($SINKGATE_ADMIN_TOKEN is not set)")
    assert (
        open_access_warnings(
            load_config(write_config(tmp_path, "", pay=destination), {"SINKGATE_ADMIN_TOKEN": LONG})
        )
        == []
    )
    wide = write_config(tmp_path, '[server]\nlisten = "0.0.0.0:8480"\n', pay=destination)
    assert open_access_warnings(load_config(wide, {"SINKGATE_ADMIN_TOKEN": LONG})) == [
        "the lease API is open to whoever reaches 0.0.0.0: set [server] lease_tokens_env",
        "destinations pay take writes from whoever reaches 0.0.0.0: set worker_tokens_env "
        "in their files",
    ]


@pytest.mark.parametrize("token", ["has space inside token 12345", "tökén-long-enough-0123456"])
def test_a_shared_admin_token_a_header_cannot_carry_is_refused_as_an_operators_is(
    tmp_path: Path, token: str
) -> None:
    # The CLI could never send it; curl and the page's form could.
    error = config_error(write_config(tmp_path, ""), {"SINKGATE_ADMIN_TOKEN": token})
    assert "admin.token_env: the token has characters other than visible ASCII" in error
    assert token not in error


def test_serve_says_an_admin_listener_beyond_loopback_without_tls_sends_tokens_in_clear(
    tmp_path: Path,
) -> None:
    path = write_config(tmp_path, '[server]\nadmin_listen = "0.0.0.0:8481"\n')
    (warning,) = open_access_warnings(load_config(path, {"SINKGATE_ADMIN_TOKEN": LONG}))
    assert warning.startswith("the admin listener on 0.0.0.0 serves plain HTTP beyond loopback")


def test_a_file_meant_as_a_destination_but_not_read_is_a_warning(tmp_path: Path) -> None:
    path = write_config(tmp_path, "", pay='upstream = "http://127.0.0.1:9/"\n')
    for name in ("Refunds.TOML", "mail.tml", "notes.txt", ".#pay.toml", "pay.toml.bak"):
        (tmp_path / "destinations" / name).write_text('upstream = "http://127.0.0.1:9/"\n')
    config = load_config(path, {"SINKGATE_ADMIN_TOKEN": LONG})
    assert sorted(config.destinations) == ["pay"]
    assert config_warnings(config) == [
        "destinations/Refunds.TOML: not read: a destination file's name ends in .toml, "
        "in lower case",
        "destinations/mail.tml: not read: a destination file's name ends in .toml, in lower case",
    ]


@pytest.mark.parametrize(
    "gateway",
    [
        '[admin]\ntoken_env = "f00dbabe4c7d9e8a6b5c4d3e2f1a0b9c"\n',
        '[admin.operators]\nalice = "deadbeef0123456789abcdef01234567"\n',
    ],
)
def test_a_variable_name_that_may_be_the_secret_itself_is_never_shown(
    tmp_path: Path, gateway: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hex token pasted into a `*_env` key is a valid variable name: said unset
    (or in check-config's summary), it would be printed and logged."""
    secret = gateway.split('"')[1]
    path = write_config(tmp_path, gateway)
    try:
        config = load_config(path, {})
    except ConfigError as exc:
        shown = str(exc)
    else:
        shown = "\n".join([*open_access_warnings(config), summary(config)])
    assert secret not in shown
    assert "name not shown" in shown


def test_a_variable_name_in_capitals_is_shown(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, ""), {})
    assert "$SINKGATE_ADMIN_TOKEN" in summary(config)
