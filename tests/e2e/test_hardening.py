"""Limits, bad input and the security review's claims, against a real gateway.

The gateway runs with the runner and server limits `serve` uses
(`GatewayRunner`, `app.SERVER_LIMITS`). Requests that aiohttp's client refuses
to send (invalid UTF-8, control characters, oversized or trickling headers) go
over raw sockets. Every test checks that nothing was forwarded and the store
holds exactly what the contract says (a rejection-log row where SPEC 2 wants
one; no lease, fence or key).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import http_exceptions, web
from structlog.testing import capture_logs
from yarl import URL

from gateway.admin import app as admin
from gateway.admin.app import create_admin_app
from gateway.app import SERVER_LIMITS, WRITES, create_app
from gateway.http import bodies, server
from gateway.http.appkeys import CONFIG, METRICS
from gateway.http.server import GatewayRunner, parse_error_rejection
from gateway.policy.decision import Fencing
from gateway.store.records import RejectionQuery
from gateway.store.sqlite import SQLiteStore
from gateway.write.request import origin_form
from leases.sqlite import sqlite_path
from tests.harness import (
    FakeClock,
    Gateway,
    RecordingUpstream,
    destination,
    eventually,
    make_config,
    running_gateway,
)
from tests.harness import recording_upstream as _recording_upstream

ADMIN_TOKEN = "admin-token-for-hardening"
WORKER_TOKEN = "worker-token-for-hardening"


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    async with _recording_upstream() as up:
        yield up


@asynccontextmanager
async def gateway_with_limits(
    tmp_path: Path,
    upstream: RecordingUpstream,
    listen: tuple[str, int] = ("127.0.0.1", 0),
    **limits: Any,
) -> AsyncIterator[Gateway]:
    """The gateway on a loopback port; `listen` is what its config says it listens
    on (a wildcard: it serves any host name, as one reached by name must)."""
    config = make_config(
        tmp_path,
        destination("pay", upstream.url + "/api"),
        destination("other", upstream.url + "/other"),
        destination("mono", upstream.url + "/api", fencing=Fencing.MONOTONIC),
        destination("secure", upstream.url + "/api", worker_tokens=(WORKER_TOKEN,)),
        destination("narrow", upstream.url + "/api", max_in_flight=2),
        listen=listen,
    )
    clock = FakeClock()
    store = await SQLiteStore.open(config.store_url, clock=clock)
    app = create_app(config, store=store, clock=clock)
    runner = GatewayRunner(app, shutdown_timeout=5, **{**SERVER_LIMITS, **limits})
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    session = aiohttp.ClientSession()
    try:
        yield Gateway(f"http://{host}:{port}", store, clock, session, app)
    finally:
        await session.close()
        await runner.cleanup()
        await store.close()


@pytest.fixture
async def gw(tmp_path: Path, upstream: RecordingUpstream) -> AsyncIterator[Gateway]:
    async with gateway_with_limits(tmp_path, upstream) as gateway:
        yield gateway


@pytest.fixture
async def gw_by_name(tmp_path: Path, upstream: RecordingUpstream) -> AsyncIterator[Gateway]:
    """A gateway whose config listens on every address: any Host is served."""
    async with gateway_with_limits(tmp_path, upstream, listen=("0.0.0.0", 8480)) as gateway:
        yield gateway


@asynccontextmanager
async def admin_listener(gw: Gateway) -> AsyncIterator[str]:
    """The admin app on `gw`'s store, served as `serve` serves it; yields its URL."""
    admin = create_admin_app(gw.store, gw.app[METRICS], token=ADMIN_TOKEN)
    runner = GatewayRunner(admin, **SERVER_LIMITS)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


# --- helpers -------------------------------------------------------------------------------


async def raw_request(gw: Gateway, data: bytes) -> bytes:
    """Send raw bytes, read one response (requests say Connection: close)."""
    url = URL(gw.url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(read_response(reader), 10)
    finally:
        writer.close()


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 response with a Content-Length (or up to EOF without one)."""
    head = await reader.readuntil(b"\r\n\r\n")
    headers, _ = head_and_body(head)
    if "content-length" in headers:
        return head + await reader.readexactly(int(headers["content-length"]))
    return head + await reader.read()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def head_and_body(response: bytes) -> tuple[dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")[1:]
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    return headers, body


def write_head(path: str, job: bytes, *, key: bytes = b"k-1", extra: bytes = b"") -> bytes:
    return (
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\n"
        b"Fencing-Job: "
        + job
        + b"\r\nFencing-Token: 1\r\nIdempotency-Key: "
        + key
        + b"\r\n"
        + extra
        + b"\r\n{}"
    )


async def table_counts(store: SQLiteStore) -> dict[str, int]:
    """Rows per table, read on the store's own connection."""
    tables = ("leases", "fences", "idempotency", "attempts", "rejections")
    return {
        t: (
            await store._executor.read(
                lambda c, t=t: c.execute(f"SELECT count(*) FROM {t}").fetchone()
            )
        )[0]
        for t in tables
    }


def assert_problem(response: bytes, status: int, reason: str) -> dict[str, Any]:
    assert status_of(response) == status, response[:300]
    headers, body = head_and_body(response)
    assert headers["content-type"].startswith("application/problem+json")
    assert headers["sinkgate-rejected"] == reason
    doc: dict[str, Any] = json.loads(body)
    assert doc["reason"] == reason and doc["status"] == status
    return doc


# Put into the bytes a parser refuses: its answer must not quote them back.
LEAK = b"zz-leak-marker"


def assert_parser_refusal(response: bytes, status: int) -> None:
    """The gateway's own answer for a request aiohttp's parser refused: an
    `invalid_request` problem with aiohttp's status and a short generic detail."""
    doc = assert_problem(response, status, "invalid_request")
    assert set(doc) == {"type", "title", "status", "detail", "reason"}
    assert doc["type"] == "urn:sinkgate:problem:invalid_request"
    assert doc["title"] == "Invalid request"
    detail = doc["detail"]
    assert detail.startswith("malformed HTTP request: ")
    assert detail.isascii() and detail.isprintable() and len(detail) <= 200
    assert LEAK not in response


@contextmanager
def log_records() -> Iterator[list[logging.LogRecord]]:
    """Every standard-library log record made meanwhile, at any level (aiohttp's
    server logs through it)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    root, handler = logging.getLogger(), Keep(logging.DEBUG)
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def assert_quiet(records: list[logging.LogRecord]) -> None:
    """No error-level line, no traceback and none of the request's bytes (`LEAK`
    stands for a token it carried) in what was logged."""
    texts = [logging.Formatter().format(record) for record in records]
    assert not [r for r in records if r.levelno >= logging.ERROR], texts
    assert not [t for t in texts if LEAK.decode() in t or "Traceback" in t], texts


async def refused_by_the_parser(base_url: str, data: bytes) -> None:
    """Send `data`, which aiohttp's parser refuses: a 400 `invalid_request`
    problem, and the connection closed after it as aiohttp closes it. Nothing
    of the request is logged: the parser's message quotes the offending bytes,
    a token among them."""
    url = URL(base_url)
    with log_records() as records:
        reader, writer = await asyncio.open_connection(url.host, url.port)
        try:
            writer.write(data)
            await writer.drain()
            response = await asyncio.wait_for(read_response(reader), 10)
            rest = await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()
    assert_parser_refusal(response, 400)
    assert rest == b"", "the connection stayed open after a parse error"
    assert_quiet(records)


async def test_a_connection_error_of_the_gateways_own_is_still_a_500_problem(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the client's own connection going away is a quiet line: a
    ConnectionError from anywhere else is a bug to see, with its traceback."""

    async def refused(*args: object, **kwargs: object) -> None:
        raise ConnectionRefusedError("not the client's")

    monkeypatch.setattr(gw.store, "claim", refused)
    with capture_logs() as logs:
        async with gw.session.post(
            f"{gw.url}/leases/job-1/claim", json={"owner": "a", "ttl": 10}
        ) as resp:
            assert (resp.status, resp.headers["Sinkgate-Rejected"]) == (500, "internal_error")
    assert [e["event"] for e in logs if e.get("exc_info")] == ["unhandled_error"]


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"deflate, chunked"])
async def test_a_transfer_coding_other_than_chunked_is_501(
    gw: Gateway, upstream: RecordingUpstream, coding: bytes
) -> None:
    """Its body would reach the upstream still coded, with nothing saying so."""
    await gw.claim("job-1")
    body = b"2\r\n{}\r\n0\r\n\r\n"
    request = (
        b"POST /to/pay/x HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Fencing-Job: job-1\r\nFencing-Token: 1\r\nIdempotency-Key: k-te\r\n"
        b"Transfer-Encoding: " + coding + b"\r\n\r\n" + body
    )
    response = await raw_request(gw, request)
    assert status_of(response) == 501, response[:300]
    assert b"Sinkgate-Rejected: invalid_request" in response
    assert upstream.received == []
    assert await gw.store.key_record("pay", "k-te") is None


@pytest.mark.parametrize(
    "headers",
    [
        (b"Bearer " + WORKER_TOKEN.encode(), b"Bearer wrong"),
        (b"Bearer wrong", b"Bearer " + WORKER_TOKEN.encode()),
        (b"Bearer " + WORKER_TOKEN.encode(), b"Bearer " + WORKER_TOKEN.encode()),
    ],
    ids=["right-first", "right-second", "both-right"],
)
async def test_two_authorization_headers_are_refused_whichever_is_right(
    gw: Gateway, upstream: RecordingUpstream, headers: tuple[bytes, bytes]
) -> None:
    """A request carries one Authorization (RFC 9110): the first of two was read, so
    the answer hung on their order; two duplicate fencing headers are refused too."""
    await gw.claim("job-1")
    extra = b"".join(b"Authorization: " + value + b"\r\n" for value in headers)
    response = await raw_request(gw, write_head("/to/secure/x", b"job-1", extra=extra))
    assert_problem(response, 401, "unauthorized")
    assert upstream.received == []


async def test_bodies_still_arriving_are_held_within_max_body_buffer(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """Many slow bodies grew the gateway without bound (2000 connections each
    announcing 1 MiB and stalling: 2.8 GB). Past `max_body_buffer` a body still to
    arrive is refused at once, 503 overloaded with the connection closed; the
    ones already taken finish, and their room is given back."""
    config = make_config(
        tmp_path,
        destination("pay", upstream.url + "/api", max_body=1000),
        max_body_buffer=1500,
    )
    async with running_gateway(config) as gw:
        await gw.claim("job-1")
        url = URL(gw.url)
        budget = gw.app[WRITES].body_budget

        async def started(key: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection(url.host, url.port)
            writer.write(
                b"POST /to/pay/x HTTP/1.1\r\nHost: 127.0.0.1\r\nFencing-Job: job-1\r\n"
                + f"Fencing-Token: 1\r\nIdempotency-Key: {key}\r\n".encode()
                + b"Content-Length: 1000\r\n\r\n"
                + b"x" * 10
            )
            await writer.drain()
            return reader, writer

        first = await started("k-first")
        await eventually(lambda: budget.used == 1000, what="the first body's room taken")
        second = await started("k-second")  # 1000 more would pass 1500
        refusal = await asyncio.wait_for(read_response(second[0]), 10)
        assert status_of(refusal) == 503, refusal
        assert b"Sinkgate-Rejected: overloaded" in refusal
        assert b"Retry-After: 1" in refusal and b"Connection: close" in refusal
        second[1].close()
        first[1].write(b"x" * 990)  # the first body completes
        answer = await asyncio.wait_for(read_response(first[0]), 10)
        first[1].close()
        assert status_of(answer) == 201, answer
        assert budget.used == 0
        assert await gw.store.key_record("pay", "k-second") is None
        assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["k-first"]


@pytest.mark.parametrize("path", ["/to/pay/x", "/leases/job-1/claim"])
async def test_a_client_gone_mid_body_is_one_quiet_line_not_a_traceback(
    gw: Gateway, upstream: RecordingUpstream, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that hangs up with its body cut short is no fault of the gateway's:
    it must not fill the error log (every client could)."""
    lines: list[tuple[str, dict[str, Any]]] = []

    class Lines:
        def info(self, event: str, **fields: Any) -> None:
            lines.append((event, fields))

    monkeypatch.setattr(server, "log", Lines())
    url = URL(gw.url)
    with log_records() as records:
        reader, writer = await asyncio.open_connection(url.host, url.port)
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nFencing-Job: job-1\r\n".encode()
            + b"Fencing-Token: 1\r\nIdempotency-Key: k-gone\r\n"
            + b"Content-Type: application/json\r\nContent-Length: 100\r\n"
            + b"Expect: 100-continue\r\n\r\n"
        )
        # The continue says the head was read and the body is awaited.
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == (
            b"HTTP/1.1 100 Continue\r\n\r\n"
        )
        writer.write(b"0123456789")
        await writer.drain()
        writer.transport.abort()
        await eventually(lambda: lines, what="the connection handler's line")
    assert [event for event, _ in lines] == ["client_disconnected"]
    assert_quiet(records)
    assert upstream.received == []
    assert sum((await table_counts(gw.store)).values()) == 0


# --- slow clients ---------------------------------------------------------------------------


async def test_a_write_body_slower_than_the_deadline_is_408_and_changes_nothing(
    gw: Gateway, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bodies, "BODY_READ_TIMEOUT_S", 0.3)
    await gw.claim("job-1")
    before = await table_counts(gw.store)
    url = URL(gw.url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(
            b"POST /to/pay/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n"
            b"Fencing-Job: job-1\r\nFencing-Token: 1\r\nIdempotency-Key: k\r\n\r\n" + b"x" * 10
        )
        await writer.drain()
        started = time.monotonic()
        response = await asyncio.wait_for(read_response(reader), 10)
    finally:
        writer.close()
    assert time.monotonic() - started < 5
    assert_problem(response, 408, "request_timeout")
    assert head_and_body(response)[0]["connection"].lower() == "close"
    assert upstream.received == []
    assert await table_counts(gw.store) == before


async def test_a_lease_body_slower_than_the_deadline_is_408_with_connection_close(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on the write route: the rest of the body is never read, so the answer
    says the connection closes."""
    monkeypatch.setattr(bodies, "BODY_READ_TIMEOUT_S", 0.3)
    url = URL(gw.url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(
            b"POST /leases/job-1/claim HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"
        )
        await writer.drain()
        response = await asyncio.wait_for(read_response(reader), 10)
    finally:
        writer.close()
    assert_problem(response, 408, "request_timeout")
    assert head_and_body(response)[0]["connection"].lower() == "close"
    assert await gw.store.get("job-1") is None


async def test_slowloris_headers_are_cut_off_at_the_keepalive_deadline(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """aiohttp closes a connection whose header block is still incomplete when the
    keep-alive deadline runs out; `serve` sets it (SERVER_LIMITS), here shortened."""
    assert SERVER_LIMITS["keepalive_timeout"] <= 30
    async with gateway_with_limits(tmp_path, upstream, keepalive_timeout=0.5) as gw:
        url = URL(gw.url)
        reader, writer = await asyncio.open_connection(url.host, url.port)
        started = time.monotonic()
        closed_after = None
        try:
            writer.write(b"POST /to/pay/x HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            for i in range(100):  # one header line every 50 ms: never a complete head
                try:
                    writer.write(f"X-Trickle-{i}: 1\r\n".encode())
                    await writer.drain()
                except ConnectionError:
                    closed_after = time.monotonic() - started
                    break
                try:
                    data = await asyncio.wait_for(reader.read(1), 0.05)
                except TimeoutError:
                    continue
                assert data == b"", "the server answered a request it never fully received"
                closed_after = time.monotonic() - started
                break
        finally:
            writer.close()
        assert closed_after is not None and closed_after < 3.0, closed_after
        assert upstream.received == []


@pytest.mark.parametrize(
    ("what", "request_bytes"),
    [
        (
            "long header",
            write_head("/to/pay/x", b"job-1", extra=b"X-Big: " + b"a" * 9000 + b"\r\n"),
        ),
        (
            "many headers",
            write_head(
                "/to/pay/x", b"job-1", extra=b"".join(b"X-H%d: 1\r\n" % i for i in range(150))
            ),
        ),
        ("long request line", write_head("/to/pay/" + "a" * 9000, b"job-1")),
        ("long job id header", write_head("/to/pay/x", b"j" * 9000)),
    ],
)
async def test_oversized_headers_are_a_4xx_problem_and_change_nothing(
    gw: Gateway, upstream: RecordingUpstream, what: str, request_bytes: bytes
) -> None:
    """aiohttp's parser refuses them and picks the status; the gateway answers."""
    await gw.claim("job-1")
    before = await table_counts(gw.store)
    response = await raw_request(gw, request_bytes)
    assert 400 <= status_of(response) < 500, (what, response[:200])
    assert_parser_refusal(response, status_of(response))
    assert upstream.received == []
    assert await table_counts(gw.store) == before


async def test_oversized_json_on_the_lease_api_is_413_problem_and_claims_nothing(
    gw: Gateway,
) -> None:
    body = json.dumps({"owner": "a", "ttl": 10, "pad": "x" * 70_000}).encode()
    async with gw.session.post(f"{gw.url}/leases/job-1/claim", data=body) as resp:
        assert resp.status == 413
        assert resp.headers["Content-Type"].startswith("application/problem+json")
        assert (await resp.json(content_type=None))["reason"] == "body_too_large"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted while read
        for _ in range(20):
            yield b" " * 4096
        yield b'{"owner": "a", "ttl": 10}'

    async with gw.session.post(f"{gw.url}/leases/job-1/claim", data=chunks()) as resp:
        assert resp.status == 413
        assert resp.headers["Sinkgate-Rejected"] == "body_too_large"
    assert await gw.store.get("job-1") is None


# --- invalid ids ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "job",
    [b"j\xffb", b"j\xc3\xa9b", b"j\tb", b"j b"],
    ids=["invalid-utf8", "non-ascii", "tab", "space"],
)
async def test_bad_bytes_in_fencing_job_are_400_and_only_logged(
    gw: Gateway, upstream: RecordingUpstream, job: bytes
) -> None:
    response = await raw_request(gw, write_head("/to/pay/x", job))
    assert_problem(response, 400, "invalid_fencing_token")
    assert upstream.received == []
    (logged,) = await gw.store.list_rejections(RejectionQuery())
    assert logged.record.reason == "invalid_fencing_token" and logged.record.job_id is None
    counts = await table_counts(gw.store)
    assert counts == {"leases": 0, "fences": 0, "idempotency": 0, "attempts": 0, "rejections": 1}


CONTROLS = pytest.mark.parametrize(
    "control", [b"\x01", b"\x7f", b"\x00"], ids=["control", "del", "nul"]
)


@CONTROLS
async def test_control_characters_in_a_header_are_refused_by_the_parser(
    gw: Gateway, upstream: RecordingUpstream, control: bytes
) -> None:
    """aiohttp's parser refuses control characters in any header value (RFC 9110
    5.5) before the gateway runs; the answer is still the gateway's problem+json,
    and nothing reaches the store."""
    await refused_by_the_parser(gw.url, write_head("/to/pay/x", b"j" + control + LEAK))
    assert upstream.received == []
    assert sum((await table_counts(gw.store)).values()) == 0


@CONTROLS
async def test_a_control_character_in_the_idempotency_key_is_an_invalid_request_problem(
    gw: Gateway, upstream: RecordingUpstream, control: bytes
) -> None:
    await gw.claim("job-1")
    before = await table_counts(gw.store)
    key = b"k" + control + LEAK
    await refused_by_the_parser(gw.url, write_head("/to/pay/x", b"job-1", key=key))
    assert upstream.received == []
    assert await gw.store.list_rejections(RejectionQuery()) == []
    assert await table_counts(gw.store) == before


@pytest.mark.parametrize("key", [b"k\xffk", b"k\xc3\xa9"], ids=["invalid-utf8", "non-ascii"])
async def test_bad_bytes_in_the_idempotency_key_are_400(
    gw: Gateway, upstream: RecordingUpstream, key: bytes
) -> None:
    await gw.claim("job-1")
    response = await raw_request(gw, write_head("/to/pay/x", b"job-1", key=key))
    assert_problem(response, 400, "invalid_idempotency_key")
    assert upstream.received == []
    assert (await table_counts(gw.store))["idempotency"] == 0


@pytest.mark.parametrize(
    "raw_job",
    ["%FF", "a%00b", "a%0Ab", "a%7Fb", "%C3%A9", "a%20b", "j" * 257, "x%zz", "x%2", "x%"],
)
async def test_bad_job_ids_in_lease_paths_are_400_and_claim_nothing(
    gw: Gateway, raw_job: str
) -> None:
    url = URL(f"{gw.url}/leases/{raw_job}/claim", encoded=True)
    async with gw.session.post(url, json={"owner": "a", "ttl": 10}) as resp:
        assert resp.status == 400, await resp.text()
        assert (await resp.json(content_type=None))["reason"] == "invalid_request"
    assert (await table_counts(gw.store))["leases"] == 0


async def test_raw_invalid_utf8_in_a_lease_path_is_a_4xx(gw: Gateway) -> None:
    request = (
        b"POST /leases/j\xffb/claim HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: 25\r\n\r\n"
        b'{"owner": "a", "ttl": 10}'
    )
    response = await raw_request(gw, request)
    assert 400 <= status_of(response) < 500, response[:200]
    assert (await table_counts(gw.store))["leases"] == 0


async def test_a_control_character_in_a_lease_api_header_is_an_invalid_request_problem(
    gw: Gateway,
) -> None:
    request = (
        b"POST /leases/job-1/claim HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"X-Request-Id: r\x01" + LEAK + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 25\r\n\r\n"
        b'{"owner": "a", "ttl": 10}'
    )
    await refused_by_the_parser(gw.url, request)
    assert await gw.store.get("job-1") is None
    assert sum((await table_counts(gw.store)).values()) == 0


@pytest.mark.parametrize(
    "request_line",
    [
        b"POST /to/pay/x HTTP/1.1 " + LEAK,
        b"POST /leases/job-1/claim HTXP/1.1",
        b"P(ST /to/pay/" + LEAK + b" HTTP/1.1",
        b"POST /to/pay/x\x01" + LEAK + b" HTTP/1.1",
    ],
    ids=["trailing-token", "bad-version", "bad-method", "control-in-target"],
)
async def test_a_malformed_request_line_is_an_invalid_request_problem(
    gw: Gateway, upstream: RecordingUpstream, request_line: bytes
) -> None:
    await gw.claim("job-1")
    before = await table_counts(gw.store)
    request = (
        request_line + b"\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: 2\r\n"
        b"Fencing-Job: job-1\r\nFencing-Token: 1\r\nIdempotency-Key: k-line\r\n\r\n{}"
    )
    await refused_by_the_parser(gw.url, request)
    assert upstream.received == []
    assert await table_counts(gw.store) == before


@pytest.mark.parametrize(
    "error",
    [
        http_exceptions.InvalidHeader(b"X-Key: " + LEAK),
        http_exceptions.LineTooLong(LEAK * 20, 8190),
        http_exceptions.BadStatusLine(LEAK.decode()),
        http_exceptions.BadHttpMethod(LEAK.decode()),
        http_exceptions.InvalidURLError(LEAK.decode()),
        http_exceptions.TransferEncodingError(LEAK.decode()),
        http_exceptions.BadHttpMessage("Invalid header value char:\n\n  " + repr(LEAK)),
    ],
    ids=lambda error: type(error).__name__,
)
def test_a_parse_errors_detail_quotes_none_of_the_request(
    error: http_exceptions.HttpProcessingError,
) -> None:
    """aiohttp's messages quote the offending bytes; the problem's detail does not."""
    rejection = parse_error_rejection(400, error)
    assert rejection.reason == "invalid_request" and rejection.status == 400
    assert rejection.detail.startswith("malformed HTTP request: ")
    assert LEAK.decode() not in rejection.detail


def test_a_parse_errors_detail_is_short_printable_ascii() -> None:
    error = http_exceptions.BadHttpMessage("Odd \x01\x1b[31m\u00e9 " + "x" * 500)
    rejection = parse_error_rejection(431, error)
    assert rejection.status == 431
    assert rejection.detail.isascii() and rejection.detail.isprintable()
    assert len(rejection.detail) <= 200


# --- overload -------------------------------------------------------------------------------


async def test_past_max_in_flight_writes_get_503_overloaded_not_a_queue(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    slow = [asyncio.create_task(gw.write("/to/narrow/slow/1", key=f"s{i}")) for i in range(2)]
    await eventually(lambda: len(upstream.received) == 2, what="both forwards at the upstream")
    status, headers, body = await gw.write("/to/narrow/x", key="third")
    assert status == 503 and headers["Sinkgate-Rejected"] == "overloaded"
    assert int(headers["Retry-After"]) >= 1
    assert json.loads(body)["destination"] == "narrow"  # SPEC 2: where known
    assert await gw.store.key_record("narrow", "third") is None  # nothing reserved
    upstream.release.set()
    assert [(await t)[0] for t in slow] == [201, 201]
    assert (await gw.write("/to/narrow/x", key="third"))[0] == 201


async def test_writes_waiting_for_their_decision_take_no_place_on_the_wire(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    """A burst on one key used to count as in flight while it waited for the store,
    so the destination's other writers got 503 overloaded (300 writes of one key:
    44 of them). Now `max_in_flight` (2 here) counts only writes on the wire: the
    burst is decided (one forward, the rest in progress or replayed) and the other
    writer goes through. Checked by hand: counting from before the decision, as
    before, gives most of this burst and the other writer 503."""
    await gw.claim("job-1")
    burst = [gw.write("/to/narrow/x", key="same") for _ in range(60)]
    results = await asyncio.gather(*burst, gw.write("/to/narrow/y", key="other"))
    statuses = [status for status, _, _ in results]
    assert 503 not in statuses
    assert statuses[-1] == 201  # the other writer
    refused = {headers.get("Sinkgate-Rejected") for status, headers, _ in results if status != 201}
    assert refused <= {"request_in_progress"}
    assert sorted(r.headers["Idempotency-Key"] for r in upstream.received) == ["other", "same"]


@pytest.mark.parametrize("prefer", [{}, {"Prefer": "wait=5"}])
async def test_past_max_deciding_writes_get_503_overloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefer: dict[str, str]
) -> None:
    """The writes waiting for their decision are bounded too (`[server] max_deciding`),
    those that would wait under `Prefer: wait` included."""
    async with _recording_upstream() as up:
        config = make_config(tmp_path, destination("pay", up.url + "/api"))
        async with running_gateway(replace(config, max_deciding=1)) as gw:
            await gw.claim("job-1")
            writes = gw.app[WRITES]
            decide, gate = writes.store.decide_write, asyncio.Event()

            async def held(*args: Any) -> Any:
                await gate.wait()
                return await decide(*args)

            monkeypatch.setattr(writes.store, "decide_write", held)
            first = asyncio.create_task(gw.write("/to/pay/x", key="k1", headers=prefer))
            await eventually(lambda: writes.deciding == 1, what="the first write deciding")
            status, headers, _ = await gw.write("/to/pay/x", key="k2", headers=prefer)
            assert status == 503 and headers["Sinkgate-Rejected"] == "overloaded"
            gate.set()
            assert (await first)[0] == 201
            assert writes.deciding == 0


# --- the security review's claims -------------------------------------------------------------


async def test_without_a_token_a_worker_is_refused_and_logged_by_a_guarded_destination(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    status, headers, _ = await gw.write("/to/secure/x")
    assert status == 401 and headers["Sinkgate-Rejected"] == "unauthorized"
    status, _, _ = await gw.write("/to/secure/x", headers={"Authorization": "Bearer " + "x" * 20})
    assert status == 401
    assert upstream.received == []
    assert len(await gw.store.list_rejections(RejectionQuery(reason="unauthorized"))) == 2


async def test_the_lease_api_is_open_to_anyone_who_reaches_the_main_listener(
    gw: Gateway,
) -> None:
    """A documented limit, pinned so that a change is noticed: the lease API has no
    authentication, and owner and generation are readable, so any client can end
    another worker's lease. Guard the main listener at the network level."""
    await gw.claim("job-1", owner="worker-a")
    async with gw.session.get(f"{gw.url}/leases/job-1") as resp:
        lease = await resp.json()
    async with gw.session.post(
        f"{gw.url}/leases/job-1/release",
        json={"owner": lease["owner"], "generation": lease["generation"]},
    ) as resp:
        assert resp.status == 200 and (await resp.json())["state"] == "free"


async def test_a_forged_generation_is_never_forwarded_and_never_raises_the_mark(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    assert (await gw.write("/to/pay/x", generation=1, key="real"))[0] == 201
    for forged in (2, 2**63 - 1):
        status, headers, _ = await gw.write("/to/pay/x", generation=forged, key=f"f{forged}")
        assert status == 409 and headers["Sinkgate-Rejected"] == "unknown_generation"
    state = await gw.store.job_state("job-1")
    assert state is not None and state.highest_generation == 1
    assert len(upstream.received) == 1


async def test_a_rejected_write_never_raises_another_jobs_mark(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    """Lease mode: a write for a job one does not hold is refused and moves nothing.
    Monotonic mode: a rejected write (reused key) with a huge token moves nothing."""
    await gw.claim("victim", owner="b")
    status, _, _ = await gw.write("/to/pay/x", job="victim", generation=99, key="evil")
    assert status == 409
    assert (await gw.write("/to/mono/x", job="m", generation=5, key="k"))[0] == 201
    status, headers, _ = await gw.write(
        "/to/mono/x", job="m", generation=2**63 - 1, key="k", body=b"other"
    )
    assert status == 422 and headers["Sinkgate-Rejected"] == "idempotency_key_reused"
    victim = await gw.store.job_state("victim")
    assert victim is not None and victim.highest_generation is None
    mono = await gw.store.job_state("m")
    assert mono is not None and mono.highest_generation == 5
    assert len(upstream.received) == 1


async def test_the_same_key_on_another_destination_never_replays_its_answer(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    first = await gw.write("/to/pay/x", key="shared")
    second = await gw.write("/to/other/x", key="shared")
    assert first[0] == second[0] == 201
    assert "Idempotent-Replayed" not in second[1]
    assert json.loads(second[2])["n"] == 2  # the other upstream's own answer
    assert upstream.paths() == ["/api/x", "/other/x"]


@pytest.mark.parametrize(
    "request_line",
    [
        b"POST http://evil.invalid/to/pay/x HTTP/1.1",
        b"POST /to/pay/x HTTP/1.1",
    ],
)
async def test_no_request_can_point_the_gateway_at_another_host(
    gw: Gateway, gw_by_name: Gateway, upstream: RecordingUpstream, request_line: bytes
) -> None:
    """Absolute-form targets and a hostile Host header: whatever is forwarded goes to
    the configured upstream and its base path, nowhere else; a gateway on loopback
    only forwards nothing for a name that is not loopback's."""
    request = (
        request_line + b"\r\nHost: evil.invalid:80\r\nConnection: close\r\n"
        b"X-Forwarded-Host: evil.invalid\r\nContent-Length: 2\r\n"
        b"Fencing-Job: job-1\r\nFencing-Token: 1\r\nIdempotency-Key: k-host\r\n\r\n{}"
    )
    await gw.claim("job-1")
    assert_problem(await raw_request(gw, request), 403, "unauthorized")
    assert upstream.received == []
    response = await raw_request(gw_by_name, request)  # one store: the lease claimed above
    assert status_of(response) == 201, response[:300]
    (seen,) = upstream.received
    assert seen.raw_path == "/api/x"
    assert seen.headers["Host"] == URL(upstream.url).raw_authority


async def test_an_absolute_form_target_keeps_its_raw_path_and_its_checks(
    gw_by_name: Gateway, upstream: RecordingUpstream
) -> None:
    """The path checks see the absolute-form target's path as sent: percent-encoding
    and query kept on the way through, `..` above the base still refused. (Its
    authority is the request's host, RFC 9112 3.2.2: a gateway on loopback only
    refuses one that is not loopback's.)"""
    gw = gw_by_name
    await gw.claim("job-1")
    head = (
        b"\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: 2\r\n"
        b"Fencing-Job: job-1\r\nFencing-Token: 1\r\nIdempotency-Key: "
    )
    sent = b"POST https://evil.invalid:8443/to/pay/a%2Fb?q=1 HTTP/1.1" + head + b"k-abs\r\n\r\n{}"
    assert status_of(await raw_request(gw, sent)) == 201
    (seen,) = upstream.received
    assert seen.raw_path == "/api/a%2Fb?q=1"
    climbing = b"POST http://evil.invalid/to/pay/../../x HTTP/1.1" + head + b"k-up\r\n\r\n{}"
    assert_problem(await raw_request(gw, climbing), 400, "invalid_path")
    assert len(upstream.received) == 1


async def test_the_upstream_gets_the_workers_headers_not_client_defaults(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    """No Accept or Accept-Encoding the worker did not send (an Accept-Encoding would
    get it a compressed answer it never asked for, stored for replay as such), and
    an empty fencing header, which counts as missing, is not passed on."""
    await gw.claim("job-1")
    request = (
        b"POST /to/pay/x HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: 2\r\n"
        b"Fencing-Job: job-1\r\nFencing-Token: 1\r\nFencing-Owner: \r\n"
        b"Idempotency-Key: k-defaults\r\nX-Worker: w1\r\n\r\n{}"
    )
    assert status_of(await raw_request(gw, request)) == 201
    (seen,) = upstream.received
    names = {name.lower() for name in seen.headers}
    assert {"accept", "accept-encoding", "fencing-owner"}.isdisjoint(names), seen.headers
    assert (seen.headers["Fencing-Job"], seen.headers["X-Worker"]) == ("job-1", "w1")


@pytest.mark.parametrize(
    ("raw", "origin"),
    [
        ("/to/pay/x?q=1", "/to/pay/x?q=1"),
        ("http://h/to/pay/x?q=1", "/to/pay/x?q=1"),
        ("HTTPS://user@h:1/to/pay/%2e%2e", "/to/pay/%2e%2e"),
        ("http://h", "/"),
        ("http://h?q", "/?q"),
        ("*", "*"),
    ],
)
def test_origin_form_drops_only_scheme_and_authority(raw: str, origin: str) -> None:
    assert origin_form(raw) == origin


async def test_the_admin_api_is_not_on_the_main_listener_and_needs_its_token(
    gw: Gateway,
) -> None:
    async with gw.session.get(f"{gw.url}/admin/rejections") as resp:
        assert resp.status == 404
    async with admin_listener(gw) as admin:
        for headers in ({}, {"Authorization": f"Bearer {WORKER_TOKEN}"}):
            async with gw.session.get(f"{admin}/admin/rejections", headers=headers) as resp:
                assert resp.status == 401
        async with gw.session.get(
            f"{admin}/admin/rejections", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ) as resp:
            assert resp.status == 200


@pytest.mark.parametrize(
    "request_line",
    [b"GET /admin/rejections HTTP/1.1", b"GET /admin/rejections HTXP/1.1"],
    ids=["control-in-token", "bad-version"],
)
async def test_a_parse_error_on_the_admin_listener_is_an_invalid_request_problem(
    gw: Gateway, request_line: bytes
) -> None:
    """The admin listener is served by the same runner: a control character in its
    token, or a malformed request line, gets the same answer as on the main one."""
    request = (
        request_line + b"\r\nHost: admin\r\nConnection: close\r\n"
        b"Authorization: Bearer " + ADMIN_TOKEN.encode() + b"\x01" + LEAK + b"\r\n\r\n"
    )
    async with admin_listener(gw) as admin:
        await refused_by_the_parser(admin, request)
    assert await gw.store.list_rejections(RejectionQuery()) == []
    assert sum((await table_counts(gw.store)).values()) == 0


async def test_in_monotonic_mode_any_authorised_worker_can_raise_any_jobs_mark(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    """A documented limit, pinned so that a change is noticed: tokens authenticate a
    worker to a destination, not to a job. In monotonic mode the gateway cannot
    tell an honest high token from a forged one, so a worker that sends one for
    another job has it forwarded and fences that job's real writers off."""
    assert (await gw.write("/to/mono/x", job="victim", generation=3, key="v1"))[0] == 201
    assert (await gw.write("/to/mono/x", job="victim", generation=2**62, key="evil"))[0] == 201
    status, headers, _ = await gw.write("/to/mono/x", job="victim", generation=4, key="v2")
    assert status == 409 and headers["Sinkgate-Rejected"] == "stale_generation"


async def test_readyz_fails_while_another_process_holds_the_sqlite_write_lock(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under WAL a read answers even while every write waits for the lock: ready
    must mean a write can commit, or a load balancer keeps sending writes here."""
    monkeypatch.setattr(admin, "READY_TIMEOUT_S", 0.3)

    async def ready() -> int:
        async with gw.session.get(f"{gw.url}/readyz") as resp:
            return resp.status

    assert await ready() == 200
    other = sqlite3.connect(sqlite_path(gw.app[CONFIG].store_url), isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # another process's writer, stuck
        assert await ready() == 503
        other.execute("ROLLBACK")
    finally:
        other.close()
    # the probe's own write drains once the lock is free
    await eventually(lambda: _is(ready(), 200), what="/readyz answering 200")


async def _is(status: Awaitable[int], expected: int) -> bool:
    return await status == expected
