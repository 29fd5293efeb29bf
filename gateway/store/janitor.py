"""Retention: delete completed idempotency records and old rejections, a little at a time.

Each store call deletes at most `batch` rows of each kind in one short
transaction, so a purge never holds the write lock long enough to stall the
writes queued behind it; between batches the loop yields to the event loop.
In-flight and unknown-outcome records are never deleted: the store's `purge`
only ever selects completed keys.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from gateway.errors import StoreUnavailable
from gateway.store.protocol import PurgeStore
from gateway.telemetry.metrics import Metrics

log = structlog.get_logger("gateway.store")


async def purge_once(
    store: PurgeStore,
    metrics: Metrics,
    *,
    idempotency_ttl: float,
    rejections_ttl: float,
    audit_ttl: float,
    batch: int = 500,
) -> tuple[int, int]:
    """One retention pass; returns (keys, rejections) deleted.

    The cut-offs are fixed at the start of the pass by the store's clock, so a
    pass ends even while new records keep arriving. Audit rows have their own
    `audit_ttl`: the record of what operators decided is not noise to expire with
    the rejections (SPEC 4).
    """
    if batch < 1:
        raise ValueError("batch must be at least 1")
    now = store.clock()
    completed_before, rejections_before = now - idempotency_ttl, now - rejections_ttl
    started = time.monotonic()
    keys = rejections = batches = 0
    while True:
        k, r = await store.purge(
            completed_before=completed_before, rejections_before=rejections_before, batch=batch
        )
        batches += 1
        keys, rejections = keys + k, rejections + r
        metrics.purged.labels(kind="idempotency").inc(k)
        metrics.purged.labels(kind="rejections").inc(r)
        if k < batch and r < batch:
            break
        await asyncio.sleep(0)  # let queued writes in before the next batch
    audit = await _purge_audit(store, now - audit_ttl, batch)
    metrics.purged.labels(kind="audit").inc(audit)
    if keys or rejections or audit:
        log.info(
            "retention_purged",
            keys=keys,
            rejections=rejections,
            audit=audit,
            batches=batches,
            duration_ms=round((time.monotonic() - started) * 1000, 1),
        )
    return keys, rejections


async def _purge_audit(store: PurgeStore, before: float, batch: int) -> int:
    total = 0
    while True:
        deleted = await store.purge_audit(before=before, batch=batch)
        total += deleted
        if deleted < batch:
            return total
        await asyncio.sleep(0)


async def run_janitor(
    store: PurgeStore,
    metrics: Metrics,
    *,
    idempotency_ttl: float,
    rejections_ttl: float,
    audit_ttl: float,
    interval: float = 30.0,
    batch: int = 500,
    retention: Callable[[], tuple[float, float, float]] | None = None,
) -> None:
    """Purge every `interval` seconds until cancelled; `retention`, if given, is
    asked for (idempotency_ttl, rejections_ttl, audit_ttl) before each purge (a
    reload may have changed them).

    A store that does not answer is logged and retried at the next interval (the
    gateway already fails closed while it is down); any other error ends the
    task, and the app that watches it stops.
    """
    if min(idempotency_ttl, rejections_ttl, audit_ttl, interval) <= 0:
        raise ValueError("the ttls and the interval must be positive")
    while True:
        if retention is not None:
            idempotency_ttl, rejections_ttl, audit_ttl = retention()
        try:
            await purge_once(
                store,
                metrics,
                idempotency_ttl=idempotency_ttl,
                rejections_ttl=rejections_ttl,
                audit_ttl=audit_ttl,
                batch=batch,
            )
        except StoreUnavailable as exc:
            metrics.store_errors.labels(op="purge").inc()
            log.warning("retention_store_unavailable", error=str(exc))
        await asyncio.sleep(interval)
