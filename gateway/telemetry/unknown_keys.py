"""The `sinkgate_unknown_keys` gauge, kept current from the store.

Refreshed on a timer and after every resolve, never at scrape time: a scrape
only reads the gauge. Each refresh is one indexed query that reads the in-flight
and unknown rows only (`AdminStore.unknown_counts`), not the completed keys.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from gateway.errors import StoreUnavailable
from gateway.telemetry.metrics import Metrics

log = structlog.get_logger("gateway.telemetry")

REFRESH_INTERVAL_S = 15.0


class UnknownKeysGauge:
    """Sets the gauge per destination; a destination whose count fell to zero reads 0
    (not absent), so an alert on it resolves instead of going stale."""

    def __init__(self, store: Any, metrics: Metrics) -> None:
        self._store = store
        self._gauge = metrics.unknown_keys
        self._metrics = metrics
        self._seen: set[str] = set()

    async def refresh(self) -> dict[str, int]:
        counts: dict[str, int] = await self._store.unknown_counts()
        # Every configured destination too: a series at 0 from the first refresh
        # (set, not only made: shared between workers, the most recent set wins).
        for destination in (self._seen | self._metrics.destinations) - set(counts):
            self._gauge.labels(destination=destination).set(0)
        for destination, count in counts.items():
            self._gauge.labels(destination=destination).set(count)
        self._seen |= set(counts)
        return counts

    async def run(self, interval: float = REFRESH_INTERVAL_S) -> None:
        """Refresh every `interval` seconds until cancelled; a store outage is logged
        and the gauge keeps its last values."""
        while True:
            try:
                await self.refresh()
            except StoreUnavailable as exc:
                self._metrics.store_errors.labels(op="unknown_keys").inc()
                log.warning("unknown_keys_refresh_failed", error=str(exc))
            await asyncio.sleep(interval)
