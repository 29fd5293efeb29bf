"""structlog, configured once by the command line (STYLE habit 8).

JSON lines on stderr when stderr is not a terminal, the console renderer when
it is. The gateway writes one JSON line per decision, so structlog's lines are
rendered by orjson and written as bytes (structlog's performance recipe).
Context bound with `structlog.contextvars.bind_contextvars` (per request) is
merged first, so every line carries it. Standard-library records (aiohttp,
asyncio) go through the same fields and the stdlib encoder, so stderr stays one
format.

The write route's line per decision is the hottest line: `info_line` writes it
without structlog's bound-logger machinery while the JSON configuration made
here is in force (the same bytes, a third of the CPU), and through structlog
otherwise (the console, `structlog.testing.capture_logs`).
"""

from __future__ import annotations

import json as stdlib_json
import logging
import os
import sys
import time
from typing import Any

import orjson
import structlog
from structlog.tracebacks import ExceptionDictTransformer
from structlog.typing import Processor

from gateway.telemetry.linebuffer import TurnBuffer, TurnBufferedLoggerFactory

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
        add_utc_timestamp,
    ]
    renderer, structlog_renderer, logger_factory = _renderers(json, shared)
    processors = [*shared, structlog_renderer]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=logger_factory,
        cache_logger_on_first_use=True,
    )
    _route_stdlib(shared, renderer, level_no)
    global _JSON_LINES
    _JSON_LINES = None
    if isinstance(logger_factory, TurnBufferedLoggerFactory):
        _JSON_LINES = _JsonLines(logger_factory.buffer, processors, level_no)


def info_line(log: Any, event: str, fields: dict[str, Any], *, owned: bool = False) -> None:
    """`log.info(event, **fields)`: the same line, cheaper where it can be (above).
    `owned`: the caller hands `fields` over, so the line is made in it, not a copy."""
    lines = _JSON_LINES
    if lines is None or not lines.in_force() or "exc_info" in fields:
        log.info(event, **fields)
        return
    if lines.level_no > logging.INFO:
        return
    # What structlog's chain does, in its order: the fields, the event, the bound
    # context, the level, the time.
    line = fields if owned else dict(fields)
    line["event"] = event
    structlog.contextvars.merge_contextvars(None, "info", line)
    line["level"] = "info"
    line["timestamp"] = utc_timestamp()
    lines.buffer.write(_line_bytes(line))


class _JsonLines:
    """The JSON configuration `configure_logging` made: its buffer, its level, and
    its processor list, by which `info_line` knows the configuration still holds
    (and so that its renderer, the chain's last processor, is the JSON renderer
    `_renderers` made, whose bytes `_line_bytes` makes)."""

    __slots__ = ("buffer", "chain", "level_no")

    def __init__(self, buffer: TurnBuffer, processors: list[Processor], level_no: int) -> None:
        self.buffer = buffer
        self.chain = list(processors)
        self.level_no = level_no

    def in_force(self) -> bool:
        # By content: `capture_logs` and others change the configured list in place.
        processors: list[Processor] = structlog.get_config()["processors"]
        return processors == self.chain


_JSON_LINES: _JsonLines | None = None

# The formatted second, reused by every line within it: (second, "YYYY-MM-DDTHH:MM:SS").
_second: tuple[int, str] = (-1, "")


def utc_timestamp() -> str:
    """Now in UTC as structlog's `TimeStamper(fmt="iso", utc=True)` writes it
    (`2026-12-01T16:50:39.135006Z`, microseconds cut as `datetime.now` cuts
    them; no fraction at a whole second), at a third of its cost."""
    global _second
    second, nanos = divmod(time.time_ns(), 1_000_000_000)
    micro = nanos // 1000
    cached, text = _second
    if cached != second:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _second = (second, text)
    return f"{text}.{micro:06d}Z" if micro else f"{text}Z"


def add_utc_timestamp(logger: Any, method_name: str, event_dict: Any) -> Any:
    """structlog processor: `timestamp`, by `utc_timestamp`."""
    event_dict["timestamp"] = utc_timestamp()
    return event_dict


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
        structlog_renderer: Processor = structlog.processors.JSONRenderer(
            serializer=_dumps, default=_json_default
        )
        binary = getattr(sys.stderr, "buffer", None)
        if binary is None:  # stderr replaced by a text-only stream
            structlog_renderer = renderer
            logger_factory = structlog.WriteLoggerFactory(file=sys.stderr)
        else:
            logger_factory = TurnBufferedLoggerFactory(binary)
    else:
        # Plain tracebacks: rich ones would print frame locals, which may hold secrets.
        # Colours only on a terminal, and not under NO_COLOR (no-color.org): a file
        # or a pipe gets the text without escape codes.
        colours = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
        renderer = structlog.dev.ConsoleRenderer(
            colors=colours, exception_formatter=structlog.dev.plain_traceback
        )
        structlog_renderer = renderer
        logger_factory = structlog.WriteLoggerFactory(file=sys.stderr)
    return renderer, structlog_renderer, logger_factory


def _route_stdlib(shared: list[Processor], renderer: Processor, level_no: int) -> None:
    """Standard-library records through the same fields, to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_warning_without_traceback)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level_no)


def _warning_without_traceback(record: logging.LogRecord) -> bool:
    """A library's warning that carries its exception (asyncpg's pool, retrying a
    connection while the database refuses them) in one line: the exception's type
    and words after the message, not a traceback of the library's frames."""
    if record.exc_info and record.levelno < logging.ERROR:
        exc = record.exc_info[1]
        if exc is not None:
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {exc}"
            record.args = None
        record.exc_info = None
        record.exc_text = None
    return True


def _json_default(value: Any) -> Any:
    """What JSON has no type for, as structlog's renderer has it by default: its
    `__structlog__()`, else its `repr`."""
    try:
        return value.__structlog__()
    except AttributeError:
        return repr(value)


def _line_bytes(event: dict[str, Any]) -> bytes:
    """The structlog JSON renderer's bytes for `event` (`_dumps`, `_json_default`)
    and the newline, in one call of orjson where it can: `info_line`'s line."""
    try:
        return orjson.dumps(event, default=_json_default, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        return _dumps(event, default=_json_default) + b"\n"


def _dumps(event: dict[str, Any], **kw: Any) -> bytes:
    """orjson, with the standard library's encoder for what orjson refuses (an
    integer beyond 64 bits, a dict with non-string keys) so a line is never lost."""
    try:
        return orjson.dumps(event, **kw)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return stdlib_json.dumps(event, **kw).encode()
