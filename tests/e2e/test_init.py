"""`sinkgate init`, `--version`, and `serve` without a config file (SPEC 6), through
the real entry point, in an empty directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from gateway.config import keys
from gateway.config.model import load_config
from gateway.config.starter import template
from tests.harness import repository_build

REPO = Path(__file__).resolve().parents[2]


def sinkgate(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SINKGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=cwd,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_version_prints_the_package_version() -> None:
    result = sinkgate(REPO, "--version")
    assert result.returncode == 0
    assert result.stdout == f"sinkgate {version('sinkgate')}\n"


def test_init_writes_files_that_check_config_accepts(tmp_path: Path) -> None:
    result = sinkgate(tmp_path, "init")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "config" / "gateway.toml").read_text() == template("gateway.toml")
    assert (tmp_path / "config" / "destinations" / "example.toml").read_text() == template(
        "example.toml"
    )
    assert result.stdout.splitlines()[:2] == [
        "wrote config/gateway.toml",
        "wrote config/destinations/example.toml",
    ]
    assert "  sinkgate check-config\n  sinkgate serve\n" in result.stdout
    check = sinkgate(tmp_path, "check-config")
    assert check.returncode == 0, check.stderr
    assert "example  http://127.0.0.1:9000/api" in check.stdout


def test_init_into_a_directory_names_it_in_the_next_commands(tmp_path: Path) -> None:
    result = sinkgate(tmp_path, "init", "etc/sg")
    assert result.returncode == 0, result.stderr
    assert "  sinkgate serve --config etc/sg/gateway.toml\n" in result.stdout
    check = sinkgate(tmp_path, "check-config", "--config", "etc/sg/gateway.toml")
    assert check.returncode == 0, check.stderr
    spaced = sinkgate(tmp_path, "init", "my config")
    assert "  sinkgate serve --config 'my config/gateway.toml'\n" in spaced.stdout


@pytest.mark.parametrize("existing", ["gateway.toml", "destinations/example.toml"])
def test_init_refuses_to_overwrite_and_writes_nothing(tmp_path: Path, existing: str) -> None:
    target = tmp_path / "config" / existing
    target.parent.mkdir(parents=True)
    target.write_text("# mine\n")
    result = sinkgate(tmp_path, "init")
    assert result.returncode == 1
    assert result.stderr == f"sinkgate: config/{existing} already exists; not overwriting it\n"
    assert target.read_text() == "# mine\n"
    assert sorted(p.name for p in (tmp_path / "config").rglob("*.toml")) == [target.name]


@pytest.mark.parametrize(
    ("file", "into", "message"),
    [
        ("sg", "sg", "sinkgate: sg is not a directory; cannot write sg/gateway.toml\n"),
        (
            "sg/destinations",
            "sg",
            "sinkgate: sg/destinations is not a directory; cannot write "
            "sg/destinations/example.toml\n",
        ),
    ],
)
def test_init_where_a_file_is_in_the_way_says_so_and_writes_nothing(
    tmp_path: Path, file: str, into: str, message: str
) -> None:
    (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / file).write_text("")
    result = sinkgate(tmp_path, "init", into)
    assert (result.returncode, result.stderr) == (1, message)
    assert not list(tmp_path.rglob("*.toml"))


def test_init_where_nothing_can_be_written_says_so_in_one_line(tmp_path: Path) -> None:
    result = sinkgate(tmp_path, "init", "/proc/sinkgate-cannot-be-here")
    assert result.returncode == 1
    assert result.stderr == (
        "sinkgate: cannot write /proc/sinkgate-cannot-be-here/gateway.toml: "
        "No such file or directory\n"
    )


def test_serve_without_a_config_file_says_to_run_init(tmp_path: Path) -> None:
    result = sinkgate(tmp_path, "serve")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "sinkgate: config/gateway.toml: cannot read: no such file",
        "sinkgate: no config file: run `sinkgate init` to write one, or pass --config PATH",
    ]


def test_a_config_named_and_missing_says_the_init_that_writes_it(tmp_path: Path) -> None:
    """It said "or pass --config PATH" to a user who had, and then nothing of
    `sinkgate init` (SPEC 6: serve without a config file says to run it)."""
    result = sinkgate(tmp_path, "serve", "--config", "else where/gateway.toml")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "sinkgate: else where/gateway.toml: cannot read: no such file",
        "sinkgate: no config file: run `sinkgate init 'else where'` to write one",
    ]
    result = sinkgate(tmp_path, "serve", "--config", "prod.toml")
    assert result.stderr.splitlines()[1] == (
        "sinkgate: no config file: run `sinkgate init` to write one (config/gateway.toml), "
        "then pass that"
    )


def test_an_interrupt_without_a_handler_is_one_line_and_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C during `demo` printed a CancelledError and a KeyboardInterrupt traceback."""
    from gateway import cli

    def interrupted(argv: list[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_main", interrupted)
    assert cli.main(["demo"]) == 130
    assert capsys.readouterr().err.strip() == "sinkgate: interrupted"


def test_every_key_is_in_the_templates_that_init_writes() -> None:
    """The templates document every key: a key added to keys.py and not to them fails."""
    gateway, example = template("gateway.toml"), template("example.toml")
    for section in keys.GATEWAY_FILE:
        assert f"[{section.name}]" in gateway
        for name in section.names:  # a key, or a table of its own (commented out or not)
            assert f"{name} = " in gateway or f"[{section.name}.{name}]" in gateway, name
    for name in keys.DESTINATION.names:
        assert f"{name} = " in example or f"[{name}]" in example, name


def test_the_operators_table_of_the_written_file_can_be_filled_in(tmp_path: Path) -> None:
    """`[admin.operators]` is a table of its own: uncommenting the template's example,
    or adding the table as SPEC 5 shows it, loads (an inline `operators = {}` in
    the file made the second a TOML error: the table declared twice)."""
    assert sinkgate(tmp_path, "init").returncode == 0
    path = tmp_path / "config" / "gateway.toml"
    written = path.read_text()
    environ = {"SINKGATE_TOKEN_ALICE": "a" * 20, "SINKGATE_TOKEN_BOB": "b" * 20}
    uncommented, found = re.subn(
        r"^# (\[admin\.operators\])\n# (alice = \"SINKGATE_TOKEN_ALICE\")$",
        r"\1\n\2",
        written,
        flags=re.MULTILINE,
    )
    assert found == 1
    path.write_text(uncommented)
    assert load_config(path, environ).admin_operators == (("alice", "a" * 20),)
    path.write_text(written + '\n[admin.operators]\nbob = "SINKGATE_TOKEN_BOB"\n')
    assert load_config(path, environ).admin_operators == (("bob", "b" * 20),)


@pytest.mark.slow
def test_the_wheel_carries_the_templates(tmp_path: Path) -> None:
    with repository_build():  # another test process may be building it now
        _wheel(tmp_path)
    (wheel,) = tmp_path.glob("sinkgate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "gateway/config/templates/gateway.toml" in names
    assert "gateway/config/templates/example.toml" in names


def _wheel(into: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-w",
            str(into),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )


def test_a_key_appended_to_the_destination_template_is_never_a_header(tmp_path: Path) -> None:
    """The template leaves `[upstream_headers]` commented out, so a key added at the
    end is the destination's (or a duplicate, refused), never a header; with the
    table in use, `check-config` warns about a header named like a destination key."""
    assert sinkgate(tmp_path, "init").returncode == 0
    example = tmp_path / "config" / "destinations" / "example.toml"
    shipped = example.read_text()

    example.write_text(shipped + 'timeout = "3s"\n')
    check = sinkgate(tmp_path, "check-config")
    assert check.returncode == 1  # set twice: an error, not a header
    invalid = r"config/destinations/example\.toml: line \d+, column \d+: invalid TOML"
    assert re.search(invalid, check.stderr), check.stderr

    example.write_text(shipped + "max_in_flight = 8\n")
    check = sinkgate(tmp_path, "check-config")
    assert check.returncode == 0, check.stderr
    assert "upstream_headers=none" in check.stdout and "warning" not in check.stderr

    # A user who enables the table and then appends a key gets told.
    enabled = shipped.replace("# [upstream_headers]", "[upstream_headers]")
    assert enabled != shipped
    example.write_text(enabled + 'timeout = "3s"\n')
    check = sinkgate(tmp_path, "check-config")
    assert check.returncode == 0, check.stderr
    assert "upstream_headers=timeout" in check.stdout
    assert (
        "sinkgate: warning: config/destinations/example.toml: [upstream_headers] timeout: "
        "a header named like the destination key 'timeout'"
    ) in check.stderr
