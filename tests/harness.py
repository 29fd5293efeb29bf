"""End-to-end test harness: a real recording upstream and a real gateway on loopback.

No patched internals: the gateway is `create_app` served on a free port by the
runner `serve` uses, the upstream is an aiohttp server that records every request
it received.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
    nullcontext,
)
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from gateway.app import create_app, write_front
from gateway.config.model import Config, DestinationConfig
from gateway.http.server import GatewayRunner
from gateway.policy.decision import Fencing
from gateway.store.postgres import PostgresStore
from gateway.store.protocol import Store
from gateway.store.sqlite import SQLiteStore
from gateway.tools.chaos.processes import free_port


class FakeClock:
    """The store's clock, moved by the test."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class OffsetClock:
    """A PostgreSQL store's clock (the server's), moved by the test through the
    store's `clock_offset`: the server's clock still decides, only shifted."""

    def __init__(self, store: PostgresStore) -> None:
        self._store = store

    def __call__(self) -> float:
        return self._store.clock()

    def advance(self, seconds: float) -> None:
        self._store.clock_offset += seconds


@dataclass
class Received:
    method: str
    raw_path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class RecordingUpstream:
    """An upstream that records what it applied. Behaviour by first path segment:

    /slow/...      waits until `release` is set (or 30 s), then 200
    /status/NNN    answers NNN
    /drop/...      closes the connection without an answer
    /redirect      302 to another host
    /big/N         200 with N bytes
    anything else  201 {"ok": true, "n": <count>} with Location and ETag
    """

    received: list[Received] = field(default_factory=list)
    # Behaviours for the next requests, whatever their paths ("drop", "status/503"):
    # one key's attempts, which share a path, met differently.
    next: list[str] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(
            Received(request.method, request.raw_path, dict(request.headers), body)
        )
        self.arrived.set()
        parts = request.path.split("/")
        if self.next:
            parts = ["", "", *self.next.pop(0).split("/")]
        kind = parts[2] if len(parts) > 2 else ""
        if kind == "slow":
            try:
                await asyncio.wait_for(self.release.wait(), 30)
            except TimeoutError:
                pass
        elif kind == "status":
            return web.Response(status=int(parts[3]), text=f"status {parts[3]}")
        elif kind == "drop":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0)
            return web.Response(status=200)
        elif kind == "redirect":
            return web.Response(status=302, headers={"Location": "http://elsewhere.invalid/"})
        elif kind == "big":
            return web.Response(status=200, body=b"x" * int(parts[3]), content_type="text/plain")
        return web.json_response(
            {"ok": True, "n": len(self.received)},
            status=201,
            headers={"Location": "/things/1", "ETag": '"v1"', "X-Upstream": "yes"},
        )

    def paths(self) -> list[str]:
        return [r.raw_path for r in self.received]


@asynccontextmanager
async def serving(app: web.Application, **runner_options: Any) -> AsyncIterator[str]:
    """Serve `app` on a free loopback port, with the runner `serve` uses; yields its
    base URL."""
    runner = GatewayRunner(app, **{"shutdown_timeout": 1, **runner_options})
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def catch_all(handler: Any) -> web.Application:
    """An app answering every method and path with `handler`."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return app


class ServedUpstream(Protocol):
    """A test upstream: answers with `handle`, learns its `url`, and lets requests
    it holds go once `release` is set."""

    url: str
    release: asyncio.Event

    async def handle(self, request: web.Request) -> web.StreamResponse: ...


UpstreamT = TypeVar("UpstreamT", bound=ServedUpstream)


@asynccontextmanager
async def served_upstream(upstream: UpstreamT) -> AsyncIterator[UpstreamT]:
    """`upstream` on a loopback port; requests it still holds are let go at the end."""
    async with serving(catch_all(upstream.handle)) as url:
        upstream.url = url
        try:
            yield upstream
        finally:
            upstream.release.set()


def recording_upstream() -> AbstractAsyncContextManager[RecordingUpstream]:
    return served_upstream(RecordingUpstream())


async def eventually(
    condition: Callable[[], Any],
    *,
    within: float = 10.0,
    every: float = 0.02,
    what: str = "the condition",
) -> Any:
    """Poll `condition` (a plain or async callable) until it returns something true,
    and return that; fail the test after `within` seconds. The one poll loop of the
    suite: for what another task or process makes true, never to let time pass."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if loop.time() >= deadline:
            pytest.fail(f"{what} did not hold within {within:g} s")
        await asyncio.sleep(every)


async def wait_until_ok(
    session: aiohttp.ClientSession,
    url: str,
    *,
    exited: Callable[[], str | None],
    within: float = 30.0,
) -> None:
    """Poll `url` until it answers 200. `exited()` says why the process behind it
    is gone (None while it runs): the wait fails at once with that, or after
    `within` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while loop.time() < deadline:
        gone = exited()
        if gone is not None:
            pytest.fail(gone)
        try:
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.05)
    pytest.fail(f"{url} did not answer 200 within {within:g} s")


def destination(name: str, upstream: str, **overrides: Any) -> DestinationConfig:
    base = DestinationConfig(
        name=name,
        upstream=upstream.rstrip("/"),
        fencing=Fencing.LEASE,
        timeout=5.0,
        connect_timeout=1.0,
        source=Path(f"destinations/{name}.toml"),
    )
    return replace(base, **overrides)


def make_config(tmp_path: Path, *destinations: DestinationConfig, **overrides: Any) -> Config:
    config = Config(
        source=tmp_path / "gateway.toml",
        listen=("127.0.0.1", 0),
        admin_listen=("127.0.0.1", 0),
        store_url=f"sqlite:///{tmp_path / 'sinkgate.db'}",
        destinations=MappingProxyType({d.name: d for d in destinations}),
        shutdown_grace=5.0,
    )
    return replace(config, **overrides)


@dataclass
class Gateway:
    url: str
    store: Store
    clock: FakeClock | OffsetClock
    session: aiohttp.ClientSession
    app: web.Application

    async def claim(self, job_id: str, owner: str = "worker-a", ttl: float = 30.0) -> int:
        async with self.session.post(
            f"{self.url}/leases/{job_id}/claim", json={"owner": owner, "ttl": ttl}
        ) as resp:
            assert resp.status == 200, await resp.text()
            return int((await resp.json())["generation"])

    async def write(
        self,
        path: str,
        *,
        job: str = "job-1",
        generation: int | str | None = 1,
        key: str | None = "key-1",
        owner: str | None = None,
        method: str = "POST",
        body: bytes = b'{"amount": 100}',
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """Send a write with a raw (unnormalised) path; returns status, headers, body."""
        h = {"Content-Type": "application/json"}
        if job is not None:
            h["Fencing-Job"] = job
        if generation is not None:
            h["Fencing-Token"] = str(generation)
        if key is not None:
            h["Idempotency-Key"] = key
        if owner is not None:
            h["Fencing-Owner"] = owner
        h.update(headers or {})
        url = URL(self.url + path, encoded=True)
        async with self.session.request(
            method, url, data=body, headers=h, allow_redirects=False
        ) as resp:
            return resp.status, dict(resp.headers), await resp.read()


@asynccontextmanager
async def running_gateway(
    config: Config, clock: FakeClock | None = None, backend: str = "sqlite"
) -> AsyncIterator[Gateway]:
    """`backend`: "sqlite" (config.store_url, on `clock`) or a postgresql:// URL
    (the server's clock, moved by `Gateway.clock.advance` through `clock_offset`)."""
    store: SQLiteStore | PostgresStore
    gateway_clock: FakeClock | OffsetClock
    if backend == "sqlite":
        gateway_clock = clock or FakeClock()
        store = await SQLiteStore.open(config.store_url, clock=gateway_clock)
    else:
        assert clock is None, "a PostgreSQL store runs on the server's clock"
        store = await PostgresStore.open(backend)
        gateway_clock = OffsetClock(store)
    app = create_app(config, store=store, clock=gateway_clock)
    try:
        async with (
            serving(app, front=write_front(app), shutdown_timeout=5) as url,
            aiohttp.ClientSession() as session,
        ):
            yield Gateway(url, store, gateway_clock, session, app)
    finally:
        await store.close()


def run_chaos(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    """`sinkgate chaos ARGS` in a process of its own: its exit code, its JSON report
    and what it printed (stdout, then stderr)."""
    report_path = tmp_path / "report.json"
    faulted = "--store-faults" in args or "--wire-faults" in args
    with faulted_chaos_alone() if faulted else nullcontext():
        proc = subprocess.run(
            [sys.executable, "-m", "gateway", "chaos", *args, "--json", str(report_path)],
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
    assert report_path.exists(), proc.stdout + proc.stderr
    return proc.returncode, json.loads(report_path.read_text()), proc.stdout + proc.stderr


# --- `sinkgate serve` as a process -----------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def write_serve_config(
    directory: Path,
    store_url: str,
    upstream: str,
    *,
    listen: str | None = None,
    shutdown_grace: str = "5s",
    timeout: str = "10s",
    connect_timeout: str | None = "2s",
    workers: int | None = None,
) -> tuple[Path, str]:
    """A gateway.toml with one destination, `pay` (`{upstream}/api`, lease fencing),
    in `directory/destinations`; returns (the config's path, the main listener's URL)."""
    listen = listen or f"127.0.0.1:{free_port()}"
    workers_line = "" if workers is None else f"workers = {workers}  # --workers wins\n"
    (directory / "destinations").mkdir(parents=True)
    (directory / "gateway.toml").write_text(
        f"""[server]
listen = "{listen}"
admin_listen = "127.0.0.1:{free_port()}"
shutdown_grace = "{shutdown_grace}"
{workers_line}
[store]
url = "{store_url}"
pool_size = 4

[destinations]
dir = "destinations"
"""
    )
    connect = "" if connect_timeout is None else f'connect_timeout = "{connect_timeout}"\n'
    (directory / "destinations" / "pay.toml").write_text(
        f'upstream = "{upstream}/api"\nfencing = "lease"\ntimeout = "{timeout}"\n{connect}'
    )
    return directory / "gateway.toml", f"http://{listen}"


async def spawn_serve(config: Path, log: Path, *args: str) -> asyncio.subprocess.Process:
    """`python -m gateway serve --config CONFIG ARGS --log-format json` from the
    repository, without the caller's SINKGATE_ variables; its stderr goes to `log`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SINKGATE_")}
    with log.open("wb") as stderr:
        return await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "gateway", "serve", "--config", str(config), *args),
            *("--log-format", "json"),
            cwd=REPO,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=stderr,
        )


async def stop_serve(process: asyncio.subprocess.Process, within: float) -> int:
    """SIGTERM (a drain), SIGKILL if it has not exited `within` seconds; the exit code."""
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), within)
        except TimeoutError:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode


def repository_build() -> AbstractContextManager[None]:
    """Hold the lock for building this repository with pip (`pip install <repo>`,
    `pip wheel <repo>`): pip builds in the tree (`build/`, `*.egg-info`), and two
    test processes building at once collide there ("File exists")."""
    return _held("build")


def faulted_chaos_alone() -> AbstractContextManager[None]:
    """Hold the lock for a chaos run with store or wire faults: two at once (one
    per test process) starved each other until a job's last steps missed the
    run's deadline (`completed_exactly_once`), in this tree and before it."""
    return _held("chaos")


@contextmanager
def _held(name: str) -> Iterator[None]:
    """This repository's lock `name`, shared by the test processes (`-n 2`)."""
    repo = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(str(repo).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"sinkgate-{name}-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
