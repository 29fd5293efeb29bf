"""The write route end to end (SPEC 2): a real gateway, a real recording upstream."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
from multidict import CIMultiDict

from gateway import app as app_module
from gateway.app import WRITES
from gateway.http.appkeys import METRICS
from gateway.policy import decision as decision_module
from gateway.policy.decision import Fencing
from gateway.policy.outcome import RELEASED, UNKNOWN
from gateway.store import postgres_batch
from gateway.store.postgres import PostgresStore
from gateway.store.records import RejectionQuery
from gateway.write import route as route_module
from gateway.write import upstream as upstream_module
from leases.errors import StoreUnavailable
from tests.harness import (
    Gateway,
    RecordingUpstream,
    destination,
    eventually,
    free_port,
    make_config,
    recording_upstream,
    running_gateway,
)


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    async with recording_upstream() as up:
        yield up


@pytest.fixture
async def gw(store_url: str, tmp_path: Path, upstream: RecordingUpstream) -> AsyncIterator[Gateway]:
    """The gateway on each store backend (PostgreSQL: a fresh database per test)."""
    config = make_config(
        tmp_path,
        destination("pay", upstream.url + "/api"),
        destination("mono", upstream.url + "/api", fencing=Fencing.MONOTONIC),
        destination("open", upstream.url + "/api", require_idempotency_key=False),
        destination("idem", upstream.url + "/api", upstream_idempotent=True),
        destination(
            "idem-quick",
            upstream.url + "/api",
            upstream_idempotent=True,
            timeout=0.3,
            connect_timeout=0.3,
        ),
        destination("quick", upstream.url + "/api", timeout=0.3, connect_timeout=0.3),
        # For stalls past a timeout: long beside a decision on a loaded machine.
        destination("mid", upstream.url + "/api", timeout=1.0, connect_timeout=1.0),
        destination("tiny", upstream.url + "/api", timeout=0.05, connect_timeout=0.05),
        destination(
            "small",
            upstream.url + "/api",
            max_body=16,
            max_replay_body=8,
            methods=frozenset({"POST", "PUT"}),
        ),
        destination(
            "secure",
            upstream.url + "/api",
            worker_tokens=("s3cret-token",),
            upstream_headers=(("Authorization", "Bearer upstream-secret"), ("X-Tenant", "acme")),
        ),
        destination("quiet", upstream.url + "/api", forward_fencing_headers=False),
        destination("down", f"http://127.0.0.1:{free_port()}/api"),
    )
    async with running_gateway(config, backend=store_url) as gateway:
        yield gateway


def problem(body: bytes) -> dict[str, object]:
    return json.loads(body)


def assert_rejected(result: tuple[int, dict[str, str], bytes], status: int, reason: str) -> dict:
    code, headers, body = result
    assert code == status, body
    assert headers["Content-Type"].startswith("application/problem+json")
    assert headers["Sinkgate-Rejected"] == reason
    doc = problem(body)
    assert doc["reason"] == reason and doc["status"] == status
    assert {"type", "title", "detail"} <= doc.keys()
    return doc


# --- steps 1-5: request shape ------------------------------------------------------------


async def test_unknown_destination_is_404(gw: Gateway, upstream: RecordingUpstream) -> None:
    doc = assert_rejected(await gw.write("/to/nope/x"), 404, "unknown_destination")
    assert doc["destination"] == "nope"  # SPEC 2: the members "where known"
    assert upstream.received == []


async def test_an_unknown_destination_is_cut_in_the_line(gw: Gateway) -> None:
    """`/to/<7000 characters>/x` made a 7 KB write_decision line, for anybody."""
    with structlog.testing.capture_logs() as logs:
        assert_rejected(await gw.write(f"/to/{'A' * 3000}/x"), 404, "unknown_destination")
    [line] = [e for e in logs if e["event"] == "write_decision"]
    assert line["destination"] == "A" * 80


async def test_a_misspelt_destination_gets_a_did_you_mean(gw: Gateway) -> None:
    doc = assert_rejected(await gw.write("/to/smal/x"), 404, "unknown_destination")
    assert doc["detail"] == "no destination named 'smal' (did you mean 'small'?)"
    doc = assert_rejected(await gw.write("/to/zzzzzz/x"), 404, "unknown_destination")
    assert doc["detail"] == "no destination named 'zzzzzz'"


async def test_a_destination_with_worker_tokens_is_never_hinted(gw: Gateway) -> None:
    """Without the filter in `_did_you_mean`, 'secur' gets "did you mean 'secure'":
    a caller without a token could list the guarded names one guess at a time, and
    a hint given only with the right token would let a 404 (never recorded) check
    a guessed token."""
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Bearer s3cret-token"},
    ):
        doc = assert_rejected(
            await gw.write("/to/secur/x", headers=headers), 404, "unknown_destination"
        )
        assert doc["detail"] == "no destination named 'secur'"
    # 'suret' is closest to 'secure', then to the open 'quiet': the open one is
    # named, so a missing hint says nothing of a guarded name near the typo.
    doc = assert_rejected(await gw.write("/to/suret/x"), 404, "unknown_destination")
    assert doc["detail"] == "no destination named 'suret' (did you mean 'quiet'?)"


async def test_an_encoded_nul_anywhere_in_the_path_is_refused_unforwarded(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    """`..%00` is no dot segment, so the climbing check lets it through: without the
    NUL rule (has_nul returning False, checked by hand) this goes out as /api/..%00/admin."""
    await gw.claim("job-1")
    for path in ("/to/pay/..%00/admin", "/to/pay/a%00", "/to/pay/%00/x"):
        doc = assert_rejected(await gw.write(path), 400, "invalid_path")
        assert "NUL" in doc["detail"]
    assert upstream.received == []
    status, _, _ = await gw.write("/to/pay/a%01")  # other escapes still go on
    assert status == 201
    assert [r.raw_path for r in upstream.received] == ["/api/a%01"]


async def test_the_root_of_the_write_listener_points_at_the_write_route(gw: Gateway) -> None:
    async with gw.session.get(gw.url + "/") as resp:
        assert resp.status == 404
        assert resp.content_type == "application/problem+json"
        doc = await resp.json(content_type=None)
    assert doc["reason"] == "not_found"
    assert "/to/{destination}/{path}" in doc["detail"] and "/openapi.json" in doc["detail"]


async def test_method_outside_the_destinations_methods_is_405(gw: Gateway) -> None:
    await gw.claim("job-1")
    refused = await gw.write("/to/small/x", method="DELETE", body=b"")
    assert_rejected(refused, 405, "method_not_allowed")
    assert refused[1]["Allow"] == "POST, PUT"  # RFC 9110 15.5.6: a 405 lists what is allowed


async def test_worker_token_missing_or_wrong_is_401_and_recorded(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    assert_rejected(await gw.write("/to/secure/x"), 401, "unauthorized")
    doc = assert_rejected(
        await gw.write("/to/secure/x", headers={"Authorization": "Bearer nope"}),
        401,
        "unauthorized",
    )
    assert upstream.received == []
    logged = await gw.store.list_rejections(RejectionQuery(reason="unauthorized"))
    assert len(logged) == 2 and logged[0].id == doc["rejection_id"]
    # the members the rejection-log row has are the problem's too (SPEC 2 "where known")
    assert (doc["destination"], doc["job_id"], doc["generation"]) == ("secure", "job-1", 1)
    assert (logged[0].record.job_id, logged[0].record.generation) == ("job-1", 1)


async def test_a_refusal_of_the_headers_names_the_valid_ones(gw: Gateway) -> None:
    await gw.claim("job-1")
    doc = assert_rejected(
        await gw.write("/to/pay/x", headers={"Fencing-Owner": "a b"}), 400, "invalid_fencing_token"
    )
    assert (doc["job_id"], doc["generation"]) == ("job-1", 1)
    doc = assert_rejected(await gw.write("/to/pay/x", job="a b"), 400, "invalid_fencing_token")
    assert "job_id" not in doc and doc["generation"] == 1


async def test_right_worker_token_forwards_without_the_workers_authorization(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    status, _, _ = await gw.write(
        "/to/secure/x", headers={"Authorization": "Bearer s3cret-token", "X-Tenant": "evil"}
    )
    assert status == 201
    (seen,) = upstream.received
    assert seen.headers["Authorization"] == "Bearer upstream-secret"
    assert seen.headers["X-Tenant"] == "acme"


async def test_body_over_max_body_is_413_and_not_forwarded(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    assert_rejected(await gw.write("/to/small/x", body=b"x" * 17), 413, "body_too_large")
    assert upstream.received == []


async def test_body_limit_is_enforced_while_reading_a_chunked_body(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"x" * 8

    headers = {"Fencing-Job": "job-1", "Fencing-Token": "1", "Idempotency-Key": "k"}
    async with gw.session.post(f"{gw.url}/to/small/x", data=chunks(), headers=headers) as resp:
        assert resp.status == 413
        assert resp.headers["Sinkgate-Rejected"] == "body_too_large"
    assert upstream.received == []


@pytest.mark.parametrize(
    ("job", "token", "reason"),
    [
        (None, "1", "missing_fencing_token"),
        ("job-1", None, "missing_fencing_token"),
        ("", "1", "missing_fencing_token"),
        ("job-1", "", "missing_fencing_token"),
        ("job 1", "1", "invalid_fencing_token"),
        ("j" * 257, "1", "invalid_fencing_token"),
        ("job-1", "0", "invalid_fencing_token"),
        ("job-1", "01", "invalid_fencing_token"),
        ("job-1", "-1", "invalid_fencing_token"),
        ("job-1", "+1", "invalid_fencing_token"),
        ("job-1", "1.0", "invalid_fencing_token"),
        ("job-1", str(2**63), "invalid_fencing_token"),
    ],
)
async def test_fencing_headers_missing_or_malformed_are_400_and_recorded(
    gw: Gateway, upstream: RecordingUpstream, job: str | None, token: str | None, reason: str
) -> None:
    doc = assert_rejected(await gw.write("/to/pay/x", job=job, generation=token), 400, reason)
    assert upstream.received == []
    (logged,) = await gw.store.list_rejections(RejectionQuery())
    assert logged.id == doc["rejection_id"] and logged.record.reason == reason


@pytest.mark.parametrize(
    ("name", "second", "reason"),
    [
        ("Fencing-Token", "99", "invalid_fencing_token"),
        ("Fencing-Job", "job-2", "invalid_fencing_token"),
        ("Fencing-Owner", "worker-b", "invalid_fencing_token"),
        ("Idempotency-Key", "key-2", "invalid_idempotency_key"),
    ],
)
async def test_a_repeated_fencing_header_or_key_is_400_and_nothing_is_forwarded(
    gw: Gateway, upstream: RecordingUpstream, name: str, second: str, reason: str
) -> None:
    """Two lines of one header are one value joined by ", " (RFC 9110 5.3). Checking
    only the first line while the upstream received both would let the upstream
    fence or deduplicate on a value the gateway never checked."""
    await gw.claim("job-1")
    await gw.claim("job-2")
    headers = CIMultiDict(
        [
            ("Fencing-Job", "job-1"),
            ("Fencing-Token", "1"),
            ("Fencing-Owner", "worker-a"),
            ("Idempotency-Key", "key-1"),
            (name, second),
        ]
    )
    async with gw.session.post(f"{gw.url}/to/pay/x", data=b"{}", headers=headers) as resp:
        result = resp.status, dict(resp.headers), await resp.read()
    assert_rejected(result, 400, reason)
    assert upstream.received == []


@pytest.mark.parametrize(
    ("method", "path", "status", "reason", "allow"),
    [
        ("PUT", "/leases/job-1", 405, "method_not_allowed", "GET, HEAD"),
        ("GET", "/leases/job-1/", 404, "not_found", None),
        ("POST", "/leases/job-1/claim/", 404, "not_found", None),
        ("GET", "/leases", 404, "not_found", None),
        ("GET", "/nothing-here", 404, "not_found", None),
    ],
)
async def test_routes_the_main_listener_does_not_have_are_problems_too(
    gw: Gateway, method: str, path: str, status: int, reason: str, allow: str | None
) -> None:
    """SPEC 2: every error the gateway makes itself is problem+json, also the
    router's own 404 and 405 around the lease API."""
    async with gw.session.request(method, f"{gw.url}{path}", json={"owner": "w"}) as resp:
        result = resp.status, dict(resp.headers), await resp.read()
    assert_rejected(result, status, reason)
    assert result[1].get("Allow") == allow


async def test_largest_generation_is_a_valid_token(gw: Gateway) -> None:
    assert_rejected(await gw.write("/to/pay/x", generation=str(2**63 - 1)), 409, "lease_not_held")


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        (None, "missing_idempotency_key"),
        ("", "missing_idempotency_key"),
        ("k" * 256, "invalid_idempotency_key"),
        ("a b", "invalid_idempotency_key"),
        ('""', "invalid_idempotency_key"),
    ],
)
async def test_idempotency_key_missing_or_malformed_is_400(
    gw: Gateway, upstream: RecordingUpstream, key: str | None, reason: str
) -> None:
    await gw.claim("job-1")
    assert_rejected(await gw.write("/to/pay/x", key=key), 400, reason)
    assert upstream.received == []


async def test_a_write_refused_on_its_headers_keeps_what_of_them_was_valid(gw: Gateway) -> None:
    """SPEC 10 and 4: the decision's line carries job_id, generation and key (null
    where not known) and the record what of the fencing headers passed its check."""
    with structlog.testing.capture_logs() as logs:
        await gw.write("/to/pay/x", job="job-7", generation=3, owner="w-1", key=None)
        await gw.write("/to/pay/x", job="job-7", generation="03", key="k-1")
        await gw.write("/to/nowhere/x", job="job-8", generation=2, key="k-2")
    decisions = [e for e in logs if e["event"] == "write_decision"]  # not write_refused
    lines = [(e["job_id"], e["generation"], e["key"], e["reason"]) for e in decisions]
    assert lines == [
        ("job-7", 3, None, "missing_idempotency_key"),
        ("job-7", None, "k-1", "invalid_fencing_token"),
        ("job-8", 2, "k-2", "unknown_destination"),
    ]
    logged = await gw.store.list_rejections(RejectionQuery(destination="pay"))
    assert [
        (r.record.job_id, r.record.generation, r.record.owner, r.record.idempotency_key)
        for r in logged
    ] == [("job-7", None, None, "k-1"), ("job-7", 3, "w-1", None)]  # newest first
    status, _, body = await gw.write("/to/pay/x", job="job-7", generation=None)
    assert (status, json.loads(body)["job_id"]) == (400, "job-7")  # known, so in the answer


async def test_a_compressed_body_is_forwarded_as_sent(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    """SPEC 2: the body and its end-to-end headers go on as they came. The server
    used to inflate a gzip body and forward the inflated bytes still labelled
    gzip, and to answer 500 for a body that was not gzip at all."""
    await gw.claim("job-1")
    packed = gzip.compress(b'{"amount": 100}')
    for key, body in (("gz-1", packed), ("gz-2", b"not gzip")):
        status, _, _ = await gw.write(
            "/to/pay/x", key=key, body=body, headers={"Content-Encoding": "gzip"}
        )
        assert status == 201
        assert upstream.received[-1].body == body
        assert upstream.received[-1].headers["Content-Encoding"] == "gzip"
    # The fingerprint is the body as sent: the same JSON uncompressed is another body.
    status, _, _ = await gw.write("/to/pay/x", key="gz-1", body=b'{"amount": 100}')
    assert status == 422


@pytest.mark.parametrize(
    "header", [b"Content-Type: text/plain; charset=\xe9", b"X-Note: \xe9t\xe9"]
)
async def test_a_header_that_is_not_utf8_is_a_400_not_a_500(
    gw: Gateway, upstream: RecordingUpstream, header: bytes
) -> None:
    """Its value can be neither hashed nor sent on: the fingerprint raised on such
    a Content-Type (a 500), and forwarding any such header would have failed
    after the key was reserved."""
    await gw.claim("job-1")
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /to/pay/x HTTP/1.1\r\nHost: 127.0.0.1\r\nFencing-Job: job-1\r\nFencing-Token: 1\r\n"
        b"Idempotency-Key: k-8\r\nContent-Length: 2\r\n" + header + b"\r\n\r\n{}"
    )
    head, _, body = (await reader.read(65536)).partition(b"\r\n\r\n")
    writer.close()
    assert head.startswith(b"HTTP/1.1 400 ")
    assert b"Sinkgate-Rejected: invalid_request" in head
    assert json.loads(body)["detail"].endswith("is not UTF-8")
    assert upstream.received == []
    assert await gw.store.key_record("pay", "k-8") is None


@pytest.mark.parametrize(
    ("coding", "body"),
    [
        ("gzip", b"not gzip"),
        ("gzip", b'{"owner": "a", "ttl": 10}'),  # labelled gzip, sent plain: as sent
        ("br", b'{"owner": "a", "ttl": 10}'),
        ("gzip", gzip.compress(b'{"owner": "a", "ttl": 10}', mtime=0)),
    ],
)
async def test_a_lease_body_in_a_content_coding_is_a_400(
    gw: Gateway, coding: str, body: bytes
) -> None:
    """The lease API reads bodies as sent (the listener does not inflate them): a
    body said to be in a coding is refused whatever its bytes, not read as JSON."""
    async with gw.session.post(
        f"{gw.url}/leases/job-9/claim",
        data=body,
        headers={"Content-Type": "application/json", "Content-Encoding": coding},
    ) as resp:
        assert (resp.status, resp.headers["Sinkgate-Rejected"]) == (400, "invalid_request")
        assert "content coding" in (await resp.json(content_type=None))["detail"]
    assert (await gw.store.get("job-9")) is None


async def test_a_lease_body_said_to_be_identity_is_read(gw: Gateway) -> None:
    async with gw.session.post(
        f"{gw.url}/leases/job-9/claim",
        data=b'{"owner": "a", "ttl": 10}',
        headers={"Content-Type": "application/json", "Content-Encoding": "identity"},
    ) as resp:
        assert resp.status == 200


async def test_a_destination_without_required_keys_forwards_keyless_writes(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    assert (await gw.write("/to/open/x", key=None))[0] == 201
    assert (await gw.write("/to/open/x", key=None))[0] == 201
    assert len(upstream.received) == 2


async def test_quoted_key_is_the_same_key_unquoted(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    assert (await gw.write("/to/pay/x", key='"abc"'))[0] == 201
    status, headers, _ = await gw.write("/to/pay/x", key="abc")
    assert status == 201 and headers["Idempotent-Replayed"] == "true"
    assert len(upstream.received) == 1


async def test_a_write_sent_with_expect_100_continue_gets_its_continue_and_one_forward(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    """The write route answers `100 Continue`: the client sends its body only after it."""
    await gw.claim("job-1")
    expect = {"Expect": "100-continue"}
    first = await asyncio.wait_for(gw.write("/to/pay/x", headers=expect), 10)
    assert first[0] == 201, first
    again = await asyncio.wait_for(gw.write("/to/pay/x", headers=expect), 10)
    assert again[0] == 201 and again[1]["Idempotent-Replayed"] == "true"
    assert len(upstream.received) == 1
    assert upstream.received[0].body == b'{"amount": 100}'
    assert "Expect" not in upstream.received[0].headers


async def expect_continue(gw: Gateway, head: bytes) -> tuple[bytes, bytes]:
    """Send `head` (a request's head with `Expect: 100-continue`, no body) and read
    what comes back before the body is sent: (the first status line, the rest)."""
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + b"Expect: 100-continue\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()
    status, _, rest = answer.partition(b"\r\n")
    return status, rest


@pytest.mark.parametrize(
    ("path", "headers", "status", "reason"),
    [
        ("/to/small/x", b"Content-Length: 17\r\n", b"413", b"body_too_large"),
        ("/to/secure/x", b"Content-Length: 2\r\n", b"401", b"unauthorized"),
        ("/to/nope/x", b"Content-Length: 2\r\n", b"404", b"unknown_destination"),
    ],
)
async def test_a_write_refused_before_its_body_gets_no_100_continue(
    gw: Gateway,
    upstream: RecordingUpstream,
    path: str,
    headers: bytes,
    status: bytes,
    reason: bytes,
) -> None:
    """RFC 9110 10.1.1: a server that will refuse the request answers at once, so
    the client does not send a body only to have it refused (an oversized body
    was uploaded in full before its 413)."""
    await gw.claim("job-1")
    first, rest = await expect_continue(
        gw,
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
        + b"Fencing-Job: job-1\r\nFencing-Token: 1\r\nIdempotency-Key: k-e\r\n"
        + headers,
    )
    assert first.startswith(b"HTTP/1.1 " + status), (first, rest)
    assert b"Sinkgate-Rejected: " + reason in rest and b"100 Continue" not in rest
    assert upstream.received == []


async def test_an_unknown_expectation_is_a_417_problem(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /to/pay/x HTTP/1.1\r\nHost: 127.0.0.1\r\nFencing-Job: job-1\r\nFencing-Token: 1\r\n"
        b"Idempotency-Key: k-e\r\nExpect: 200-ok\r\nContent-Length: 2\r\n"
        b"Connection: close\r\n\r\n{}"
    )
    head, _, body = (await asyncio.wait_for(reader.read(65536), 10)).partition(b"\r\n\r\n")
    writer.close()
    assert head.startswith(b"HTTP/1.1 417 "), head
    assert b"Sinkgate-Rejected: invalid_request" in head
    assert problem(body)["status"] == 417
    assert upstream.received == []
    assert await gw.store.key_record("pay", "k-e") is None


# --- step 6: the fence --------------------------------------------------------------------


async def test_lease_fence_reasons_in_contract_order(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    assert_rejected(await gw.write("/to/pay/x", job="never"), 409, "lease_not_held")
    await gw.claim("job-1", owner="a", ttl=10)
    gw.clock.advance(11)
    assert await gw.claim("job-1", owner="b", ttl=10) == 2
    doc = assert_rejected(await gw.write("/to/pay/x", generation=1), 409, "stale_generation")
    assert doc["current_generation"] == 2 and doc["generation"] == 1 and doc["job_id"] == "job-1"
    assert_rejected(await gw.write("/to/pay/x", generation=3), 409, "unknown_generation")
    assert_rejected(await gw.write("/to/pay/x", generation=2, owner="a"), 409, "owner_mismatch")
    gw.clock.advance(11)
    assert_rejected(await gw.write("/to/pay/x", generation=2), 409, "lease_expired")
    assert upstream.received == []


async def test_completed_and_released_jobs_refuse_writes(gw: Gateway) -> None:
    await gw.claim("job-1", owner="a")
    async with gw.session.post(
        f"{gw.url}/leases/job-1/release", json={"owner": "a", "generation": 1}
    ) as r:
        assert r.status == 200
    assert_rejected(await gw.write("/to/pay/x"), 409, "lease_not_held")
    await gw.claim("job-1", owner="a")
    async with gw.session.post(
        f"{gw.url}/leases/job-1/complete", json={"owner": "a", "generation": 2}
    ) as r:
        assert r.status == 200
    assert_rejected(await gw.write("/to/pay/x", generation=2), 409, "job_completed")


async def test_monotonic_mode_raises_the_mark_only_on_forward(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    assert (await gw.write("/to/mono/x", generation=5, key="a"))[0] == 201
    doc = assert_rejected(
        await gw.write("/to/mono/x", generation=4, key="b"), 409, "stale_generation"
    )
    assert doc["highest_generation"] == 5
    assert (await gw.write("/to/mono/x", generation=5, key="c"))[0] == 201
    # a rejected write (bad key reuse) with a higher token does not raise the mark
    assert_rejected(
        await gw.write("/to/mono/x", generation=9, key="a", body=b"other"),
        422,
        "idempotency_key_reused",
    )
    assert (await gw.write("/to/mono/x", generation=6, key="d"))[0] == 201
    assert len(upstream.received) == 3


async def test_the_fence_is_per_job_across_destinations(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    assert (await gw.write("/to/mono/x", generation=5, key="a"))[0] == 201
    assert_rejected(await gw.write("/to/mono/y", generation=4, key="b"), 409, "stale_generation")
    assert (await gw.write("/to/mono/x", job="job-2", generation=1, key="c"))[0] == 201


async def test_generation_barrier_holds_newer_writes_until_the_older_answer(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1", owner="a", ttl=1)
    old = asyncio.create_task(gw.write("/to/pay/slow/1", key="old"))
    await asyncio.wait_for(upstream.arrived.wait(), 5)
    gw.clock.advance(2)  # A's lease is gone, its write (timeout 5 s) still on the wire
    assert await gw.claim("job-1", owner="b", ttl=10) == 2
    result = await gw.write("/to/pay/x", generation=2, key="new")
    assert_rejected(result, 409, "older_generation_in_flight")
    assert int(result[1]["Retry-After"]) >= 1
    assert upstream.paths() == ["/api/slow/1"]
    upstream.release.set()
    assert (await old)[0] == 201
    assert (await gw.write("/to/pay/x", generation=2, key="new"))[0] == 201
    assert upstream.paths() == ["/api/slow/1", "/api/x"]


# --- step 7: idempotency -------------------------------------------------------------------


async def test_duplicate_is_replayed_and_the_upstream_sees_it_once(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    first = await gw.write("/to/pay/charges?x=1")
    second = await gw.write("/to/pay/charges?x=1")
    assert first[0] == second[0] == 201
    assert first[2] == second[2]
    assert second[1]["Idempotent-Replayed"] == "true"
    assert "Sinkgate-Rejected" not in second[1]
    assert second[1]["Content-Type"] == first[1]["Content-Type"]
    assert second[1]["Location"] == "/things/1" and "X-Upstream" not in second[1]
    assert len(upstream.received) == 1
    (logged,) = await gw.store.list_rejections(RejectionQuery(reason="duplicate"))
    assert logged.record.idempotency_key == "key-1"


async def test_a_second_worker_redoing_the_job_gets_the_first_result(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1", owner="a", ttl=10)
    first = await gw.write("/to/pay/x", owner="a")
    gw.clock.advance(11)
    await gw.claim("job-1", owner="b", ttl=10)
    again = await gw.write("/to/pay/x", generation=2, owner="b")
    assert again[0] == 201 and again[2] == first[2] and again[1]["Idempotent-Replayed"] == "true"
    assert len(upstream.received) == 1


async def test_same_key_with_the_media_type_in_other_case_is_a_replay(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    first = await gw.write("/to/pay/x", headers={"Content-Type": "application/json"})
    again = await gw.write("/to/pay/x", headers={"Content-Type": "Application/JSON"})
    assert again[1]["Idempotent-Replayed"] == "true" and again[2] == first[2]
    assert len(upstream.received) == 1


async def test_same_key_other_payload_is_422(gw: Gateway, upstream: RecordingUpstream) -> None:
    await gw.claim("job-1")
    await gw.write("/to/pay/x")
    assert_rejected(await gw.write("/to/pay/x", body=b"{}"), 422, "idempotency_key_reused")
    assert_rejected(await gw.write("/to/pay/y"), 422, "idempotency_key_reused")
    assert len(upstream.received) == 1


async def test_concurrent_same_key_one_in_progress_upstream_sees_one(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    first = asyncio.create_task(gw.write("/to/pay/slow/x"))
    await asyncio.wait_for(upstream.arrived.wait(), 5)
    result = await gw.write("/to/pay/slow/x")
    assert_rejected(result, 409, "request_in_progress")
    assert int(result[1]["Retry-After"]) >= 1
    upstream.release.set()
    assert (await first)[0] == 201
    assert len(upstream.received) == 1


async def test_dropped_connection_leaves_the_outcome_unknown(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    assert_rejected(await gw.write("/to/pay/drop/1"), 502, "upstream_disconnected")
    assert_rejected(await gw.write("/to/pay/drop/1"), 409, "outcome_unknown")
    assert len(upstream.received) == 1
    record = await gw.store.key_record("pay", "key-1")
    assert record is not None and record.state == "unknown"


async def test_upstream_idempotent_destination_forwards_an_unknown_key_again(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    assert_rejected(await gw.write("/to/idem/drop/1"), 502, "upstream_disconnected")
    assert_rejected(await gw.write("/to/idem/drop/1"), 502, "upstream_disconnected")
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["key-1", "key-1"]
    record = await gw.store.key_record("idem", "key-1")
    assert record is not None and record.attempts == 2


async def test_read_timeout_is_504_and_unknown(gw: Gateway, upstream: RecordingUpstream) -> None:
    await gw.claim("job-1")
    doc = assert_rejected(await gw.write("/to/quick/slow/1"), 504, "upstream_timeout")
    assert doc["detail"].startswith("no answer within the timeout; ")
    assert "outcome is now unknown" in doc["detail"] and "admin resolve" in doc["detail"]
    assert_rejected(await gw.write("/to/quick/slow/1"), 409, "outcome_unknown")
    assert len(upstream.received) == 1


async def test_unreachable_upstream_releases_the_key(gw: Gateway) -> None:
    await gw.claim("job-1")
    assert_rejected(await gw.write("/to/down/x"), 502, "upstream_unreachable")
    assert await gw.store.key_record("down", "key-1") is None
    assert_rejected(await gw.write("/to/down/x"), 502, "upstream_unreachable")


async def test_a_connect_timeout_names_the_upstreams_host_not_its_url(
    tmp_path: Path, store_url: str
) -> None:
    """A listener whose accept queue is full never completes a handshake: the
    connect times out. aiohttp's message quotes the URL with the write's query;
    the worker's problem (and the log) get the host and port only."""
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        fillers = []
        try:
            for _ in range(8):  # past the queue's length, handshakes stall
                filler = socket.socket()
                filler.setblocking(False)
                filler.connect_ex(("127.0.0.1", port))
                fillers.append(filler)
            config = make_config(
                tmp_path,
                destination("hang", f"http://127.0.0.1:{port}/api", connect_timeout=0.2),
            )
            async with running_gateway(config, backend=store_url) as gw:
                await gw.claim("job-1")
                doc = assert_rejected(
                    await gw.write("/to/hang/x?card=4111"), 502, "upstream_unreachable"
                )
        finally:
            for filler in fillers:
                filler.close()
    assert doc["detail"] == f"connect timeout to 127.0.0.1:{port}"


async def test_retryable_status_is_relayed_and_not_stored(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    status, headers, body = await gw.write("/to/pay/status/503")
    assert status == 503 and body == b"status 503" and "Sinkgate-Rejected" not in headers
    assert (await gw.write("/to/pay/status/503"))[0] == 503
    assert len(upstream.received) == 2


async def test_non_retryable_error_status_is_stored_and_replayed(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    assert (await gw.write("/to/pay/status/400"))[0] == 400
    status, headers, body = await gw.write("/to/pay/status/400")
    assert status == 400 and body == b"status 400" and headers["Idempotent-Replayed"] == "true"
    assert len(upstream.received) == 1


async def test_body_over_max_replay_body_is_relayed_but_replayed_empty(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    status, _, body = await gw.write("/to/small/big/100", body=b"{}")
    assert status == 200 and body == b"x" * 100
    status, headers, body = await gw.write("/to/small/big/100", body=b"{}")
    assert status == 200 and body == b""
    assert headers["Sinkgate-Replay-Body"] == "omitted" and headers["Idempotent-Replayed"] == "true"


# --- forwarding hygiene ----------------------------------------------------------------------


async def test_path_and_query_are_mapped_under_the_base_path_raw(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    await gw.write("/to/pay/a%2Fb/c%20d?q=1&r=%41", key="k1")
    await gw.write("/to/pay", key="k2")
    await gw.write("/to/pay/", key="k3")
    await gw.write("/to/pay/a/../b", key="k4")
    assert upstream.paths() == ["/api/a%2Fb/c%20d?q=1&r=%41", "/api", "/api", "/api/a/../b"]


@pytest.mark.parametrize(
    "path",
    [
        "/to/pay/..",
        "/to/pay/../x",
        "/to/pay/a/../../x",
        "/to/pay/%2e%2e/x",
        "/to/pay/%2E%2E",
        "/to/pay/a/..%2f..%2fx",
        "//to/pay",
        "/to/pay//evil.example/x",
    ],
)
async def test_paths_escaping_the_base_are_refused(
    gw: Gateway, upstream: RecordingUpstream, path: str
) -> None:
    await gw.claim("job-1")
    status, headers, _ = await gw.write(path)
    if path.startswith("//"):
        assert status == 404  # not a write route at all
    else:
        assert_rejected((status, headers, _), 400, "invalid_path")
    assert upstream.received == []


async def test_hop_by_hop_headers_are_stripped_and_fencing_headers_passed_on(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1", owner="a")
    await gw.write(
        "/to/pay/x",
        owner="a",
        headers={
            "Connection": "X-Secret-Hop",
            "X-Secret-Hop": "1",
            "Keep-Alive": "timeout=5",
            "Proxy-Authorization": "Basic eA==",
            "X-End-To-End": "kept",
            "Authorization": "Bearer w",
        },
    )
    (seen,) = upstream.received
    lower = {k.lower() for k in seen.headers}
    assert {"x-secret-hop", "keep-alive", "proxy-authorization", "authorization"}.isdisjoint(lower)
    assert seen.headers["X-End-To-End"] == "kept"
    assert (
        seen.headers["Fencing-Job"],
        seen.headers["Fencing-Token"],
        seen.headers["Fencing-Owner"],
    ) == ("job-1", "1", "a")
    assert seen.headers["Idempotency-Key"] == "key-1"


async def test_connection_cannot_strip_the_headers_the_write_was_checked_on(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    """RFC 9110 makes a header named in `Connection` hop-by-hop; the fencing
    headers, the key and the content type are what the gateway checked and
    fingerprinted, and what a destination's own fence reads: passed on anyway."""
    await gw.claim("job-1", owner="a")
    listed = "Idempotency-Key, Fencing-Token, Fencing-Job, fencing-owner, Content-Type, X-Hop"
    await gw.write(
        "/to/pay/x",
        owner="a",
        headers={"Connection": listed, "X-Hop": "1", "Content-Type": "application/json"},
    )
    (seen,) = upstream.received
    assert "X-Hop" not in seen.headers and "Connection" not in seen.headers
    assert (
        seen.headers["Fencing-Job"],
        seen.headers["Fencing-Token"],
        seen.headers["Fencing-Owner"],
        seen.headers["Idempotency-Key"],
        seen.headers["Content-Type"],
    ) == ("job-1", "1", "a", "key-1", "application/json")


async def test_fencing_headers_not_passed_on_when_switched_off(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    await gw.claim("job-1")
    await gw.write("/to/quiet/x")
    (seen,) = upstream.received
    assert "Fencing-Token" not in seen.headers and seen.headers["Idempotency-Key"] == "key-1"


async def test_redirects_are_relayed_not_followed(gw: Gateway, upstream: RecordingUpstream) -> None:
    await gw.claim("job-1")
    status, headers, _ = await gw.write("/to/pay/redirect")
    assert status == 302 and headers["Location"] == "http://elsewhere.invalid/"
    assert len(upstream.received) == 1


async def test_store_unavailable_fails_closed(
    gw: Gateway, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    await gw.claim("job-1")
    driver = "PostgreSQL write decision failed: UndefinedColumnError: column l.job_id"

    async def failing(*args: object) -> None:
        raise StoreUnavailable(driver)

    monkeypatch.setattr(gw.store, "decide_write", failing)
    monkeypatch.setattr(gw.store, "start_decision", None, raising=False)
    with structlog.testing.capture_logs() as logs:
        result = await gw.write("/to/pay/x")
    doc = assert_rejected(result, 503, "store_unavailable")
    assert result[1]["Retry-After"] == "1"  # the same write may succeed later
    assert upstream.received == []
    # The driver's words (the database's names) are for the operator's log only.
    assert "UndefinedColumnError" not in doc["detail"] and "retry" in doc["detail"]
    [line] = [e for e in logs if e["event"] == "store_unavailable"]
    assert line["error"] == driver and line["op"] == "decide"


def store_errors(gw: Gateway, op: str) -> float:
    return gw.app[METRICS].store_errors.labels(op)._value.get()


async def test_an_outcome_the_store_cannot_take_says_so_on_the_decisions_line(
    gw: Gateway, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker still gets the upstream's answer (the effect happened) and the
    key stays in flight, to read `unknown` after its deadline; the line must not
    say the outcome was stored."""
    await gw.claim("job-1")
    with structlog.testing.capture_logs() as logs:
        assert (await gw.write("/to/pay/x", key="k-ok"))[0] == 201

        async def failing(*args: object) -> bool:
            raise StoreUnavailable("disk gone")

        monkeypatch.setattr(gw.app[WRITES].store, "record_outcome", failing)
        assert (await gw.write("/to/pay/x", key="k-lost"))[0] == 201
    lines = [e for e in logs if e["event"] == "write_decision"]
    assert [(e["key"], e["outcome"], e["outcome_recorded"]) for e in lines] == [
        ("k-ok", "completed", True),
        ("k-lost", "completed", False),
    ]
    assert store_errors(gw, "record") == 1
    # counted as the key ends: unknown, not the completed it could not store
    outcomes = gw.app[METRICS].upstream_outcomes
    assert outcomes.labels("pay", "completed")._value.get() == 1
    assert outcomes.labels("pay", "unknown")._value.get() == 1
    record = await gw.store.key_record("pay", "k-lost")
    assert record is not None and record.state.value == "in_flight"


async def test_a_rejection_the_store_cannot_log_is_a_503_and_counted(
    gw: Gateway, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def failing(*args: object) -> int:
        raise StoreUnavailable("disk gone")

    monkeypatch.setattr(gw.app[WRITES].store, "record_rejection", failing)
    with structlog.testing.capture_logs() as logs:
        assert_rejected(await gw.write("/to/pay/x", generation=None), 503, "store_unavailable")
    assert store_errors(gw, "record_rejection") == 1
    assert upstream.received == []
    # not a refusal before the fence (write_refused, the admin page's tile): the
    # store failed to log one that is
    assert not [e for e in logs if e["event"] == "write_refused"]
    assert gw.app[METRICS].refusals.top(3) == []


# --- the worked example, and the protection switched off ------------------------------------


async def worked_example(gw: Gateway, upstream: RecordingUpstream) -> dict[str, object]:
    """SPEC 1: A gen 7 pauses, B claims 8, A's late complete and write are refused,
    B's duplicate reaches the destination once."""
    for _ in range(6):
        await gw.claim("job-42", owner="a", ttl=5)
        gw.clock.advance(6)
    assert await gw.claim("job-42", owner="a", ttl=5) == 7
    gw.clock.advance(6)  # A pauses past its lease
    assert await gw.claim("job-42", owner="b", ttl=5) == 8
    async with gw.session.post(
        f"{gw.url}/leases/job-42/complete", json={"owner": "a", "generation": 7}
    ) as resp:
        complete_a = (resp.status, (await resp.json())["reason"])
    late_a = await gw.write("/to/pay/charge", job="job-42", generation=7, owner="a", key="a-charge")
    b_first = await gw.write(
        "/to/pay/charge", job="job-42", generation=8, owner="b", key="b-charge"
    )
    b_dup = await gw.write("/to/pay/charge", job="job-42", generation=8, owner="b", key="b-charge")
    return {"complete_a": complete_a, "late_a": late_a, "b_first": b_first, "b_dup": b_dup}


async def test_worked_example_over_http(gw: Gateway, upstream: RecordingUpstream) -> None:
    with structlog.testing.capture_logs() as logs:
        r = await worked_example(gw, upstream)
    assert r["complete_a"] == (409, "stale_generation")
    assert_rejected(r["late_a"], 409, "stale_generation")  # type: ignore[arg-type]
    assert r["b_first"][0] == 201 and r["b_dup"][1]["Idempotent-Replayed"] == "true"  # type: ignore[index]
    assert [
        (x.headers["Fencing-Token"], x.headers["Idempotency-Key"]) for x in upstream.received
    ] == [("8", "b-charge")]
    decisions = [e for e in logs if e["event"] == "write_decision"]
    assert [(e["generation"], e["decision"], e.get("reason")) for e in decisions] == [
        (7, "rejected", "stale_generation"),
        (8, "forwarded", None),
        (8, "replayed", "duplicate"),
    ]
    assert all(
        {"destination", "job_id", "key", "status", "total_ms"} <= e.keys() for e in decisions
    )


async def test_without_the_fence_the_stale_write_lands(
    gw: Gateway, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The protection switched off: the same run lets A's generation-7 write reach
    the destination. Shows the worked-example test can fail."""
    monkeypatch.setattr(decision_module, "check_fence", lambda facts, state, now: None)
    if isinstance(gw.store, PostgresStore):  # there the policy runs in the server
        barrier = "IF v_verdict IS NULL AND v_older IS NOT NULL"
        assert barrier in postgres_batch.DECIDE_FUNCTION_DDL
        no_fence = postgres_batch.DECIDE_FUNCTION_DDL.replace(
            barrier, f"v_verdict := NULL; {barrier}"
        )
        async with gw.store._pool.acquire() as conn:
            await conn.execute(no_fence)
    r = await worked_example(gw, upstream)
    assert r["late_a"][0] == 201  # type: ignore[index]
    assert [x.headers["Fencing-Token"] for x in upstream.received] == ["7", "8"]


async def test_unknown_destinations_share_one_metric_series(gw: Gateway) -> None:
    """`/to/<random>` must not create a metric series per name sent."""
    for name in ("a1", "b2", "c3"):
        assert_rejected(await gw.write(f"/to/{name}/x"), 404, "unknown_destination")
    from gateway.http.appkeys import METRICS

    text = gw.app[METRICS].render()[0].decode()
    assert 'sinkgate_writes_total{decision="rejected",destination="(unknown)"} 3.0' in text
    assert 'destination="a1"' not in text


async def test_the_in_flight_gauge_counts_a_forward_while_it_is_at_the_upstream(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    """Read when scraped: there at 0 for every destination, 1 while a write waits
    for its upstream, 0 again once it is answered."""
    from gateway.http.appkeys import METRICS

    def in_flight(destination: str) -> str:
        text = gw.app[METRICS].render()[0].decode()
        prefix = f'sinkgate_in_flight_writes{{destination="{destination}"}} '
        return next(line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix))

    assert in_flight("pay") == in_flight("mono") == "0.0"
    await gw.claim("job-1")
    write = asyncio.create_task(gw.write("/to/pay/slow/x"))
    await asyncio.wait_for(upstream.arrived.wait(), 5)
    assert in_flight("pay") == "1.0" and in_flight("mono") == "0.0"
    upstream.release.set()
    assert (await write)[0] == 201
    assert in_flight("pay") == "0.0"


async def test_main_listener_health_and_readiness_follow_the_store(gw: Gateway) -> None:
    async with gw.session.get(f"{gw.url}/healthz") as resp:
        assert resp.status == 200
    async with gw.session.get(f"{gw.url}/readyz") as resp:
        assert resp.status == 200
    await gw.store.close()
    async with gw.session.get(f"{gw.url}/readyz") as resp:
        assert resp.status == 503
        assert resp.headers["Sinkgate-Rejected"] == "store_unavailable"


@asynccontextmanager
async def canned_upstream(answer: bytes, *, hold: bool = False) -> AsyncIterator[str]:
    """An upstream that reads a request's head and writes `answer` as it is, then
    closes (or, with `hold`, keeps the connection until the gateway closes it);
    yields its base URL."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        if hold:
            await reader.read()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def test_an_answer_header_that_is_not_utf8_is_relayed_stored_and_replayed(
    tmp_path: Path,
) -> None:
    """Such bytes failed the outcome's record and the relay: the worker got a 500
    and the key stayed in flight, then unknown. They now go on read as ISO-8859-1."""
    answer = (
        b'HTTP/1.1 201 Created\r\nContent-Length: 2\r\nETag: "\xe9"\r\nX-Odd: \xe9t\xe9\r\n'
        b"Connection: close\r\n\r\n{}"
    )
    async with canned_upstream(answer) as url:
        config = make_config(tmp_path, destination("pay", f"{url}/api"))
        async with running_gateway(config) as gw:
            await gw.claim("job-1")
            status, headers, body = await gw.write("/to/pay/x", key="odd-1")
            assert (status, body) == (201, b"{}")
            lower = {name.lower(): value for name, value in headers.items()}
            assert (lower["etag"], lower["x-odd"]) == ('"é"', "été")
            record = await gw.store.key_record("pay", "odd-1")
            assert record is not None and record.state == "completed"
            status, headers, _ = await gw.write("/to/pay/x", key="odd-1")
            lower = {name.lower(): value for name, value in headers.items()}
            assert (status, lower["etag"], lower["idempotent-replayed"]) == (201, '"é"', "true")


async def test_a_replay_of_a_compressed_answer_keeps_its_content_encoding(
    tmp_path: Path,
) -> None:
    """The stored body is the answer's bytes as sent; replayed without their
    Content-Encoding (not among the default replay_headers) they were unreadable."""
    packed = gzip.compress(b'{"charged": 100}')
    answer = (
        b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
        b"Content-Encoding: gzip\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
        % len(packed)
        + packed
    )
    async with canned_upstream(answer) as url:
        upstream = f"{url}/api"
        config = make_config(
            tmp_path,
            destination("pay", upstream),
            destination("tiny", upstream, max_replay_body=8),
        )
        async with running_gateway(config) as gw:
            await gw.claim("job-1")
            for _ in range(2):  # the answer, then its replay: the client inflates both
                status, _, body = await gw.write("/to/pay/x", key="gz-a")
                assert (status, json.loads(body)) == (201, {"charged": 100})
            record = await gw.store.key_record("pay", "gz-a")
            assert record is not None and ("Content-Encoding", "gzip") in record.headers
            # A body too long to keep is replayed empty, without a coding for it.
            await gw.write("/to/tiny/x", key="gz-b")
            status, headers, body = await gw.write("/to/tiny/x", key="gz-b")
            assert (status, body, headers["Sinkgate-Replay-Body"]) == (201, b"", "omitted")
            assert "content-encoding" not in {name.lower() for name in headers}


async def test_an_upstream_switching_protocols_unasked_is_502_and_unknown(
    tmp_path: Path,
) -> None:
    """A 101 cannot be relayed as an answer (the worker's connection hung on it, and
    the key was stored as completed with status 101, replayed as such); the
    request was sent, so the outcome is unknown."""
    answer = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n"
    async with canned_upstream(answer, hold=True) as url:
        config = make_config(tmp_path, destination("pay", f"{url}/api"))
        async with running_gateway(config) as gw:
            await gw.claim("job-1")
            first = await asyncio.wait_for(gw.write("/to/pay/x", key="up-1"), 10)
            assert_rejected(first, 502, "upstream_disconnected")
            again = await asyncio.wait_for(gw.write("/to/pay/x", key="up-1"), 10)
            assert_rejected(again, 409, "outcome_unknown")


async def test_a_replay_keeps_the_content_type_whatever_replay_headers_lists(
    tmp_path: Path,
) -> None:
    """SPEC 2 step 7: a replay has the same status, body and content type. A
    destination listing other headers only was replayed as octet-stream."""
    answer = (
        b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nX-Up: 1\r\n"
        b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    async with canned_upstream(answer) as url:
        config = make_config(tmp_path, destination("pay", f"{url}/api", replay_headers=("X-Up",)))
        async with running_gateway(config) as gw:
            await gw.claim("job-1")
            first = await gw.write("/to/pay/x", key="ct-1")
            again = await gw.write("/to/pay/x", key="ct-1")
    assert first[1]["Content-Type"] == again[1]["Content-Type"] == "application/json"
    assert again[1]["Idempotent-Replayed"] == "true" and again[1]["X-Up"] == "1"


async def test_a_refusal_before_the_fence_is_one_log_line_with_the_workers_address(
    gw: Gateway,
) -> None:
    """A misspelt destination or a disallowed method reached no log but the
    write's own line: it is said with the reason and the worker's address. A
    refusal the rejection log keeps (a missing fencing header) is not said again."""
    with structlog.testing.capture_logs() as logs:
        assert_rejected(await gw.write("/to/exampel/x"), 404, "unknown_destination")
        assert_rejected(await gw.write("/to/pay/x", generation=None), 400, "missing_fencing_token")
    decisions = [entry["reason"] for entry in logs if entry["event"] == "write_decision"]
    assert decisions == ["unknown_destination", "missing_fencing_token"]
    (line,) = [entry for entry in logs if entry["event"] == "write_refused"]
    assert (line["reason"], line["destination"], line["method"]) == (
        "unknown_destination",
        "exampel",
        "POST",
    )
    assert line["remote"] == "127.0.0.1"


def late_verdicts(gw: Gateway, monkeypatch: pytest.MonkeyPatch, late_by: float) -> None:
    """The store's verdicts reach the gateway `late_by` seconds after they were
    made (a slow or lost answer from the database, a paused process)."""
    decide = gw.store.decide_write

    async def late(*args: object) -> object:
        verdict = await decide(*args)  # type: ignore[arg-type]
        await asyncio.sleep(late_by)
        return verdict

    monkeypatch.setattr(gw.store, "decide_write", late)
    monkeypatch.setattr(gw.store, "start_decision", None, raising=False)


async def test_a_verdict_arriving_after_the_timeout_is_not_forwarded_and_its_key_released(
    gw: Gateway, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write's barrier counts the destination's timeout from the store's clock
    when it decided: a forward begun after it could still be on the wire when a
    newer generation is let through (SPEC 2 step 6, SPEC 8). "quick": 0.3 s."""
    await gw.claim("job-1")
    late_verdicts(gw, monkeypatch, 0.4)
    with structlog.testing.capture_logs() as logs:
        result = await gw.write("/to/quick/x", key="late-1")
    doc = assert_rejected(result, 503, "store_unavailable")
    (line,) = [e for e in logs if e["event"] == "write_decision"]
    assert line["store_ms"] >= 400 and line["too_late"] is True  # the line says why
    (warning,) = [e for e in logs if e["event"] == "store_unavailable"]
    assert (warning["op"], warning["key"], warning["job_id"]) == ("decide", "late-1", "job-1")
    assert "too late" in doc["detail"] and "nothing was forwarded" in doc["detail"]
    assert upstream.received == []
    errors = gw.app[METRICS].registry.get_sample_value
    assert errors("sinkgate_store_errors_total", {"op": "decide_late"}) == 1
    assert errors("sinkgate_store_errors_total", {"op": "decide"}) == 0
    monkeypatch.undo()
    # released, not left in flight: the same key is forwarded at once
    assert (await gw.write("/to/quick/x", key="late-1"))[0] == 201
    assert len(upstream.received) == 1


async def _abandoned_at_shutdown(
    gw: Gateway, path: str, key: str, under_way: Callable[[], object] | None = None
) -> dict[str, object]:
    """Send a write to `path`, and once it is under way (`under_way`, else its
    forward begun) cut it as the end of `shutdown_grace` does: the
    `forwards_abandoned` line."""
    writes = gw.app[WRITES]
    sending = asyncio.create_task(gw.write(path, key=key))
    await eventually(under_way or (lambda: writes.forwards), what="the forward under way")
    with structlog.testing.capture_logs() as logs:
        app_module._abandon(writes)
    await asyncio.gather(sending, return_exceptions=True)
    (line,) = [e for e in logs if e["event"] == "forwards_abandoned"]
    return line


def _stuck_recording(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """The store never answers an outcome (until `monkeypatch.undo()`); the event
    is set once one is asked for."""
    asked = asyncio.Event()

    async def stuck(*args: object) -> bool:
        asked.set()
        await asyncio.Event().wait()
        raise AssertionError("never answered")

    monkeypatch.setattr(gw.store, "record_outcome", stuck)
    return asked


async def test_a_forward_cut_at_shutdown_says_whether_it_may_have_been_sent(
    gw: Gateway, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A late verdict's key being released when the grace ran out was named
    "may have reached its upstream", though nothing of it was sent: its key
    reads `unknown`, and the operator must not be told to go and check."""
    await gw.claim("job-1")
    arrived = upstream.arrived.is_set  # cut only once it is at the upstream
    line = await _abandoned_at_shutdown(gw, "/to/pay/slow/1", "held-at-upstream", arrived)
    assert upstream.received  # on the upstream's side when cut
    assert (line["count"], line["maybe_sent"]) == (1, 1)
    assert [w["maybe_sent"] for w in line["writes"]] == [True]  # type: ignore[attr-defined]

    late_verdicts(gw, monkeypatch, 0.4)  # "quick": 0.3 s, refused as too late
    releasing = _stuck_recording(gw, monkeypatch)  # until the grace ends
    line = await _abandoned_at_shutdown(gw, "/to/quick/x", "late-at-shutdown", releasing.is_set)
    assert releasing.is_set()
    assert (line["count"], line["maybe_sent"]) == (1, 0)
    assert [w["key"] for w in line["writes"]] == ["late-at-shutdown"]  # type: ignore[attr-defined]
    assert [w["maybe_sent"] for w in line["writes"]] == [False]  # type: ignore[attr-defined]
    assert len(upstream.received) == 1


@pytest.mark.parametrize("recorded", [False, True], ids=["as-built", "recorded-unknown"])
async def test_a_forward_cut_on_the_wire_at_shutdown_keeps_its_key_and_its_barrier(
    gw: Gateway, upstream: RecordingUpstream, recorded: bool
) -> None:
    """A forward cut at the end of `shutdown_grace` may still be under way at its
    upstream (the gateway only closed its connection): its key stays in flight,
    and its job's newer generations barred, until its deadlines, as for a gateway
    that died. Recorded `unknown` as the gateway stops (the first version of
    `record_cut` did so), the barrier was lifted: a newer generation's write was
    forwarded while the old one could still land after it."""
    await gw.claim("job-1", owner="a", ttl=1)
    writes = gw.app[WRITES]
    sending = asyncio.create_task(gw.write("/to/pay/slow/1", key="old"))
    await asyncio.wait_for(upstream.arrived.wait(), 5)
    (facts,) = writes.forwards.values()
    app_module._abandon(writes)
    await asyncio.gather(sending, return_exceptions=True)
    assert writes.cut == {}  # nothing to record for it
    # Counted as its key will end, once.
    assert gw.app[METRICS].upstream_outcomes.labels("pay", "unknown")._value.get() == 1
    if recorded:
        held = await gw.store.key_record("pay", "old")
        assert held is not None and held.attempt is not None
        writes.cut[held.attempt] = route_module._Cut(facts, UNKNOWN, False)
    await writes.record_cut(5.0)
    gw.clock.advance(2)  # A's lease is gone, its write (timeout 5 s) may be on the wire
    assert await gw.claim("job-1", owner="b", ttl=10) == 2
    newer = await gw.write("/to/pay/x", generation=2, key="new")
    if recorded:
        assert newer[0] == 201  # the protection switched off: forwarded past the old one
        assert upstream.paths() == ["/api/slow/1", "/api/x"]
        return
    assert_rejected(newer, 409, "older_generation_in_flight")
    held = await gw.store.key_record("pay", "old")
    assert held is not None and held.state == "in_flight"
    assert upstream.paths() == ["/api/slow/1"]


async def test_a_forward_cut_while_releasing_a_key_it_never_sent_is_released_as_it_stops(
    gw: Gateway, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verdict too late to be sent, cut at shutdown while its key was being
    released: nothing of it was sent, but its key sat in flight until its
    reservation's deadline, then read `unknown` for an operator to resolve. The
    release it was making is recorded as the gateway stops: its retry is
    forwarded."""
    await gw.claim("job-1")
    writes = gw.app[WRITES]
    late_verdicts(gw, monkeypatch, 0.4)  # "quick": 0.3 s, refused as too late
    releasing = _stuck_recording(gw, monkeypatch)
    await _abandoned_at_shutdown(gw, "/to/quick/x", "cut-releasing", releasing.is_set)
    assert releasing.is_set()
    monkeypatch.undo()
    assert [c.facts.key for c in writes.cut.values()] == ["cut-releasing"]
    retry = await gw.write("/to/quick/x", key="cut-releasing")
    assert_rejected(retry, 409, "request_in_progress")  # not yet recorded

    with structlog.testing.capture_logs() as logs:
        await writes.record_cut(5.0)
    assert writes.cut == {}
    (line,) = [e for e in logs if e["event"] == "abandoned_recorded"]
    assert (line["count"], line["recorded"], line["not_recorded"]) == (1, 1, 0)
    assert (await gw.write("/to/quick/x", key="cut-releasing"))[0] == 201
    assert upstream.paths() == ["/api/x"]


async def test_a_forward_cut_while_releasing_a_key_it_never_reached_is_counted_once(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection refused ("down"), its key was being released when the grace
    ran out: counted among the upstream outcomes once, as the release it ends
    with, when `record_cut` records it (not `unknown` as the cut, and again)."""
    await gw.claim("job-1")
    writes = gw.app[WRITES]
    outcomes = gw.app[METRICS].upstream_outcomes
    releasing = _stuck_recording(gw, monkeypatch)
    line = await _abandoned_at_shutdown(gw, "/to/down/x", "refused", releasing.is_set)
    monkeypatch.undo()
    assert [w["maybe_sent"] for w in line["writes"]] == [False]  # type: ignore[attr-defined]
    assert [(c.facts.key, c.counted) for c in writes.cut.values()] == [("refused", True)]
    counts = {kind: outcomes.labels("down", kind)._value.get() for kind in ("released", "unknown")}
    assert counts == {"released": 0, "unknown": 0}
    await writes.record_cut(5.0)
    counts = {kind: outcomes.labels("down", kind)._value.get() for kind in ("released", "unknown")}
    assert counts == {"released": 1, "unknown": 0}
    assert await gw.store.key_record("down", "refused") is None  # released


async def test_the_gateway_stopping_records_what_its_cut_forwards_were_releasing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`record_cut` runs as the gateway stops, before its store is closed."""
    config = make_config(tmp_path, destination("down", f"http://127.0.0.1:{free_port()}/api"))
    with structlog.testing.capture_logs() as logs:
        async with running_gateway(config) as gw:
            await gw.claim("job-1")
            releasing = _stuck_recording(gw, monkeypatch)
            await _abandoned_at_shutdown(gw, "/to/down/x", "refused", releasing.is_set)
            monkeypatch.undo()
            assert await gw.store.key_record("down", "refused") is not None  # in flight
        # stopped here, as by SIGTERM
    (line,) = [e for e in logs if e["event"] == "abandoned_recorded"]
    assert (line["count"], line["recorded"]) == (1, 1)
    async with running_gateway(config) as again:
        assert await again.store.key_record("down", "refused") is None  # released


@pytest.mark.parametrize("store_is", ["down", "silent"])
async def test_cut_forwards_a_store_does_not_take_are_said_so_within_the_bound(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch, store_is: str
) -> None:
    """The stop gives the store a bounded time for the cut forwards' releases; one
    it fails or does not answer in time is a warning with the store's words, and
    the stop goes on (the keys read `unknown` by their deadlines)."""
    writes = gw.app[WRITES]

    async def down(*args: object) -> bool:
        raise StoreUnavailable("the database went away")

    if store_is == "down":
        monkeypatch.setattr(gw.store, "record_outcome", down)
    else:
        _stuck_recording(gw, monkeypatch)
    facts: Any = SimpleNamespace(destination="pay", key="k", job_id="job-1", generation=1)
    writes.cut["attempt-1"] = route_module._Cut(facts, RELEASED, True)
    started = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        await asyncio.wait_for(writes.record_cut(0.2), 5)
    assert time.monotonic() - started < 2.0  # the bound, 0.2 s, and a loaded machine's margin
    (line,) = [e for e in logs if e["event"] == "abandoned_recorded"]
    assert line["log_level"] == "warning"
    assert (line["count"], line["recorded"], line["not_recorded"]) == (1, 0, 1)
    assert line["error"] == ("the database went away" if store_is == "down" else None)
    assert [w["key"] for w in line["writes"]] == ["k"]
    assert writes.cut == {}
    outcomes = gw.app[METRICS].upstream_outcomes
    assert outcomes.labels("pay", "unknown")._value.get() == 1  # as the key will end


async def test_a_pause_after_a_verdict_in_time_is_checked_just_before_the_send(
    gw: Gateway, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verdict in time, then the process stalls (a busy loop's turn, a pause)
    before the forward goes out: checked only as the verdict arrived, the write
    went out past its barrier (1.05 s into "mid"'s 1 s), where a newer
    generation could already be forwarded. Checked just before the send, it is
    refused as too late and its key released."""
    await gw.claim("job-1")
    headers_of = route_module.forward_headers

    def stalled(*args: object) -> object:
        time.sleep(1.05)  # the whole process stands still
        return headers_of(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(route_module, "forward_headers", stalled)
    doc = assert_rejected(await gw.write("/to/mid/x", key="paused-1"), 503, "store_unavailable")
    assert "too late" in doc["detail"]
    assert upstream.received == []
    monkeypatch.undo()
    assert (await gw.write("/to/mid/x", key="paused-1"))[0] == 201  # released


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
@pytest.mark.parametrize("client_retries", [False, True], ids=["as-built", "client-retry-on"])
async def test_a_put_or_delete_the_upstream_drops_is_sent_once(
    gw: Gateway, upstream: RecordingUpstream, method: str, client_retries: bool
) -> None:
    """aiohttp sends an idempotent method again by itself when the connection drops
    before the answer: the upstream got the write twice within one forward, and
    the worker a 201. One forward is one request: maybe applied, unknown. (With
    the client's retry switched back on, the body refuses to be written twice.)"""
    await gw.claim("job-1")
    if client_retries:
        writes = gw.app[WRITES]
        pool = writes.upstreams._pool(writes.config.destinations["pay"])
        pool.session._retry_connection = True
    upstream.next = ["drop"]
    result = await gw.write("/to/pay/x", method=method, key=f"dropped-{method}")
    assert_rejected(result, 502, "upstream_disconnected")
    assert len(upstream.received) == 1
    record = await gw.store.key_record("pay", f"dropped-{method}")
    assert record is not None and record.state == "unknown"


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "new-connection"])
async def test_a_pause_after_the_check_before_the_bytes_leave_sends_nothing(
    gw: Gateway, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch, pooled: bool
) -> None:
    """The check before `session.request` passes, then the process stalls on the
    loop's next turn: aiohttp writes the request from a task of its own (on Python
    3.11 a turn later, and only once a new connection is made), so it reached the
    upstream 1.05 s into "mid"'s 1 s, past its barrier. Checked again where the
    first byte reaches the socket, nothing is sent and the key is released."""
    await gw.claim("job-1")
    if pooled:
        assert (await gw.write("/to/mid/x", key="warm-1"))[0] == 201
    before = len(upstream.received)
    headers_of = route_module.forward_headers

    def stall_next_turn(*args: object) -> object:
        # the whole process stands still on the loop's next turn (GC, a busy turn)
        asyncio.get_running_loop().call_soon(time.sleep, 1.05)
        return headers_of(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(route_module, "forward_headers", stall_next_turn)
    result = await gw.write("/to/mid/x", key="stalled-1")
    await asyncio.sleep(0.2)  # what did leave has arrived
    assert len(upstream.received) == before, "the write reached the upstream past its barrier"
    if pooled or result[0] == 503:  # a new connection may also time out: 502, released
        assert "too late" in assert_rejected(result, 503, "store_unavailable")["detail"]
    monkeypatch.undo()
    assert (await gw.write("/to/mid/x", key="stalled-1"))[0] == 201  # released
    assert len(upstream.received) == before + 1


async def test_a_verdict_arriving_late_leaves_the_forward_only_the_rest_of_the_timeout(
    gw: Gateway, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    await gw.claim("job-1")
    writes = gw.app[WRITES]
    send = writes.upstreams.send
    left: list[float] = []

    async def spied(*args: object, until: float, **kwargs: object) -> object:
        left.append(until - time.perf_counter())
        return await send(*args, until=until, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(writes.upstreams, "send", spied)
    late_verdicts(gw, monkeypatch, 0.5)
    assert (await gw.write("/to/mid/x", key="late-2"))[0] == 201
    (seconds,) = left
    assert 0 < seconds <= 1.0 - 0.5


async def test_a_late_resend_of_an_unknown_key_leaves_it_unknown(
    gw: Gateway, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`upstream_idempotent`: the key's first attempt may have been applied; the
    re-send that came too late to go out settles nothing, so the key stays for an
    operator instead of being freed (and dropped from the unknown-keys queue)."""
    await gw.claim("job-1")
    assert_rejected(await gw.write("/to/idem-quick/drop/1"), 502, "upstream_disconnected")
    late_verdicts(gw, monkeypatch, 0.4)  # past "idem-quick"'s timeout (0.3 s)
    assert_rejected(await gw.write("/to/idem-quick/drop/1"), 503, "store_unavailable")
    assert len(upstream.received) == 1
    record = await gw.store.key_record("idem-quick", "key-1")
    assert record is not None and record.state == "unknown"


async def test_a_timeout_under_a_tenth_of_a_second_keeps_half_of_itself_to_send_in(
    gw: Gateway, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a verdict at once (the gateway's clock stands still), a 50 ms timeout is
    not all floor: the write goes out (whatever the upstream then makes of 50 ms)
    instead of every write being refused as too late."""
    frozen = time.perf_counter()
    clock = SimpleNamespace(perf_counter=lambda: frozen)
    monkeypatch.setattr(route_module, "time", clock)
    monkeypatch.setattr(upstream_module, "time", clock)  # where the bytes leave
    await gw.claim("job-1")
    status, headers, _ = await gw.write("/to/tiny/x", key="tiny-1")
    assert headers.get("Sinkgate-Rejected") != "store_unavailable", (status, headers)


async def test_a_resend_of_an_unknown_key_answered_retryably_leaves_it_unknown(
    gw: Gateway, upstream: RecordingUpstream
) -> None:
    """`upstream_idempotent`: a re-send answered with a retryable status says
    nothing of the first attempt's effect: the key stays `unknown` (in the
    operators' queue) instead of being freed."""
    await gw.claim("job-1")
    upstream.next = ["drop", "status/503"]
    assert_rejected(await gw.write("/to/idem/x"), 502, "upstream_disconnected")
    assert (await gw.write("/to/idem/x"))[0] == 503  # the upstream's own, relayed
    assert len(upstream.received) == 2
    record = await gw.store.key_record("idem", "key-1")
    assert record is not None and record.state == "unknown"
