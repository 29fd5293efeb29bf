"""The lease store seam: one protocol, three backends picked by URL scheme."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from .model import Lease, LeaseRef
from .urls import shown_scheme


@runtime_checkable
class LeaseStore(Protocol):
    """What every backend (SQLite, PostgreSQL, HTTP) offers, with the same errors."""

    async def claim(self, job_id: str, *, owner: str | None = None, ttl: float) -> Lease: ...
    async def renew(self, lease: Lease | LeaseRef, *, ttl: float | None = None) -> Lease: ...
    async def complete(self, lease: Lease | LeaseRef) -> Lease: ...
    async def release(self, lease: Lease | LeaseRef) -> Lease: ...
    async def get(self, job_id: str) -> Lease | None: ...
    async def close(self) -> None: ...
    async def __aenter__(self) -> LeaseStore: ...
    async def __aexit__(self, *exc: object) -> None: ...


async def open_store(url: str, **options: object) -> LeaseStore:
    """Open a lease store: `sqlite:///path`, `postgresql://...` or `http(s)://gateway`.

    Backends are imported lazily so that a SQLite user never needs asyncpg loaded.
    """
    if not isinstance(url, str):
        raise ValueError(f"store URL must be a string, not {type(url).__name__}")
    scheme = url.split(":", 1)[0].lower()
    if scheme == "sqlite":
        from .sqlite import SQLiteLeaseStore, sqlite_path

        clock = options.pop("clock", time.time)
        _no_options(options)
        return await SQLiteLeaseStore.open(sqlite_path(url), clock=clock)  # type: ignore[arg-type]
    if scheme in ("postgresql", "postgres"):
        from .postgres import PostgresLeaseStore

        _no_options(_unknown(PostgresLeaseStore.open, options))
        return await PostgresLeaseStore.open(url, **options)  # type: ignore[arg-type]
    if scheme in ("http", "https"):
        from .http import HTTPLeaseStore

        _no_options(_unknown(HTTPLeaseStore.open, options))
        return await HTTPLeaseStore.open(url, **options)  # type: ignore[arg-type]
    # Never the URL itself, nor what precedes its first `:`: it may carry a password.
    raise ValueError(f"unsupported store URL: {shown_scheme(url)} (sqlite, postgresql, http)")


def _unknown(open_fn: Callable[..., object], options: dict[str, object]) -> dict[str, object]:
    """The options `open_fn` has no keyword parameter for: the same `ValueError` on
    every backend, instead of a `TypeError` from the call on some."""
    accepted = inspect.signature(open_fn).parameters
    return {name: value for name, value in options.items() if name not in accepted}


def _no_options(options: dict[str, object]) -> None:
    if options:
        raise ValueError(f"unknown store options: {', '.join(sorted(options))}")
