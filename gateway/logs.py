"""structlog, configured once by the command line (STYLE habit 8).

JSON lines on stderr when stderr is not a terminal, the console renderer when
it is. Context bound with `structlog.contextvars.bind_contextvars` (per request)
is merged first, so every line carries it. Standard-library records (aiohttp,
asyncio) go through the same renderer, so stderr stays one format.
"""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.tracebacks import ExceptionDictTransformer
from structlog.typing import Processor

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
    renderer: Processor
    if json:
        # Structured tracebacks, without frame locals: a local may hold a secret.
        transformer = ExceptionDictTransformer(show_locals=False)
        shared.append(structlog.processors.ExceptionRenderer(transformer))
        renderer = structlog.processors.JSONRenderer()
    else:
        # Plain tracebacks: rich ones would print frame locals, which may hold secrets.
        renderer = structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)

    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )

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
