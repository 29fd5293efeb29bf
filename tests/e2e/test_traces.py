"""Traces (SPEC 10): the spans a write and a lease call make, recorded by the SDK's
in-memory exporter, through a real gateway and a real recording upstream.

Each test turns tracing on with its own provider before the app is built (as
`sinkgate serve` does from the OTEL_* variables) and off again afterwards.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp.test_utils import make_mocked_request
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.telemetry import traces
from leases.http import HTTPLeaseStore
from leases.writer import FencedWriter, StaleWrite
from tests.harness import (
    Gateway,
    RecordingUpstream,
    destination,
    make_config,
    recording_upstream,
    running_gateway,
)

# A worker's span: trace 4bf9..., span 00f0..., sampled.
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
WORKER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{WORKER_SPAN}-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traces.use_provider(provider)
    try:
        yield exporter
    finally:
        traces.use_provider(None)
        provider.shutdown()


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    async with recording_upstream() as up:
        yield up


@pytest.fixture
async def gw(
    tmp_path: Path, upstream: RecordingUpstream, spans: InMemorySpanExporter
) -> AsyncIterator[Gateway]:
    config = make_config(tmp_path, destination("pay", upstream.url))
    async with running_gateway(config) as gateway:
        yield gateway


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def only(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = named(exporter, name)
    assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
    return found[0]


def children(exporter: InMemorySpanExporter, parent: ReadableSpan) -> list[str]:
    return sorted(
        s.name
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == parent.context.span_id
    )


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    return format(span.context.trace_id, "032x"), format(span.context.span_id, "016x")


async def test_a_forwarded_write_is_a_span_tree_continuing_the_worker_trace(
    gw: Gateway, upstream: RecordingUpstream, spans: InMemorySpanExporter
) -> None:
    await gw.claim("job-1")
    status, _, _ = await gw.write(
        "/to/pay/charges", headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
    )
    assert status == 201
    write = only(spans, "sinkgate.write")
    assert write.kind is SpanKind.SERVER
    assert hex_ids(write)[0] == TRACE_ID
    assert write.parent is not None and format(write.parent.span_id, "016x") == WORKER_SPAN
    assert write.context.trace_state.get("vendor") == "1"
    assert children(spans, write) == ["POST", "sinkgate.store.decide", "sinkgate.store.record"]
    attrs = dict(write.attributes or {})
    assert attrs["sinkgate.destination"] == "pay"
    assert attrs["sinkgate.job_id"] == "job-1"
    assert attrs["sinkgate.generation"] == 1
    assert attrs["sinkgate.decision"] == "forwarded"
    assert "sinkgate.reason" not in attrs
    assert attrs["http.request.method"] == "POST"
    assert attrs["http.response.status_code"] == 201
    assert attrs["http.route"] == "/to/{destination}/{path}"
    decide = only(spans, "sinkgate.store.decide")
    assert (decide.attributes or {})["sinkgate.decision"] == "forwarded"
    assert (only(spans, "sinkgate.store.record").attributes or {})["sinkgate.outcome"] == (
        "completed"
    )


async def test_the_upstream_receives_the_forward_span_as_its_parent(
    gw: Gateway, upstream: RecordingUpstream, spans: InMemorySpanExporter
) -> None:
    await gw.claim("job-1")
    await gw.write("/to/pay/charges", headers={"traceparent": TRACEPARENT})
    forward = only(spans, "POST")
    assert forward.kind is SpanKind.CLIENT
    trace_id, span_id = hex_ids(forward)
    # Not the worker's traceparent passed through: the gateway's client span.
    assert upstream.received[0].headers["traceparent"] == f"00-{trace_id}-{span_id}-01"
    assert trace_id == TRACE_ID
    attrs = dict(forward.attributes or {})
    assert attrs["http.response.status_code"] == 201
    assert attrs["url.full"] == f"{upstream.url}/charges"
    assert attrs["server.address"] == "127.0.0.1"


async def test_a_write_without_traceparent_starts_a_trace(
    gw: Gateway, spans: InMemorySpanExporter
) -> None:
    await gw.claim("job-1")
    await gw.write("/to/pay/charges")
    write = only(spans, "sinkgate.write")
    assert write.parent is None and write.context.trace_id != int(TRACE_ID, 16)


async def test_a_rejected_write_carries_reason_and_rejection_id(
    gw: Gateway, upstream: RecordingUpstream, spans: InMemorySpanExporter
) -> None:
    await gw.claim("job-1")
    gw.clock.advance(31)
    assert await gw.claim("job-1", owner="worker-b") == 2
    status, headers, body = await gw.write("/to/pay/charges", generation=1)
    assert status == 409 and headers["Sinkgate-Rejected"] == "stale_generation"
    rejection_id = json.loads(body)["rejection_id"]
    assert isinstance(rejection_id, int)
    attrs = dict(only(spans, "sinkgate.write").attributes or {})
    assert attrs["sinkgate.decision"] == "rejected"
    assert attrs["sinkgate.reason"] == "stale_generation"
    assert attrs["sinkgate.rejection_id"] == rejection_id
    assert attrs["http.response.status_code"] == 409
    assert not named(spans, "POST") and not upstream.received


async def test_a_request_refused_before_the_decision_carries_its_rejection_id(
    gw: Gateway, spans: InMemorySpanExporter
) -> None:
    status, _, body = await gw.write("/to/pay/charges", generation="007")
    assert status == 400
    attrs = dict(only(spans, "sinkgate.write").attributes or {})
    assert attrs["sinkgate.reason"] == "invalid_fencing_token"
    assert attrs["sinkgate.rejection_id"] == json.loads(body)["rejection_id"]
    assert named(spans, "sinkgate.store.record_rejection")


async def test_an_unknown_destination_and_its_path_are_cut_in_the_span(
    gw: Gateway, spans: InMemorySpanExporter
) -> None:
    """`/to/<3000 characters>/x` put the whole name and path, anybody's, into the span."""
    status, _, _ = await gw.write(f"/to/{'A' * 3000}/x")
    assert status == 404
    attrs = dict(only(spans, "sinkgate.write").attributes or {})
    assert attrs["sinkgate.destination"] == "A" * 80
    assert attrs["url.path"] == "/to/" + "A" * 196


async def test_a_replayed_write_carries_reason_duplicate(
    gw: Gateway, upstream: RecordingUpstream, spans: InMemorySpanExporter
) -> None:
    await gw.claim("job-1")
    await gw.write("/to/pay/charges")
    spans.clear()
    status, headers, _ = await gw.write("/to/pay/charges")
    assert status == 201 and headers["Idempotent-Replayed"] == "true"
    write = only(spans, "sinkgate.write")
    attrs = dict(write.attributes or {})
    assert attrs["sinkgate.decision"] == "replayed"
    assert attrs["sinkgate.reason"] == "duplicate"
    assert type(attrs["sinkgate.reason"]) is str  # not the Reason enum: exporters see a string
    assert children(spans, write) == ["sinkgate.store.decide"]  # no second forward
    assert len(upstream.received) == 1


async def test_an_upstream_5xx_marks_the_client_span_and_a_gateway_5xx_the_server_span(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    config = make_config(tmp_path, destination("pay", "http://127.0.0.1:9"))  # nothing there
    async with running_gateway(config) as gw:
        await gw.claim("job-1")
        status, headers, _ = await gw.write("/to/pay/charges")
    assert status == 502 and headers["Sinkgate-Rejected"] == "upstream_unreachable"
    write = only(spans, "sinkgate.write")
    assert write.status.is_ok is False
    assert (write.attributes or {})["error.type"] == "upstream_unreachable"
    assert (only(spans, "POST").attributes or {})["error.type"] == "upstream_unreachable"


async def test_the_decision_log_line_names_the_trace_and_span(
    gw: Gateway, spans: InMemorySpanExporter
) -> None:
    await gw.claim("job-1")
    with structlog.testing.capture_logs() as logs:
        await gw.write("/to/pay/charges", headers={"traceparent": TRACEPARENT})
    line = next(e for e in logs if e["event"] == "write_decision")
    assert (line["trace_id"], line["span_id"]) == hex_ids(only(spans, "sinkgate.write"))


async def test_without_tracing_the_log_line_has_no_trace_ids(tmp_path: Path) -> None:
    """Tracing off: no span, no ids, the worker's traceparent passed on untouched."""
    async with recording_upstream() as upstream:
        config = make_config(tmp_path, destination("pay", upstream.url))
        async with running_gateway(config) as gw:
            await gw.claim("job-1")
            with structlog.testing.capture_logs() as logs:
                await gw.write("/to/pay/charges", headers={"traceparent": TRACEPARENT})
    line = next(e for e in logs if e["event"] == "write_decision")
    assert "trace_id" not in line and "span_id" not in line
    assert upstream.received[0].headers["traceparent"] == TRACEPARENT


async def test_lease_calls_are_spans_and_the_http_store_propagates(
    gw: Gateway, spans: InMemorySpanExporter
) -> None:
    async with await HTTPLeaseStore.open(gw.url) as store:
        with structlog.testing.capture_logs() as logs:
            lease = await store.claim("job-7", owner="w", ttl=30)
        lease = await store.renew(lease)
        await store.get("job-7")
        await store.complete(lease)
        with pytest.raises(Exception):  # noqa: B017 - whichever refusal: the span is the point
            await store.release(lease)
    for op in ("claim", "renew", "get", "complete", "release"):
        server, client = sorted(named(spans, f"sinkgate.lease.{op}"), key=lambda s: s.kind.value)
        assert (server.kind, client.kind) == (SpanKind.SERVER, SpanKind.CLIENT)
        assert server.parent is not None and server.parent.span_id == client.context.span_id
        assert server.context.trace_id == client.context.trace_id
    claim = next(s for s in named(spans, "sinkgate.lease.claim") if s.kind is SpanKind.SERVER)
    attrs = dict(claim.attributes or {})
    assert attrs["sinkgate.job_id"] == "job-7" and attrs["sinkgate.generation"] == 1
    assert attrs["sinkgate.lease.result"] == "ok"
    line = next(e for e in logs if e["event"] == "lease_decision")
    assert (line["trace_id"], line["span_id"]) == hex_ids(claim)
    release = next(s for s in named(spans, "sinkgate.lease.release") if s.kind is SpanKind.SERVER)
    assert (release.attributes or {})["sinkgate.lease.result"] != "ok"


async def test_a_lease_path_naming_no_operation_is_other_in_the_span(
    gw: Gateway, spans: InMemorySpanExporter
) -> None:
    """The span took the raw path segment as `sinkgate.lease.op`, which the metric
    and the line already named `(other)`: anybody's string in every trace."""
    async with gw.session.post(f"{gw.url}/leases/job-1/FYysE5Xg5Saa", json={}) as response:
        assert response.status == 404
    [span] = named(spans, "sinkgate.lease")
    assert (span.attributes or {})["sinkgate.lease.op"] == "(other)"


async def test_the_fenced_writer_makes_the_worker_span_the_gateway_continues(
    gw: Gateway, upstream: RecordingUpstream, spans: InMemorySpanExporter
) -> None:
    async with await HTTPLeaseStore.open(gw.url) as store:
        lease = await store.claim("job-9", owner="w", ttl=30)
    async with FencedWriter(gw.url, lease) as writer:
        await writer.post("pay", "/charges", json={"n": 1}, step="charge")
        gw.clock.advance(31)
        async with await HTTPLeaseStore.open(gw.url) as store:
            await store.claim("job-9", owner="other", ttl=30)
        with pytest.raises(StaleWrite):
            await writer.post("pay", "/charges", json={"n": 2}, step="again")
    clients = [s for s in named(spans, "sinkgate.write") if s.kind is SpanKind.CLIENT]
    servers = [s for s in named(spans, "sinkgate.write") if s.kind is SpanKind.SERVER]
    assert len(clients) == len(servers) == 2
    for client, server in zip(clients, servers, strict=True):
        assert server.parent is not None and server.parent.span_id == client.context.span_id
    first: dict[str, Any] = dict(clients[0].attributes or {})
    assert first["sinkgate.job_id"] == "job-9" and first["sinkgate.generation"] == 1
    assert first["http.response.status_code"] == 201
    assert (clients[1].attributes or {})["sinkgate.reason"] == "stale_generation"
    assert upstream.received[0].headers["traceparent"].split("-")[1] == hex_ids(clients[0])[0]


async def test_a_worker_trace_not_sampled_is_not_recorded_but_still_propagated(
    gw: Gateway, upstream: RecordingUpstream, spans: InMemorySpanExporter
) -> None:
    """The default sampler follows the worker's decision (flags 00: not sampled)."""
    await gw.claim("job-1")
    spans.clear()
    with structlog.testing.capture_logs() as logs:
        status, _, _ = await gw.write(
            "/to/pay/charges", headers={"traceparent": f"00-{TRACE_ID}-{WORKER_SPAN}-00"}
        )
    assert status == 201
    assert spans.get_finished_spans() == ()
    sent = upstream.received[0].headers["traceparent"].split("-")
    assert (sent[1], sent[3]) == (TRACE_ID, "00") and sent[2] != WORKER_SPAN
    line = next(e for e in logs if e["event"] == "write_decision")
    assert line["trace_id"] == TRACE_ID


@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        f"00-{'0' * 32}-{WORKER_SPAN}-01",  # the all-zero trace id is invalid
        f"00-{TRACE_ID}-{WORKER_SPAN}-01-extra",
        "00-" + "x" * 5000,
    ],
)
async def test_a_malformed_traceparent_starts_a_new_trace_and_the_write_goes_through(
    gw: Gateway, spans: InMemorySpanExporter, traceparent: str
) -> None:
    await gw.claim("job-1")
    status, _, _ = await gw.write(
        "/to/pay/charges", headers={"traceparent": traceparent, "tracestate": "=,=bad"}
    )
    assert status == 201
    write = only(spans, "sinkgate.write")
    assert write.parent is None


@pytest.mark.parametrize(("host", "port"), [("gw:8080", 8080), ("gw:²", None), ("gw", None)])
def test_the_server_port_is_read_from_ascii_digits_only(host: str, port: int | None) -> None:
    """ "²" is a digit to `str.isdigit` but not to `int`: a traced request whose
    Host header ended in it was answered 500."""
    request = make_mocked_request("POST", "/to/pay/x", headers={"Host": host})
    attributes = traces._server_attributes(request, "/to/{destination}/{path}")
    assert attributes.get("server.port") == port
