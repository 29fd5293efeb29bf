"""Reload without a restart (SPEC 5): destinations added, changed and removed,
a write in flight finishing under the destination as it was, a broken file
changing nothing, restart-only keys refused; through SIGHUP and /admin/reload."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from structlog.testing import capture_logs

from gateway.app import RELOADER, WRITES
from gateway.config.model import load_config
from gateway.errors import ConfigError, StoreUnavailable
from gateway.http.appkeys import METRICS
from gateway.store.admin_records import AuditQuery
from tests.harness import (
    Gateway,
    RecordingUpstream,
    eventually,
    recording_upstream,
    running_gateway,
)
from tests.served import served

GATEWAY = '[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'


def write_files(directory: Path, gateway: str = GATEWAY, **destinations: str | None) -> Path:
    """gateway.toml and destinations/<name>.toml; None removes that file."""
    (directory / "destinations").mkdir(exist_ok=True)
    (directory / "gateway.toml").write_text(gateway)
    for name, text in destinations.items():
        path = directory / "destinations" / f"{name}.toml"
        if text is None:
            path.unlink()
        else:
            path.write_text(text)
    return directory / "gateway.toml"


def to(upstream: RecordingUpstream, base: str = "/api") -> str:
    return f'upstream = "{upstream.url}{base}"\ntimeout = "20s"\n'


@pytest.fixture
async def one() -> AsyncIterator[RecordingUpstream]:
    async with recording_upstream() as up:
        yield up


@pytest.fixture
async def two() -> AsyncIterator[RecordingUpstream]:
    async with recording_upstream() as up:
        yield up


async def test_destinations_are_added_changed_and_removed(
    tmp_path: Path, one: RecordingUpstream, two: RecordingUpstream
) -> None:
    path = write_files(tmp_path, a=to(one), b=to(one), c=to(one))
    async with running_gateway(load_config(path, {})) as gw:
        await gw.claim("job-1")
        write_files(tmp_path, a=to(two, "/v2"), b=None, c=to(one), d=to(two))
        result = await gw.app[RELOADER].reload("test")
        assert (result.added, result.changed, result.removed) == (("d",), ("a",), ("b",))
        assert result.destinations == ("a", "c", "d")
        assert (await gw.write("/to/a/x", key="k1"))[0] == 201
        assert (await gw.write("/to/c/x", key="k2"))[0] == 201
        assert (await gw.write("/to/d/x", key="k3"))[0] == 201
        status, headers, _ = await gw.write("/to/b/x", key="k4")
        assert status == 404 and headers["Sinkgate-Rejected"] == "unknown_destination"
        # a removed destination's writes in flight are no series; an added one's
        # series are there at 0 before its first count (rate() sees that count)
        exposed = gw.app[METRICS].render()[0].decode()
        assert 'sinkgate_in_flight_writes{destination="b"}' not in exposed
        assert 'sinkgate_in_flight_writes{destination="d"} 0.0' in exposed
        assert 'sinkgate_upstream_outcomes_total{destination="d",outcome="unknown"} 0.0' in exposed
        assert "d" in gw.app[METRICS].destinations  # the unknown-keys gauge sets it
    assert one.paths() == ["/api/x"]
    assert two.paths() == ["/v2/x", "/api/x"]


async def held_write(gw: Gateway, upstream: RecordingUpstream, key: str) -> asyncio.Task:
    """A write the upstream holds until `upstream.release` is set."""
    task = asyncio.create_task(gw.write("/to/a/slow/1", key=key))
    await eventually(lambda: upstream.arrived.is_set(), what="the held write's arrival")
    return task


@pytest.mark.parametrize("change", ["changed", "removed"])
async def test_a_write_in_flight_finishes_under_the_destination_as_it_was(
    tmp_path: Path, one: RecordingUpstream, two: RecordingUpstream, change: str
) -> None:
    path = write_files(tmp_path, a=to(one))
    async with running_gateway(load_config(path, {})) as gw:
        await gw.claim("job-1")
        held = await held_write(gw, one, "k-held")
        write_files(tmp_path, a=to(two) if change == "changed" else None)
        await gw.app[RELOADER].reload("test")
        upstreams = gw.app[WRITES].upstreams
        # The old pool stays open for the write it still carries...
        assert upstreams.retired_open == 1
        if change == "changed":
            assert (await gw.write("/to/a/new", key="k-new"))[0] == 201
            assert two.paths() == ["/api/new"]
        one.release.set()
        status, _, body = await held
        assert status == 201, body
        # ...and is closed once that write has ended.
        assert upstreams.retired_open == 0
        record = await gw.store.key_record("a", "k-held")
        assert record is not None and record.state == "completed"
    assert one.paths() == ["/api/slow/1"]


async def test_a_pool_that_relayed_a_streamed_answer_closes_after_its_timeout(
    tmp_path: Path, one: RecordingUpstream
) -> None:
    """An answer longer than max_replay_body is relayed after send() returned: the
    old pool stays open until that relay has run out of time, then closes."""
    path = write_files(
        tmp_path, a=f'upstream = "{one.url}/api"\ntimeout = "1s"\nmax_replay_body = "16B"\n'
    )
    async with running_gateway(load_config(path, {})) as gw:
        await gw.claim("job-1")
        status, _, body = await gw.write("/to/a/big/200000", key="k-big")
        assert status == 200 and len(body) == 200000
        write_files(tmp_path, a=None)
        await gw.app[RELOADER].reload("test")
        upstreams = gw.app[WRITES].upstreams
        assert upstreams.retired_open == 1
        await eventually(lambda: upstreams.retired_open == 0, what="the old pool's close")


async def test_a_broken_file_changes_nothing_and_is_logged_as_check_config_says(
    tmp_path: Path, one: RecordingUpstream, two: RecordingUpstream
) -> None:
    path = write_files(tmp_path, a=to(one))
    async with running_gateway(load_config(str(path), {}, display=str(path))) as gw:
        await gw.claim("job-1")
        write_files(
            tmp_path,
            GATEWAY + '[retention]\nidempotency_ttl = "1h"\n',
            a=to(two),
            b='upstream = "ftp://x"\n',
            c=to(two) + "retries = 3\n",
        )
        with capture_logs() as logs, pytest.raises(ConfigError):
            await gw.app[RELOADER].reload("test")
        assert gw.app[RELOADER].config.idempotency_ttl == 24 * 3600
        assert (await gw.write("/to/a/x", key="k1"))[0] == 201
        assert one.paths() == ["/api/x"] and two.received == []
        assert (await gw.write("/to/c/x", key="k2"))[0] == 404
    checked = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gateway", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    expected = [line.removeprefix("sinkgate: ") for line in checked.stderr.splitlines()]
    assert len(expected) == 2
    assert [e["error"] for e in logs if e["event"] == "reload_failed"] == expected


async def test_restart_only_keys_are_refused_and_the_rest_goes_ahead(
    tmp_path: Path, one: RecordingUpstream
) -> None:
    path = write_files(tmp_path, a=to(one))
    async with running_gateway(load_config(path, {})) as gw:
        write_files(
            tmp_path,
            GATEWAY + "max_in_flight = 7\n[store]\npool_size = 3\n"
            '[admin]\ntoken_env = "OTHER"\n[retention]\nrejections_ttl = "1d"\n',
            b=to(one),
        )
        with capture_logs() as logs:
            result = await gw.app[RELOADER].reload("test")
        keys = ["server.max_in_flight", "store.pool_size", "admin.token_env"]
        assert result.refused == tuple(keys)
        assert [e["keys"] for e in logs if e["event"] == "reload_refused"] == [keys]
        applied = gw.app[WRITES].config
        assert applied.max_in_flight == 4096 and applied.store_pool_size == 10
        assert applied.rejections_ttl == 24 * 3600 and sorted(applied.destinations) == ["a", "b"]


async def test_a_restart_only_section_this_process_cannot_read_is_refused_not_failed(
    tmp_path: Path, one: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator added to the file before the variable reaches this process (it
    will at the restart): [admin] waits for that restart as any change of it does,
    and the reload of the destinations and [retention] goes ahead, refusing the
    keys with their errors (it used to fail whole, every SIGHUP, until a restart)."""
    monkeypatch.setenv("RELOAD_T_ALICE", "alice-token-0123456789abcdef")
    monkeypatch.delenv("RELOAD_T_CAROL", raising=False)
    operators = '[admin.operators]\nalice = "RELOAD_T_ALICE"\n'
    path = write_files(tmp_path, GATEWAY + operators, a=to(one))
    async with running_gateway(load_config(path)) as gw:
        running = gw.app[RELOADER].config
        carol = 'carol = "RELOAD_T_CAROL"\n'
        other = '[admin]\ntoken_env = "RELOAD_T_OTHER"\n'  # a change beside it is named too
        write_files(
            tmp_path,
            GATEWAY + other + operators + carol + '[retention]\nrejections_ttl = "1d"\n',
            b=to(one),
        )
        with capture_logs() as logs:
            result = await gw.app[RELOADER].reload("test")
        (entry,) = await gw.store.list_audit(AuditQuery())
    assert result.added == ("b",)
    assert result.refused == ("admin.operators.carol", "admin.token_env")
    applied = gw.app[WRITES].config
    assert applied.rejections_ttl == 24 * 3600 and sorted(applied.destinations) == ["a", "b"]
    assert applied.admin_operators == running.admin_operators  # as it ran
    (refused,) = [e for e in logs if e["event"] == "reload_refused"]
    assert refused["keys"] == ["admin.operators.carol", "admin.token_env"]
    assert refused["errors"] == [
        "gateway.toml: admin.operators.carol: environment variable RELOAD_T_CAROL is not set"
    ]
    assert "alice-token" not in repr(logs)
    assert entry.note == (
        "test: added b; retention rejections_ttl 7d -> 1d;"
        " refused admin.operators.carol, admin.token_env"
    )


@pytest.mark.parametrize(
    ("server", "section"),
    [
        ("bogus = 1\n", ""),
        ('max_in_flight = "many"\n', ""),
        ("", '[store]\nurl = "mysql://x"\n'),
        ("", '[admin.operators]\n"bad name" = "RELOAD_T_ALICE"\n'),
    ],
)
async def test_a_file_error_in_a_restart_only_section_fails_the_reload(
    tmp_path: Path, one: RecordingUpstream, monkeypatch: pytest.MonkeyPatch, server, section
) -> None:
    """SPEC 5: a reload whose files do not validate changes nothing, whatever the
    section: only what this process's variables fail is refused instead."""
    monkeypatch.setenv("RELOAD_T_ALICE", "alice-token-0123456789abcdef")
    path = write_files(tmp_path, a=to(one))
    async with running_gateway(load_config(path)) as gw:
        retention = '[retention]\nrejections_ttl = "1d"\n'
        write_files(tmp_path, GATEWAY + server + section + retention, b=to(one))
        with pytest.raises(ConfigError):
            await gw.app[RELOADER].reload("test")
        applied = gw.app[WRITES].config
        assert sorted(applied.destinations) == ["a"] and applied.rejections_ttl == 7 * 86400


async def test_each_applied_reload_is_in_the_audit_log_and_a_failed_one_is_not(
    tmp_path: Path, one: RecordingUpstream
) -> None:
    path = write_files(tmp_path, a=to(one), b=to(one))
    async with running_gateway(load_config(path, {})) as gw:
        reloader = gw.app[RELOADER]
        write_files(tmp_path, GATEWAY + "max_in_flight = 7\n", a=to(one, "/v2"), b=None, c=to(one))
        await reloader.reload("test", remote="10.0.0.7")
        write_files(tmp_path, a='upstream = "nope"\n')
        with pytest.raises(ConfigError):
            await reloader.reload("test")
        (entry,) = await gw.store.list_audit(AuditQuery())
    assert (entry.action, entry.remote) == ("reload", "10.0.0.7")
    assert entry.note == "test: added c; changed a; removed b; refused server.max_in_flight"


async def test_a_retention_change_is_in_the_reloads_audit_note(
    tmp_path: Path, one: RecordingUpstream
) -> None:
    path = write_files(tmp_path, a=to(one))
    async with running_gateway(load_config(path, {})) as gw:
        retention = '[retention]\nidempotency_ttl = "2d"\nrejections_ttl = "90m"\n'
        write_files(tmp_path, GATEWAY + retention, a=to(one))
        await gw.app[RELOADER].reload("test")
        (entry,) = await gw.store.list_audit(AuditQuery())
    assert entry.note == "test: retention idempotency_ttl 1d -> 2d, rejections_ttl 7d -> 90m"


async def test_a_reload_the_store_cannot_audit_is_audited_once_it_can(
    tmp_path: Path, one: RecordingUpstream
) -> None:
    """SPEC 5: each applied reload is in the audit log. One applied while the store
    was down used to be only logged; its row is now written when the store is back."""
    path = write_files(tmp_path, a=to(one))
    async with running_gateway(load_config(path, {})) as gw:
        reloader = gw.app[RELOADER]
        refusals = 2

        async def flaky(**entry: object) -> int:
            nonlocal refusals
            if refusals:
                refusals -= 1
                raise StoreUnavailable("database is locked")
            return await gw.store.record_audit(**entry)  # type: ignore[arg-type]

        reloader.attach(gw.app[WRITES], audit=flaky)
        reloader.audit_retry_s = 0.01
        write_files(tmp_path, a=to(one), b=to(one))
        with capture_logs() as logs:
            result = await reloader.reload("test")
            assert result.added == ("b",)  # applied, audited or not
            entries = await eventually(lambda: gw.store.list_audit(AuditQuery()), what="the row")
        (entry,) = entries
    assert entry.note.startswith("test: added b (applied ")
    assert entry.note.endswith(", recorded once the store was back)")
    events = [e["event"] for e in logs if e["event"].startswith("reload_")]
    assert events == [
        "reload_applied",
        "reload_not_audited",
        "reload_not_audited",
        "reload_audited_late",
    ]


async def test_a_reload_never_audited_is_named_in_the_log_at_shutdown(
    tmp_path: Path, one: RecordingUpstream
) -> None:
    path = write_files(tmp_path, a=to(one))

    async def refusing(**entry: object) -> int:
        raise StoreUnavailable("database is locked")

    with capture_logs() as logs:
        async with running_gateway(load_config(path, {})) as gw:
            gw.app[RELOADER].attach(gw.app[WRITES], audit=refusing)
            write_files(tmp_path, a=to(one), b=to(one))
            await gw.app[RELOADER].reload("test")
    (line,) = [e for e in logs if e["event"] == "reloads_never_audited"]
    assert [note.split(" (")[0] for note in line["notes"]] == ["test: added b"]


# --- through the real triggers ------------------------------------------------------


async def test_sighup_and_admin_reload_apply_and_are_counted(
    tmp_path: Path, one: RecordingUpstream
) -> None:
    path = write_files(tmp_path, a=to(one))
    config = load_config(path, {})
    async with served(config) as info, aiohttp.ClientSession() as session:
        main, admin = f"http://{info['listen']}", f"http://{info['admin_listen']}"
        write_files(tmp_path, a=to(one), b=to(one))
        os.kill(os.getpid(), signal.SIGHUP)

        async def b_is_known() -> bool:
            async with session.post(f"{main}/to/b/x") as resp:
                return resp.status != 404

        await eventually(b_is_known, what="destination b after SIGHUP")

        write_files(tmp_path, a=to(one), b=to(one), c=to(one))
        # As every admin route: a parameter it does not know is refused, nothing reloaded.
        async with session.post(f"{admin}/admin/reload?dry_run=1") as resp:
            assert resp.status == 400
            assert (await resp.json())["detail"] == "unknown query parameter(s): dry_run"
        async with session.post(f"{main}/to/c/x") as resp:
            assert resp.status == 404
        async with session.post(f"{admin}/admin/reload") as resp:
            assert resp.status == 200
            assert await resp.json() == {"reloaded": True, "destinations": ["a", "b", "c"]}

        write_files(tmp_path, a='upstream = "nope"\n')
        async with session.post(f"{admin}/admin/reload") as resp:
            assert resp.status == 400
            assert resp.headers["Content-Type"].startswith("application/problem+json")
            problem = await resp.json()
        assert problem["reason"] == "invalid_config"
        assert problem["detail"].startswith("destinations/a.toml: upstream: expected an absolute")
        assert problem["errors"] == [problem["detail"]]

        async with session.get(f"{admin}/metrics") as resp:
            text = await resp.text()
        assert 'sinkgate_reloads_total{result="applied"} 2.0' in text
        assert 'sinkgate_reloads_total{result="failed"} 1.0' in text


async def test_a_reload_says_what_it_does_not_read(tmp_path: Path, one: RecordingUpstream) -> None:
    """A file added as `Refunds.TOML` is the one a reload is run for: its warning
    comes with the reload, not only from check-config."""
    path = write_files(tmp_path, a=to(one))
    async with running_gateway(load_config(path, {})) as gw:
        (tmp_path / "destinations" / "Refunds.TOML").write_text(to(one))
        with capture_logs() as logs:
            await gw.app[RELOADER].reload("test")
        (warning,) = [e for e in logs if e["event"] == "config_warning"]
        assert warning["warning"].endswith(
            "Refunds.TOML: not read: a destination file's name ends in .toml, in lower case"
        )
        assert warning["trigger"] == "test"
