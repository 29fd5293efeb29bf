"""Shared fixtures: the backends every store test runs on (`tests/backends.py`),
and logging as each test found it."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

from gateway.telemetry import refusals
from tests.backends import Backend as Backend
from tests.backends import database_url as database_url
from tests.backends import fake_clock as fake_clock
from tests.backends import lease_backend as lease_backend
from tests.backends import store_backend as store_backend
from tests.backends import store_url as store_url
from tests.harness import FakeClock as FakeClock


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """Give each test the logging set-up it found.

    A test that runs the CLI in-process (`cli.main`, `chaos.main`) configures
    logging, binding the root handler to the stderr pytest captured for that
    test; later tests' `aiohttp.access` records then hit a closed stream
    ("--- Logging error --- ValueError: I/O operation on closed file").
    """
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    config = structlog.get_config()
    # The process-wide budget of store_unavailable lines: each test starts with
    # its burst, whatever the tests before it spent.
    refusals.reset_store_unavailable_budget()
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        structlog.configure(**config)
