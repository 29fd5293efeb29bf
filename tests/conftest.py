"""Shared fixtures: a movable clock, and one lease store per backend.

`lease_backend` runs a test on every backend (SQLite; the HTTP client against a
live lease API; PostgreSQL when a server is reachable, and as a failure instead
of a skip under CI=true). Each
backend's clock can be moved with `.advance(seconds)`, so no test sleeps for a
lease to expire.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
import structlog

from leases.sqlite import SQLiteLeaseStore
from tests.harness import FakeClock, serving


@dataclass
class LeaseBackend:
    """A lease store plus the handle that moves the clock its decisions use."""

    name: str
    store: Any
    _advance: Callable[[float], None]

    def advance(self, seconds: float) -> None:
        """Move the store's clock forward by `seconds`."""
        self._advance(seconds)


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


def _skip_without(reason: str) -> NoReturn:
    """Skip (or, under CI=true, fail) when a part the postgres backend needs is missing."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@asynccontextmanager
async def _postgres_backend() -> AsyncIterator[LeaseBackend]:
    # Imported lazily: the PostgreSQL helpers and backend are optional for SQLite runs.
    try:
        from tests.pg import fresh_database, pg_skip_reason, skip_or_fail
    except ImportError as exc:
        _skip_without(f"PostgreSQL test helpers unavailable (tests/pg.py): {exc}")
    try:
        from leases.postgres import PostgresLeaseStore
    except ImportError as exc:
        skip_or_fail(f"PostgreSQL lease backend unavailable (leases/postgres.py): {exc}")
    reason = await pg_skip_reason()
    if reason is not None:
        skip_or_fail(reason)
    async with fresh_database() as url:
        store = await PostgresLeaseStore.open(url, clock_offset=0.0)

        def advance(seconds: float) -> None:
            store.clock_offset += seconds

        try:
            yield LeaseBackend("postgres", store, advance)
        finally:
            await store.close()


@asynccontextmanager
async def _http_backend(tmp_path: Path, clock: FakeClock) -> AsyncIterator[LeaseBackend]:
    """The HTTP lease client against the gateway's live lease API on loopback."""
    from aiohttp import web

    from gateway.http.appkeys import METRICS, STORE
    from gateway.http.leases import add_lease_routes
    from gateway.store.sqlite import SQLiteStore
    from gateway.telemetry.metrics import Metrics
    from leases.http import HTTPLeaseStore

    server_store = await SQLiteStore.open(f"sqlite:///{tmp_path / 'gateway.db'}", clock=clock)
    app = web.Application()
    app[STORE] = server_store
    app[METRICS] = Metrics()
    add_lease_routes(app)
    try:
        async with serving(app, access_log=None) as url, await HTTPLeaseStore.open(url) as store:
            yield LeaseBackend("http", store, clock.advance)
    finally:
        await server_store.close()


@pytest.fixture(params=["sqlite", "http", pytest.param("postgres", marks=pytest.mark.postgres)])
async def lease_backend(
    request: pytest.FixtureRequest, tmp_path: Path, fake_clock: FakeClock
) -> AsyncIterator[LeaseBackend]:
    """A fresh, empty lease store on each backend, with a movable store clock."""
    if request.param == "sqlite":
        store = await SQLiteLeaseStore.open(tmp_path / "leases.db", clock=fake_clock)
        try:
            yield LeaseBackend("sqlite", store, fake_clock.advance)
        finally:
            await store.close()
        return
    if request.param == "http":
        async with _http_backend(tmp_path, fake_clock) as backend:
            yield backend
        return
    async with _postgres_backend() as backend:
        yield backend


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
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        structlog.configure(**config)
