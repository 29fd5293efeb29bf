"""What `--store-faults` and `--wire-faults` add to a chaos run, behind a few hooks
in `chaos_run`: where the gateways find their store and their upstream (a fault
proxy, a database of the run's own), the injector beside the workers, the extra
counts and checks of the report.

With `--store-faults` and a PostgreSQL URL the run creates a fresh database on
that server (through the database the URL names, which is never faulted) and
drops it at the end: refusing connections and terminating backends must only
ever touch the run's own database.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from gateway.tools.chaos.context import DESTINATION, Tally
from gateway.tools.chaos.faults import (
    PipedGateway,
    PostgresFaults,
    RunDatabase,
    SQLiteFaults,
    StoreFaults,
    with_address,
)
from gateway.tools.chaos.processes import GatewayProcess, Ports
from gateway.tools.chaos.proxy import FaultProxy
from gateway.tools.chaos.records import RECORD_INVARIANTS, check_records, read_key_records
from leases.sqlite import BUSY_TIMEOUT_S, sqlite_path
from leases.urls import is_postgres_url

# Refusals closer together than this belong to one stretch of refused writes.
_REFUSAL_GAP_S = 1.0


class FaultPlan:
    """The store and wire faults of one run (nothing at all when both are 0)."""

    def __init__(
        self, args: argparse.Namespace, ports: Ports, *, destination_timeout: float
    ) -> None:
        self.ports = ports
        self.destination_timeout = destination_timeout
        self.store_share: float = args.store_faults
        self.wire_share: float = args.wire_faults
        self.seed: int = args.seed
        self.keep: bool = args.keep
        self.db: RunDatabase | None = None
        self.proxies: dict[str, FaultProxy] = {}
        self.injector: StoreFaults | None = None
        self.direct_store_url = ""
        self._sqlite = False
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def store(self, url: str) -> str:
        """The store URL the gateways get, from the one the run was given."""
        self._sqlite = not is_postgres_url(url)
        if not self._sqlite and self.store_share:
            self.db = RunDatabase(url)
            await self.db.create()
            url = self.db.url
        self.direct_store_url = url
        if not self._sqlite and self.wire_share:
            parts = urlsplit(url)
            # Answers held about the destination's timeout: verdicts that come too
            # late to be sent, or only just in time, and must not overlap.
            proxy = await self._proxy(
                "store",
                parts.hostname or "127.0.0.1",
                parts.port or 5432,
                late_s=(0.75 * self.destination_timeout, 1.25 * self.destination_timeout),
            )
            url = with_address(url, "127.0.0.1", proxy.port)
        return url

    async def upstream(self, url: str) -> str:
        """The destination's URL as the gateways (and bypassing workers) reach it."""
        if not self.wire_share:
            return url
        parts = urlsplit(url)
        # Latency past the gateway's upstream timeout now and then: an answer
        # that comes after the gateway gave up on it.
        proxy = await self._proxy(
            "destination",
            parts.hostname or "127.0.0.1",
            int(parts.port or 80),
            max_latency=2.5,
            http=True,
        )
        return f"http://127.0.0.1:{proxy.port}"

    async def _proxy(self, name: str, host: str, port: int, **kw: Any) -> FaultProxy:
        proxy = FaultProxy(name, host, port, share=self.wire_share, seed=self.seed, **kw)
        await proxy.start(self.ports.take())
        self.proxies[name] = proxy
        return proxy

    @property
    def strands(self) -> bool:
        """Whether a reservation may be left without its forward, as by a killed
        gateway; the key then reads as unknown and is never sent (SPEC 2 step
        8), so its absence from the destination is explained:

        - on PostgreSQL a COMMIT whose answer was lost (its backend terminated,
          its connection reset or stalled) makes the gateway refuse a write
          whose reservation did commit;
        - on either store, an outcome that cannot be recorded while the store is
          failing (the destination answered 503, or was never reached) leaves
          the reservation in flight."""
        return bool(self.store_share) or bool(self.wire_share and not self._sqlite)

    @property
    def gateway_class(self) -> type[GatewayProcess]:
        return PipedGateway if self._sqlite and self.store_share else GatewayProcess

    @property
    def extra_patience(self) -> float:
        """Seconds a worker waits beyond the usual: a gateway waiting out a held
        SQLite write lock answers only after its busy timeout."""
        return BUSY_TIMEOUT_S + 2 if self._sqlite and self.store_share else 0.0

    def start(self, gateways: list[GatewayProcess], jobs: Callable[[], list[str]]) -> None:
        """Start injecting store and wire faults beside the workers."""
        for proxy in self.proxies.values():
            proxy.begin()
        if not self.store_share:
            return
        if self.db is not None:
            self.injector = PostgresFaults(self.db, self.store_share, self.seed)
        else:
            path = sqlite_path(self.direct_store_url)
            self.injector = SQLiteFaults(path, gateways, self.store_share, self.seed)
        self._task = asyncio.create_task(self.injector.run(self._stop, jobs))

    async def calm(self) -> None:
        """Stop every fault (the checks read through a calm setup); idempotent."""
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self.injector is not None:
            await self.injector.close()
        for proxy in self.proxies.values():
            await proxy.calm()

    async def close(self) -> None:
        await self.calm()
        for proxy in self.proxies.values():
            await proxy.stop()
        if self.db is not None:
            if self.keep:
                print(f"run database kept: {self.db.name}", file=sys.stderr)
            else:
                await self.db.drop()

    def explain_drops(self, record: dict[str, Any]) -> None:
        """Count the requests the destination's proxy cut before they all arrived,
        or whose not-applied answer it cut, as dropped before they were applied
        (the destination's own `dropped_before`): a key left unknown and
        unapplied by them is explained, as by a drop."""
        proxy = self.proxies.get("destination")
        if proxy is None:
            return
        dropped = record["dropped_before"]
        for key, n in proxy.cut_keys.items():
            dropped[key] = dropped.get(key, 0) + n

    async def records(self, keys: list[str]) -> dict[str, str | None]:
        return await read_key_records(self.direct_store_url, DESTINATION, keys)

    def extend_report(
        self,
        report: dict[str, Any],
        *,
        effects: list[dict[str, Any]],
        jobs: dict[str, list[str]],
        records: dict[str, str | None],
        tally: Tally,
    ) -> None:
        """Add the store/wire fault counts, the refusals and the record checks."""
        faults = report["faults"]
        if self.injector is not None:
            for kind, n in self.injector.counts.items():
                faults[f"store_{kind}"] = n
            faults["store_fault_s"] = round(self.injector.fault_s, 2)
            if isinstance(self.injector, PostgresFaults):
                faults["store_backends_terminated"] = self.injector.terminated
            if isinstance(self.injector, SQLiteFaults):
                faults["store_write_lock_past_busy_timeout"] = self.injector.long_holds
        for name, proxy in self.proxies.items():
            for kind, n in proxy.counts.items():
                faults[f"wire_{name}_{kind}"] = n
            faults[f"wire_{name}_connections"] = proxy.connections
        report["store_unavailable"] = _refusals(tally, self.injector)
        if self.db is not None:
            report["run_database"] = self.db.name  # dropped at the end unless --keep
        found = check_records(
            effects=effects, jobs=jobs, records=records, acknowledged=tally.acknowledged
        )
        for name in RECORD_INVARIANTS:
            report["violations"][name] = len(found[name])
            if found[name]:
                report["violation_examples"][name] = found[name][:5]
        report["violation_count"] += sum(len(v) for v in found.values())


def _refusals(tally: Tally, injector: StoreFaults | None) -> dict[str, Any]:
    """How long writes were refused with `store_unavailable`, as the workers saw it."""
    times = sorted(tally.store_refusals)
    spans: list[float] = []
    for t in times:
        if spans and t - spans[-1] <= _REFUSAL_GAP_S:
            spans[-1] = t
        else:
            spans.extend([t, t])
    lengths = [spans[i + 1] - spans[i] for i in range(0, len(spans), 2)]
    during, recovered = _recoveries(
        [] if injector is None else injector.windows, sorted(tally.acknowledged.values())
    )
    return {
        "answers": len(times),
        "without_retry_after": tally.store_refusals_without_retry_after,
        "stretches": len(lengths),
        "refused_s": round(sum(lengths), 2),
        "longest_s": round(max(lengths, default=0.0), 2),
        "faults_during_writes": during,
        "faults_followed_by_acknowledged_writes": recovered,
    }


def _recoveries(windows: list[tuple[float, float]], acks: list[float]) -> tuple[int, int]:
    """Of the faults that ended while workers were still being answered, how many
    were followed by an acknowledged write before the next fault began: the
    gateways took writes again once the store was back (none is restarted)."""
    if not acks:
        return 0, 0
    during = [w for w in windows if w[1] < acks[-1]]
    recovered = 0
    for i, (_, end) in enumerate(during):
        upto = windows[i + 1][0] if i + 1 < len(windows) else float("inf")
        if any(end < t < upto for t in acks):
            recovered += 1
    return len(during), recovered
