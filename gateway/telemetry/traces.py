"""OpenTelemetry traces of writes and lease calls (SPEC 10), off unless configured.

Tracing is on only when the `sinkgate[otel]` extra is installed and
`OTEL_TRACES_EXPORTER` names an exporter (`configure_from_env`, called once by
`sinkgate serve`). Off, `TRACER` is None and nothing here is ever called on the
write path: the route checks that one name before its log line, and
the `traced_*` wrappers hand back the untouched objects, so
no span, no context extraction and no extra await happen per write.

On, a write is a server span `sinkgate.write` continuing the worker's
`traceparent`, with children `sinkgate.store.decide`, the upstream call (a client
span whose context the upstream receives as `traceparent`) and
`sinkgate.store.record`; each lease call is a server span `sinkgate.lease.<op>`.
The spans are made by wrapping the write handler, the store and the upstream pool
the app gives the write route (`gateway.app`), so the route itself only hands over
its log fields.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar, cast

import structlog
from aiohttp import web

from leases import tracing as lease_tracing

log = structlog.get_logger("gateway.traces")

T = TypeVar("T")


class WriteHandler(Protocol):
    """The write route's handler (`WriteGateway.handle`)."""

    def __call__(
        self, request: web.Request, target: Any, *, continued: bool = False
    ) -> Awaitable[web.StreamResponse]: ...


# None: tracing is off. The only name the write path reads when it is.
TRACER: Any = None
_PROVIDER: Any = None

_LEASE_OPS = frozenset({"claim", "renew", "complete", "release", "get"})
_DECISIONS = {"Forward": "forwarded", "Replay": "replayed", "Reject": "rejected"}
# The log fields a write span carries, under their span attribute names.
_WRITE_ATTRIBUTES = {
    "destination": "sinkgate.destination",
    "job_id": "sinkgate.job_id",
    "generation": "sinkgate.generation",
    "key": "sinkgate.idempotency_key",
    "decision": "sinkgate.decision",
    "reason": "sinkgate.reason",
    "rejection_id": "sinkgate.rejection_id",
    "attempt": "sinkgate.attempt",
    "outcome": "sinkgate.outcome",
    "upstream_status": "sinkgate.upstream_status",
}
_LEASE_ATTRIBUTES = {
    "job_id": "sinkgate.job_id",
    "owner": "sinkgate.owner",
    "generation": "sinkgate.generation",
    "result": "sinkgate.lease.result",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --- configuration ---------------------------------------------------------------------


def configure_from_env() -> bool:
    """Turn tracing on from the standard `OTEL_*` variables; True if it is on.

    Off (and nothing imported beyond this module's try) without the extra, with
    `OTEL_SDK_DISABLED=true`, or with `OTEL_TRACES_EXPORTER` unset or `none`.
    A configuration the SDK cannot honour is logged and leaves tracing off: a
    tracing backend is never a reason for the gateway not to serve. Reads
    `os.environ`, as the SDK's exporters, sampler and resource do.
    """
    environ = os.environ
    names = [n.strip() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or names in ([], ["none"]):
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        reason = "OTEL_TRACES_EXPORTER is set but sinkgate[otel] is not installed"
        log.warning("tracing_off", reason=reason)
        return False
    try:
        exporters = [_exporter(name, environ) for name in names]
    except (RuntimeError, ImportError) as exc:
        log.warning("tracing_off", reason=str(exc))
        return False
    provider = TracerProvider(resource=_resource())  # sampler from OTEL_TRACES_SAMPLER
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* apply
    trace.set_tracer_provider(provider)  # other instrumentation in the process joins
    use_provider(provider)
    log.info("tracing_on", exporters=names)
    return True


def use_provider(provider: Any) -> None:
    """Trace with `provider` (a `TracerProvider`); None turns tracing off."""
    global TRACER, _PROVIDER
    _PROVIDER = provider
    TRACER = None if provider is None else provider.get_tracer("sinkgate")
    lease_tracing.use_tracer_provider(provider)


def shutdown() -> None:
    """Flush and stop the exporters (at the end of `sinkgate serve`)."""
    if _PROVIDER is not None:
        _PROVIDER.shutdown()


def _exporter(name: str, environ: Mapping[str, str]) -> Any:
    """The exporter registered under `name`, as the SDK's own auto-configuration
    finds it: the `opentelemetry_traces_exporter` entry points, with `otlp` read as
    the protocol of `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL` (http/protobuf by
    default, the OTLP specification's default)."""
    from importlib.metadata import entry_points

    if name == "otlp":
        protocol = (
            environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        ).strip()
        by_protocol = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}
        if protocol not in by_protocol:
            raise RuntimeError(f"unsupported OTLP protocol {protocol!r}")
        name = by_protocol[protocol]
    found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
    if not found:
        raise RuntimeError(f"no trace exporter named {name!r} is installed")
    exporter_class = found[0].load()
    return exporter_class()  # endpoint, headers, timeout: from OTEL_*


def _resource() -> Any:
    """`OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES`, else service.name `sinkgate`."""
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "sinkgate"}))
    return resource


# --- log correlation -------------------------------------------------------------------


def annotate(fields: dict[str, Any], names: Mapping[str, str] = _WRITE_ATTRIBUTES) -> None:
    """Copy a decision's log fields onto the current span, and its ids into the fields."""
    from opentelemetry import trace

    span = trace.get_current_span()
    context = span.get_span_context()
    if not context.is_valid:
        return
    fields["trace_id"] = format(context.trace_id, "032x")
    fields["span_id"] = format(context.span_id, "016x")
    if not span.is_recording():
        return
    for name, attr in names.items():
        value = fields.get(name)
        if value is not None:
            # A reason is a StrEnum: exported as its plain string value.
            span.set_attribute(attr, str(value) if isinstance(value, str) else value)


def annotate_lease(fields: dict[str, Any]) -> None:
    """`annotate` for a lease call's log fields."""
    annotate(fields, _LEASE_ATTRIBUTES)


# --- the write path --------------------------------------------------------------------


def traced_write_handler(handle: WriteHandler) -> WriteHandler:
    """The write route's handler inside a server span; `handle` itself when off."""
    tracer = TRACER
    if tracer is None:
        return handle
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    async def traced_handle(
        request: web.Request, target: Any, *, continued: bool = False
    ) -> web.StreamResponse:
        parent = propagate.extract(request.headers)  # the worker's traceparent/tracestate
        with tracer.start_as_current_span(
            "sinkgate.write", context=parent, kind=SpanKind.SERVER
        ) as span:
            if span.is_recording():  # attributes only for a sampled write
                span.set_attributes(_server_attributes(request, "/to/{destination}/{path}"))
            response: web.StreamResponse = await handle(request, target, continued=continued)
            _end_server_span(span, response)
            return response

    return traced_handle


def traced_write_store(store: T) -> T:
    """The write route's store with a child span per call; `store` itself when off."""
    tracer = TRACER
    return store if tracer is None else cast(T, _TracedStore(store, tracer))


def traced_upstreams(upstreams: T) -> T:
    """The upstream pools, each forward in a client span; `upstreams` itself when off."""
    tracer = TRACER
    return upstreams if tracer is None else cast(T, _TracedUpstreams(upstreams, tracer))


class _TracedStore:
    """The write route's store, with a child span per call the route makes."""

    def __init__(self, store: Any, tracer: Any) -> None:
        self._store = store
        self._tracer = tracer

    def __getattr__(self, name: str) -> Any:
        # Traced, woken writes are decided one by one, each in a span of its own
        # request: neither in their key's group nor started by their wake.
        if name in ("decide_group", "start_decision"):
            raise AttributeError(name)
        return getattr(self._store, name)

    async def decide_write(self, facts: Any, context: Any) -> Any:
        with self._tracer.start_as_current_span("sinkgate.store.decide") as span:
            verdict = await self._store.decide_write(facts, context)
            if not span.is_recording():
                return verdict
            decision = verdict.decision
            span.set_attribute(
                "sinkgate.decision", _DECISIONS.get(type(decision).__name__, "unknown")
            )
            reason = getattr(decision, "reason", None)
            if reason is not None:
                span.set_attribute("sinkgate.reason", str(reason))
            return verdict

    async def record_outcome(self, facts: Any, attempt: str, outcome: Any) -> Any:
        with self._tracer.start_as_current_span("sinkgate.store.record") as span:
            held = await self._store.record_outcome(facts, attempt, outcome)
            if span.is_recording():
                span.set_attribute("sinkgate.outcome", outcome.kind)
                span.set_attribute("sinkgate.reservation_held", bool(held))
            return held

    async def record_rejection(self, record: Any) -> Any:
        with self._tracer.start_as_current_span(
            "sinkgate.store.record_rejection", attributes={"sinkgate.reason": record.reason}
        ):
            return await self._store.record_rejection(record)


class _TracedUpstreams:
    """The upstream pool, sending each forward inside a client span whose context
    goes to the upstream as `traceparent` (replacing the worker's)."""

    def __init__(self, upstreams: Any, tracer: Any) -> None:
        self._upstreams = upstreams
        self._tracer = tracer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._upstreams, name)

    async def send(
        self,
        destination: Any,
        method: str,
        url: Any,
        headers: Any,
        body: bytes,
        buffer_limit: int,
        until: float | None = None,
        send_by: float | None = None,
    ) -> Any:
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, Status, StatusCode

        with self._tracer.start_as_current_span(
            method, kind=SpanKind.CLIENT, record_exception=False
        ) as span:
            propagate.inject(headers)
            if span.is_recording():
                span.set_attributes(_client_attributes(destination.name, method, url))
            try:
                answer = await self._upstreams.send(
                    destination, method, url, headers, body, buffer_limit, until, send_by
                )
            except Exception as exc:
                failure = getattr(exc, "failure", None)
                error = str(failure) if failure is not None else type(exc).__qualname__
                span.set_attribute("error.type", error)
                span.set_status(Status(StatusCode.ERROR, error))
                raise
            span.set_attribute("http.response.status_code", answer.status)
            if answer.status >= 400:  # a client span's error (HTTP semantic conventions)
                span.set_attribute("error.type", str(answer.status))
                span.set_status(Status(StatusCode.ERROR))
            return answer


def _client_attributes(destination: str, method: str, url: Any) -> dict[str, Any]:
    attributes = {
        "http.request.method": method,
        "server.address": url.host or "",
        "url.full": _url_without_secrets(url),
        "sinkgate.destination": destination,
    }
    if url.port is not None:
        attributes["server.port"] = url.port
    return attributes


def _url_without_secrets(url: Any) -> str:
    """The upstream URL without userinfo or query string, either may hold a credential."""
    return str(url.with_user(None).with_query(None).with_fragment(None))


PATH_SHOWN = 200  # characters of a request's path in its span


# --- the lease API ---------------------------------------------------------------------


def traced_lease_handler(handler: Handler) -> Handler:
    """`handler` inside a server span `sinkgate.lease.<op>`; `handler` itself when off."""
    tracer = TRACER
    if tracer is None:
        return handler
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    async def traced(request: web.Request) -> web.StreamResponse:
        op = request.match_info.get("op", "get")
        name = f"sinkgate.lease.{op}" if op in _LEASE_OPS else "sinkgate.lease"
        route = "/leases/{job_id}" + ("/{op}" if "op" in request.match_info else "")
        with tracer.start_as_current_span(
            name, context=propagate.extract(request.headers), kind=SpanKind.SERVER
        ) as span:
            if span.is_recording():
                span.set_attributes(_server_attributes(request, route))
                # as the metric and the line name it: the raw segment is anybody's
                span.set_attribute("sinkgate.lease.op", op if op in _LEASE_OPS else "(other)")
            response = await handler(request)
            _end_server_span(span, response)
            return response

    return traced


# --- HTTP semantic conventions ---------------------------------------------------------


def _server_attributes(request: web.Request, route: str) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "http.request.method": request.method,
        "http.route": route,
        "url.path": request.path[:PATH_SHOWN],  # the caller's: cut, as in the lines
        "url.scheme": request.scheme,
        "network.protocol.version": f"{request.version.major}.{request.version.minor}",
    }
    if request.remote:
        attributes["client.address"] = request.remote
    # From the Host header as sent: cheaper than building `request.url`.
    host, colon, port = request.host.rpartition(":")
    if colon and port.isascii() and port.isdigit():
        attributes["server.port"] = int(port)
    else:
        host = request.host
    if host:
        attributes["server.address"] = host
    agent = request.headers.get("User-Agent")
    if agent:
        attributes["user_agent.original"] = agent
    return attributes


def _end_server_span(span: Any, response: web.StreamResponse) -> None:
    from opentelemetry.trace import Status, StatusCode

    if not span.is_recording():
        return
    span.set_attribute("http.response.status_code", response.status)
    if response.status >= 500:  # a server span's error (HTTP semantic conventions)
        reason = response.headers.get("Sinkgate-Rejected") or str(response.status)
        span.set_attribute("error.type", reason)
        span.set_status(Status(StatusCode.ERROR, reason))
