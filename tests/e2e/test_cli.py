"""The command line (SPEC 6): check-config through the real entry point, the
subcommands that live in other modules, serve's start-up, and logging."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

# Loaded before any test fakes `gateway.admin.cli.rejections`: the keys command's parser
# imports its page limit from there, so a test run alone would find the fake.
import gateway.admin.cli.keys  # noqa: F401
from gateway import cli
from gateway.config.model import Config
from gateway.telemetry.logs import configure_logging

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "config" / "gateway.toml"
SECRET = "s3cr3t-value-that-must-not-leak"


def sinkgate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m gateway ARGS` with no SINKGATE_* variables but those in `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SINKGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=REPO,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.reset_defaults()
    root.handlers, root.level = handlers, level


# --- check-config, through the real entry point ---------------------------------


def test_check_config_on_the_shipped_config_passes_and_lists_destinations() -> None:
    result = sinkgate("check-config", "--config", "config/gateway.toml")
    assert result.returncode == 0, result.stderr
    assert "127.0.0.1:8480" in result.stdout
    assert "admin token   not set" in result.stdout
    assert "lease API     open to whoever reaches the listener" in result.stdout
    assert "payments  http://127.0.0.1:9000/api  fencing=lease" in result.stdout


def test_check_config_reads_the_path_from_sinkgate_config() -> None:
    result = sinkgate("check-config", env={"SINKGATE_CONFIG": str(SHIPPED)})
    assert result.returncode == 0, result.stderr
    assert "payments" in result.stdout


def test_check_config_with_an_unknown_key_exits_1_naming_file_and_key(tmp_path: Path) -> None:
    (tmp_path / "destinations").mkdir()
    (tmp_path / "gateway.toml").write_text('[server]\nlisten = "127.0.0.1:8480"\nlistn = 1\n')
    result = sinkgate("check-config", "--config", str(tmp_path / "gateway.toml"))
    assert result.returncode == 1
    assert result.stdout == ""
    # The file is named as the command line gave it.
    assert result.stderr == (
        f'sinkgate: {tmp_path}/gateway.toml: server.listn: unknown key (did you mean "listen"?)\n'
    )


def test_check_config_with_an_unknown_destination_key_names_the_destination_file(
    tmp_path: Path,
) -> None:
    (tmp_path / "destinations").mkdir()
    (tmp_path / "gateway.toml").write_text("")
    (tmp_path / "destinations" / "mail.toml").write_text('upstream = "http://h"\nretries = 3\n')
    result = sinkgate("check-config", "--config", str(tmp_path / "gateway.toml"))
    assert result.returncode == 1
    assert "destinations/mail.toml: retries: unknown key" in result.stderr


def test_check_config_prints_secret_names_never_their_values(tmp_path: Path) -> None:
    (tmp_path / "destinations").mkdir()
    (tmp_path / "gateway.toml").write_text(
        '[store]\nurl = "postgresql://gw:pg-' + SECRET + '@db/gw"\n'
    )
    (tmp_path / "destinations" / "payments.toml").write_text(
        'upstream = "https://payments.internal/api"\n'
        'worker_tokens_env = "PAYMENTS_WORKER_TOKENS"\n'
        "[upstream_headers]\n"
        'Authorization = { env = "PAYMENTS_API_TOKEN", format = "Bearer {}" }\n'
        'X-Static = "static-' + SECRET + '"\n'
    )
    env = {
        "PAYMENTS_WORKER_TOKENS": f"w1-{SECRET},w2-{SECRET}",
        "PAYMENTS_API_TOKEN": f"api-{SECRET}",
        "SINKGATE_ADMIN_TOKEN": f"admin-{SECRET}",
    }
    result = sinkgate("check-config", "--config", str(tmp_path / "gateway.toml"), env=env)
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert "admin token   set ($SINKGATE_ADMIN_TOKEN)" in result.stdout
    assert "postgresql://gw:***@db/gw" in result.stdout
    assert "auth=yes" in result.stdout
    assert "upstream_headers=Authorization,X-Static" in result.stdout


def test_check_config_names_the_operators_never_their_tokens(tmp_path: Path) -> None:
    """With `[admin.operators]`, "admin token not set" alone read as if nothing
    guarded /admin: the operators are listed by name, and the audit log's
    retention and the Prefer: wait bound are shown with the other limits."""
    (tmp_path / "gateway.toml").write_text(
        '[server]\nmax_waiting = 7\n[retention]\naudit_ttl = "30d"\n'
        '[admin.operators]\nbob = "TOKEN_BOB"\nalice = "TOKEN_ALICE"\n'
    )
    env = {"TOKEN_ALICE": f"alice-{SECRET}", "TOKEN_BOB": f"bob-{SECRET}"}
    result = sinkgate("check-config", "--config", str(tmp_path / "gateway.toml"), env=env)
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "admin token   not set ($SINKGATE_ADMIN_TOKEN)" in lines
    assert "operators     alice, bob (a token of their own each, named in the audit log)" in lines
    assert "retention     idempotency keys 1d, rejections 7d, audit log 30d" in lines
    assert "limits        4096 writes in flight, 7 waiting under Prefer: wait per process, " in (
        result.stdout
    )


def test_check_config_says_when_there_are_no_destinations(tmp_path: Path) -> None:
    (tmp_path / "gateway.toml").write_text("")
    result = sinkgate("check-config", "--config", str(tmp_path / "gateway.toml"))
    assert result.returncode == 0, result.stderr
    assert "destinations  none" in result.stdout


def test_no_subcommand_prints_help_and_exits_2() -> None:
    result = sinkgate()
    assert result.returncode == 2
    assert "check-config" in result.stderr


# --- subcommands living in other modules ----------------------------------------


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    """Install `name` with a `main` that records its argument and returns 7."""
    calls: list[Any] = []
    module = types.ModuleType(name)
    module.main = lambda arg: calls.append(arg) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_chaos_gets_every_argument_after_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_module(monkeypatch, "gateway.tools.chaos.run")
    argv = ["chaos", "--workers", "5", "--bypass-gateway", "--help", "extra"]
    assert cli.main(argv) == 7
    assert calls == [["--workers", "5", "--bypass-gateway", "--help", "extra"]]


def test_rejections_passes_its_parsed_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_module(monkeypatch, "gateway.admin.cli.rejections")
    monkeypatch.delenv("SINKGATE_ADMIN_URL", raising=False)
    argv = ["rejections", "--reason", "stale_generation", "--since", "1h", "--limit", "5"]
    assert cli.main(argv) == 7
    (args,) = calls
    assert (args.admin, args.reason, args.since, args.limit) == (
        None,  # --admin not given: $SINKGATE_ADMIN_URL or the default, read when used
        "stale_generation",
        "1h",
        5,
    )
    assert (args.job, args.destination, args.until, args.json) == (None, None, None, False)


def test_rejections_refuses_a_limit_over_1000(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["rejections", "--limit", "5000"])
    assert info.value.code == 2
    assert "must be 1..1000" in capsys.readouterr().err


def test_demo_runs_the_demo_module(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_module(monkeypatch, "gateway.tools.demo")
    assert cli.main(["demo"]) == 7
    assert calls[0].command == "demo"


def test_a_missing_subcommand_module_is_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli._delegate("gateway.no_such_module", "frobnicate", None) == 2
    assert capsys.readouterr().err == (
        "sinkgate: the frobnicate command is not available in this installation "
        "(gateway.no_such_module)\n"
    )


def test_check_config_says_when_the_lease_api_needs_a_token(tmp_path: Path) -> None:
    (tmp_path / "gateway.toml").write_text('[server]\nlease_tokens_env = "LEASE_TOKENS"\n')
    result = sinkgate(
        "check-config",
        "--config",
        str(tmp_path / "gateway.toml"),
        env={"LEASE_TOKENS": "tok-a, tok-b"},
    )
    assert result.returncode == 0, result.stderr
    assert "lease API     needs one of 2 bearer token(s)" in result.stdout
    assert "tok-a" not in result.stdout  # the tokens themselves are never shown


# --- serve -----------------------------------------------------------------------


def test_serve_with_a_bad_config_exits_1_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "gateway.toml").write_text("[server]\nlisten = 1\n")
    assert cli.main(["serve", "--config", str(tmp_path / "gateway.toml")]) == 1
    assert capsys.readouterr().err.startswith(
        f"sinkgate: {tmp_path}/gateway.toml: server.listen: expected"
    )


def test_a_bad_log_level_from_the_environment_is_one_line_and_exit_2() -> None:
    result = sinkgate(
        "serve", "--config", "config/gateway.toml", env={"SINKGATE_LOG_LEVEL": "bogus"}
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "sinkgate: SINKGATE_LOG_LEVEL must be one of debug, info, warning, error, critical, "
        "not 'bogus'"
    )


def test_serve_with_an_unreachable_store_exits_1_with_one_line(tmp_path: Path) -> None:
    """A store that cannot be opened at start-up is a one-line error, not a traceback."""
    (tmp_path / "destinations").mkdir()
    (tmp_path / "gateway.toml").write_text(
        '[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
        '[store]\nurl = "postgresql://postgres@127.0.0.1:1/nothing-listens-here"\n'
    )
    result = sinkgate("serve", "--config", str(tmp_path / "gateway.toml"))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    # In check-config --connect's words, not the driver's `ConnectionRefusedError: [Errno 111]`.
    assert last == (
        "sinkgate: store postgresql://postgres@127.0.0.1:1/nothing-listens-here: cannot "
        "connect to 127.0.0.1:1 (Connection refused): is PostgreSQL running there, and is "
        "the URL's port its port?"
    ), result.stderr


@pytest.mark.parametrize(
    ("url", "says"),
    [
        # refused by check-config and serve alike
        ("postgresql://postgres:pw@127.0.0.1:notaport/test", "a port in it is not a number"),
        # asyncpg checks its options only when connecting
        ("postgresql://postgres:pw@127.0.0.1:1/test?sslmode=bogus", "`sslmode` parameter"),
    ],
)
def test_serve_with_a_store_url_the_driver_refuses_exits_1_with_one_line(
    tmp_path: Path, url: str, says: str
) -> None:
    (tmp_path / "destinations").mkdir()
    (tmp_path / "gateway.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n[store]\nurl = "{url}"\n'
    )
    result = sinkgate("serve", "--config", str(tmp_path / "gateway.toml"))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "pw" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("sinkgate: ") and says in last, result.stderr


def test_serve_where_the_sqlite_directory_cannot_be_made_names_the_store(tmp_path: Path) -> None:
    (tmp_path / "destinations").mkdir()
    (tmp_path / "in-the-way").write_text("a file, not a directory")
    (tmp_path / "gateway.toml").write_text(
        '[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
        '[store]\nurl = "sqlite:///in-the-way/sinkgate.db"\n'
    )
    result = sinkgate("serve", "--config", str(tmp_path / "gateway.toml"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("sinkgate: store sqlite:///") and "cannot make the directory" in last


def test_serve_on_a_store_from_a_newer_release_exits_1_with_one_line(tmp_path: Path) -> None:
    """A database whose recorded schema is newer than this release is refused at
    start-up, without a traceback, and its recorded version is left as it was."""
    import sqlite3

    (tmp_path / "destinations").mkdir()
    (tmp_path / "gateway.toml").write_text(
        '[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
        '[store]\nurl = "sqlite:///data/sinkgate.db"\n'
    )
    first = sinkgate("check-config", "--config", str(tmp_path / "gateway.toml"))
    assert first.returncode == 0, first.stderr
    db = tmp_path / "data" / "sinkgate.db"
    db.parent.mkdir()
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE sinkgate_schema (component TEXT PRIMARY KEY, version INTEGER)")
        conn.execute("INSERT INTO sinkgate_schema VALUES ('leases', 99)")
    result = sinkgate("serve", "--config", str(tmp_path / "gateway.toml"))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("sinkgate: store sqlite:///") and "leases v99 is newer" in last, (
        result.stderr
    )
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT * FROM sinkgate_schema").fetchall() == [("leases", 99)]


def test_serve_runs_the_app_with_the_loaded_config(
    monkeypatch: pytest.MonkeyPatch, restore_logging: None
) -> None:
    served: list[Config] = []

    async def serve(config: Config) -> None:
        served.append(config)

    app = types.ModuleType("gateway.app")
    app.serve = serve  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gateway.app", app)
    assert cli.main(["serve", "--config", str(SHIPPED), "--log-format", "json"]) == 0
    assert [c.source for c in served] == [SHIPPED]


# --- logging -------------------------------------------------------------------------


def test_json_logs_carry_level_utc_time_and_bound_context(
    capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    configure_logging("info", json=True)
    log = structlog.get_logger()
    with structlog.contextvars.bound_contextvars(destination="payments"):
        log.debug("not_shown")
        log.info("forwarded", status=201)
        logging.getLogger("aiohttp.access").info("GET %s", "/x")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["event"] for line in lines] == ["forwarded", "GET /x"]
    first = lines[0]
    assert (first["level"], first["destination"], first["status"]) == ("info", "payments", 201)
    assert first["timestamp"].endswith("Z")
    assert lines[1]["logger"] == "aiohttp.access"


def test_unknown_log_level_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("loud")
