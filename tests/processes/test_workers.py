"""`sinkgate serve --workers 2` as an operator runs it (SPEC 5 "Processes"): both
workers answer on the shared sockets, fencing and idempotency hold whichever of
them answers, a killed worker is restarted, SIGHUP and `POST /admin/reload`
reload every worker, SIGTERM drains and exits 0.

Which worker answered a request is read from the kernel, not from the gateway:
the server side of the client's connection is a socket one worker holds open
(`/proc/net/tcp` names its inode, `/proc/PID/fd` who has it). A "pinned" client
is a keep-alive connection found on a given worker, and each answer says which
worker gave it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.harness import (
    REPO,
    RecordingUpstream,
    eventually,
    recording_upstream,
    spawn_serve,
    stop_serve,
    write_serve_config,
)
from tests.pg import fresh_database

pytestmark = pytest.mark.slow

STOP_TIMEOUT_S = 30.0


# --- who answered: the kernel's view of the connection ---------------------------------


def children(parent: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == parent:
                found.add(int(entry))
    return found


def _hex_address(host_port: tuple[str, int]) -> str:
    host, port = host_port
    packed = bytes(int(part) for part in host.split("."))
    return f"{int.from_bytes(packed, 'little'):08X}:{port:04X}"


def holder(server: tuple[str, int], client: tuple[str, int], pids: set[int]) -> int | None:
    """The pid among `pids` holding the server side of the connection `client`."""
    local, remote = _hex_address(server), _hex_address(client)
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            inode = fields[9]
    if inode is None:
        return None
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    return None


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    pid: int | None


@dataclass
class Pinned:
    """One keep-alive HTTP/1.1 connection to the gateway, held by worker `pid`.
    Spoken by hand, so that it is one known socket from first to last request."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    pid: int
    gateway: Gateway

    async def request(
        self, method: str, path: str, *, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> Answer:
        lines = [f"{method} {path} HTTP/1.1", "Host: localhost", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        status_line = await self.reader.readline()
        assert status_line.startswith(b"HTTP/1.1 "), status_line
        answer_headers: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            answer_headers[name.strip()] = value.strip()
        lowered = {k.lower(): v for k, v in answer_headers.items()}
        if lowered.get("transfer-encoding") == "chunked":
            data = b""
            while size := int((await self.reader.readline()).strip(), 16):
                data += await self.reader.readexactly(size + 2)
                data = data[:-2]
            await self.reader.readline()
        else:
            data = await self.reader.readexactly(int(lowered.get("content-length", "0")))
        server = self.writer.get_extra_info("peername")[:2]
        client = self.writer.get_extra_info("sockname")[:2]
        pid = holder(server, client, self.gateway.workers())
        return Answer(int(status_line.split()[1]), answer_headers, data, pid)

    async def write(self, path: str, *, job: str, generation: int, key: str) -> Answer:
        headers = {
            "Content-Type": "application/json",
            "Fencing-Job": job,
            "Fencing-Token": str(generation),
            "Idempotency-Key": key,
        }
        return await self.request("POST", path, body=b'{"amount": 100}', headers=headers)

    async def lease(self, op: str, job: str, **fields: Any) -> dict[str, Any]:
        answer = await self.request(
            "POST",
            f"/leases/{job}/{op}",
            body=json.dumps(fields).encode(),
            headers={"Content-Type": "application/json"},
        )
        assert answer.status == 200 and answer.pid == self.pid, answer
        result: dict[str, Any] = json.loads(answer.body)
        return result


@dataclass
class Gateway:
    process: asyncio.subprocess.Process
    directory: Path
    listen: str
    admin: str
    log: Path
    upstream: RecordingUpstream
    connections: list[asyncio.StreamWriter] = field(default_factory=list)

    def workers(self) -> set[int]:
        return children(self.process.pid)

    def events(self, name: str) -> list[dict[str, Any]]:
        lines = []
        for line in self.log.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a traceback, or a line still being written
            if isinstance(event, dict) and event.get("event") == name:
                lines.append(event)
        return lines

    async def pin(self, pid: int, *, admin: bool = False) -> Pinned:
        """A keep-alive connection that landed on worker `pid` (new ones until one does)."""
        host, port = (self.admin if admin else self.listen).rsplit(":", 1)

        async def attempt() -> Pinned | None:
            reader, writer = await asyncio.open_connection(host, int(port))
            self.connections.append(writer)
            pinned = Pinned(reader, writer, 0, self)
            answer = await pinned.request("GET", "/healthz")
            if answer.status == 200 and answer.pid == pid:
                pinned.pid = pid
                return pinned
            writer.close()
            return None

        return await eventually(attempt, within=20, what=f"a connection to worker {pid}")

    async def pin_each(self, *, admin: bool = False) -> list[Pinned]:
        pids = await eventually(lambda: len(w := self.workers()) == 2 and w)
        return [await self.pin(pid, admin=admin) for pid in sorted(pids)]


@asynccontextmanager
async def gateway(directory: Path, store_url: str) -> AsyncIterator[Gateway]:
    async with recording_upstream() as upstream:
        config, _ = write_serve_config(
            directory,
            store_url,
            upstream.url,
            shutdown_grace="10s",
            timeout="20s",
            connect_timeout=None,
            workers=1,
        )
        log = directory / "serve.log"
        process = await spawn_serve(config, log, "--workers", "2")
        gw = Gateway(process, directory, "", "", log, upstream)
        try:
            serving = await eventually(
                lambda: process.returncode is not None or gw.events("workers_serving"),
                within=30,
                what="both workers serving",
            )
            assert process.returncode is None, log.read_text()
            assert len(serving[0]["pids"]) == 2
            first = gw.events("serving")[0]
            gw.listen, gw.admin = first["listen"], first["admin_listen"]
            yield gw
        finally:
            upstream.release.set()
            for writer in gw.connections:
                writer.close()
            await stop_serve(process, STOP_TIMEOUT_S)
        assert process.returncode == 0, log.read_text()[-3000:]


@pytest.fixture
async def sqlite_gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    async with gateway(tmp_path, f"sqlite:///{tmp_path / 'gateway.db'}") as gw:
        yield gw


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def any_gateway(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Gateway]:
    if request.param == "sqlite":
        async with gateway(tmp_path, f"sqlite:///{tmp_path / 'gateway.db'}") as gw:
            yield gw
        return
    async with fresh_database() as url, gateway(tmp_path, url) as gw:
        yield gw


# --- the tests ---------------------------------------------------------------------------


async def test_fencing_and_idempotency_hold_across_the_workers(any_gateway: Gateway) -> None:
    gw = any_gateway
    a, b = await gw.pin_each()
    assert a.pid != b.pid
    assert (await a.lease("claim", "job-1", owner="old", ttl=30))["generation"] == 1
    await a.lease("release", "job-1", owner="old", generation=1)
    assert (await b.lease("claim", "job-1", owner="new", ttl=30))["generation"] == 2
    # The older generation is refused by the worker that never saw the newer claim.
    stale = await a.write("/to/pay/charge", job="job-1", generation=1, key="late")
    assert (stale.status, stale.headers.get("Sinkgate-Rejected")) == (409, "stale_generation")
    assert stale.pid == a.pid
    first = await b.write("/to/pay/charge", job="job-1", generation=2, key="k-1")
    assert first.status == 201 and "Idempotent-Replayed" not in first.headers
    again = await a.write("/to/pay/charge", job="job-1", generation=2, key="k-1")
    assert (again.status, again.headers.get("Idempotent-Replayed")) == (201, "true")
    assert again.body == first.body and again.pid == a.pid
    assert [r.headers["Idempotency-Key"] for r in gw.upstream.received] == ["k-1"]


async def test_a_killed_worker_is_restarted_and_the_service_keeps_answering(
    sqlite_gateway: Gateway,
) -> None:
    gw = sqlite_gateway
    a, b = await gw.pin_each()
    os.kill(a.pid, signal.SIGKILL)
    # The survivor answers all along.
    assert (await b.request("GET", "/readyz")).status == 200
    died = await eventually(lambda: gw.events("worker_died"), within=10)
    assert died[0]["pid"] == a.pid and died[0]["signal"] == "SIGKILL"
    restarted = await eventually(lambda: gw.events("worker_restarted"), within=30)
    assert restarted[0]["worker"] == died[0]["worker"]
    new = restarted[0]["pid"]
    assert gw.workers() == {new, b.pid}
    fresh = await gw.pin(new)
    assert (await fresh.request("GET", "/readyz")).status == 200
    assert (await b.request("GET", "/readyz")).status == 200


async def add_destination(gw: Gateway, name: str) -> None:
    (gw.directory / "destinations" / f"{name}.toml").write_text(
        f'upstream = "{gw.upstream.url}/{name}"\nfencing = "monotonic"\n'
    )


async def routable_everywhere(pinned: list[Pinned], name: str) -> bool:
    for n, client in enumerate(pinned):
        answer = await client.write(f"/to/{name}/x", job=f"j-{name}", generation=1, key=f"{n}")
        assert answer.pid == client.pid
        if answer.status != 201:
            return False
    return True


async def test_sighup_to_the_parent_reloads_every_worker(sqlite_gateway: Gateway) -> None:
    gw = sqlite_gateway
    pinned = await gw.pin_each()
    for client in pinned:
        unknown = await client.write("/to/refunds/x", job="j", generation=1, key="before")
        assert unknown.headers.get("Sinkgate-Rejected") == "unknown_destination"
    await add_destination(gw, "refunds")
    gw.process.send_signal(signal.SIGHUP)
    await eventually(lambda: len(gw.events("reload_applied")) == 2, within=10)
    # one worker records the reload in the audit log; the other reloads unrecorded
    assert sorted(e["trigger"] for e in gw.events("reload_applied")) == ["relayed", "sighup"]
    assert await routable_everywhere(pinned, "refunds")
    assert await eventually(lambda: audit_notes(gw)) == ["sighup: added refunds"]


async def test_admin_reload_on_one_worker_reloads_every_worker(sqlite_gateway: Gateway) -> None:
    gw = sqlite_gateway
    pinned = await gw.pin_each()
    admin = (await gw.pin_each(admin=True))[0]
    await add_destination(gw, "payouts")
    answer = await admin.request("POST", "/admin/reload")
    assert answer.status == 200 and json.loads(answer.body)["destinations"] == ["pay", "payouts"]
    applied = await eventually(lambda: (e := gw.events("reload_applied")) and len(e) == 2 and e)
    assert sorted(e["trigger"] for e in applied) == ["admin", "relayed"]
    assert await routable_everywhere(pinned, "payouts")
    # the one row is the admin's: no anonymous "sighup" row nobody sent
    assert await eventually(lambda: audit_notes(gw)) == ["admin: added payouts"]
    # and one count, whichever worker is scraped (each worker applied it)
    for scraper in await gw.pin_each(admin=True):
        assert await scraped(scraper, "sinkgate_reloads_total", result="applied") == 1


async def test_a_sighup_that_fails_in_every_worker_counts_once(sqlite_gateway: Gateway) -> None:
    gw = sqlite_gateway
    (gw.directory / "destinations" / "broken.toml").write_text("upstream = \n")
    gw.process.send_signal(signal.SIGHUP)
    # every worker rereads the files and fails, and logs it
    await eventually(lambda: len(gw.events("reload_failed")) >= 2, within=10)
    # one reload, one count, as an applied one (each worker failed it)
    for scraper in await gw.pin_each(admin=True):
        assert await scraped(scraper, "sinkgate_reloads_total", result="failed") == 1


async def audit_notes(gw: Gateway) -> list[str]:
    admin = (await gw.pin_each(admin=True))[0]
    answer = await admin.request("GET", "/admin/audit")
    assert answer.status == 200
    return [entry["note"] for entry in json.loads(answer.body)["items"]]


async def test_a_worker_restarted_serves_what_the_others_do_not_the_files_now(
    sqlite_gateway: Gateway,
) -> None:
    """A worker started again reread the files as they were then: after a reload
    that failed (the start-up config, a destination the others had taken on by an
    earlier reload unknown to it) or an edit nobody had reloaded (applied by it
    alone), it served what the others did not. It is forked with what they serve."""
    gw = sqlite_gateway
    await add_destination(gw, "refunds")
    gw.process.send_signal(signal.SIGHUP)
    await eventually(lambda: len(gw.events("reload_applied")) == 2, within=10)
    broken = gw.directory / "destinations" / "broken.toml"
    broken.write_text("upstream = \n")
    gw.process.send_signal(signal.SIGHUP)
    await eventually(lambda: len(gw.events("reload_failed")) >= 2, within=10)
    (gw.directory / "destinations" / "refunds.toml").unlink()  # and nobody reloads
    a, b = await gw.pin_each()
    os.kill(a.pid, signal.SIGKILL)
    restarted = await eventually(lambda: gw.events("worker_restarted"), within=30)
    fresh = await gw.pin(restarted[0]["pid"])
    assert await routable_everywhere([fresh, await gw.pin(b.pid)], "refunds")
    assert len(gw.events("reload_applied")) == 2  # nothing reread at the start


async def test_sigterm_drains_every_worker_and_exits_0(sqlite_gateway: Gateway) -> None:
    gw = sqlite_gateway
    a, _ = await gw.pin_each()
    assert (await a.lease("claim", "job-d", owner="w", ttl=30))["generation"] == 1
    slow = asyncio.create_task(a.write("/to/pay/slow/1", job="job-d", generation=1, key="s"))
    await asyncio.wait_for(gw.upstream.arrived.wait(), 10)
    gw.process.send_signal(signal.SIGTERM)
    # Both workers have stopped accepting; the write under way still gets its answer.
    await eventually(lambda: len(gw.events("shutting_down")) == 2, within=10)
    gw.upstream.release.set()
    assert (await slow).status == 201
    assert await asyncio.wait_for(gw.process.wait(), STOP_TIMEOUT_S) == 0
    stopped = gw.events("worker_stopped")
    assert sorted(e["worker"] for e in stopped) == [0, 1]
    assert {e["exit_code"] for e in stopped} == {0}


async def exit_of(process: asyncio.subprocess.Process) -> str:
    """Its stderr once it exited; a process still running after the timeout is
    stopped (SIGTERM, then SIGKILL) so that a failing test leaves nothing behind."""
    try:
        _, err = await asyncio.wait_for(process.communicate(), STOP_TIMEOUT_S)
    except TimeoutError:
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            process.kill()
        raise
    return err.decode()


async def serve_to_exit(config: Path, workers: int = 2) -> tuple[asyncio.subprocess.Process, str]:
    """`serve --workers N` on `config`, to its exit: the process and its stderr."""
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "gateway", "serve", "--config", str(config)),
        *("--workers", str(workers)),
        cwd=REPO,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    return process, await exit_of(process)


async def test_a_worker_that_cannot_start_fails_the_start_with_exit_1(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()  # a directory where the SQLite file should be
    config, _ = write_serve_config(
        tmp_path, f"sqlite:///{tmp_path / 'store'}", "http://127.0.0.1:9"
    )
    process, err = await serve_to_exit(config)
    assert process.returncode == 1
    assert err.count("cannot open SQLite database") == 1, err


async def test_a_second_serve_on_the_same_port_is_refused(sqlite_gateway: Gateway) -> None:
    """SO_REUSEPORT would let a second `serve --workers` join the first one's sockets
    unnoticed; it is refused as one process would be."""
    other = sqlite_gateway.directory / "other"
    taken = sqlite_gateway.listen
    config, _ = write_serve_config(
        other, f"sqlite:///{other / 'gateway.db'}", "http://127.0.0.1:9", listen=taken
    )
    process, err = await serve_to_exit(config)
    assert process.returncode == 1
    assert f"cannot listen on {taken}: Address already in use: another process" in err, err
    assert "set another address in [server] listen" in err
    # One process says the same, where aiohttp's own words named no key.
    process, err = await serve_to_exit(config, workers=1)
    assert process.returncode == 1
    assert f"cannot listen on {taken}: Address already in use: another process" in err, err
    assert "set another address in [server] listen" in err
    assert "[Errno" not in err  # the words, not the number first


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_listen_host_that_does_not_resolve_is_named_with_the_resolvers_words(
    tmp_path: Path, workers: int
) -> None:
    """bind_error read the resolver's errno as the system's: 'Unknown error -2'."""
    config, _ = write_serve_config(
        tmp_path, f"sqlite:///{tmp_path / 'g.db'}", "http://127.0.0.1:9",
        listen="nosuchhost.invalid:18480",
    )  # fmt: skip
    process, err = await serve_to_exit(config, workers=workers)
    assert process.returncode == 1
    assert "cannot listen on nosuchhost.invalid:18480: " in err, err
    assert "(check the host in [server] listen)" in err
    assert "Unknown error" not in err


def sample(exposition: bytes, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus text exposition, if present."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in exposition.decode().splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        metric, _, label_text = series.partition("{")
        if metric == name and ",".join(sorted(label_text.rstrip("}").split(","))) == wanted:
            return float(value)
    return None


async def scraped(admin: Pinned, name: str, **labels: str) -> float | None:
    answer = await admin.request("GET", "/metrics")
    assert answer.status == 200 and answer.pid == admin.pid
    return sample(answer.body, name, **labels)


async def test_metrics_count_every_workers_writes_whichever_worker_is_scraped(
    sqlite_gateway: Gateway,
) -> None:
    gw = sqlite_gateway
    a, b = await gw.pin_each()
    admins = await gw.pin_each(admin=True)
    assert (await a.lease("claim", "job-m", owner="w", ttl=60))["generation"] == 1
    for n, client in enumerate((a, a, a, b, b)):
        answer = await client.write("/to/pay/charge", job="job-m", generation=1, key=f"m-{n}")
        assert answer.status == 201 and answer.pid == client.pid
    forwarded = {"destination": "pay", "decision": "forwarded"}
    # Each worker saw 3 or 2 of them; either one's /metrics counts all 5.
    for admin in admins:
        assert await scraped(admin, "sinkgate_writes_total", **forwarded) == 5
        assert await scraped(admin, "sinkgate_in_flight_writes", destination="pay") == 0
        # there at 0 from the gauge's first refresh at start, not "no data"
        assert await scraped(admin, "sinkgate_unknown_keys", destination="pay") == 0
        assert await scraped(admin, "sinkgate_reloads_total", result="failed") == 0
    # A write waiting for its upstream is in flight on worker a; both show it.
    gw.upstream.arrived.clear()
    slow = asyncio.create_task(a.write("/to/pay/slow/1", job="job-m", generation=1, key="m-s"))
    await asyncio.wait_for(gw.upstream.arrived.wait(), 10)
    for admin in admins:
        assert await scraped(admin, "sinkgate_in_flight_writes", destination="pay") == 1
    # Worker a killed and started again: its writes still count, none twice, and
    # the write it had in flight no longer does.
    os.kill(a.pid, signal.SIGKILL)
    restarted = await eventually(lambda: gw.events("worker_restarted"), within=30)
    fresh = await gw.pin(restarted[0]["pid"], admin=True)
    survivor = next(admin for admin in admins if admin.pid == b.pid)
    for admin in (fresh, survivor):
        assert await scraped(admin, "sinkgate_writes_total", **forwarded) == 5
        assert await scraped(admin, "sinkgate_in_flight_writes", destination="pay") == 0
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError, AssertionError)):
        await slow  # its connection died with the worker
    # A new connection to b: the first one may have sat idle past the listener's
    # keep-alive timeout (15 s) while a was restarted on a loaded machine.
    b = await gw.pin(b.pid)
    answer = await b.write("/to/pay/charge", job="job-m", generation=1, key="m-after")
    assert answer.status == 201
    assert await scraped(fresh, "sinkgate_writes_total", **forwarded) == 6
