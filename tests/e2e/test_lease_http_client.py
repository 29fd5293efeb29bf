"""`HTTPLeaseStore` against a live lease API: the same values and errors as the SQLite
store it fronts, typed errors for every way the network can fail, and `hold()` unchanged.

The gateway side is the real `add_lease_routes` on a real SQLite store whose clock
the test moves.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.http.appkeys import METRICS, STORE
from gateway.http.leases import add_lease_routes
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.metrics import Metrics
from leases import JobCompleted, Lease, LeaseHeld, LeaseLost, StoreUnavailable, hold, open_store
from leases.http import HTTPLeaseStore
from tests.conftest import FakeClock
from tests.harness import eventually


@pytest.fixture
async def backing(tmp_path: Path, fake_clock: FakeClock) -> AsyncIterator[SQLiteStore]:
    store = await SQLiteStore.open("sqlite:///" + str(tmp_path / "g.db"), clock=fake_clock)
    yield store
    await store.close()


@pytest.fixture
async def server(backing: SQLiteStore) -> AsyncIterator[TestServer]:
    app = web.Application()
    app[STORE] = backing
    app[METRICS] = Metrics()
    add_lease_routes(app)
    async with TestServer(app) as srv:
        yield srv


@pytest.fixture
async def store(server: TestServer) -> AsyncIterator[HTTPLeaseStore]:
    async with await HTTPLeaseStore.open(str(server.make_url("/"))) as s:
        yield s


def closed_port_url() -> str:
    """A loopback URL nobody listens on: bound, then released."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
async def odd_server() -> AsyncIterator[tuple[TestServer, dict[str, Any]]]:
    """A server standing in for a misbehaving gateway; `state` says how to answer."""
    state: dict[str, Any] = {"status": 500, "body": b"oops", "ctype": "text/plain", "seen": []}
    never = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        state["seen"].append((request.method, request.raw_path, dict(request.headers)))
        if state.get("hang"):
            await never.wait()
        return web.Response(status=state["status"], body=state["body"], content_type=state["ctype"])

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    async with TestServer(app) as srv:
        yield srv, state


# --- same values as the store it fronts ------------------------------------------------


async def test_open_store_dispatches_http_urls_to_the_http_store(server: TestServer) -> None:
    store = await open_store(str(server.make_url("/")), timeout=5.0)
    try:
        assert isinstance(store, HTTPLeaseStore)
        lease = await store.claim("j", owner="a", ttl=10)
        assert lease.generation == 1
    finally:
        await store.close()


async def test_claim_returns_the_lease_the_backing_store_holds(
    store: HTTPLeaseStore, backing: SQLiteStore, fake_clock: FakeClock
) -> None:
    lease = await store.claim("job-1", owner="a", ttl=30)
    assert lease == await backing.get("job-1")
    assert lease.lease_until == datetime.fromtimestamp(fake_clock.now + 30, UTC)
    assert lease.lease_until.utcoffset() == timedelta(0)
    assert (lease.state, lease.expires_in, lease.owner) == ("active", 30.0, "a")


async def test_claim_without_owner_uses_a_default_owner(store: HTTPLeaseStore) -> None:
    lease = await store.claim("j", ttl=10)
    assert lease.owner and " " not in lease.owner


async def test_renew_complete_release_match_the_sqlite_store(
    store: HTTPLeaseStore, backing: SQLiteStore, fake_clock: FakeClock
) -> None:
    lease = await store.claim("j", owner="a", ttl=10)
    fake_clock.advance(4)
    renewed = await store.renew(lease, ttl=20)
    assert renewed.lease_until == datetime.fromtimestamp(fake_clock.now + 20, UTC)
    assert renewed == await backing.get("j")
    kept = await store.renew(renewed)  # no ttl: the last one (20s) again
    assert kept.lease_until == renewed.lease_until
    done = await store.complete(kept)
    assert done.state == "done" and done == await backing.get("j")
    lease2 = await store.claim("k", owner="a", ttl=10)
    free = await store.release(lease2)
    assert free.state == "free" and free == await backing.get("k")
    assert (await store.claim("k", owner="b", ttl=10)).generation == 2


async def test_get_of_an_unknown_job_is_none(store: HTTPLeaseStore) -> None:
    assert await store.get("nobody") is None


async def test_expires_in_comes_from_the_server_clock(
    store: HTTPLeaseStore, fake_clock: FakeClock
) -> None:
    await store.claim("j", owner="a", ttl=10)
    fake_clock.advance(7.5)
    current = await store.get("j")
    assert current is not None and current.expires_in == 2.5


# --- same errors --------------------------------------------------------------------------


async def test_claim_of_a_held_job_raises_lease_held_with_owner_and_expires_in(
    store: HTTPLeaseStore, fake_clock: FakeClock
) -> None:
    await store.claim("j", owner="a", ttl=10)
    fake_clock.advance(4)
    with pytest.raises(LeaseHeld) as info:
        await store.claim("j", owner="b", ttl=10)
    assert (info.value.job_id, info.value.owner, info.value.expires_in) == ("j", "a", 6.0)
    assert info.value.reason == "lease_held"


async def test_claim_of_a_completed_job_raises_job_completed(store: HTTPLeaseStore) -> None:
    await store.complete(await store.claim("j", owner="a", ttl=10))
    with pytest.raises(JobCompleted) as info:
        await store.claim("j", owner="b", ttl=10)
    assert info.value.job_id == "j" and info.value.reason == "job_completed"
    assert info.value.current_generation == 1


def _lease(job_id: str, owner: str, generation: int) -> Lease:
    return Lease(job_id, owner, generation, "active", datetime.now(UTC), 0.0)


@pytest.mark.parametrize("op", ["renew", "complete", "release"])
@pytest.mark.parametrize(
    ("setup", "owner", "generation", "reason", "current"),
    [
        ("never", "b", 1, "lease_not_held", None),
        ("gen2", "a", 1, "stale_generation", 2),
        ("gen2", "b", 3, "unknown_generation", 2),
        ("done", "b", 2, "job_completed", 2),
        ("free", "b", 2, "lease_not_held", 2),
        ("expired", "b", 2, "lease_expired", 2),
        ("gen2", "a", 2, "owner_mismatch", 2),
    ],
)
async def test_held_verbs_raise_lease_lost_like_the_sqlite_store(
    store: HTTPLeaseStore,
    backing: SQLiteStore,
    fake_clock: FakeClock,
    op: str,
    setup: str,
    owner: str,
    generation: int,
    reason: str,
    current: int | None,
) -> None:
    if setup != "never":
        await backing.claim("j", owner="a", ttl=10)
        fake_clock.advance(10)
        b = await backing.claim("j", owner="b", ttl=10)
        if setup == "done":
            await backing.complete(b)
        elif setup == "free":
            await backing.release(b)
        elif setup == "expired":
            fake_clock.advance(10)
    lease = _lease("j", owner, generation)
    with pytest.raises(LeaseLost) as over_http:
        await getattr(store, op)(lease)
    with pytest.raises(LeaseLost) as direct:
        await getattr(backing, op)(lease)
    got, want = over_http.value, direct.value
    assert (got.reason, got.job_id, got.generation, got.current_generation) == (
        want.reason,
        want.job_id,
        want.generation,
        want.current_generation,
    )
    assert (got.reason, got.current_generation) == (reason, current)


@pytest.mark.parametrize(
    ("call", "args", "kwargs"),
    [
        ("claim", ("a b",), {"owner": "a", "ttl": 10}),
        ("claim", ("x" * 257,), {"owner": "a", "ttl": 10}),
        ("claim", ("",), {"owner": "a", "ttl": 10}),
        ("claim", (42,), {"owner": "a", "ttl": 10}),
        ("claim", ("j",), {"owner": "a b", "ttl": 10}),
        ("claim", ("j",), {"owner": "", "ttl": 10}),
        ("claim", ("j",), {"owner": "a", "ttl": 0.04}),
        ("claim", ("j",), {"owner": "a", "ttl": 86401}),
        ("claim", ("j",), {"owner": "a", "ttl": 10**400}),
        ("claim", ("j",), {"owner": "a", "ttl": True}),
        ("claim", ("j",), {"owner": "a", "ttl": "10"}),
        ("renew", (_lease("j", "a", 1),), {"ttl": float("nan")}),
        ("renew", ("j",), {}),
        ("renew", (_lease("j", "a", 0),), {}),
        ("complete", (_lease("j", "a b", 1),), {}),
        ("release", (_lease("j", "a", 2**63),), {}),
        ("get", ("é",), {}),
    ],
)
async def test_bad_arguments_raise_value_error_before_anything_is_sent(
    call: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    # Nobody listens at this address: a request would be StoreUnavailable, not ValueError.
    async with await HTTPLeaseStore.open(closed_port_url()) as store:
        with pytest.raises(ValueError):
            await getattr(store, call)(*args, **kwargs)


@pytest.mark.parametrize("job_id", ["a/b", ".", "..", "100%", "a?b#c", "../../admin", "%2F"])
async def test_job_ids_with_url_characters_reach_the_right_job(
    store: HTTPLeaseStore, backing: SQLiteStore, job_id: str
) -> None:
    lease = await store.claim(job_id, owner="a", ttl=10)
    assert lease.job_id == job_id
    assert await backing.get(job_id) == lease
    assert await store.get(job_id) == lease
    assert (await store.complete(lease)).state == "done"


# --- the network failing ---------------------------------------------------------------


async def test_closed_port_is_store_unavailable() -> None:
    async with await HTTPLeaseStore.open(closed_port_url(), timeout=2.0) as store:
        with pytest.raises(StoreUnavailable):
            await store.claim("j", owner="a", ttl=10)
        with pytest.raises(StoreUnavailable):
            await store.get("j")


async def test_timeout_is_store_unavailable(
    odd_server: tuple[TestServer, dict[str, Any]],
) -> None:
    srv, state = odd_server
    state["hang"] = True
    async with await HTTPLeaseStore.open(str(srv.make_url("/")), timeout=0.2) as store:
        with pytest.raises(StoreUnavailable, match="timed out"):
            await store.renew(_lease("j", "a", 1))


@pytest.mark.parametrize(
    ("status", "body", "ctype"),
    [
        (500, b"Internal Server Error", "text/plain"),
        (502, b"<html>bad gateway</html>", "text/html"),
        (503, b'{"reason": "store_unavailable", "status": 503}', "application/problem+json"),
        (200, b"not json", "application/json"),
        (200, b'{"job_id": "j"}', "application/json"),
        (200, b"[1]", "application/json"),
        (404, b"Not Found", "text/plain"),
        (401, b'{"reason": "unauthorized", "status": 401}', "application/problem+json"),
    ],
)
async def test_answers_it_cannot_use_are_store_unavailable(
    odd_server: tuple[TestServer, dict[str, Any]], status: int, body: bytes, ctype: str
) -> None:
    srv, state = odd_server
    state.update(status=status, body=body, ctype=ctype)
    async with await HTTPLeaseStore.open(str(srv.make_url("/"))) as store:
        with pytest.raises(StoreUnavailable) as claimed:
            await store.claim("j", owner="a", ttl=10)
        with pytest.raises(StoreUnavailable):
            await store.renew(_lease("j", "a", 1))
    # the status of the answer it could not use: a 401 is the token, not an outage
    assert claimed.value.status == status


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (404, b'{"reason": "not_found", "detail": "no route /leases/j/claim"}'),  # admin's
        (201, b'{"ok": true}'),  # an upstream's
        (404, b"Not Found"),  # no JSON at all
    ],
)
async def test_a_url_that_is_not_the_lease_apis_is_named_as_the_likely_cause(
    odd_server: tuple[TestServer, dict[str, Any]], status: int, body: bytes
) -> None:
    srv, state = odd_server
    state.update(status=status, body=body, ctype="application/json")
    async with await HTTPLeaseStore.open(str(srv.make_url("/"))) as store:
        with pytest.raises(StoreUnavailable, match=r"is http://.* the gateway's main listener"):
            await store.claim("j", owner="a", ttl=10)


async def test_gateway_store_closed_underneath_is_store_unavailable(
    store: HTTPLeaseStore, backing: SQLiteStore
) -> None:
    lease = await store.claim("j", owner="a", ttl=10)
    await backing.close()
    with pytest.raises(StoreUnavailable):
        await store.renew(lease)
    with pytest.raises(StoreUnavailable):
        await store.get("j")


# --- options -----------------------------------------------------------------------------


async def test_headers_option_goes_with_every_call(
    odd_server: tuple[TestServer, dict[str, Any]],
) -> None:
    srv, state = odd_server
    url = str(srv.make_url("/prefix/"))
    async with await HTTPLeaseStore.open(url, headers={"Authorization": "Bearer s3cret"}) as store:
        with pytest.raises(StoreUnavailable):
            await store.get("a/b")
    method, path, headers = state["seen"][0]
    assert (method, path) == ("GET", "/prefix/leases/a%2Fb")
    assert headers["Authorization"] == "Bearer s3cret"


async def test_a_session_passed_in_is_used_and_left_open(server: TestServer) -> None:
    async with aiohttp.ClientSession() as session:
        store = await HTTPLeaseStore.open(str(server.make_url("/")), session=session)
        assert (await store.claim("j", owner="a", ttl=1)).generation == 1
        await store.close()
        assert not session.closed


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("ftp://host", {}),
        ("http://", {}),
        ("http://host?x=1", {}),
        ("http://host", {"timeout": 0}),
        ("http://host", {"timeout": True}),
        ("http://host", {"headers": {"X": 1}}),
    ],
)
async def test_bad_open_arguments_raise_value_error(url: str, options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        await HTTPLeaseStore.open(url, **options)


# --- hold() over HTTP ----------------------------------------------------------------------


async def _until(predicate: Any, *, within: float = 5.0) -> None:
    await eventually(predicate, within=within, every=0.01)


async def test_hold_renews_over_http(
    store: HTTPLeaseStore, backing: SQLiteStore, fake_clock: FakeClock
) -> None:
    async with hold(store, "j", owner="a", ttl=1.0) as lease:
        first_until = lease.lease_until
        fake_clock.advance(0.5)  # the next renewal then lands at a later lease_until

        async def renewed() -> bool:
            current = await backing.get("j")
            return current is not None and current.lease_until > first_until

        await _until(renewed)
    done = await backing.get("j")
    assert done is not None and done.state == "done" and done.generation == 1


async def test_hold_over_http_is_lost_once_another_owner_claims(
    store: HTTPLeaseStore, backing: SQLiteStore, fake_clock: FakeClock
) -> None:
    reached_end = False
    with pytest.raises(LeaseLost) as info:
        async with asyncio.timeout(5):
            async with hold(store, "j", owner="a", ttl=1.0):
                fake_clock.advance(1.0)  # expired by the store's clock
                await backing.claim("j", owner="b", ttl=30)
                await asyncio.sleep(30)  # cancelled by the failed renewal
                reached_end = True
    assert not reached_end
    assert info.value.reason == "stale_generation"
    assert info.value.current_generation == 2
    current = await backing.get("j")
    assert current is not None and (current.owner, current.state) == ("b", "active")


async def test_hold_over_http_treats_an_unreachable_store_as_failed_renewals(
    store: HTTPLeaseStore, backing: SQLiteStore, server: TestServer
) -> None:
    """Renewals answered 503 are retried, not fatal, until the worker's own deadline."""
    with pytest.raises(LeaseLost) as info:
        async with asyncio.timeout(5):
            async with hold(store, "j", owner="a", ttl=0.5):
                await backing.close()  # every renewal is now a 503
                await asyncio.sleep(30)
    # Lost at the local deadline, after renewals that failed as store_unavailable.
    assert info.value.reason in ("lease_expired", "store_unavailable")
    failed = server.app[METRICS].registry.get_sample_value(
        "sinkgate_lease_operations_total", {"op": "renew", "result": "store_unavailable"}
    )
    assert failed is not None and failed >= 1
