"""Client spans for the worker side (`FencedWriter`, `HTTPLeaseStore`), when the
application has configured the OpenTelemetry SDK.

The worker's own process decides: its global tracer provider (set by its code or
by `opentelemetry-instrument`), or one given to `use_tracer_provider`. Without the
`opentelemetry-api` package, or with only the API's default no-op provider,
`tracer()` is None and callers send their requests exactly as before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

_PROVIDER: Any = None
_CACHED: tuple[Any, Any] = (None, None)  # (provider, its tracer)


def use_tracer_provider(provider: Any) -> None:
    """Trace with `provider` instead of the global one; None goes back to the global."""
    global _PROVIDER
    _PROVIDER = provider


def tracer() -> Any:
    """The tracer to use, or None when no SDK provider is configured."""
    # Not imported by anyone: no SDK can have been configured (and importing the
    # API here would cost every worker start ~50 ms for nothing).
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    provider = _PROVIDER or trace.get_tracer_provider()
    # The API's stand-ins until an SDK provider is set: no spans would be recorded.
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    global _CACHED
    if _CACHED[0] is not provider:
        _CACHED = (provider, provider.get_tracer("sinkgate.leases"))
    return _CACHED[1]


@contextmanager
def client_span(
    name: str, headers: MutableMapping[str, str], attributes: Callable[[], dict[str, Any]]
) -> Iterator[Any]:
    """A client span around one request; its context is injected into `headers`
    (`traceparent`, `tracestate`). Yields the span, or None when tracing is off;
    `attributes()` is only called for a span that is recorded."""
    current = tracer()
    if current is None:
        yield None
        return
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    with current.start_as_current_span(name, kind=SpanKind.CLIENT) as span:
        propagate.inject(headers)
        if span.is_recording():
            span.set_attributes(attributes())
        yield span


def answered(span: Any, status: int, reason: str | None = None) -> None:
    """Record an HTTP answer on a `client_span` span (a no-op for None)."""
    if span is None:
        return
    span.set_attribute("http.response.status_code", status)
    if reason is not None:
        span.set_attribute("sinkgate.reason", reason)
    from opentelemetry.trace import Status, StatusCode

    if status >= 400:  # a client span's error (HTTP semantic conventions)
        span.set_attribute("error.type", reason or str(status))
        span.set_status(Status(StatusCode.ERROR, reason))
