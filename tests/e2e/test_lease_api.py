"""The lease API over HTTP (SPEC 3) on a real aiohttp server and a real SQLite store.

Time is a fake clock the store reads; no test sleeps to make a lease expire.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs
from yarl import URL

from gateway.http.appkeys import METRICS, STORE
from gateway.http.leases import MAX_BODY, add_lease_routes
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.metrics import Metrics

T0 = 1_800_000_000.0
RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Api:
    """A small client for the lease API that keeps the path's encoding as given."""

    def __init__(self, client: TestClient[Any, Any]) -> None:
        self.client = client
        self.base = str(client.make_url("/")).rstrip("/")

    async def call(
        self, method: str, path: str, body: Any = None, *, raw: bytes | None = None
    ) -> tuple[int, dict[str, Any], Any]:
        url = URL(self.base + path, encoded=True)
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        async with self.client.session.request(method, url, data=data) as resp:
            text = await resp.text()
            return resp.status, dict(resp.headers), json.loads(text) if text else None

    async def post(self, job: str, op: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        status, _, doc = await self.call("POST", f"/leases/{job}/{op}", body, **kw)
        return status, doc

    async def get(self, job: str) -> tuple[int, Any]:
        status, _, doc = await self.call("GET", f"/leases/{job}")
        return status, doc


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def store(tmp_path: Path, clock: FakeClock) -> AsyncIterator[SQLiteStore]:
    s = await SQLiteStore.open("sqlite:///" + str(tmp_path / "g.db"), clock=clock)
    yield s
    await s.close()


@pytest.fixture
async def client(store: SQLiteStore) -> AsyncIterator[TestClient[Any, Any]]:
    app = web.Application()
    app[STORE] = store
    app[METRICS] = Metrics()
    add_lease_routes(app)
    async with TestClient(TestServer(app)) as c:
        yield c


@pytest.fixture
def api(client: TestClient[Any, Any]) -> Api:
    return Api(client)


def ts(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def assert_problem(status: int, headers: dict[str, str], doc: Any, want: int, reason: str) -> None:
    assert status == want, doc
    assert headers["Content-Type"].startswith("application/problem+json")
    assert headers["Sinkgate-Rejected"] == reason
    assert doc["reason"] == reason
    assert doc["status"] == want
    assert {"type", "title", "detail"} <= set(doc)


class TickingClock(FakeClock):
    """A store clock that moves 1 ms at every reading, as a real one moves
    between the claim's transaction and the answer."""

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


@pytest.mark.parametrize("clock", [TickingClock()])
async def test_server_time_is_the_now_that_expires_in_counts_from(api: Api) -> None:
    for answer in (
        await api.post("job-t", "claim", {"owner": "a", "ttl": 10}),
        await api.get("job-t"),
    ):
        doc = answer[1]
        until, server = (
            datetime.fromisoformat(doc[name].replace("Z", "+00:00"))
            for name in ("lease_until", "server_time")
        )
        assert (until - server).total_seconds() == pytest.approx(doc["expires_in"], abs=1e-6)
    assert (await api.post("job-u", "claim", {"owner": "a", "ttl": 10}))[1]["expires_in"] == 10


# --- claim -----------------------------------------------------------------------------


async def test_claim_of_a_new_job_returns_generation_1_lease_object(api: Api) -> None:
    status, doc = await api.post("job-1", "claim", {"owner": "a", "ttl": 30})
    assert status == 200
    assert doc == {
        "job_id": "job-1",
        "owner": "a",
        "generation": 1,
        "state": "active",
        "lease_until": ts(T0 + 30),
        "expires_in": 30.0,
        "server_time": ts(T0),
    }
    assert RFC3339.fullmatch(doc["lease_until"]) and RFC3339.fullmatch(doc["server_time"])


async def test_claim_of_a_held_job_is_lease_held_with_owner_expires_in_and_retry_after(
    api: Api, clock: FakeClock
) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    clock.advance(2.5)
    status, headers, doc = await api.call("POST", "/leases/j/claim", {"owner": "b", "ttl": 10})
    assert_problem(status, headers, doc, 409, "lease_held")
    assert doc["owner"] == "a"
    assert doc["expires_in"] == 7.5
    assert doc["job_id"] == "j"
    assert headers["Retry-After"] == "8"


async def test_lease_held_retry_after_is_at_least_one_second(api: Api, clock: FakeClock) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 1})
    clock.advance(0.9)
    status, headers, doc = await api.call("POST", "/leases/j/claim", {"owner": "b", "ttl": 1})
    assert status == 409 and doc["expires_in"] == pytest.approx(0.1)
    assert headers["Retry-After"] == "1"


async def test_claim_by_the_holder_itself_is_also_refused_while_held(api: Api) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    status, doc = await api.post("j", "claim", {"owner": "a", "ttl": 10})
    assert status == 409 and doc["reason"] == "lease_held"


async def test_claim_after_expiry_bumps_the_generation(api: Api, clock: FakeClock) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    clock.advance(10)  # lease_until <= now: expired
    status, doc = await api.post("j", "claim", {"owner": "b", "ttl": 5})
    assert status == 200
    assert (doc["owner"], doc["generation"], doc["expires_in"]) == ("b", 2, 5.0)


async def test_claim_after_release_bumps_the_generation(api: Api) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    await api.post("j", "release", {"owner": "a", "generation": 1})
    status, doc = await api.post("j", "claim", {"owner": "b", "ttl": 10})
    assert status == 200 and doc["generation"] == 2


async def test_claim_of_a_completed_job_is_job_completed(api: Api) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    await api.post("j", "complete", {"owner": "a", "generation": 1})
    status, headers, doc = await api.call("POST", "/leases/j/claim", {"owner": "b", "ttl": 10})
    assert_problem(status, headers, doc, 409, "job_completed")
    assert doc["job_id"] == "j" and doc["current_generation"] == 1


# --- renew / complete / release ---------------------------------------------------------


async def test_renew_extends_from_the_store_now_with_the_given_ttl(
    api: Api, clock: FakeClock
) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    clock.advance(4)
    status, doc = await api.post("j", "renew", {"owner": "a", "generation": 1, "ttl": 20})
    assert status == 200
    assert doc["lease_until"] == ts(T0 + 24)
    assert doc["expires_in"] == 20.0 and doc["generation"] == 1
    assert doc["server_time"] == ts(T0 + 4)


async def test_renew_without_ttl_keeps_the_ttl_of_the_claim(api: Api, clock: FakeClock) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    clock.advance(4)
    status, doc = await api.post("j", "renew", {"owner": "a", "generation": 1})
    assert status == 200 and doc["lease_until"] == ts(T0 + 14)


async def test_complete_answers_the_lease_in_state_done(api: Api) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    status, doc = await api.post("j", "complete", {"owner": "a", "generation": 1})
    assert status == 200
    assert (doc["state"], doc["expires_in"], doc["generation"]) == ("done", 0.0, 1)


async def test_release_answers_the_lease_in_state_free(api: Api) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    status, doc = await api.post("j", "release", {"owner": "a", "generation": 1})
    assert status == 200
    assert (doc["state"], doc["expires_in"]) == ("free", 0.0)


async def _setup_generation_2(api: Api, clock: FakeClock) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    clock.advance(10)
    await api.post("j", "claim", {"owner": "b", "ttl": 10})


@pytest.mark.parametrize("op", ["renew", "complete", "release"])
@pytest.mark.parametrize(
    ("setup", "owner", "generation", "reason", "current"),
    [
        ("never", "b", 1, "lease_not_held", None),
        ("gen2", "a", 1, "stale_generation", 2),
        ("gen2", "b", 3, "unknown_generation", 2),
        ("gen2_done", "b", 2, "job_completed", 2),
        ("gen2_free", "b", 2, "lease_not_held", 2),
        ("gen2_expired", "b", 2, "lease_expired", 2),
        ("gen2", "a", 2, "owner_mismatch", 2),
        # the order of SPEC 2 step 6: a stale token is stale even on a done job
        ("gen2_done", "b", 1, "stale_generation", 2),
        ("gen2_expired", "a", 2, "lease_expired", 2),
    ],
)
async def test_held_verbs_refuse_in_the_contract_order_and_change_nothing(
    api: Api,
    clock: FakeClock,
    op: str,
    setup: str,
    owner: str,
    generation: int,
    reason: str,
    current: int | None,
) -> None:
    if setup != "never":
        await _setup_generation_2(api, clock)
    if setup == "gen2_done":
        await api.post("j", "complete", {"owner": "b", "generation": 2})
    if setup == "gen2_free":
        await api.post("j", "release", {"owner": "b", "generation": 2})
    if setup == "gen2_expired":
        clock.advance(10)
    _, before = await api.get("j")
    status, headers, doc = await api.call(
        "POST", f"/leases/j/{op}", {"owner": owner, "generation": generation}
    )
    assert_problem(status, headers, doc, 409, reason)
    assert doc["job_id"] == "j" and doc["generation"] == generation
    assert doc.get("current_generation") == current
    _, after = await api.get("j")
    assert after == before


# --- get --------------------------------------------------------------------------------


async def test_get_answers_the_current_lease_as_of_the_store_now(
    api: Api, clock: FakeClock
) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    clock.advance(3)
    status, doc = await api.get("j")
    assert status == 200
    assert doc["expires_in"] == 7.0 and doc["server_time"] == ts(T0 + 3)
    assert (doc["owner"], doc["generation"], doc["state"]) == ("a", 1, "active")


async def test_get_of_an_expired_lease_shows_it_active_with_zero_expires_in(
    api: Api, clock: FakeClock
) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    clock.advance(60)
    _, doc = await api.get("j")
    assert doc["expires_in"] == 0.0 and doc["lease_until"] == ts(T0 + 10)


async def test_get_of_an_unknown_job_is_404_lease_not_held(api: Api) -> None:
    status, headers, doc = await api.call("GET", "/leases/nobody")
    assert_problem(status, headers, doc, 404, "lease_not_held")
    assert doc["job_id"] == "nobody"


# --- the worked example (SPEC 1) --------------------------------------------------------


async def test_worked_example_over_http(api: Api, clock: FakeClock) -> None:
    """A claims, pauses past its ttl; B claims N+1; A's complete is stale; B completes."""
    status, a = await api.post("job-42", "claim", {"owner": "worker-a", "ttl": 5})
    assert status == 200
    n = a["generation"]
    clock.advance(6)
    status, b = await api.post("job-42", "claim", {"owner": "worker-b", "ttl": 5})
    assert status == 200 and b["generation"] == n + 1
    status, doc = await api.post("job-42", "complete", {"owner": "worker-a", "generation": n})
    assert status == 409 and doc["reason"] == "stale_generation"
    assert doc["current_generation"] == n + 1
    status, done = await api.post("job-42", "complete", {"owner": "worker-b", "generation": n + 1})
    assert status == 200 and done["state"] == "done"
    status, doc = await api.post("job-42", "claim", {"owner": "worker-c", "ttl": 5})
    assert status == 409 and doc["reason"] == "job_completed"


# --- 400 / 413: invalid requests change nothing ------------------------------------------

BAD_BODIES: list[tuple[str, str, Any]] = [
    ("claim", "bad json", b"{not json"),
    ("claim", "not utf-8", b'{"owner": "\xff", "ttl": 1}'),
    ("claim", "empty body", b""),
    ("claim", "array body", [1, 2]),
    ("claim", "string body", "owner"),
    ("claim", "null body", None),
    ("claim", "missing owner", {"ttl": 10}),
    ("claim", "missing ttl", {"owner": "b"}),
    ("claim", "null ttl", {"owner": "b", "ttl": None}),
    ("claim", "ttl as string", {"owner": "b", "ttl": "10"}),
    ("claim", "bool ttl", {"owner": "b", "ttl": True}),
    ("claim", "ttl 0.04", {"owner": "b", "ttl": 0.04}),
    ("claim", "ttl 86401", {"owner": "b", "ttl": 86401}),
    ("claim", "ttl NaN", b'{"owner": "b", "ttl": NaN}'),
    ("claim", "ttl Infinity", b'{"owner": "b", "ttl": Infinity}'),
    ("claim", "ttl past the floats", b'{"owner": "b", "ttl": 1' + b"0" * 400 + b"}"),
    ("claim", "owner with a space", {"owner": "b c", "ttl": 10}),
    ("claim", "empty owner", {"owner": "", "ttl": 10}),
    ("claim", "owner of 257 chars", {"owner": "o" * 257, "ttl": 10}),
    ("claim", "owner as number", {"owner": 7, "ttl": 10}),
    ("claim", "non-ascii owner", {"owner": "wörker", "ttl": 10}),
    ("claim", "unknown field", {"owner": "b", "ttl": 10, "tll": 10}),
    ("claim", "generation on claim", {"owner": "b", "ttl": 10, "generation": 1}),
    ("renew", "missing generation", {"owner": "a"}),
    ("renew", "bool generation", {"owner": "a", "generation": True}),
    ("renew", "float generation", {"owner": "a", "generation": 1.0}),
    ("renew", "string generation", {"owner": "a", "generation": "1"}),
    ("renew", "generation 0", {"owner": "a", "generation": 0}),
    ("renew", "generation 2^63", {"owner": "a", "generation": 2**63}),
    ("renew", "huge generation", b'{"owner": "a", "generation": 1' + b"0" * 5000 + b"}"),
    ("renew", "bool ttl", {"owner": "a", "generation": 1, "ttl": False}),
    ("renew", "null ttl", {"owner": "a", "generation": 1, "ttl": None}),
    ("renew", "ttl 86401", {"owner": "a", "generation": 1, "ttl": 86401}),
    (
        "renew",
        "ttl past the floats",
        b'{"owner": "a", "generation": 1, "ttl": 1' + b"0" * 400 + b"}",
    ),
    ("complete", "ttl on complete", {"owner": "a", "generation": 1, "ttl": 10}),
    ("complete", "missing owner", {"generation": 1}),
    ("release", "unknown field", {"owner": "a", "generation": 1, "force": True}),
    ("release", "deeply nested", b"[" * 30_000 + b"]" * 30_000),
]


@pytest.mark.parametrize(("op", "case", "body"), BAD_BODIES, ids=[c for _, c, _ in BAD_BODIES])
async def test_invalid_bodies_are_400_invalid_request_and_change_nothing(
    api: Api, op: str, case: str, body: Any
) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    _, before = await api.get("j")
    for job in ("j", "fresh"):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, headers, doc = await api.call("POST", f"/leases/{job}/{op}", raw=raw)
        assert_problem(status, headers, doc, 400, "invalid_request")
    _, after = await api.get("j")
    assert after == before
    assert (await api.get("fresh"))[0] == 404


async def test_unknown_field_is_named_in_the_problem(api: Api) -> None:
    status, doc = await api.post("j", "claim", {"owner": "a", "ttl": 10, "tll": 10})
    assert status == 400
    assert doc["field"] == "tll" and "tll" in doc["detail"]


async def test_ttl_bounds_are_inclusive(api: Api) -> None:
    assert (await api.post("lo", "claim", {"owner": "a", "ttl": 0.05}))[0] == 200
    assert (await api.post("hi", "claim", {"owner": "a", "ttl": 86400}))[0] == 200


async def test_a_refused_body_names_the_paths_job(api: Api) -> None:
    status, headers, doc = await api.call("POST", "/leases/t2/claim", {"owner": "w", "ttl": 0.049})
    assert_problem(status, headers, doc, 400, "invalid_request")
    assert (doc["field"], doc["job_id"]) == ("ttl", "t2")


async def test_body_over_64_kib_is_413_body_too_large(api: Api) -> None:
    body = json.dumps({"owner": "a", "ttl": 10, "pad": "x" * MAX_BODY}).encode()
    status, headers, doc = await api.call("POST", "/leases/j/claim", raw=body)
    assert_problem(status, headers, doc, 413, "body_too_large")
    assert (await api.get("j"))[0] == 404


async def test_chunked_body_over_64_kib_is_413_body_too_large(
    client: TestClient[Any, Any],
) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b" " * 4096  # whitespace is valid JSON padding, so only size decides

    resp = await client.post("/leases/j/claim", data=chunks())
    assert resp.status == 413
    assert resp.headers["Sinkgate-Rejected"] == "body_too_large"


# --- the job id in the path ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("encoded", "job_id"),
    [
        ("a%2Fb", "a/b"),
        ("a%2fb%2F..%2Fc", "a/b/../c"),
        ("100%25", "100%"),
        ("a%3Fb%23c", "a?b#c"),
        ("%2E", "."),
        ("%2E%2E", ".."),
        ("job%3A42", "job:42"),
        ("~user!$&'()*+,;=@", "~user!$&'()*+,;=@"),
        # aiohttp's default segment pattern left `{` and `}` out: 404 no route
        ("job{1}", "job{1}"),
        ("%7Bjob%7D", "{job}"),
    ],
)
async def test_job_id_in_the_path_is_percent_decoded(
    api: Api, store: SQLiteStore, encoded: str, job_id: str
) -> None:
    status, doc = await api.post(encoded, "claim", {"owner": "a", "ttl": 10})
    assert status == 200 and doc["job_id"] == job_id
    stored = await store.get(job_id)
    assert stored is not None and stored.generation == 1
    status, doc = await api.get(encoded)
    assert status == 200 and doc["job_id"] == job_id
    status, doc = await api.post(encoded, "complete", {"owner": "a", "generation": 1})
    assert status == 200 and doc["state"] == "done"


@pytest.mark.parametrize(
    "encoded",
    ["a%20b", "tab%09", "%C3%A9t%C3%A9", "%FF", "x" * 257, "%7F", "a%00b"],
    ids=["space", "tab", "non-ascii", "invalid-utf8", "257-chars", "DEL", "NUL"],
)
async def test_job_id_outside_the_alphabet_is_400_and_changes_nothing(
    api: Api, store: SQLiteStore, encoded: str
) -> None:
    body = {"owner": "a", "ttl": 1}
    status, headers, doc = await api.call("POST", f"/leases/{encoded}/claim", body)
    assert_problem(status, headers, doc, 400, "invalid_request")
    status, headers, doc = await api.call("GET", f"/leases/{encoded}")
    assert_problem(status, headers, doc, 400, "invalid_request")


async def test_job_id_of_256_chars_is_accepted(api: Api) -> None:
    status, doc = await api.post("x" * 256, "claim", {"owner": "a", "ttl": 1})
    assert status == 200 and doc["job_id"] == "x" * 256


# --- other routes, store failure, observability ------------------------------------------


async def test_unknown_operation_is_404_problem(api: Api) -> None:
    status, headers, doc = await api.call("POST", "/leases/j/steal", {"owner": "a"})
    assert_problem(status, headers, doc, 404, "not_found")


async def test_wrong_method_on_a_verb_is_405_problem_with_allow(api: Api) -> None:
    status, headers, doc = await api.call("GET", "/leases/j/claim")
    assert_problem(status, headers, doc, 405, "method_not_allowed")
    assert headers["Allow"] == "POST"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/leases/j/claim", {"owner": "a", "ttl": 10}),
        ("POST", "/leases/j/renew", {"owner": "a", "generation": 1}),
        ("POST", "/leases/j/complete", {"owner": "a", "generation": 1}),
        ("POST", "/leases/j/release", {"owner": "a", "generation": 1}),
        ("GET", "/leases/j", None),
    ],
)
async def test_closed_store_is_503_store_unavailable(
    api: Api, store: SQLiteStore, method: str, path: str, body: Any
) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    await store.close()
    with capture_logs() as logs:
        status, headers, doc = await api.call(method, path, body)
    assert_problem(status, headers, doc, 503, "store_unavailable")
    [line] = [e for e in logs if e["event"] == "store_unavailable"]
    op = path.rsplit("/", 1)[1] if method == "POST" else "get"
    assert line["op"] == f"lease_{op}"  # as the metric's label says it
    assert "Retry-After" in headers
    # the store's own words ("store is closed", a driver's naming the database) are
    # logged, not answered: the lease API may need no token
    assert doc["detail"] == "the lease store did not answer; retry"


async def test_one_log_line_per_lease_decision(api: Api) -> None:
    with capture_logs() as logs:
        await api.post("j", "claim", {"owner": "a", "ttl": 10})
        await api.post("j", "claim", {"owner": "b", "ttl": 10})
        await api.post("j", "renew", {"owner": "a", "generation": 2})
    decisions = [e for e in logs if e["event"] == "lease_decision"]
    assert [(e["op"], e["result"], e["owner"], e["generation"]) for e in decisions] == [
        ("claim", "ok", "a", 1),
        ("claim", "lease_held", "b", None),
        ("renew", "unknown_generation", "a", 2),
    ]
    assert all(e["job_id"] == "j" and e["key"] is None for e in decisions)
    assert [(e["decision"], e["reason"]) for e in decisions] == [
        ("ok", None),
        ("rejected", "lease_held"),
        ("rejected", "unknown_generation"),
    ]
    # The store's time on every call that reached it; none on one refused before.
    assert all(isinstance(e["store_ms"], float) and e["store_ms"] >= 0 for e in decisions)
    with capture_logs() as logs:
        await api.post("j", "claim", {"owner": "b", "ttl": "x"})
    (refused,) = [e for e in logs if e["event"] == "lease_decision"]
    assert refused["reason"] == "invalid_request" and refused["store_ms"] is None


async def test_lease_ops_are_counted_by_op_and_result(
    api: Api, client: TestClient[Any, Any]
) -> None:
    await api.post("j", "claim", {"owner": "a", "ttl": 10})
    await api.post("j", "claim", {"owner": "b", "ttl": 10})
    await api.post("j", "claim", {"owner": "b", "ttl": "x"})
    metrics = client.app[METRICS]  # type: ignore[index]
    value = metrics.registry.get_sample_value
    name = "sinkgate_lease_operations_total"
    assert value(name, {"op": "claim", "result": "ok"}) == 1
    assert value(name, {"op": "claim", "result": "lease_held"}) == 1
    assert value(name, {"op": "claim", "result": "invalid_request"}) == 1
    # A path naming no operation is one series, whatever it names: the raw segment
    # was a new series per request, for anybody (refused before the token check).
    for n in range(3):
        await api.call("POST", f"/leases/j/steal-{n}", {})
        await api.call("DELETE", f"/leases/j/drop-{n}")
    assert value(name, {"op": "(other)", "result": "not_found"}) == 6
    assert value(name, {"op": "steal-0", "result": "not_found"}) is None


@pytest.mark.parametrize(
    ("op", "body", "detail"),
    [
        (
            "renew",
            {"owner": "a", "generation": 1, "ttl": None},
            "ttl must be a number of seconds, not null",
        ),
        ("claim", {"owner": "b", "ttl": None}, "ttl must be a number of seconds, not null"),
        ("claim", {"owner": None, "ttl": 10}, "owner must be a string, not null"),
        ("claim", {"owner": "b", "ttl": "10"}, "ttl must be a number of seconds, not a string"),
        ("claim", {"owner": "b", "ttl": [10]}, "ttl must be a number of seconds, not an array"),
        ("claim", {"owner": 7, "ttl": 10}, "owner must be a string, not a number"),
        ("claim", {"owner": {}, "ttl": 10}, "owner must be a string, not an object"),
        (
            "renew",
            {"owner": "a", "generation": True},
            "generation must be an integer, not a boolean",
        ),
        ("renew", {"owner": "a", "generation": 1.0}, "generation must be an integer, not 1.0"),
    ],
)
async def test_a_wrongly_typed_field_is_named_in_jsons_words(
    api: Api, op: str, body: dict[str, Any], detail: str
) -> None:
    # The checks are shared with the Python API; a JSON client is told JSON's types.
    status, doc = await api.post("j", op, body)
    assert status == 400 and doc["detail"] == detail, doc


async def test_a_body_that_is_no_object_is_named_in_jsons_words(api: Api) -> None:
    status, _, doc = await api.call("POST", "/leases/j/claim", raw=b"[1]")
    assert status == 400 and doc["detail"] == "the body must be a JSON object, not an array"
