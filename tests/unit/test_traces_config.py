"""When tracing is on (SPEC 10): only with the extra and an exporter named in
OTEL_TRACES_EXPORTER; off, the write route's objects are left exactly as they are."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gateway.telemetry import traces
from leases import tracing as lease_tracing


@pytest.fixture(autouse=True)
def tracing_off_after(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    yield
    traces.shutdown()
    traces.use_provider(None)


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"OTEL_TRACES_EXPORTER": "none"},
        {"OTEL_TRACES_EXPORTER": " "},
        {"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"},
    ],
)
def test_no_exporter_named_means_off(
    environ: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert traces.configure_from_env() is False
    assert traces.TRACER is None


def test_an_exporter_named_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not the global provider: the API lets that be set once per process.
    monkeypatch.setattr("opentelemetry.trace.set_tracer_provider", lambda provider: None)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gw-a")
    assert traces.configure_from_env() is True
    assert traces.TRACER is not None
    provider = traces._PROVIDER
    assert provider.resource.attributes["service.name"] == "gw-a"
    exporter = provider._active_span_processor._span_processors[0]._batch_processor._exporter
    assert type(exporter).__module__.startswith("opentelemetry.exporter.otlp.proto.http")


@pytest.mark.parametrize(
    ("environ", "reason"),
    [
        ({"OTEL_TRACES_EXPORTER": "nosuch"}, "no trace exporter named 'nosuch'"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"},
            "unsupported OTLP protocol",
        ),
    ],
)
def test_an_exporter_that_cannot_be_had_leaves_it_off_and_says_why(
    environ: dict[str, str], reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with capture_logs() as logs:
        assert traces.configure_from_env() is False
    assert traces.TRACER is None
    assert any(e["event"] == "tracing_off" and reason in e["reason"] for e in logs)


def test_without_the_extra_it_stays_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m.startswith("opentelemetry")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # import fails
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    with capture_logs() as logs:
        assert traces.configure_from_env() is False
    assert "sinkgate[otel] is not installed" in logs[0]["reason"]
    assert lease_tracing.tracer() is None  # the worker side: no API, no spans


def test_off_the_write_route_keeps_its_own_handler_store_and_upstreams() -> None:
    handle, store, upstreams = object(), object(), object()
    assert traces.traced_write_handler(handle) is handle  # type: ignore[arg-type]
    assert traces.traced_write_store(store) is store
    assert traces.traced_upstreams(upstreams) is upstreams


def test_off_a_lease_handler_is_registered_as_it_is() -> None:
    async def handler(request: object) -> None: ...

    assert traces.traced_lease_handler(handler) is handler  # type: ignore[arg-type]


def test_on_the_write_route_is_wrapped(tmp_path: Path) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    traces.use_provider(TracerProvider())
    handle, store, upstreams = object(), object(), object()
    assert traces.traced_write_handler(handle) is not handle  # type: ignore[arg-type]
    assert traces.traced_write_store(store) is not store
    assert traces.traced_upstreams(upstreams) is not upstreams


def test_the_worker_side_is_off_until_an_sdk_provider_exists() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    assert lease_tracing.tracer() is None  # the API's default proxy provider
    headers: dict[str, str] = {}
    with lease_tracing.client_span("sinkgate.write", headers, dict) as span:
        assert span is None
    assert headers == {}
    lease_tracing.use_tracer_provider(TracerProvider())
    with lease_tracing.client_span("sinkgate.write", headers, dict) as span:
        assert span is not None
    assert headers["traceparent"].startswith("00-")


def test_the_traced_store_hides_the_ways_around_its_decide_span() -> None:
    """Traced, a woken write's decision goes through `decide_write` (its span):
    the store's group decisions and its wake-started decisions are hidden, so the
    write route falls back to it."""
    from gateway.store.protocol import GroupDecisions, StartsDecisions

    class Store:
        async def decide_write(self, facts: object, context: object) -> None: ...
        async def decide_group(self, writes: object) -> None: ...
        def start_decision(self, facts: object, context: object, answer: object) -> None: ...

    store = Store()
    assert isinstance(store, GroupDecisions) and isinstance(store, StartsDecisions)
    traced = traces._TracedStore(store, tracer=None)
    assert not isinstance(traced, GroupDecisions)
    assert not isinstance(traced, StartsDecisions)
