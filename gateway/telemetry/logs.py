"""structlog, configured once by the command line (STYLE habit 8).

JSON lines on stderr when stderr is not a terminal, the console renderer when
it is. The gateway writes one JSON line per decision, so structlog's lines are
rendered by orjson and written as bytes (structlog's performance recipe).
Context bound with `structlog.contextvars.bind_contextvars` (per request) is
merged first, so every line carries it. Standard-library records (aiohttp,
asyncio) go through the same fields and the stdlib encoder, so stderr stays one
format.
"""

from __future__ import annotations

import json as stdlib_json
import logging
import sys
from typing import Any

import orjson
import structlog
from structlog.tracebacks import ExceptionDictTransformer
from structlog.typing import Processor

from gateway.telemetry.linebuffer import TurnBufferedLoggerFactory

LEVELS = ("debug", "info", "warning", "error", "critical")


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """Configure structlog and the standard library root logger.

    `level` is one of `LEVELS`; `json=None` picks JSON unless stderr is a TTY.
    """
    if level.lower() not in LEVELS:
        raise ValueError(f"unknown log level {level!r}: expected one of {', '.join(LEVELS)}")
    level_no = logging.getLevelNamesMapping()[level.upper()]
    if json is None:
        json = not sys.stderr.isatty()

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer, structlog_renderer, logger_factory = _renderers(json, shared)
    structlog.configure(
        processors=[*shared, structlog_renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=logger_factory,
        cache_logger_on_first_use=True,
    )
    _route_stdlib(shared, renderer, level_no)


def _renderers(json: bool, shared: list[Processor]) -> tuple[Processor, Processor, Any]:
    """The standard library's renderer (text), structlog's (bytes where it can) and
    structlog's logger factory; JSON also appends the exception renderer to `shared`."""
    renderer: Processor
    logger_factory: Any
    if json:
        # Structured tracebacks, without frame locals: a local may hold a secret.
        transformer = ExceptionDictTransformer(show_locals=False)
        shared.append(structlog.processors.ExceptionRenderer(transformer))
        renderer = structlog.processors.JSONRenderer()  # text, for the stdlib handler
        structlog_renderer: Processor = structlog.processors.JSONRenderer(serializer=_dumps)
        binary = getattr(sys.stderr, "buffer", None)
        if binary is None:  # stderr replaced by a text-only stream
            structlog_renderer = renderer
            logger_factory = structlog.WriteLoggerFactory(file=sys.stderr)
        else:
            logger_factory = TurnBufferedLoggerFactory(binary)
    else:
        # Plain tracebacks: rich ones would print frame locals, which may hold secrets.
        renderer = structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
        structlog_renderer = renderer
        logger_factory = structlog.WriteLoggerFactory(file=sys.stderr)
    return renderer, structlog_renderer, logger_factory


def _route_stdlib(shared: list[Processor], renderer: Processor, level_no: int) -> None:
    """Standard-library records through the same fields, to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level_no)


def _dumps(event: dict[str, Any], **kw: Any) -> bytes:
    """orjson, with the standard library's encoder for what orjson refuses (an
    integer beyond 64 bits, a dict with non-string keys) so a line is never lost."""
    try:
        return orjson.dumps(event, **kw)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return stdlib_json.dumps(event, **kw).encode()
