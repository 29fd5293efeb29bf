"""`FencedWriter`: fenced writes through the gateway from a worker.

Most tests run against a small real aiohttp server on loopback that answers the
way the gateway does (problem+json with `Sinkgate-Rejected`, `Retry-After`,
`Idempotent-Replayed`) from a script. The last ones go through the real gateway
to a real recording upstream.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from leases import LeaseLost, hold
from leases.errors import StoreUnavailable
from leases.hold import Hold
from leases.http import HTTPLeaseStore
from leases.model import Lease
from leases.writer import (
    BadWrite,
    DuplicateWrite,
    FencedWriter,
    GatewayRejected,
    GatewayUnavailable,
    StaleWrite,
    WriteResult,
    derive_key,
)
from tests.harness import (
    RecordingUpstream,
    destination,
    free_port,
    make_config,
    recording_upstream,
    running_gateway,
)

LEASE = Lease("job-42", "worker-a", 7, "active", datetime(2026, 1, 1, tzinfo=UTC), 30.0)


@dataclass
class Seen:
    method: str
    raw_path: str
    query: str
    headers: dict[str, str]
    body: bytes
    target: str  # the path and query as sent


@dataclass
class FakeGateway:
    """Answers each request with the next scripted response (the last one repeats)."""

    url: str = ""
    script: list[web.Response] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(
            Seen(
                request.method,
                request.raw_path.split("?")[0],
                request.query_string,
                dict(request.headers),
                await request.read(),
                request.raw_path,
            )
        )
        if not self.script:
            return web.json_response({"ok": True}, status=201)
        return self.script.pop(0) if len(self.script) > 1 else _copy(self.script[0])


def _copy(resp: web.Response) -> web.Response:
    assert resp.body is None or isinstance(resp.body, bytes)
    return web.Response(status=resp.status, body=resp.body, headers=dict(resp.headers))


def rejected(
    reason: str, status: int, retry_after: int | None = None, **members: Any
) -> web.Response:
    headers = {"Sinkgate-Rejected": reason, "Content-Type": "application/problem+json"}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    problem = {
        "type": f"urn:sinkgate:problem:{reason}",
        "title": reason,
        "status": status,
        "detail": f"because {reason}",
        "reason": reason,
        **members,
    }
    return web.Response(status=status, body=json.dumps(problem).encode(), headers=headers)


@pytest.fixture
async def fake() -> AsyncIterator[FakeGateway]:
    gateway = FakeGateway()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", gateway.handle)
    async with TestServer(app) as srv:
        gateway.url = str(srv.make_url("/")).rstrip("/")
        yield gateway


class Sleeps:
    """An injected sleep that records the waits instead of waiting."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


@pytest.fixture
async def writer(fake: FakeGateway) -> AsyncIterator[FencedWriter]:
    async with FencedWriter(fake.url, LEASE, token="tok-1", sleep=Sleeps()) as w:
        yield w


# --- what is sent ----------------------------------------------------------------------


async def test_write_goes_to_the_to_route_with_fencing_headers_key_and_token(
    fake: FakeGateway, writer: FencedWriter
) -> None:
    await writer.post(
        "payments",
        "/charges",
        json={"b": 2, "a": 1},
        params={"dry": "no"},
        headers={"X-Trace": "t1"},
        idempotency_key="charge-1",
    )
    [seen] = fake.seen
    assert (seen.method, seen.raw_path, seen.query) == ("POST", "/to/payments/charges", "dry=no")
    assert seen.headers["Fencing-Job"] == "job-42"
    assert seen.headers["Fencing-Token"] == "7"
    assert seen.headers["Fencing-Owner"] == "worker-a"
    assert seen.headers["Idempotency-Key"] == "charge-1"
    assert seen.headers["Authorization"] == "Bearer tok-1"
    assert seen.headers["X-Trace"] == "t1"
    assert seen.headers["Content-Type"] == "application/json"
    assert seen.body == b'{"a":1,"b":2}'  # sorted and compact: the same bytes every time


@pytest.mark.parametrize("verb", ["put", "patch", "delete"])
async def test_shortcuts_send_their_method(
    fake: FakeGateway, writer: FencedWriter, verb: str
) -> None:
    await getattr(writer, verb)("inventory", "/items/9", data=b"x", step="s")
    assert fake.seen[0].method == verb.upper()
    assert fake.seen[0].raw_path == "/to/inventory/items/9"


async def test_a_backslash_is_sent_escaped_never_read_as_a_slash(
    fake: FakeGateway, writer: FencedWriter
) -> None:
    """As the TypeScript writer sends it: read as '/', '..\\' would climb out of the route."""
    await writer.post("payments", "/orders/..\\..\\refunds\\r1", step="s")
    assert [s.raw_path for s in fake.seen] == ["/to/payments/orders/..%5C..%5Crefunds%5Cr1"]


async def test_empty_path_and_percent_escapes_in_the_path_are_kept(
    fake: FakeGateway, writer: FencedWriter
) -> None:
    await writer.post("d", step="a")
    await writer.post("d", "/files/a%2Fb/c d", step="b")
    assert [s.raw_path for s in fake.seen] == ["/to/d", "/to/d/files/a%2Fb/c%20d"]


# {path, params, sent}: what follows /to/{destination}, as both writers spell it
# (the TypeScript client's cross-language test sends the same table through both).
SPELLINGS = json.loads((Path(__file__).parents[1] / "vectors" / "write_spellings.json").read_text())


async def test_paths_and_params_are_spelled_as_the_typescript_writer_spells_them(
    fake: FakeGateway, writer: FencedWriter
) -> None:
    """The gateway fingerprints the path and query as sent: a job redone by a
    Node worker after a Python one (or the other way) must send the same bytes.
    yarl spelled `|`, `%41` or a space in the query otherwise than Node's URL."""
    for n, case in enumerate(SPELLINGS):
        await writer.post("d", case["path"], params=case["params"], step=str(n))
    assert [s.target for s in fake.seen] == ["/to/d" + case["sent"] for case in SPELLINGS]


@pytest.mark.parametrize(
    "params",
    [
        {"a": 1.5},
        {"a": None},
        {"a": True},
        {"\ud800": "x"},
        {"a": "b\udfff"},
        "a=1",
        [("a",)],
        ["ab", "cd"],  # two strings of two characters are not two pairs
        5,
    ],
)
async def test_params_that_cannot_be_spelled_raise_before_sending(
    fake: FakeGateway, writer: FencedWriter, params: Any
) -> None:
    with pytest.raises(ValueError):
        await writer.post("d", "/x", params=params, step="s")
    assert fake.seen == []


async def test_a_tab_in_a_header_value_is_sent(fake: FakeGateway, writer: FencedWriter) -> None:
    await writer.post("d", "/x", step="s", headers={"X-A": "a\tb"})
    assert [s.headers.get("X-A") for s in fake.seen] == ["a\tb"]


@pytest.mark.parametrize(
    "headers",
    [
        {"X-A": "a\nb"},
        {"X-A": "a\rb"},
        {"X-A": "a\x00"},
        {"X-A": "\x1fa"},  # any control character but HTAB: the gateway refuses it (400)
        {"X-A": "a\x7f"},
        {"X A": "1"},
        {"X-A": 1},
        {"Content-Length": "3"},
        {"transfer-encoding": "chunked"},
        {"Expect": "100-continue"},
        {"Connection": "close"},
    ],
)
async def test_headers_that_cannot_be_sent_raise_before_sending(
    fake: FakeGateway, writer: FencedWriter, headers: dict[str, Any]
) -> None:
    """As the TypeScript writer refuses them (aiohttp sent a name with a space)."""
    with pytest.raises(ValueError):
        await writer.post("d", "/x", headers=headers, step="s")
    assert fake.seen == []


async def test_no_authorization_without_a_token(fake: FakeGateway) -> None:
    async with FencedWriter(fake.url, LEASE) as w:
        await w.post("d", "/x", step="s")
    assert "Authorization" not in fake.seen[0].headers


# --- what comes back ---------------------------------------------------------------------


async def test_upstream_answer_comes_back_untouched(
    fake: FakeGateway, writer: FencedWriter
) -> None:
    fake.script = [
        web.Response(
            status=201,
            body=b'{"id": "ch_1"}',
            headers={"Content-Type": "application/json", "Location": "/charges/ch_1"},
        )
    ]
    result = await writer.post("payments", "/charges", json={}, step="charge")
    assert isinstance(result, WriteResult)
    assert (result.status, result.body, result.replayed) == (201, b'{"id": "ch_1"}', False)
    assert result.headers["Location"] == "/charges/ch_1"
    assert result.json() == {"id": "ch_1"}


async def test_an_upstreams_own_409_is_a_result_not_a_rejection(
    fake: FakeGateway, writer: FencedWriter
) -> None:
    fake.script = [web.Response(status=409, text="conflict upstream")]
    result = await writer.post("d", "/x", step="s")
    assert (result.status, result.text()) == (409, "conflict upstream")


async def test_a_redirect_is_returned_not_followed(fake: FakeGateway, writer: FencedWriter) -> None:
    fake.script = [web.Response(status=302, headers={"Location": "http://elsewhere.invalid/"})]
    result = await writer.post("d", "/x", step="s")
    assert result.status == 302 and len(fake.seen) == 1


async def test_a_replay_is_visible_on_the_result(fake: FakeGateway, writer: FencedWriter) -> None:
    fake.script = [web.Response(status=201, body=b"{}", headers={"Idempotent-Replayed": "true"})]
    result = await writer.post("d", "/x", step="s")
    assert result.replayed and result.status == 201


FAMILIES = [
    ("stale_generation", 409, StaleWrite),
    ("unknown_generation", 409, StaleWrite),
    ("lease_not_held", 409, StaleWrite),
    ("lease_expired", 409, StaleWrite),
    ("job_completed", 409, StaleWrite),
    ("owner_mismatch", 409, StaleWrite),
    ("idempotency_key_reused", 422, DuplicateWrite),
    ("outcome_unknown", 409, DuplicateWrite),
    ("unknown_destination", 404, BadWrite),
    ("method_not_allowed", 405, BadWrite),
    ("unauthorized", 401, BadWrite),
    ("body_too_large", 413, BadWrite),
    ("missing_fencing_token", 400, BadWrite),
    ("invalid_fencing_token", 400, BadWrite),
    ("missing_idempotency_key", 400, BadWrite),
    ("invalid_idempotency_key", 400, BadWrite),
    ("invalid_path", 400, BadWrite),
    ("store_unavailable", 503, GatewayUnavailable),
    ("overloaded", 503, GatewayUnavailable),
    ("upstream_unreachable", 502, GatewayUnavailable),
    ("upstream_timeout", 504, GatewayUnavailable),
    ("upstream_disconnected", 502, GatewayUnavailable),
    ("a_reason_from_the_future", 409, BadWrite),
    ("another_future_reason", 503, GatewayUnavailable),
]


@pytest.mark.parametrize(("reason", "status", "family"), FAMILIES)
async def test_gateway_rejections_raise_one_class_per_family_with_their_fields(
    fake: FakeGateway,
    writer: FencedWriter,
    reason: str,
    status: int,
    family: type[GatewayRejected],
) -> None:
    fake.script = [
        rejected(
            reason,
            status,
            retry_after=3,
            job_id="job-42",
            generation=7,
            current_generation=8,
            highest_generation=8,
            rejection_id=1234,
        )
    ]
    with pytest.raises(GatewayRejected) as info:
        await writer.post("d", "/x", step="s")
    exc = info.value
    assert type(exc) is family
    assert (exc.reason, exc.status, exc.detail) == (reason, status, f"because {reason}")
    assert (exc.job_id, exc.generation, exc.current_generation) == ("job-42", 7, 8)
    assert (exc.highest_generation, exc.rejection_id, exc.retry_after) == (8, 1234, 3.0)
    assert exc.problem["reason"] == reason
    assert len(fake.seen) == 1  # none of these is retried


async def test_a_rejection_without_a_json_body_still_raises_by_header(
    fake: FakeGateway, writer: FencedWriter
) -> None:
    fake.script = [
        web.Response(status=409, text="nope", headers={"Sinkgate-Rejected": "lease_expired"})
    ]
    with pytest.raises(StaleWrite) as info:
        await writer.post("d", "/x", step="s")
    assert info.value.reason == "lease_expired" and info.value.current_generation is None


# --- retries -----------------------------------------------------------------------------


@pytest.mark.parametrize("reason", ["older_generation_in_flight", "request_in_progress"])
async def test_in_flight_rejections_are_retried_honouring_retry_after(
    fake: FakeGateway, reason: str
) -> None:
    sleeps = Sleeps()
    fake.script = [
        rejected(reason, 409, retry_after=1),
        rejected(reason, 409, retry_after=2),
        web.Response(status=201, text="done"),
    ]
    async with FencedWriter(fake.url, LEASE, sleep=sleeps) as w:
        result = await w.post("d", "/x", json={"n": 1}, step="s")
    assert result.status == 201
    assert sleeps.waits == [1.0, 2.0]
    assert len(fake.seen) == 3
    assert len({(s.headers["Idempotency-Key"], s.body) for s in fake.seen}) == 1


def test_a_max_retry_wait_past_the_floats_range_is_no_cap() -> None:
    assert FencedWriter("http://gw", LEASE, max_retry_wait=10**400).max_retry_wait == math.inf


async def test_retry_wait_is_capped_by_max_retry_wait(fake: FakeGateway) -> None:
    sleeps = Sleeps()
    fake.script = [
        rejected("older_generation_in_flight", 409, retry_after=60),
        web.Response(status=200),
    ]
    async with FencedWriter(fake.url, LEASE, sleep=sleeps, max_retry_wait=0.5) as w:
        assert (await w.post("d", "/x", step="s")).status == 200
    assert sleeps.waits == [0.5]


async def test_without_retry_after_the_writer_backs_off_exponentially(fake: FakeGateway) -> None:
    sleeps = Sleeps()
    fake.script = [rejected("request_in_progress", 409) for _ in range(3)]
    fake.script.append(web.Response(status=200))
    async with FencedWriter(fake.url, LEASE, sleep=sleeps) as w:
        await w.post("d", "/x", step="s")
    assert sleeps.waits == [0.05, 0.1, 0.2]


async def test_retries_stop_after_max_retries_and_raise(fake: FakeGateway) -> None:
    sleeps = Sleeps()
    fake.script = [rejected("older_generation_in_flight", 409, retry_after=1, current_generation=8)]
    async with FencedWriter(fake.url, LEASE, sleep=sleeps, max_retries=3) as w:
        with pytest.raises(DuplicateWrite) as info:
            await w.post("d", "/x", step="s")
    assert info.value.reason == "older_generation_in_flight"
    assert len(fake.seen) == 4 and sleeps.waits == [1.0, 1.0, 1.0]


async def test_each_write_asks_the_gateway_to_wait(fake: FakeGateway) -> None:
    async with FencedWriter(fake.url, LEASE) as w:
        await w.post("d", "/x", step="s")
    async with FencedWriter(fake.url, LEASE, wait=20) as w:
        await w.post("d", "/x", step="s")
    async with FencedWriter(fake.url, LEASE, wait=0) as w:
        await w.post("d", "/x", step="s")
    assert [s.headers.get("Prefer") for s in fake.seen] == ["wait=5", "wait=20", None]


async def test_a_callers_prefer_is_sent_before_the_writers_wait(fake: FakeGateway) -> None:
    """A PostgREST-style upstream needs `Prefer: return=representation`."""
    async with FencedWriter(fake.url, LEASE) as w:
        await w.post("d", "/x", step="s", headers={"Prefer": "return=representation"})
        await w.post(
            "d", "/x", step="s", headers={"prefer": "return=minimal; a=1, handling=lenient"}
        )
    async with FencedWriter(fake.url, LEASE, wait=0) as w:
        await w.post("d", "/x", step="s", headers={"Prefer": "return=representation"})
    assert [s.headers.get("Prefer") for s in fake.seen] == [
        "return=representation, wait=5",
        "return=minimal; a=1, handling=lenient, wait=5",
        "return=representation",
    ]


async def test_a_wait_inside_a_callers_quoted_value_is_no_wait_preference(
    fake: FakeGateway,
) -> None:
    """Read as the gateway reads it (RFC 7240): a comma inside quotes separates nothing."""
    async with FencedWriter(fake.url, LEASE) as w:
        await w.post("d", "/x", step="s", headers={"Prefer": 'note="a, wait=3"'})
    assert [s.headers.get("Prefer") for s in fake.seen] == ['note="a, wait=3", wait=5']


@pytest.mark.parametrize(
    "prefer",
    [
        [("Prefer", "wait=600")],
        [("Prefer", "return=minimal, WAIT = 3")],
        [("Prefer", "wait;x=1")],
        # read as sent, stripped and joined: padding past 1,024 characters, a space
        # Python strips, or two values that read as one hid the caller's wait
        [("Prefer", " " * 1100 + "wait=1")],
        [("Prefer", "\xa0,wait=1")],
        [("Prefer", 'a="x'), ("Prefer", '", wait=3')],
        # joined past 1,024 characters, which the gateway does not read: refused all the same
        [("Prefer", "wait=1"), ("Prefer", "x=" + "y" * 1100)],
    ],
)
async def test_a_callers_wait_preference_is_a_bad_argument(
    fake: FakeGateway, prefer: list[tuple[str, str]]
) -> None:
    """The gateway reads only the first `wait`: the caller's would silently win."""
    for wait in (5, 0):
        async with FencedWriter(fake.url, LEASE, wait=wait) as w:
            with pytest.raises(ValueError, match="the writer sets the wait preference"):
                await w.post("d", "/x", step="s", headers=prefer)  # type: ignore[arg-type]
    assert fake.seen == []


@pytest.mark.parametrize("prefer", ["a, =b", 'note="unterminated', "(x)", "r=" + "x" * 1020])
async def test_a_prefer_the_gateway_would_not_read_to_its_end_is_refused_under_a_wait(
    fake: FakeGateway, prefer: str
) -> None:
    """The gateway stops reading a value where it stops being a preference list
    (or does not read one over 1,024 characters): the writer's wait after it was
    sent and never seen. Without a wait of the writer's, nothing is lost."""
    async with FencedWriter(fake.url, LEASE, wait=5) as w:
        with pytest.raises(ValueError, match="Prefer"):
            await w.post("d", "/x", step="s", headers={"Prefer": prefer})
    assert fake.seen == []
    async with FencedWriter(fake.url, LEASE, wait=0) as w:
        await w.post("d", "/x", step="s", headers={"Prefer": prefer})
    assert [s.headers.get("Prefer") for s in fake.seen] == [prefer]


async def test_a_prefer_too_long_with_the_writers_wait_says_its_length(
    fake: FakeGateway,
) -> None:
    """Two readable preferences of 600 characters: the length is the trouble."""
    prefer = [("Prefer", "a=" + "x" * 600), ("Prefer", "b=" + "y" * 600)]
    async with FencedWriter(fake.url, LEASE, wait=5) as w:
        with pytest.raises(ValueError, match="the gateway reads at most 1024"):
            await w.post("d", "/x", step="s", headers=prefer)  # type: ignore[arg-type]
    assert fake.seen == []


async def test_a_refusal_after_the_gateways_own_wait_is_retried_at_once(
    fake: FakeGateway,
) -> None:
    """The gateway held the write already: no second wait on top of its own."""
    sleeps = Sleeps()
    held = rejected("request_in_progress", 409, retry_after=3)
    held.headers["Preference-Applied"] = "wait=5"
    fake.script = [held, rejected("request_in_progress", 409, retry_after=2)]
    fake.script.append(web.Response(status=201))
    async with FencedWriter(fake.url, LEASE, sleep=sleeps) as w:
        assert (await w.post("d", "/x", step="s")).status == 201
    assert sleeps.waits == [2.0]  # only the answer without Preference-Applied waits
    assert len(fake.seen) == 3


def _held(seconds: int, retry_after: int) -> web.Response:
    answer = rejected("request_in_progress", 409, retry_after=retry_after)
    answer.headers["Preference-Applied"] = f"wait={seconds}"
    return answer


async def test_a_short_max_wait_leaves_the_writer_as_patient_as_polling(
    fake: FakeGateway,
) -> None:
    """A destination's `max_wait = "1s"` under a writer's wait=5: each hold is 1 s,
    and a retry is counted when the holds add up to the 5 s (`max_retry_wait`)
    the writer would have slept on `Retry-After: 10`, not at every hold."""
    sleeps = Sleeps()
    fake.script = [_held(1, 10) for _ in range(7)]
    fake.script.append(web.Response(status=201))
    async with FencedWriter(fake.url, LEASE, max_retries=1, sleep=sleeps) as w:
        assert (await w.post("d", "/x", step="s")).status == 201
    assert len(fake.seen) == 8
    assert sleeps.waits == []  # held each time, never slept on top


async def test_holds_that_never_end_still_run_out_of_retries(fake: FakeGateway) -> None:
    """Holds of 1 s count a retry per 5 s held: max_retries=1 gives up after 10.
    A `wait=0` (from no gateway of ours) held nothing: a whole retry each."""
    fake.script = [*(_held(1, 10) for _ in range(20)), web.Response(status=201)]
    async with FencedWriter(fake.url, LEASE, max_retries=1) as w:
        with pytest.raises(DuplicateWrite):
            await w.post("d", "/x", step="s")
    assert len(fake.seen) == 10
    fake.seen.clear()
    fake.script = [*(_held(0, 10) for _ in range(20)), web.Response(status=201)]
    async with FencedWriter(fake.url, LEASE, max_retries=1) as w:
        with pytest.raises(DuplicateWrite):
            await w.post("d", "/x", step="s")
    assert len(fake.seen) == 2


async def test_max_retries_zero_raises_at_once(fake: FakeGateway) -> None:
    fake.script = [rejected("request_in_progress", 409, retry_after=1)]
    async with FencedWriter(fake.url, LEASE, max_retries=0) as w:
        with pytest.raises(DuplicateWrite):
            await w.post("d", "/x", step="s")
    assert len(fake.seen) == 1


async def test_retry_after_zero_retries_with_the_real_sleep(fake: FakeGateway) -> None:
    fake.script = [rejected("request_in_progress", 409, retry_after=0), web.Response(status=204)]
    async with FencedWriter(fake.url, LEASE) as w:
        assert (await w.post("d", "/x", step="s")).status == 204
    assert len(fake.seen) == 2


# --- keys ----------------------------------------------------------------------------------


def test_derived_keys_are_deterministic_and_free_of_the_generation() -> None:
    assert derive_key("job-42", "charge") == derive_key("job-42", "charge")
    assert derive_key("job-42", "charge") != derive_key("job-42", "refund")
    assert derive_key("job-42", "charge") != derive_key("job-43", "charge")
    assert derive_key("a:b", "c") != derive_key("a", "b:c")
    assert derive_key("job-42", "charge").startswith("job-42:charge:")


@pytest.mark.parametrize(
    ("job_id", "step"),
    [("j" * 256, "s" * 1000), ("job", "stép 1\n\t"), ("job", " "), ("~!*", "%%")],
)
def test_derived_keys_are_valid_idempotency_keys(job_id: str, step: str) -> None:
    key = derive_key(job_id, step)
    assert 1 <= len(key) <= 255
    assert re.fullmatch(r"[\x21-\x7e]+", key)


async def test_two_workers_on_different_generations_send_the_same_derived_key(
    fake: FakeGateway,
) -> None:
    lease_b = Lease("job-42", "worker-b", 8, "active", LEASE.lease_until, 30.0)
    for lease in (LEASE, lease_b):
        async with FencedWriter(fake.url, lease) as w:
            await w.post("d", "/x", json={"amount": 1}, step="charge")
    a, b = fake.seen
    assert a.headers["Idempotency-Key"] == b.headers["Idempotency-Key"]
    assert a.headers["Idempotency-Key"] == derive_key("job-42", "charge")
    assert (a.headers["Fencing-Token"], b.headers["Fencing-Token"]) == ("7", "8")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"idempotency_key": "k", "step": "s"},
        {"idempotency_key": ""},
        {"idempotency_key": "with space"},
        {"idempotency_key": "k" * 256},
        {"step": ""},
        {"step": "s", "json": {}, "data": b""},
        {"step": "s", "json": {"x": float("nan")}},
        {"step": "s", "headers": {"fencing-token": "9"}},
        {"step": "s", "headers": {"Idempotency-Key": "other"}},
        {"step": "s", "headers": {"prefer": "wait=600"}},
    ],
)
async def test_bad_arguments_raise_value_error_and_send_nothing(
    fake: FakeGateway, writer: FencedWriter, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ValueError):
        await writer.post("d", "/x", **kwargs)
    assert fake.seen == []


@pytest.mark.parametrize(
    ("destination", "path"),
    [
        ("", "/x"),
        ("a/b", "/x"),
        ("d", "/../admin"),
        ("d", "/a/%2E%2E/b"),
        ("d", "/./x"),
        # the URL parser drops tabs and newlines: these would be "..", out of /to/d/
        ("d", "/a/.\t./b"),
        ("d", ".\t."),
        ("d", "/a/.\n./..\r/b"),
        ("d", "\t/x"),
        ("d", "/a\x00"),
        ("d", "/a\x7f"),
        # as a destination, "/to/.." + "/leases/j/release" would be POST /leases/j/release
        ("..", "/leases/j/release"),
        (".", "/x"),
    ],
)
async def test_bad_destinations_and_dot_segments_are_refused_before_sending(
    fake: FakeGateway, writer: FencedWriter, destination: str, path: str
) -> None:
    with pytest.raises(ValueError):
        await writer.post(destination, path, step="s")
    assert fake.seen == []


# --- the lease: a Hold is checked before every send -----------------------------------------


async def test_a_lost_hold_refuses_to_send(fake: FakeGateway) -> None:
    state = Hold(LEASE, time.monotonic() + 60)
    state.lost = LeaseLost("job-42", 7, "stale_generation", current_generation=8)
    async with FencedWriter(fake.url, state) as w:
        with pytest.raises(LeaseLost) as info:
            await w.post("d", "/x", step="s")
    assert info.value.reason == "stale_generation"
    assert fake.seen == []


async def test_a_hold_past_its_local_deadline_refuses_to_send(fake: FakeGateway) -> None:
    now = [100.0]
    state = Hold(LEASE, deadline=110.0, monotonic=lambda: now[0])
    async with FencedWriter(fake.url, state) as w:
        await w.post("d", "/x", step="a")
        now[0] = 110.0
        with pytest.raises(LeaseLost) as info:
            await w.post("d", "/x", step="b")
    assert info.value.reason == "lease_expired"
    assert len(fake.seen) == 1


async def test_a_hold_lost_during_a_retry_wait_stops_the_retry(fake: FakeGateway) -> None:
    state = Hold(LEASE, time.monotonic() + 60)

    async def lose_while_waiting(seconds: float) -> None:
        state.lost = LeaseLost("job-42", 7, "lease_expired")

    fake.script = [rejected("older_generation_in_flight", 409, retry_after=1)]
    async with FencedWriter(fake.url, state, sleep=lose_while_waiting) as w:
        with pytest.raises(LeaseLost):
            await w.post("d", "/x", step="s")
    assert len(fake.seen) == 1


async def test_a_hold_sends_its_latest_renewed_lease(fake: FakeGateway) -> None:
    state = Hold(LEASE, time.monotonic() + 60)
    async with FencedWriter(fake.url, state) as w:
        state.lease = Lease("job-42", "worker-a", 7, "active", datetime.now(UTC), 30.0)
        assert w.lease is state.lease
        await w.post("d", "/x", step="s")
    assert fake.seen[0].headers["Fencing-Token"] == "7"


async def test_an_unreachable_gateway_is_gateway_unavailable_and_says_why() -> None:
    port = free_port()
    async with FencedWriter(f"http://127.0.0.1:{port}", LEASE) as w:
        with pytest.raises(GatewayUnavailable) as info:
            await w.post("d", "/x", step="s")
    assert info.value.reason == "gateway_unreachable" and info.value.status is None
    # in words, not the client library's repr; no "None" for the status it never got
    assert str(info.value) == (
        f"gateway_unreachable: cannot reach the gateway: cannot connect to 127.0.0.1:{port}: "
        "ECONNREFUSED"
    )
    async with await HTTPLeaseStore.open(f"http://127.0.0.1:{port}") as store:
        with pytest.raises(StoreUnavailable) as lease_info:
            await store.claim("job-1", owner="w", ttl=10)
    assert str(lease_info.value).endswith(f"cannot connect to 127.0.0.1:{port}: ECONNREFUSED")


async def test_a_write_whose_connection_was_lost_once_sent_may_have_reached_the_gateway() -> None:
    """ "cannot reach the gateway" read as if nothing had been sent: a retry with
    another key would then make a second effect."""

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the request reached us
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with FencedWriter(f"http://127.0.0.1:{port}", LEASE, max_retries=0) as w:
            with pytest.raises(GatewayUnavailable) as info:
                await w.post("d", "/x", step="s")
    finally:
        server.close()
        await server.wait_closed()
    assert info.value.reason == "gateway_unreachable"
    assert str(info.value) == (
        "gateway_unreachable: no usable answer from the gateway, which may have the write: "
        "the connection closed before the answer"
    )


@pytest.mark.parametrize(
    ("url", "lease", "options"),
    [
        ("ftp://gw", LEASE, {}),
        ("gw:8480", LEASE, {}),
        ("http://gw", "job-42", {}),
        ("http://gw", LEASE, {"max_retries": -1}),
        ("http://gw", LEASE, {"max_retries": True}),
        ("http://gw", LEASE, {"max_retry_wait": -1}),
        ("http://gw", LEASE, {"max_retry_wait": "5"}),
        # aiohttp read 0 as no timeout at all, and inf overflowed at every write
        ("http://gw", LEASE, {"timeout": 0}),
        ("http://gw", LEASE, {"timeout": float("inf")}),
        ("http://gw", LEASE, {"timeout": float("nan")}),
        ("http://gw", LEASE, {"timeout": 10**400}),
        ("http://gw", LEASE, {"wait": -1}),
        ("http://gw", LEASE, {"wait": 1.5}),
        ("http://gw", LEASE, {"token": "has space"}),
    ],
)
def test_bad_writer_arguments_raise_value_error(url: str, lease: Any, options: Any) -> None:
    with pytest.raises(ValueError):
        FencedWriter(url, lease, **options)


# --- through the real gateway ---------------------------------------------------------------


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    async with recording_upstream() as up:
        yield up


async def test_worked_example_through_the_real_gateway(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """SPEC 1: A's late write under generation N is rejected and never reaches the
    destination; B's duplicate with the same derived key reaches it once."""
    config = make_config(tmp_path, destination("payments", upstream.url + "/api"))
    async with running_gateway(config) as gw:
        async with await HTTPLeaseStore.open(gw.url) as store:
            a = await store.claim("job-42", owner="worker-a", ttl=5)
            gw.clock.advance(6)  # A pauses past its ttl
            b = await store.claim("job-42", owner="worker-b", ttl=5)
            assert b.generation == a.generation + 1
            with pytest.raises(LeaseLost) as lost:
                await store.complete(a)
            assert lost.value.reason == "stale_generation"

            async with FencedWriter(gw.url, a) as late, FencedWriter(gw.url, b) as current:
                with pytest.raises(StaleWrite) as stale:
                    await late.post("payments", "/charges", json={"amount": 100}, step="charge")
                assert stale.value.reason == "stale_generation"
                assert stale.value.current_generation == b.generation
                assert stale.value.rejection_id is not None

                first = await current.post(
                    "payments", "/charges", json={"amount": 100}, step="charge"
                )
                again = await current.post(
                    "payments", "/charges", json={"amount": 100}, step="charge"
                )
            assert (first.status, first.replayed) == (201, False)
            assert (again.status, again.replayed, again.body) == (201, True, first.body)
            assert upstream.paths() == ["/api/charges"]
            assert upstream.received[0].headers["Fencing-Token"] == str(b.generation)
            assert (await store.complete(b)).state == "done"


async def test_writer_inside_hold_over_http_through_the_real_gateway(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    config = make_config(tmp_path, destination("payments", upstream.url + "/api"))
    async with running_gateway(config) as gw:
        async with await HTTPLeaseStore.open(gw.url) as store:
            async with hold(store, "job-7", owner="worker-a", ttl=30) as lease:
                async with FencedWriter(gw.url, lease) as writer:
                    result = await writer.put("payments", "/items/1", json={"q": 1}, step="put")
            assert result.status == 201 and result.json()["ok"] is True
            done = await store.get("job-7")
            assert done is not None and done.state == "done"
            async with FencedWriter(gw.url, lease) as writer:
                with pytest.raises(StaleWrite) as info:
                    await writer.put("payments", "/items/1", json={"q": 1}, step="again")
            assert info.value.reason == "job_completed"
            assert len(upstream.received) == 1


async def test_a_replay_of_the_destinations_fence_refusal_raises_stale_write(
    tmp_path: Path,
) -> None:
    """The destination runs `leases.fence` and refuses generation 1 (its mark is 5).
    The first write raises StaleWrite from the relayed `Sinkgate-Rejected`; the
    retry of the same step gets the stored 409 replayed, which carries no
    `Sinkgate-Rejected` (SPEC 2), and must raise StaleWrite all the same, not
    come back as a result the caller might take for success."""
    from leases.fence import Fence, aiohttp_middleware

    charges: list[bytes] = []

    async def charge(request: web.Request) -> web.Response:
        charges.append(await request.read())
        return web.json_response({"charged": True}, status=201)

    middleware = aiohttp_middleware(Fence(), f"sqlite:///{tmp_path / 'ledger.db'}")
    app = web.Application(middlewares=[middleware])
    app.router.add_post("/charges", charge)
    server = TestServer(app, port=free_port())
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            newer = {"Fencing-Job": "job-9", "Fencing-Token": "5"}
            async with client.post(server.make_url("/charges"), headers=newer, data=b"{}") as r:
                assert r.status == 201  # the destination's mark for job-9 is now 5
        config = make_config(tmp_path, destination("ledger", str(server.make_url(""))))
        async with running_gateway(config) as gw:
            async with await HTTPLeaseStore.open(gw.url) as store:
                lease = await store.claim("job-9", owner="worker-a", ttl=30)
                assert lease.generation == 1
                async with FencedWriter(gw.url, lease) as writer:
                    with pytest.raises(StaleWrite) as first:
                        await writer.post("ledger", "/charges", json={"n": 1}, step="charge")
                    with pytest.raises(StaleWrite) as again:
                        await writer.post("ledger", "/charges", json={"n": 1}, step="charge")
        assert first.value.reason == again.value.reason == "stale_generation"
        assert again.value.highest_generation == 5
        assert len(charges) == 1  # only the direct write with token 5
    finally:
        await server.close()
        await middleware.close()
