"""`sinkgate rejections` against a live admin listener on loopback."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from aiohttp import web

from gateway import cli as gateway_cli
from gateway.admin.app import create_admin_app
from gateway.admin.cli import keys as keys_cli
from gateway.admin.cli.client import connect, to_rfc3339
from gateway.admin.cli.rejections import main, more_hint
from gateway.http.server import GatewayRunner
from gateway.policy.records import RejectionRecord
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.metrics import Metrics

TOKEN = "cli-test-token"


def record(reason: str, job: str, generation: int, current: int, key: str) -> RejectionRecord:
    return RejectionRecord(
        reason=reason,
        detail="test",
        destination="payments",
        method="POST",
        path="/charge?x=1",
        job_id=job,
        generation=generation,
        owner="worker-a",
        idempotency_key=key,
        current_generation=current,
        highest_generation=current,
    )


@pytest.fixture
async def admin_url(tmp_path, fake_clock) -> AsyncIterator[str]:
    store = await SQLiteStore.open("sqlite:///" + str(tmp_path / "g.db"), clock=fake_clock)
    await store.record_rejection(record("stale_generation", "job-42", 7, 8, "pay-42"))
    fake_clock.advance(60)
    await store.record_rejection(record("idempotency_key_reused", "job-43", 3, 3, "pay-43"))
    fake_clock.advance(60)
    await store.record_rejection(record("lease_expired", "job-44\x1b[31m", 2, 2, "pay-44"))
    runner = GatewayRunner(create_admin_app(store, Metrics(), token=TOKEN))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    await runner.cleanup()
    await store.close()


def parse(*argv: str) -> argparse.Namespace:
    """`sinkgate rejections ARGV` through the parser users run."""
    return gateway_cli._parser().parse_args(["rejections", *argv])


def args(admin: str, *argv: str) -> argparse.Namespace:
    return parse("--admin", admin, *argv)


async def run(namespace: argparse.Namespace, now: datetime | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    # The CLI blocks on its request; the server lives on this test's loop.
    code = await asyncio.to_thread(main, namespace, stdout=out, stderr=err, now=now)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def token(monkeypatch) -> None:
    monkeypatch.setenv("SINKGATE_ADMIN_TOKEN", TOKEN)


async def test_table_lists_rejections_newest_first_aligned(admin_url, token):
    code, out, err = await run(args(admin_url))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == [
        "WHEN",
        "(UTC)",
        "REASON",
        "JOB",
        "GEN/CUR",
        "DESTINATION",
        "REQUEST",
        "KEY",
    ]
    assert [line.split()[2] for line in lines[1:]] == [
        "lease_expired",
        "idempotency_key_reused",
        "stale_generation",
    ]
    stale = lines[3]
    assert stale.startswith("2023-11-14 22:13:20")
    assert "job-42" in stale and "7/8" in stale and "POST /charge?x=1" in stale
    assert "pay-42" in stale
    # Columns line up: every row has its reason where the header has REASON.
    for header in ("REASON", "JOB", "GEN/CUR", "KEY"):
        column = lines[0].index(header)
        assert all(line[column - 1] == " " and line[column] != " " for line in lines[1:])
    assert "\x1b" not in out  # control characters from the log never reach the terminal


async def test_filters_are_passed_on(admin_url, token):
    code, out, _ = await run(args(admin_url, "--reason", "stale_generation", "--job", "job-42"))
    assert code == 0
    assert len(out.splitlines()) == 2 and "job-42" in out


async def test_relative_since(admin_url, token):
    # The store's clock started at 22:13:20; "90s" before 22:15:20 keeps the last two.
    now = datetime(2023, 11, 14, 22, 15, 20, tzinfo=UTC)
    code, out, _ = await run(args(admin_url, "--since", "90s"), now=now)
    assert code == 0
    assert "stale_generation" not in out and "idempotency_key_reused" in out


async def test_json_lines(admin_url, token):
    code, out, _ = await run(args(admin_url, "--json", "--limit", "2"))
    assert code == 0
    items = [json.loads(line) for line in out.splitlines()]
    assert [i["reason"] for i in items] == ["lease_expired", "idempotency_key_reused"]
    assert items[1]["job_id"] == "job-43" and items[1]["generation"] == 3


async def test_limit_says_when_more_matched(admin_url, token):
    code, out, _ = await run(args(admin_url, "--limit", "1"))
    assert code == 0
    assert len([line for line in out.splitlines() if "lease_expired" in line]) == 1
    assert "more rejections match: raise --limit (up to 1000), show them all with --all" in out


def test_at_the_largest_limit_the_hint_is_to_narrow_not_to_raise_it():
    assert more_hint(1000) == (
        "show them all with --all, or narrow them with --reason, --job, --destination, "
        "--since or --until"
    )
    # `sinkgate keys --limit 1000` said to raise --limit all the same
    assert keys_cli.more_hint(1000) == (
        "show them all with --all, or narrow them with --state, --destination, --job, "
        "--since or --until"
    )
    assert keys_cli.more_hint(999).startswith("raise --limit (up to 1000), ")


async def test_empty_result(admin_url, token):
    code, out, _ = await run(args(admin_url, "--job", "nobody"))
    assert (code, out.strip()) == (0, "no rejections match")


async def test_missing_token_is_a_one_line_error(admin_url, monkeypatch):
    monkeypatch.delenv("SINKGATE_ADMIN_TOKEN", raising=False)
    code, out, err = await run(args(admin_url))
    assert code == 1 and out == ""
    assert err.count("\n") == 1
    assert "unauthorized" in err and "SINKGATE_ADMIN_TOKEN" in err


async def test_wrong_token_is_a_one_line_error(admin_url, monkeypatch):
    monkeypatch.setenv("SINKGATE_ADMIN_TOKEN", "nope")
    code, _, err = await run(args(admin_url))
    assert code == 1
    assert "token was refused" in err and err.count("\n") == 1


async def test_bad_filter_shows_the_servers_reason(admin_url, token):
    code, _, err = await run(args(admin_url, "--since", "last tuesday"))
    assert code == 1
    assert "400" in err and "RFC 3339" in err


async def test_connection_refused(token):
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = await run(args(f"http://127.0.0.1:{port}"))
    assert code == 1 and out == ""
    assert f"cannot reach the admin listener at http://127.0.0.1:{port}" in err


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://x", "--admin must be an http"),
        ("http://[::1", "is not a valid URL"),
        ("http://127.0.0.1:99999", "is not a valid URL"),
        ("http://", "--admin must be an http"),
    ],
)
def test_bad_admin_url_is_one_line(url, message):
    out, err = io.StringIO(), io.StringIO()
    assert main(args(url), stdout=out, stderr=err) == 1
    assert message in err.getvalue() and err.getvalue().count("\n") == 1


def test_a_bad_admin_url_from_the_environment_is_named_as_such(monkeypatch):
    monkeypatch.setenv("SINKGATE_ADMIN_URL", "ftp://x")
    out, err = io.StringIO(), io.StringIO()
    assert main(parse(), stdout=out, stderr=err) == 1
    assert "SINKGATE_ADMIN_URL must be an http:// or https:// URL, not 'ftp://x'" in err.getvalue()


def test_an_empty_admin_url_variable_is_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("SINKGATE_ADMIN_URL", "")
    monkeypatch.delenv("SINKGATE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)  # no config/gateway.toml here
    assert connect(parse()).base == "http://127.0.0.1:8481"


def test_a_token_no_header_can_carry_is_refused_here(monkeypatch):
    monkeypatch.setenv("SINKGATE_ADMIN_TOKEN", "sek\nret")
    out, err = io.StringIO(), io.StringIO()
    assert main(args("http://127.0.0.1:1"), stdout=out, stderr=err) == 1
    assert "SINKGATE_ADMIN_TOKEN holds characters a header cannot carry" in err.getvalue()


async def test_the_write_listener_given_as_admin_says_which_to_give(token):
    """It answered "no route /admin/rejections (404)": no word of the other listener."""
    from gateway.http.problem import router_refusal  # the write listener's 404

    @web.middleware
    async def refusals(request: web.Request, handler):  # type: ignore[no-untyped-def]
        try:
            return await handler(request)
        except web.HTTPException as exc:
            return router_refusal(request, exc) or exc

    code, out, err = await run_against(web.Application(middlewares=[refusals]))
    assert (code, out) == (1, "")
    assert "is --admin the write listener" in err and "admin_listen" in err


async def test_a_server_that_is_not_an_admin_listener_is_an_error(token):
    async def not_admin(request: web.Request) -> web.Response:
        return web.json_response({"hello": "world"})

    app = web.Application()
    app.router.add_get("/admin/rejections", not_admin)
    code, out, err = await run_against(app)
    assert (code, out) == (1, "")
    assert "did not answer like a sinkgate admin listener" in err


async def run_against(app: web.Application) -> tuple[int, str, str]:
    """`sinkgate rejections` against `app`, served on a loopback port of its own."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        return await run(args(f"http://{host}:{port}"))
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("250ms", "2024-05-01T11:59:59.750Z"),
        ("30m", "2024-05-01T11:30:00Z"),
        ("1h", "2024-05-01T11:00:00Z"),
        ("7d", "2024-04-24T12:00:00Z"),
        ("2w", "2024-04-17T12:00:00Z"),
        ("2024-01-01T00:00:00Z", "2024-01-01T00:00:00Z"),
        (None, None),
    ],
)
def test_relative_times(value, expected):
    now = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    assert to_rfc3339(value, now, "--since") == expected


def test_a_time_in_other_digits_is_left_to_the_gateway_to_refuse():
    """`٣h` (Arabic-Indic 3) was read as 3h; the gateway's own filters refuse it."""
    now = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    assert to_rfc3339("٣h", now, "--since") == "٣h"


async def test_a_reader_that_goes_away_gets_no_traceback(admin_url, token):
    """`sinkgate rejections --json | head -1`: the pipe closes under the writer."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE
    try:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "rejections", "--admin", admin_url, "--json",
            stdout=write_end, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
    finally:
        os.close(write_end)
    _, err = await child.communicate()
    assert child.returncode == 1
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


def test_a_broken_pipe_that_is_not_the_readers_is_not_hidden(monkeypatch, capsys):
    """Only a closed stdout ends the command quietly; a socket's EPIPE is a failure."""

    def broken(argv: list[str]) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(gateway_cli, "_main", broken)
    with pytest.raises(BrokenPipeError):
        gateway_cli.main(["demo"])


async def test_a_redirect_is_not_followed_and_the_token_goes_nowhere_else(token):
    """urllib follows redirects and copies `Authorization` to the new host: a
    server at the admin URL that redirected got the admin token sent to another."""
    seen: list[str | None] = []

    async def elsewhere(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"items": [], "next_cursor": None})

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://127.0.0.1:{other_port}/admin/rejections")

    other = web.Application()
    other.router.add_get("/admin/rejections", elsewhere)
    first = web.Application()
    first.router.add_get("/admin/rejections", redirect)
    runners = [web.AppRunner(other), web.AppRunner(first)]
    for runner in runners:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
    other_port = runners[0].addresses[0][1]
    port = runners[1].addresses[0][1]
    try:
        code, out, err = await run(args(f"http://127.0.0.1:{port}"))
    finally:
        for runner in runners:
            await runner.cleanup()
    assert (code, out) == (1, "")
    assert "answered 302, a redirect to" in err and "not followed" in err
    assert err.count("\n") == 1
    assert seen == []


async def test_a_token_read_with_its_newline_is_stripped_as_the_gateway_strips_it(
    admin_url, monkeypatch
):
    monkeypatch.setenv("SINKGATE_ADMIN_TOKEN", f" {TOKEN}\r\n")
    code, out, _ = await run(args(admin_url))
    assert code == 0 and "job-42" in out


def test_a_config_that_is_not_utf8_is_one_line(tmp_path, token):
    config = tmp_path / "gateway.toml"
    config.write_bytes(b'[server]\nadmin_listen = "x\xff"\n')
    out, err = io.StringIO(), io.StringIO()
    assert main(parse("--config", str(config)), stdout=out, stderr=err) == 1
    assert f"cannot read the config {config}" in err.getvalue()
    assert err.getvalue().count("\n") == 1
