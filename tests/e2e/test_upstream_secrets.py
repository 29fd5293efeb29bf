"""A malformed upstream answer tells the worker what failed, never what was sent.

aiohttp's client errors quote the request they were sending, headers included;
a 502 whose `detail` was built from one carried the destination's
`[upstream_headers]` Authorization secret to the worker. Each kind of malformed
answer is sent here by a canned upstream, and the secret, the worker's own
headers and the forwarded request's headers are looked for in the answer, every
log line and the store's file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.e2e.test_gateway_e2e import canned_upstream
from tests.harness import destination, make_config, running_gateway

SECRET = "sk_live_0123456789abcdefSECRET"
WORKER_HEADER = "worker-private-value-77"

_MALFORMED = {
    "header line over the parser's limit": (
        b"HTTP/1.1 201 Created\r\nLocation: /" + b"a" * 9000 + b"\r\nContent-Length: 0\r\n\r\n"
    ),
    "Content-Length with Transfer-Encoding": (
        b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n"
    ),
    "bad status line": b"HTTP/1.1 2O1 Created\r\nContent-Length: 0\r\n\r\n",
}


def _store_bytes(tmp_path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in tmp_path.glob("sinkgate.db*"))


@pytest.mark.parametrize("answer", list(_MALFORMED.values()), ids=list(_MALFORMED))
async def test_a_malformed_answer_leaks_no_header_to_the_worker_the_log_or_the_store(
    tmp_path: Path, answer: bytes
) -> None:
    async with canned_upstream(answer) as url:
        config = make_config(
            tmp_path,
            destination("pay", f"{url}/api", upstream_headers=(("Authorization", SECRET),)),
        )
        async with running_gateway(config) as gw:
            await gw.claim("job-1")
            with capture_logs() as logs:
                status, headers, body = await gw.write(
                    "/to/pay/x", key="k-1", headers={"X-Worker": WORKER_HEADER}
                )
            problem = json.loads(body)
            assert status == 502, body
            assert problem["reason"] == "upstream_disconnected"
            assert problem["detail"].startswith(f"127.0.0.1:{url.rsplit(':', 1)[1]}")
            record = await gw.store.key_record("pay", "k-1")
            assert record is not None and record.state == "unknown"
    seen = [body.decode(), json.dumps(headers), *(json.dumps(e, default=str) for e in logs)]
    for leaked in (SECRET, WORKER_HEADER, "Idempotency-Key", "k-1'", "RequestInfo"):
        assert not any(leaked in text for text in seen), (leaked, seen)
    stored = _store_bytes(tmp_path)
    assert SECRET.encode() not in stored and WORKER_HEADER.encode() not in stored


def test_the_description_of_a_lost_connection_is_made_of_fixed_words() -> None:
    """The repr of aiohttp's error holds the request's headers; the description
    names the failure's kind and where, and nothing the error carries."""
    from aiohttp import ClientResponseError, RequestInfo
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL

    from gateway.write.upstream import connection_lost

    url = URL("http://upstream.example:8443/api/x")
    info = RequestInfo(url, "POST", CIMultiDictProxy(CIMultiDict(Authorization=SECRET)), url)
    exc = ClientResponseError(info, (), status=400, message="Got more than 8190 bytes")
    assert SECRET in repr(exc)  # what the detail was built from before
    described = connection_lost(exc, url)
    assert SECRET not in described and "8190" in described
    assert described.startswith("upstream.example:8443: ")
    assert connection_lost(ConnectionResetError(104, "reset"), url) == (
        "connection to upstream.example:8443 lost: ECONNRESET"
    )
