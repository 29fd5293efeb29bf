"""`sinkgate keys`, `sinkgate keys resolve` and `sinkgate rejections --all` against a
live admin listener on loopback."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web

from gateway import cli as gateway_cli
from gateway.admin.app import create_admin_app
from gateway.admin.cli import keys as keys_cli
from gateway.admin.cli import rejections as rejections_cli
from gateway.http.server import GatewayRunner
from gateway.policy.decision import KeyState
from gateway.policy.records import Outcome, RejectionRecord
from gateway.store.admin_records import AuditQuery
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.metrics import Metrics
from tests.e2e.test_admin import CONTEXT, facts

TOKEN = "keys-cli-token"


@pytest.fixture
async def live(tmp_path, fake_clock, monkeypatch) -> AsyncIterator[tuple[str, SQLiteStore]]:
    monkeypatch.setenv("SINKGATE_ADMIN_TOKEN", TOKEN)
    store = await SQLiteStore.open("sqlite:///" + str(tmp_path / "k.db"), clock=fake_clock)
    for key in ("lost-1", "lost-2"):
        f = facts("job-1", 1, key)
        verdict = await store.decide_write(f, CONTEXT)
        await store.record_outcome(f, verdict.attempt, Outcome("unknown"))
        fake_clock.advance(1)
    f = facts("job-2", 1, "done")
    verdict = await store.decide_write(f, CONTEXT)
    await store.record_outcome(f, verdict.attempt, Outcome("completed", status=201, body=b"{}"))
    runner = GatewayRunner(create_admin_app(store, Metrics(), token=TOKEN, gauge_interval=None))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}", store
    await runner.cleanup()
    await store.close()


async def sinkgate(*argv: str) -> tuple[int, str, str]:
    """`sinkgate ARGV` through the real parser; the CLI blocks, so in a thread."""
    args = gateway_cli._parser().parse_args(list(argv))
    out, err = io.StringIO(), io.StringIO()
    module: Any = keys_cli if args.command == "keys" else rejections_cli
    code = await asyncio.to_thread(module.main, args, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


async def test_keys_table_and_filters(live):
    url, _ = live
    code, out, err = await sinkgate("keys", "--admin", url)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["UPDATED", "(UTC)", "STATE"]
    assert [line.split()[4] for line in lines[1:]] == ["done", "lost-2", "lost-1"]
    code, out, _ = await sinkgate("keys", "--admin", url, "--state", "unknown", "--limit", "1")
    assert code == 0 and "lost-2" in out and "lost-1" not in out and "more keys match" in out
    code, out, _ = await sinkgate("keys", "--admin", url, "--state", "unknown", "--all", "--json")
    assert code == 0 and len(out.splitlines()) == 2


async def test_admin_url_comes_from_the_environment(live, monkeypatch):
    url, _ = live
    monkeypatch.setenv("SINKGATE_ADMIN_URL", url)
    code, out, err = await sinkgate("keys", "--state", "completed")
    assert code == 0, err
    assert "done" in out
    code, out, err = await sinkgate("rejections")
    assert code == 0, err
    assert "no rejections match" in out


async def test_resolve_applied_with_a_body_file(live, tmp_path):
    url, store = live
    body = tmp_path / "answer.json"
    body.write_text('{"id":"ch_1"}')
    code, out, err = await sinkgate(
        "keys", "resolve", "--admin", url, "payments", "lost-1", "--applied", "--status", "201",
        "--body-file", str(body), "--note", "ledger has ch_1",
    )  # fmt: skip
    assert code == 0, err
    assert "as applied (status 201)" in out
    record = await store.key_record("payments", "lost-1")
    assert (record.state, record.status, record.body) == (KeyState.COMPLETED, 201, b'{"id":"ch_1"}')
    [entry] = await store.list_audit(AuditQuery())
    assert (entry.action, entry.note) == ("resolve_applied", "ledger has ch_1")


async def test_resolve_not_applied_and_refusals(live):
    url, store = live
    code, out, err = await sinkgate(
        "keys", "resolve", "--admin", url, "payments", "lost-2", "--not-applied", "--note", "none"
    )
    assert code == 0, err
    assert "as not applied" in out
    assert await store.key_record("payments", "lost-2") is None
    code, _, err = await sinkgate(
        "keys", "resolve", "--admin", url, "payments", "done", "--applied", "--note", "x"
    )
    assert code == 1 and "is completed, not unknown" in err
    code, _, err = await sinkgate(
        "keys", "resolve", "--admin", url, "payments", "nope", "--not-applied", "--note", "x"
    )
    assert code == 1 and "no idempotency record" in err
    code, _, err = await sinkgate(
        "keys", "resolve", "--admin", url, "payments", "lost-1", "--not-applied",
        "--status", "200", "--note", "x",
    )  # fmt: skip
    assert code == 1 and "go with --applied only" in err
    assert (await store.key_record("payments", "lost-1")).state is KeyState.UNKNOWN


async def test_rejections_all_follows_the_cursor_past_1000(live):
    url, store = live
    for n in range(1234):
        await store.record_rejection(RejectionRecord(reason="duplicate", detail=f"r{n}"))
    code, out, err = await sinkgate("rejections", "--admin", url, "--all", "--json")
    assert code == 0, err
    assert len(out.splitlines()) == 1234
    code, out, _ = await sinkgate("rejections", "--admin", url, "--limit", "1000", "--json")
    assert len(out.splitlines()) == 1000


async def test_an_unknown_reason_names_the_valid_ones(live):
    url, _ = live
    code, out, err = await sinkgate("rejections", "--admin", url, "--reason", "stale")
    assert code == 1 and out == ""
    assert "'stale' is not a reason" in err and "stale_generation" in err and "duplicate" in err
    # a reason of the contract that no log row carries is named as such
    code, out, err = await sinkgate("rejections", "--admin", url, "--reason", "invalid_path")
    assert code == 1 and out == ""
    assert "'invalid_path' is never in the rejection log" in err


async def test_a_long_key_and_job_are_shown_whole_to_be_copied(live, monkeypatch):
    # A derived key (job:step:<32 hex>) is longer than a cell; `keys resolve` and
    # `--job` need it whole, and the destination too.
    url, store = live
    job, key = "order-" + "7" * 60, "order-1001:charge:" + "0123456789abcdef" * 2
    where = "payments-eu-west-1-primary-ledger-settlement-batch-0001"  # resolve's first word
    f = replace(facts(job, 1, key), destination=where)
    verdict = await store.decide_write(f, CONTEXT)
    await store.record_outcome(f, verdict.attempt, Outcome("unknown"))
    code, out, err = await sinkgate("keys", "--admin", url, "--job", job)
    assert code == 0, err
    (row,) = out.splitlines()[1:]
    assert row.split()[3:6] == [where, key, job]


async def test_an_admin_url_in_the_environment_passing_over_config_is_said(
    live, monkeypatch, tmp_path
):
    url, _ = live
    config = tmp_path / "other.toml"
    config.write_text('[server]\nadmin_listen = "127.0.0.1:9"\n')
    monkeypatch.setenv("SINKGATE_ADMIN_URL", url)
    for command in ("keys", "rejections"):
        code, _, err = await sinkgate(command, "--config", str(config))
        assert code == 0
        assert f"asking $SINKGATE_ADMIN_URL ({url}), not --config's admin_listen" in err
        code, _, err = await sinkgate(command)
        assert code == 0 and err == ""
