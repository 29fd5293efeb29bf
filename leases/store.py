"""The lease store seam: one protocol, three backends picked by URL scheme."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Coroutine, Generator
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

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


class StoreOpening:
    """What `open_store` returns: awaited, the store (`store = await open_store(url)`,
    closed by the caller); or used as `async with open_store(url) as store:`, the
    store closed at the block's end. asyncpg's `create_pool` takes both forms, and
    the second read as an error (a coroutine is no context manager)."""

    __slots__ = ("_opening", "_store")

    def __init__(self, opening: Coroutine[Any, Any, LeaseStore]) -> None:
        self._opening = opening
        self._store: LeaseStore | None = None

    def __await__(self) -> Generator[Any, None, LeaseStore]:
        return self._opening.__await__()

    async def __aenter__(self) -> LeaseStore:
        self._store = await self._opening
        return await self._store.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._store is not None
        await self._store.__aexit__(exc_type, exc, traceback)


def open_store(url: str, **options: object) -> StoreOpening:
    """Open a lease store: `sqlite:///path`, `postgresql://...` or `http(s)://gateway`;
    `await` it, or `async with` it (`StoreOpening`).

    Backends are imported lazily so that a SQLite user never needs asyncpg loaded.
    """
    return StoreOpening(_open(url, **options))


async def _open(url: str, **options: object) -> LeaseStore:
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
