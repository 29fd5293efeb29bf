"""Every backend the tests run on, as one set of fixtures (registered in conftest.py).

- `lease_backend`: an empty lease store on SQLite, through the HTTP client
  against a live lease API, and on PostgreSQL.
- `store_backend`: an empty gateway store on SQLite and on PostgreSQL.
- `store_url`: what `running_gateway(config, backend=...)` runs on: "sqlite"
  (the config's file) or a fresh PostgreSQL database.
- `database_url`: a fresh database on each backend, for code that opens its own
  connections (the destination's fence).

PostgreSQL gets a fresh database per test when the server answers; when it does
not, the test is skipped with the reason, and fails instead under CI=true. Time
only moves when a test moves a store's clock (`backend.advance(seconds)`; on
PostgreSQL that is `clock_offset`, so the server's clock still decides).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gateway.http.appkeys import METRICS, STORE
from gateway.http.leases import add_lease_routes
from gateway.store.postgres import PostgresStore
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.metrics import Metrics
from leases.http import HTTPLeaseStore
from leases.postgres import PostgresLeaseStore
from leases.sqlite import SQLiteLeaseStore
from tests.harness import FakeClock, serving
from tests.pg import fresh_database

POSTGRES = pytest.param("postgres", marks=pytest.mark.postgres)
STORE_BACKENDS = ["sqlite", POSTGRES]
LEASE_BACKENDS = ["sqlite", "http", POSTGRES]


@dataclass
class Backend:
    """A store (lease or gateway) plus the handle that moves the clock its
    decisions use; `url` is where a second client can open the same store."""

    name: str
    store: Any  # used through its protocol only
    advance: Callable[[float], None]
    url: str


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=LEASE_BACKENDS)
async def lease_backend(
    request: pytest.FixtureRequest, tmp_path: Path, fake_clock: FakeClock
) -> AsyncIterator[Backend]:
    """A fresh, empty lease store on each backend, with a movable store clock."""
    if request.param == "sqlite":
        path = tmp_path / "leases.db"
        store = await SQLiteLeaseStore.open(path, clock=fake_clock)
        try:
            yield Backend("sqlite", store, fake_clock.advance, f"sqlite:///{path}")
        finally:
            await store.close()
    elif request.param == "http":
        async with _http_lease_backend(tmp_path, fake_clock) as backend:
            yield backend
    else:
        async with fresh_database() as url:
            pg = await PostgresLeaseStore.open(url, clock_offset=0.0)
            try:
                yield Backend("postgres", pg, _offset_mover(pg), url)
            finally:
                await pg.close()


@pytest.fixture(params=STORE_BACKENDS)
async def store_backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """An empty gateway store on each backend, with a movable store clock."""
    if request.param == "sqlite":
        clock = FakeClock()
        url = f"sqlite:///{tmp_path / 'sinkgate.db'}"
        sqlite = await SQLiteStore.open(url, clock=clock)
        try:
            yield Backend("sqlite", sqlite, clock.advance, url)
        finally:
            await sqlite.close()
    else:
        async with fresh_database() as url:
            pg = await PostgresStore.open(url)
            try:
                yield Backend("postgres", pg, _offset_mover(pg), url)
            finally:
                await pg.close()


@pytest.fixture(params=STORE_BACKENDS)
async def store_url(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """The `backend` of `running_gateway`: "sqlite", or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield "sqlite"
    else:
        async with fresh_database() as url:
            yield url


@pytest.fixture(params=STORE_BACKENDS)
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A fresh, empty database on each backend, as a URL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
    else:
        async with fresh_database() as url:
            yield url


def _offset_mover(store: Any) -> Callable[[float], None]:
    """Moves a PostgreSQL store's view of the server's clock."""

    def advance(seconds: float) -> None:
        store.clock_offset += seconds

    return advance


@asynccontextmanager
async def _http_lease_backend(tmp_path: Path, clock: FakeClock) -> AsyncIterator[Backend]:
    """The HTTP lease client against the gateway's live lease API on loopback."""
    server_store = await SQLiteStore.open(f"sqlite:///{tmp_path / 'gateway.db'}", clock=clock)
    app = web.Application()
    app[STORE] = server_store
    app[METRICS] = Metrics()
    add_lease_routes(app)
    try:
        async with serving(app, access_log=None) as url, await HTTPLeaseStore.open(url) as store:
            yield Backend("http", store, clock.advance, url)
    finally:
        await server_store.close()
