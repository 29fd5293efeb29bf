"""The gateway's store: `open_store(url)` picks the backend by the URL's scheme.

The backends are imported when named, so a SQLite gateway never loads asyncpg.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.store.protocol import Store
from gateway.store.records import Clock
from leases.urls import shown_scheme

__all__ = ["Store", "open_store"]


async def open_store(
    url: str, *, clock: Clock = time.time, pool_size: int | None = None, **options: Any
) -> Store:
    """Open the backend named by `url`'s scheme.

    `pool_size` (config `store.pool_size`) caps a PostgreSQL store's connection
    pool; SQLite has one writer connection and ignores it. PostgreSQL decides by
    the server's clock, so `clock` applies to SQLite only.
    """
    scheme = url.split(":", 1)[0].lower()
    if scheme == "sqlite":
        from gateway.store.sqlite import SQLiteStore

        return await SQLiteStore.open(url, clock=clock, **options)
    if scheme in ("postgresql", "postgres"):
        from gateway.store.postgres import PostgresStore

        if pool_size is not None:
            options.setdefault("max_size", pool_size)
        return await PostgresStore.open(url, **options)
    # Never the URL itself: it may carry a password.
    raise ValueError(
        f"unsupported store URL: {shown_scheme(url)} (sqlite:///path or postgresql://...)"
    )
