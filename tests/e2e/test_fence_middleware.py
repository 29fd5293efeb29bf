"""The fence middlewares (SPEC 3.1): `aiohttp_middleware` on a real aiohttp server
(SQLite and PostgreSQL), and `ASGIFence` around a bare ASGI app and a Starlette
app, driven through the ASGI interface itself."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from leases.fence import ASGIFence, Fence, aiohttp_middleware
from leases.fence import gate as fence_gate
from tests.harness import eventually, serving

BAD_TOKENS = ["0", "05", "-3", "+3", "abc", "1.5", "9223372036854775808", "1 2"]


class Ledger:
    """A destination recording the effects its handler made; `/slow` waits for
    `release` so a test can hold a handler open."""

    def __init__(self) -> None:
        self.effects: list[tuple[str | None, str | None]] = []
        self.running: set[str] = set()
        self.overlapped = False
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    async def effect(self, job: str | None, token: str | None, slow: bool) -> None:
        if job is not None and self.running:
            self.overlapped = True
        if job is not None:
            self.running.add(token or "")
            self.started.set()
        try:
            if slow:
                await self.release.wait()
            self.effects.append((job, token))
        finally:
            self.running.discard(token or "")

    async def aiohttp_handler(self, request: web.Request) -> web.Response:
        await self.effect(
            request.headers.get("Fencing-Job"),
            request.headers.get("Fencing-Token"),
            request.path == "/slow",
        )
        return web.json_response({"applied": len(self.effects)}, status=201)


@asynccontextmanager
async def aiohttp_ledger(url: str) -> AsyncIterator[tuple[Ledger, Callable[..., Any], Any]]:
    ledger = Ledger()
    middleware = aiohttp_middleware(Fence(), url)
    app = web.Application(middlewares=[middleware])
    app.on_cleanup.append(middleware.close)
    app.router.add_route("*", "/{tail:.*}", ledger.aiohttp_handler)
    async with serving(app) as base, aiohttp.ClientSession() as session:

        async def send(token: str | None = None, job: str | None = "job-1", path: str = "/e"):
            headers = {}
            if job is not None:
                headers["Fencing-Job"] = job
            if token is not None:
                headers["Fencing-Token"] = token
            async with session.post(base + path, headers=headers) as resp:
                return resp.status, resp.headers, await resp.read()

        yield ledger, send, middleware
    assert middleware.gate.database._conn is None  # closed by on_cleanup


def problem(status: int, headers: Any, body: bytes, reason: str) -> dict[str, Any]:
    assert headers["Content-Type"] == "application/problem+json"
    assert headers["Sinkgate-Rejected"] == reason
    doc = json.loads(body)
    assert doc["status"] == status and doc["reason"] == reason
    assert doc["type"] == f"urn:sinkgate:problem:{reason}"
    assert {"title", "detail"} <= set(doc)
    return doc


async def test_aiohttp_stale_requests_are_refused_before_the_handler(database_url: str) -> None:
    async with aiohttp_ledger(database_url) as (ledger, send, middleware):
        assert (await send("5"))[0] == 201
        assert (await send("5"))[0] == 201  # equal tokens pass
        assert (await send("6"))[0] == 201
        status, headers, body = await send("4")
        assert status == 409
        doc = problem(status, headers, body, "stale_generation")
        assert (doc["job_id"], doc["generation"], doc["highest_generation"]) == ("job-1", 4, 6)
        assert (await send("1", job="job-2"))[0] == 201  # another job, its own mark
        assert ledger.effects == [("job-1", "5"), ("job-1", "5"), ("job-1", "6"), ("job-2", "1")]
        assert len(middleware.gate.locks) == 0  # no lock kept for jobs nobody is writing


async def test_aiohttp_a_request_no_route_serves_does_not_raise_the_mark(tmp_path: Path) -> None:
    """A newer generation's request to a path the app does not have gets aiohttp's
    404 (or 405) and records nothing: an older generation's real write still passes."""
    ledger = Ledger()
    middleware = aiohttp_middleware(Fence(), f"sqlite:///{tmp_path / 'l.db'}")
    app = web.Application(middlewares=[middleware])
    app.on_cleanup.append(middleware.close)
    app.router.add_post("/charges", ledger.aiohttp_handler)
    async with serving(app) as base, aiohttp.ClientSession() as session:

        async def send(method: str, path: str, token: str) -> int:
            headers = {"Fencing-Job": "job-1", "Fencing-Token": token}
            async with session.request(method, base + path, headers=headers) as resp:
                return resp.status

        assert await send("POST", "/nope", "9") == 404
        assert await send("GET", "/charges", "8") == 405
        assert await send("POST", "/charges", "2") == 201
    assert ledger.effects == [("job-1", "2")]


async def test_aiohttp_requests_without_fencing_headers_pass_through(database_url: str) -> None:
    async with aiohttp_ledger(database_url) as (ledger, send, _):
        assert (await send(None, job=None))[0] == 201
        assert (await send("", job=""))[0] == 201  # empty counts as missing
        assert ledger.effects == [(None, None), ("", "")]


async def test_aiohttp_malformed_fencing_headers_get_400(tmp_path: Path) -> None:
    async with aiohttp_ledger(f"sqlite:///{tmp_path / 'l.db'}") as (ledger, send, _):
        for token in BAD_TOKENS:
            status, headers, body = await send(token)
            assert status == 400, token
            problem(status, headers, body, "invalid_fencing_token")
        status, headers, body = await send("3", job="x" * 257)
        problem(status, headers, body, "invalid_fencing_token")
        status, headers, body = await send(None, job="job-1")
        problem(status, headers, body, "missing_fencing_token")
        status, headers, body = await send("3", job=None)
        problem(status, headers, body, "missing_fencing_token")
        assert ledger.effects == []
        # Nothing malformed raised the mark: a low token still passes.
        assert (await send("1"))[0] == 201


async def test_aiohttp_an_unusable_database_fails_closed_with_503(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    async with aiohttp_ledger(f"sqlite:///{tmp_path / 'a-file' / 'fence.db'}") as (
        ledger,
        send,
        _,
    ):
        status, headers, body = await send("3")
        problem(status, headers, body, "store_unavailable")
        assert (await send(None, job=None))[0] == 201  # unfenced requests still served
        assert ledger.effects == [(None, None)]


async def test_aiohttp_a_fence_table_of_another_shape_fails_closed_with_503(
    tmp_path: Path,
) -> None:
    """Another program's `sinkgate_fence` with a text `highest`: SQLite would
    compare tokens as text ('9' above '10'); the middleware refuses to use it."""
    path = tmp_path / "ledger.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE sinkgate_fence (job_id TEXT PRIMARY KEY, highest TEXT)")
    async with aiohttp_ledger(f"sqlite:///{path}") as (ledger, send, _):
        status, headers, body = await send("10")
        assert "ForeignTable" in problem(status, headers, body, "store_unavailable")["detail"]
        assert ledger.effects == []


async def test_a_check_cancelled_while_it_begins_leaves_no_transaction_open(
    tmp_path: Path,
) -> None:
    """A request cancelled (its client gone, a server timeout) while its check's
    BEGIN IMMEDIATE waited: the statement still ran in aiosqlite's thread and the
    transaction stayed open, so every later check was 503 and SQLite's write lock
    was held from the user's other processes for good."""
    path = tmp_path / "fence.db"
    gate = fence_gate.FenceGate(Fence(), f"sqlite:///{path}")
    try:
        async with gate.admit("job-0", 1) as refusal:  # opens the database
            assert refusal is None
        check = asyncio.create_task(gate.database.check("job-1", 6))
        await asyncio.sleep(0)  # it has sent BEGIN and waits for it
        check.cancel()
        with pytest.raises(asyncio.CancelledError):
            await check
        async with gate.admit("job-1", 7) as refusal:
            assert refusal is None
        other = sqlite3.connect(path, timeout=1.0, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # the write lock is free
            other.execute("ROLLBACK")
        finally:
            other.close()
    finally:
        await gate.close()


async def test_a_commit_that_fails_leaves_no_transaction_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """COMMIT can fail (SQLITE_BUSY once busy_timeout has run out): left open, the
    transaction failed every later check and held SQLite's write lock."""
    gate = fence_gate.FenceGate(Fence(), f"sqlite:///{tmp_path / 'fence.db'}")
    try:
        async with gate.admit("job-0", 1) as refusal:  # opens the database
            assert refusal is None
        conn = gate.database._conn
        real = conn.execute_fetchall
        refused: list[str] = []

        async def busy_once(sql: str, *args: Any) -> Any:  # its next COMMIT refused
            if sql == "COMMIT" and not refused:
                refused.append(sql)
                raise sqlite3.OperationalError("database is locked")
            return await real(sql, *args)

        monkeypatch.setattr(conn, "execute_fetchall", busy_once)
        async with gate.admit("job-1", 6) as refusal:
            assert refusal is not None and refusal.status == 503
        async with gate.admit("job-1", 6) as refusal:  # not stuck: admitted, not 503
            assert refusal is None
        assert refused == ["COMMIT"]
    finally:
        monkeypatch.undo()
        await gate.close()


async def test_a_missing_directory_for_the_fence_database_is_made(tmp_path: Path) -> None:
    """As the gateway's store does: not a 503 on every fenced request."""
    path = tmp_path / "no" / "such" / "fence.db"
    async with aiohttp_ledger(f"sqlite:///{path}") as (ledger, send, _):
        assert (await send("3"))[0] == 201
        assert (await send("2"))[0] == 409
    assert path.exists() and ledger.effects == [("job-1", "3")]


async def _one_job_is_serialised(send: Callable[..., Awaitable[Any]], ledger: Ledger) -> None:
    """Generation 5's handler is held open; 6 and 4 arrive meanwhile. 6 must not run
    until 5 is done, and 4 must then be refused."""
    first = asyncio.create_task(send("5", path="/slow"))
    await asyncio.wait_for(ledger.started.wait(), 10)
    newer = asyncio.create_task(send("6"))
    older = asyncio.create_task(send("4"))
    for _ in range(30):  # give 6 ample time to (wrongly) start
        await asyncio.sleep(0.01)
        if ledger.overlapped:
            break
    ledger.release.set()
    statuses = [r[0] for r in await asyncio.gather(first, newer, older)]
    assert not ledger.overlapped, "a newer generation ran while an older one's handler ran"
    assert ledger.effects == [("job-1", "5"), ("job-1", "6")]
    assert statuses == [201, 201, 409]


async def test_aiohttp_one_jobs_requests_are_serialised_while_the_handler_runs(
    database_url: str,
) -> None:
    async with aiohttp_ledger(database_url) as (ledger, send, _):
        await _one_job_is_serialised(send, ledger)


@asynccontextmanager
async def _no_lock(self: Any, job_id: str) -> AsyncIterator[None]:
    yield


async def test_without_the_job_lock_the_serialisation_test_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The protection switched off: the test above would catch the overlap."""
    monkeypatch.setattr(fence_gate.JobLocks, "hold", _no_lock)
    async with aiohttp_ledger(f"sqlite:///{tmp_path / 'l.db'}") as (ledger, send, _):
        with pytest.raises(AssertionError, match="newer generation ran"):
            await _one_job_is_serialised(send, ledger)


# --- ASGI --------------------------------------------------------------------------------


def bare_app(ledger: Ledger) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        await ledger.effect(
            headers.get("fencing-job"), headers.get("fencing-token"), scope["path"] == "/slow"
        )
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def starlette_app(ledger: Ledger) -> Any:
    starlette = pytest.importorskip("starlette")
    del starlette
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def effect(request: Request) -> JSONResponse:
        await ledger.effect(
            request.headers.get("fencing-job"),
            request.headers.get("fencing-token"),
            request.url.path == "/slow",
        )
        return JSONResponse({"applied": len(ledger.effects)}, status_code=201)

    return Starlette(routes=[Route("/{tail:path}", effect, methods=["POST"])])


async def asgi_call(
    app: Any,
    path: str,
    headers: dict[str, str],
    body: bytes = b"",
    raw: list[tuple[bytes, bytes]] | None = None,
) -> tuple[int, Any, bytes]:
    """One HTTP POST through the ASGI interface (`raw`: header lines as the server
    would pass them, in place of `headers`)."""
    sent: list[dict[str, Any]] = []
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw
        if raw is not None
        else [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = sent[0]
    assert start["type"] == "http.response.start"
    got = {k.decode().title(): v.decode() for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], got, body


@pytest.fixture(params=["bare", "starlette"])
def asgi_ledger(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Ledger, ASGIFence, Any]:
    ledger = Ledger()
    inner = bare_app(ledger) if request.param == "bare" else starlette_app(ledger)
    fenced = ASGIFence(inner, Fence(), f"sqlite:///{tmp_path / 'ledger.db'}")

    async def send(token: str | None = None, job: str | None = "job-1", path: str = "/e"):
        headers = {}
        if job is not None:
            headers["Fencing-Job"] = job
        if token is not None:
            headers["Fencing-Token"] = token
        return await asgi_call(fenced, path, headers)

    return ledger, fenced, send


async def test_asgi_stale_refused_fresh_passed_unfenced_untouched(
    asgi_ledger: tuple[Ledger, ASGIFence, Any],
) -> None:
    ledger, fenced, send = asgi_ledger
    try:
        assert (await send("7"))[0] == 201
        assert (await send("7"))[0] == 201
        status, headers, body = await send("6")
        doc = problem(status, headers, body, "stale_generation")
        assert (doc["generation"], doc["highest_generation"]) == (6, 7)
        assert int(headers["Content-Length"]) == len(body)
        assert (await send(None, job=None))[0] == 201
        for token in BAD_TOKENS:
            status, headers, body = await send(token)
            problem(status, headers, body, "invalid_fencing_token")
        problem(*(await send(None)), "missing_fencing_token")
        assert ledger.effects == [("job-1", "7"), ("job-1", "7"), (None, None)]
    finally:
        await fenced.close()


async def test_asgi_one_jobs_requests_are_serialised(
    asgi_ledger: tuple[Ledger, ASGIFence, Any],
) -> None:
    ledger, fenced, send = asgi_ledger
    try:
        await _one_job_is_serialised(send, ledger)
    finally:
        await fenced.close()


async def test_two_middlewares_in_one_process_serialise_one_job_together(
    tmp_path: Path,
) -> None:
    """SPEC 3.1 serialises a job's requests within the process, not within one
    middleware: generation 5 held open in one fenced app, 6 and 4 sent to another
    one on the same database, and 6 still waits for 5."""
    ledger = Ledger()
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    first, second = (
        ASGIFence(bare_app(ledger), Fence(), url),
        ASGIFence(bare_app(ledger), Fence(), url),
    )

    async def send(token: str | None = None, job: str | None = "job-1", path: str = "/e"):
        app = first if token == "5" else second
        return await asgi_call(app, path, {"Fencing-Job": job or "", "Fencing-Token": token or ""})

    try:
        await _one_job_is_serialised(send, ledger)
    finally:
        await first.close()
        await second.close()


async def test_a_fence_inside_a_fence_does_not_wait_for_itself(tmp_path: Path) -> None:
    """An ASGIFence around another (a mounted app with its own): the request holds
    its job's lock from the outer one, and waited for itself in the inner one."""
    ledger = Ledger()
    inner = ASGIFence(bare_app(ledger), Fence(), f"sqlite:///{tmp_path / 'inner.db'}")
    outer = ASGIFence(inner, Fence(), f"sqlite:///{tmp_path / 'outer.db'}")
    headers = {"Fencing-Job": "job-1", "Fencing-Token": "3"}
    try:
        for _ in range(2):  # nothing left held for the next request of the job
            status, _, _ = await asyncio.wait_for(asgi_call(outer, "/e", headers), 5)
            assert status == 201
        stale = {"Fencing-Job": "job-1", "Fencing-Token": "2"}
        problem(*(await asgi_call(outer, "/e", stale)), "stale_generation")
        problem(*(await asgi_call(inner, "/e", stale)), "stale_generation")  # both marked
        assert ledger.effects == [("job-1", "3"), ("job-1", "3")]
        assert len(outer.gate.locks) == 0
    finally:
        await outer.close()
        await inner.close()


async def test_a_task_a_request_started_waits_for_the_lock_once_the_request_ended(
    tmp_path: Path,
) -> None:
    """A handler starts a task that later calls the fenced app for the same job (the
    task copies the request's context, its 'I hold job-1' too). Run after the
    request ended, while another request of the job holds the lock, the call
    waits its turn instead of passing as if it were still the holder."""
    ledger = Ledger()
    inner = bare_app(ledger)
    go = asyncio.Event()
    spawned: list[asyncio.Task[Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/spawn":

            async def later() -> Any:
                await go.wait()
                return await asgi_call(fenced, "/e", {"Fencing-Job": "job-1", "Fencing-Token": "3"})

            spawned.append(asyncio.create_task(later()))
            await send({"type": "http.response.start", "status": 202, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await inner(scope, receive, send)

    fenced = ASGIFence(app, Fence(), f"sqlite:///{tmp_path / 'l.db'}")
    headers = {"Fencing-Job": "job-1", "Fencing-Token": "3"}
    try:
        assert (await asgi_call(fenced, "/spawn", headers))[0] == 202
        holder = asyncio.create_task(asgi_call(fenced, "/slow", headers))
        await asyncio.wait_for(ledger.started.wait(), 5)
        go.set()
        await asyncio.sleep(0.2)  # time enough for the call to run, were it let in
        assert ledger.effects == []  # it waits for the holder
        ledger.release.set()
        await asyncio.wait_for(asyncio.gather(holder, *spawned), 5)
        assert not ledger.overlapped
        assert len(ledger.effects) == 2
    finally:
        ledger.release.set()
        go.set()
        await fenced.close()


async def test_aiohttp_a_fence_on_the_app_and_its_sub_app_does_not_wait_for_itself(
    tmp_path: Path,
) -> None:
    ledger = Ledger()
    outer = aiohttp_middleware(Fence(), f"sqlite:///{tmp_path / 'outer.db'}")
    inner = aiohttp_middleware(Fence(), f"sqlite:///{tmp_path / 'inner.db'}")
    sub = web.Application(middlewares=[inner])
    sub.router.add_post("/e", ledger.aiohttp_handler)
    app = web.Application(middlewares=[outer])
    app.add_subapp("/sub", sub)
    app.on_cleanup.extend([outer.close, inner.close])
    headers = {"Fencing-Job": "job-1", "Fencing-Token": "3"}
    async with serving(app) as base, aiohttp.ClientSession() as session:
        async with session.post(base + "/sub/e", headers=headers, timeout=5) as resp:
            assert resp.status == 201
    assert ledger.effects == [("job-1", "3")]


@pytest.mark.postgres
async def test_a_database_serializable_by_default_makes_the_check_wait_not_fail() -> None:
    """Another process's check of the job, committed while ours waits for the row:
    under SERIALIZABLE (the database's default here) ours failed, 503; the
    middleware's one upsert runs READ COMMITTED, waits, and decides on the mark."""
    import asyncpg  # type: ignore[import-untyped]

    from tests.pg import fresh_database

    async with fresh_database() as url:
        name = url.rsplit("/", 1)[1]
        admin = await asyncpg.connect(url)
        try:
            await admin.execute(
                f'ALTER DATABASE "{name}" SET default_transaction_isolation = serializable'
            )
        finally:
            await admin.close()
        other = await asyncpg.connect(url)  # the other process
        watcher = await asyncpg.connect(url)
        try:
            await Fence().setup(other)
            async with other.transaction(isolation="read_committed"):
                await Fence().check(other, "job-1", 1)
            async with aiohttp_ledger(url) as (ledger, send, _):
                async with other.transaction():
                    await Fence().check(other, "job-1", 5)  # holds the job's row
                    ours = asyncio.create_task(send("6"))
                    await eventually(  # read outside the transaction: a fresh view
                        lambda: watcher.fetchval(
                            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = "
                            "'Lock' AND datname = current_database()"
                        ),
                        what="the middleware's check waiting for the row",
                    )
                status, _, body = await asyncio.wait_for(ours, 10)
                assert status == 201, body
                assert ledger.effects == [("job-1", "6")]
                problem(*(await send("5")), "stale_generation")
        finally:
            await other.close()
            await watcher.close()


@pytest.mark.parametrize(
    "lines",
    [
        # U+00A0 and U+0085 are no space in a field value (str.strip() took them).
        [(b"fencing-job", b"a\xa0"), (b"fencing-token", b"3")],
        [(b"fencing-job", b"\x85a"), (b"fencing-token", b"3")],
        # A second, empty line: the gateway reads `job-1, ` and refuses it.
        [(b"fencing-job", b"job-1"), (b"fencing-job", b""), (b"fencing-token", b"3")],
        [(b"fencing-job", b"job-1"), (b"fencing-token", b"3"), (b"fencing-token", b"")],
    ],
)
async def test_asgi_a_value_outside_the_alphabet_or_sent_twice_is_refused(
    tmp_path: Path, lines: list[tuple[bytes, bytes]]
) -> None:
    ledger = Ledger()
    fenced = ASGIFence(bare_app(ledger), Fence(), f"sqlite:///{tmp_path / 'l.db'}")
    try:
        problem(*(await asgi_call(fenced, "/e", {}, raw=lines)), "invalid_fencing_token")
        assert ledger.effects == []
    finally:
        await fenced.close()


async def test_asgi_lifespan_passes_through_and_shutdown_closes_the_database(
    tmp_path: Path,
) -> None:
    ledger = Ledger()
    fenced = ASGIFence(starlette_app(ledger), Fence(), f"sqlite:///{tmp_path / 'l.db'}")
    await asgi_call(fenced, "/e", {"Fencing-Job": "j", "Fencing-Token": "2"})
    assert fenced.gate.database._conn is not None
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    answers: list[str] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        answers.append(message["type"])

    await fenced({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    assert answers == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert fenced.gate.database._conn is None


def test_the_middlewares_refuse_bad_arguments() -> None:
    with pytest.raises(ValueError):
        aiohttp_middleware("not a fence", "sqlite:///x.db")  # type: ignore[arg-type]
    with pytest.raises(ValueError) as refused:
        aiohttp_middleware(Fence(), "mysql://user:secret@db/x")
    assert "secret" not in str(refused.value)
    with pytest.raises(ValueError):
        ASGIFence(None, Fence(), "sqlite:///x.db")  # type: ignore[arg-type]
