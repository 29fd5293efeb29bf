"""The OpenAPI document against what the server really does.

A schemathesis run over a live gateway (a real `create_app` on loopback, a real
recording upstream, a real admin app on its own listener): every operation of
the lease API and the admin API is called with generated requests, valid and
invalid, and every answer must be free of 5xx and conform to the document
(status code, content type, headers, body schema).

schemathesis calls the server synchronously (requests), so the servers run on
an event loop of their own in a background thread for the module.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import urllib.request
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import pytest
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, settings
from openapi_spec_validator import validate
from schemathesis.checks import positive_data_acceptance
from schemathesis.schemas import BaseSchema

from gateway.admin.app import create_admin_app
from gateway.http.appkeys import METRICS
from gateway.http.server import GatewayRunner
from gateway.openapi.document import Listeners, build_document
from tests.harness import (
    destination,
    free_port,
    make_config,
    recording_upstream,
    running_gateway,
)
from tests.served import served

ADMIN_TOKEN = "admin-secret-for-tests"
MAX_EXAMPLES = 40

# The document as the live gateway serves it: its `servers` (the top-level one and
# the admin paths' own) send each call to the right listener, with no base URL
# given here (a tool pointed at /openapi.json needs nothing else).
served_document = schemathesis.pytest.from_fixture("served_schema")
# The write route forwards to an upstream whose answers are, by design, not in
# this document; it is covered by the hardening and end-to-end tests.
# POST /admin/reload re-reads the files of a running `serve` (tests/e2e/test_reload.py).
fuzzed = served_document.exclude(path_regex="^/to/").exclude(path="/admin/reload")


@dataclass(frozen=True)
class Live:
    main: str
    admin: str


@asynccontextmanager
async def _servers(tmp_path: Path) -> AsyncIterator[Live]:
    async with recording_upstream() as upstream:
        config = make_config(tmp_path, destination("pay", upstream.url + "/api"))
        # The admin app below listens where the config says, as under `serve`.
        config = replace(config, admin_listen=("127.0.0.1", free_port()))
        async with running_gateway(config) as gateway:
            # A few rows so that the admin API's reads find something.
            await gateway.claim("job-1")
            await gateway.write("/to/pay/x", job="job-1", generation=1, key="k-1")
            await gateway.write("/to/pay/x", job="job-1", generation=9, key="k-2")
            admin = create_admin_app(gateway.store, gateway.app[METRICS], token=ADMIN_TOKEN)
            runner = GatewayRunner(admin)
            await runner.setup()
            await web.TCPSite(runner, *config.admin_listen).start()
            host, port = runner.addresses[0][:2]
            try:
                yield Live(gateway.url, f"http://{host}:{port}")
            finally:
                await runner.cleanup()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """The servers on their own loop in a thread, for the whole module."""
    loop = asyncio.new_event_loop()
    ready: Future[Live] = Future()
    stop = asyncio.Event()

    async def main() -> None:
        try:
            async with _servers(tmp_path_factory.mktemp("openapi")) as servers:
                ready.set_result(servers)
                await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        yield ready.result(timeout=30)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)
        assert not thread.is_alive(), "the test servers did not stop"
        loop.close()


def test_the_document_is_valid_openapi_3_1() -> None:
    document = build_document()
    validate(document)
    assert document["openapi"].startswith("3.1")
    assert {
        "/leases/{job_id}/claim",
        "/to/{destination}/{path}",
        "/admin/rejections",
    } <= document["paths"].keys()


def test_the_write_route_documents_prefer_wait_and_preference_applied() -> None:
    """SPEC 2 "Waiting": the request header and the answer's, on replays and refusals."""
    post = build_document()["paths"]["/to/{destination}/{path}"]["post"]
    assert "Prefer" in {p["name"] for p in post["parameters"]}
    for status in ("default", "409"):
        assert "Preference-Applied" in post["responses"][status]["headers"]
    pattern = re.compile(
        post["responses"]["409"]["headers"]["Preference-Applied"]["schema"]["pattern"]
    )
    # A relayed answer may carry the upstream's own preferences first (`_add_applied`).
    assert pattern.fullmatch("wait=5") and pattern.fullmatch("respond-async, wait=5")
    assert pattern.fullmatch("wait=5, (x)")  # first, where the upstream's cannot be read past
    assert not pattern.fullmatch("wait=0")
    # The two refusals a wait is about say when to try again.
    assert "Retry-After" in post["responses"]["409"]["headers"]


def test_the_main_listener_documents_its_refusal_of_pages_and_lease_tokens() -> None:
    paths = build_document()["paths"]
    for path, method in (("/leases/{job_id}", "get"), ("/leases/{job_id}/claim", "post")):
        operation = paths[path][method]
        assert {"401", "403"} <= operation["responses"].keys(), path
        assert {"leaseToken": []} in operation["security"]
    assert "403" in paths["/to/{destination}/{path}"]["post"]["responses"]


@pytest.fixture(scope="module")
def served_schema(live: Live) -> BaseSchema:
    return schemathesis.openapi.from_url(f"{live.main}/openapi.json")


def test_the_gateway_serves_the_document_naming_its_own_listeners(live: Live) -> None:
    """Tools follow `servers`: the served document names the listeners this gateway
    has (here on ports other than the defaults), the admin paths the admin one."""
    with urllib.request.urlopen(f"{live.main}/openapi.json", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/json")
        document = json.loads(resp.read())
    validate(document)
    assert document == build_document(Listeners(live.main, live.admin))
    assert document["servers"][0]["url"] == live.main
    assert document["paths"]["/admin/rejections"]["servers"][0]["url"] == live.admin
    assert "8480" not in live.main and "8481" not in json.dumps(document)


async def test_a_wildcard_listener_is_named_as_the_caller_reached_it(tmp_path: Path) -> None:
    """`listen = "0.0.0.0:..."` is no address a tool can call: the served document
    names the local address the request came in on, and the admin listener as bound
    (its port 0 resolved)."""
    config = replace(make_config(tmp_path), listen=("0.0.0.0", 0))
    async with served(config) as info, aiohttp.ClientSession() as session:
        port = info["listen"].rsplit(":", 1)[1]
        async with session.get(f"http://127.0.0.1:{port}/openapi.json") as resp:
            document = await resp.json()
    assert document["servers"][0]["url"] == f"http://127.0.0.1:{port}"
    admin = document["paths"]["/admin/rejections"]["servers"][0]["url"]
    assert admin == f"http://{info['admin_listen']}" and not admin.endswith(":0")


@fuzzed.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_the_server_answers_as_documented(case: schemathesis.Case, live: Live) -> None:
    """No 5xx, and every answer (status, content type, headers, body) is in the document."""
    admin = case.path.startswith("/admin") or case.path == "/metrics"
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"} if admin else None
    # Not checked: "schema-valid data is accepted". A schema cannot say what the
    # server rightly refuses: an opaque `cursor` it never handed out, or 6634.0 as a
    # generation (JSON Schema counts it as an integer; SPEC 3 wants an integer
    # literal). Every other check runs, the negative one ("invalid data is
    # refused") included.
    case.call_and_validate(
        headers=headers,
        excluded_checks=[positive_data_acceptance],
    )
