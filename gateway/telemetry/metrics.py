"""Prometheus metrics, one registry per app so tests and replicas don't share.

The workers of one `serve --workers N` share theirs instead: each worker calls
`share_between_processes(directory)` before it builds its app, its values then
live in files in that directory (prometheus_client's multiprocess mode), and
`/metrics` on any worker answers with the sum over all of them. So a scrape
counts every worker's writes whichever worker takes it, and a counter does not
go back when a worker dies and is started again (the dead one's file stays);
`forget_process` drops a dead worker's in-flight writes from the gauges.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from bisect import bisect_left
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import values as prometheus_values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from gateway.telemetry.refusals import Refusals
from leases.reasons import REASONS, Family, Reason

# Children kept by `Metrics.child`; past this, label values are looked up each time.
_MAX_CACHED_CHILDREN = 1000
# The label values `Metrics._zeroed` makes at 0: the reasons a write can be refused
# for (not the lease API's, the admin's or the upstream's: a failed forward counts
# as forwarded), the ends of a wait (`gateway.write.waiting`), and the store's
# operations that count their failures.
_NOT_A_WRITES = frozenset({
    Reason.NOT_FOUND, Reason.INVALID_CONFIG, Reason.LEASE_HELD, Reason.KEY_NOT_UNKNOWN,
    Reason.ATTEMPT_MISMATCH,
})  # fmt: skip
WRITE_REASONS: tuple[str, ...] = (
    *(
        str(r)
        for r, info in REASONS.items()
        if info.family in (Family.REQUEST, Family.FENCE, Family.IDEMPOTENCY)
        and r not in _NOT_A_WRITES
    ),
    Reason.STORE_UNAVAILABLE,
    Reason.OVERLOADED,
)
WAIT_RESULTS = (
    "replayed", "forwarded", "refused", "timed_out", "disconnected", "stopped", "failed", "full",
)  # fmt: skip
STORE_OPS = (
    "decide", "decide_late", "record", "record_rejection", "admin", "unknown_keys", "purge",
    *(f"lease_{op}" for op in ("claim", "renew", "complete", "release", "get")),
)  # fmt: skip
_WAIT_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


# Set in a worker of `serve --workers N` (see the module's docstring).
_shared_directory: str | None = None


def share_between_processes(directory: str) -> None:
    """Keep this process's metrics in `directory`, shared with the other processes
    that do; once per process, before its first `Metrics()`."""
    global _shared_directory
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # where the values' files go
    in_files = prometheus_values.MultiProcessValue()  # type: ignore[no-untyped-call]
    prometheus_values.ValueClass = in_files
    _shared_directory = directory


def forget_process(pid: int, directory: str) -> None:
    """A sharing process has exited: its gauges no longer count (its counters do).
    Never raises: the supervisor calling it must go on restarting workers."""
    with contextlib.suppress(OSError):  # a file already gone, or the directory
        mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


METRICS_DIR_PREFIX = "sinkgate-metrics-"
_OWNER = "owner.pid"


def claim_metrics_directory(directory: str) -> None:
    """Say which process shares `directory` (`sweep_metrics_directories` reads it):
    its pid, and the pid namespace that pid is of."""
    with open(os.path.join(directory, _OWNER), "w", encoding="ascii") as out:
        out.write(f"{os.getpid()} {_pid_namespace()}")


def _pid_namespace() -> str:
    """This process's pid namespace (`pid:[4026531836]`), or "" where none is told."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def sweep_metrics_directories(parent: str | None) -> list[str]:
    """Remove the metrics directories under `parent` (the system's temporary
    directory for None) whose `serve --workers` parent is gone: killed (-9), it
    could not remove its own. Only those that name their owner are looked at;
    one whose owner lives, is of another pid namespace (another container sharing
    the tmpfs: its pids mean nothing here), or that this user may not remove, is
    left. Returns the removed ones' paths."""
    base = parent or tempfile.gettempdir()
    namespace = _pid_namespace()
    if not namespace:  # no way to tell this system's pids from another's
        return []
    removed = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(METRICS_DIR_PREFIX)]
    except OSError:
        return []
    for name in names:
        path = os.path.join(base, name)
        try:
            with open(os.path.join(path, _OWNER), encoding="ascii") as owner:
                pid_text, _, owners_namespace = owner.read().strip().partition(" ")
            if owners_namespace != namespace:
                continue
            os.kill(int(pid_text), 0)
        except ProcessLookupError:  # the owner is gone
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
        except (OSError, ValueError):  # no owner named, another user's, or alive
            continue
    return removed


class Metrics:
    """Every metric the gateway exports. Names follow Prometheus conventions."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # The directory whose files `render` sums, when shared between workers.
        self.shared_directory = _shared_directory
        # Declared in this order, exposed in this order.
        self._write_metrics(self.registry)
        self._upkeep_metrics(self.registry)
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}
        self._zeroed()
        self.destinations: set[str] = set()  # the configured ones (`destination`)
        # Writes refused before their facts: rate-limited log lines, names asked for.
        self.refusals = Refusals()
        # The write path's updates of one event-loop turn, applied at its end.
        self.tally = Tally()

    def _write_metrics(self, r: CollectorRegistry) -> None:
        """The write path's: decisions, rejections, upstream outcomes and times."""
        self.writes = Counter(
            "sinkgate_writes_total",
            "Writes through the gateway by destination and decision "
            "(forwarded, replayed, rejected).",
            ["destination", "decision"],
            registry=r,
        )
        self.rejections = Counter(
            "sinkgate_rejections_total", "Writes rejected, by reason.", ["reason"], registry=r
        )
        self.upstream_outcomes = Counter(
            "sinkgate_upstream_outcomes_total",
            "Forward outcomes (completed, released, unknown) by destination.",
            ["destination", "outcome"],
            registry=r,
        )
        self.upstream_latency = Histogram(
            "sinkgate_upstream_latency_seconds",
            "Time from forwarding a write to its upstream answer.",
            ["destination"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.store_latency = Histogram(
            "sinkgate_store_latency_seconds",
            "Time of store operations: a write's decision (decide), each lease API "
            "call (lease_<op>).",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "sinkgate_in_flight_writes",
            "Writes being forwarded now.",
            ["destination"],
            registry=r,
            multiprocess_mode="livesum",  # shared: the sum over the live workers
        )

        self.waiting = Gauge(
            "sinkgate_waiting_writes",
            "Writes held under Prefer: wait now.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.waits = Counter(
            "sinkgate_waits_total",
            "Writes held under Prefer: wait, by result (replayed, forwarded: decided to "
            "forward, sent unless too late or the wire was full, refused, "
            "timed_out, disconnected, stopped, failed: a decision again failed; "
            "full: not held, max_waiting were).",
            ["result"],
            registry=r,
        )
        self.wait_seconds = Histogram(
            "sinkgate_wait_seconds",
            "How long writes were held under Prefer: wait.",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )

    def _upkeep_metrics(self, r: CollectorRegistry) -> None:
        """The lease API's, the store's failures and retention, unknown keys, reloads."""
        self.lease_ops = Counter(
            "sinkgate_lease_operations_total",
            "Lease API calls by operation (claim, renew, complete, release, get; "
            "(other) for a path naming none) and result (ok or a reason code).",
            ["op", "result"],
            registry=r,
        )
        self.store_errors = Counter(
            "sinkgate_store_errors_total",
            "Store operations that failed (decide_late: a verdict that came too late to send).",
            ["op"],
            registry=r,
        )
        self.store_retries = Counter(
            "sinkgate_store_retries_total",
            "Store calls run again, the write waiting, after the database gave no answer "
            "(decide: a decision batch, nothing decided twice; record: an outcome sent "
            "again), by op. Errors that reached a write count in sinkgate_store_errors_total.",
            ["op"],
            registry=r,
        )
        self.settlements_unheard = Gauge(
            "sinkgate_settlements_unheard",
            "Processes not hearing the settlements of the others now (PostgreSQL: the "
            "listening connection lost, refused, or deaf behind a pooler): their held "
            "writes wake by the poll. 0 where nothing is heard (SQLite).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.purged = Counter(
            "sinkgate_purged_total", "Records deleted by retention.", ["kind"], registry=r
        )
        self.unknown_keys = Gauge(
            "sinkgate_unknown_keys",
            "Idempotency keys whose outcome is unknown and waits for an operator, by "
            "destination (the whole store's count, the same on every replica).",
            ["destination"],
            registry=r,
            multiprocess_mode="livemostrecent",  # shared: each worker counts the same store
        )
        self.reloads = Counter(
            "sinkgate_reloads_total",
            "Config reloads, by result (applied, failed); one applied by every worker counts once.",
            ["result"],
            registry=r,
        )
        self.admin_auth_failures = Counter(
            "sinkgate_admin_auth_failures_total",
            "Failed admin authentications (bearer token or sign-in form), by result: "
            "refused (a wrong token), throttled (429: too many failures from the address).",
            ["result"],
            registry=r,
        )

    def _zeroed(self) -> None:
        """Every series of a label value known in advance, at 0 from the start:
        Prometheus' `increase()` and `rate()` cannot see a series' first count when
        the series first appears with it, so the first failed reload (or store
        retry, or refusal of a reason) went unseen by the documented alerts."""
        known: dict[MetricWrapperBase, tuple[str, ...]] = {
            self.rejections: WRITE_REASONS,
            self.waits: WAIT_RESULTS,
            self.store_errors: STORE_OPS,
            self.store_retries: ("decide", "record"),
            self.reloads: ("applied", "failed"),
            self.admin_auth_failures: ("refused", "throttled"),
        }
        for metric, values in known.items():
            for value in values:
                metric.labels(value)

    def destination(self, name: str) -> None:
        """`name`'s series at 0 (or as they are), as `_zeroed` does for the rest:
        its writes by decision, its forwards' outcomes; its unknown keys are set by
        the gauge's next refresh (`destinations`: 0 where the store has none)."""
        self.destinations.add(name)
        for decision in ("forwarded", "replayed", "rejected"):
            self.writes.labels(name, decision)
        for outcome in ("completed", "released", "unknown"):
            self.upstream_outcomes.labels(name, outcome)

    def forget(self, metric: MetricWrapperBase, *values: str) -> None:
        """The series of `metric` for `values` gone from the exposition; shared
        between workers, where a series lives in every worker's file, it stays."""
        self._children.pop((metric, values), None)
        if self.shared_directory is None:
            with contextlib.suppress(KeyError):
                metric.remove(*values)

    def child(self, metric: MetricWrapperBase, *values: str) -> Any:
        """`metric.labels(*values)`, remembered: the write path asks for the same few
        children on every request, and `labels()` validates and locks each time."""
        try:
            return self._children[metric, values]
        except KeyError:
            found = metric.labels(*values)
            if len(self._children) < _MAX_CACHED_CHILDREN:
                self._children[metric, values] = found
            return found

    def render(self) -> tuple[bytes, str]:
        self.tally.flush()  # what this turn counted so far is in the figures
        if self.shared_directory is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        every_worker, directory = CollectorRegistry(), self.shared_directory
        MultiProcessCollector(every_worker, path=directory)  # type: ignore[no-untyped-call]
        return generate_latest(every_worker), CONTENT_TYPE_LATEST


class Tally:
    """Metric updates of one event-loop turn, applied together once it ends.

    A woken key answers hundreds of held writes in a turn, each adding one to
    the same few counters and one value to the same histograms; applied one by
    one, each pays `prometheus_client`'s lock and checks on a cold cache. Here a
    turn's additions to one counter or gauge are summed and applied once (whole
    numbers: the sum is what the additions one by one give), and a histogram's
    values are observed in the order they came, so every exported value is the
    same as without the tally. A scrape (`Metrics.render`) applies what is
    pending first; with metrics shared between workers, another worker's scrape
    sees this turn's updates once the turn ends. Without a running event loop
    an update is applied at once.
    """

    __slots__ = ("_added", "_observed", "_scheduled")

    def __init__(self) -> None:
        self._added: dict[Any, float] = {}
        self._observed: dict[Any, list[float]] = {}
        self._scheduled = False

    def add(self, child: Any, amount: float = 1.0) -> None:
        """`child.inc(amount)` (a counter's or a gauge's child), at the turn's end."""
        added = self._added
        added[child] = added.get(child, 0.0) + amount
        if not self._scheduled:
            self._schedule()

    def observe(self, child: Any, value: float) -> None:
        """`child.observe(value)` (a histogram's child), at the turn's end."""
        observed = self._observed.get(child)
        if observed is None:
            self._observed[child] = [value]
        else:
            observed.append(value)
        if not self._scheduled:
            self._schedule()

    def flush(self) -> None:
        """Apply what is pending."""
        self._scheduled = False
        added, self._added = self._added, {}
        observed, self._observed = self._observed, {}
        for child, amount in added.items():
            if amount:
                child.inc(amount)
        for child, values in observed.items():
            _observe_all(child, values)

    def _schedule(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._scheduled = True
        loop.call_soon(self.flush)


def _observe_all(histogram: Any, values: list[float]) -> None:
    """`histogram.observe(value)` for each of `values` in order, as one update: the
    sum accumulated value by value from the one stored (the same float as one by
    one), each bucket counted once by how many values fell in it. It reads
    `prometheus_client`'s histogram child (`_upper_bounds`, `_buckets`, `_sum`);
    one without them, or a single value, is observed the library's way."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    stored = getattr(histogram, "_sum", None)
    if len(values) == 1 or bounds is None or buckets is None or stored is None:
        for value in values:
            histogram.observe(value)
        return
    histogram._raise_if_not_observable()
    counts = [0] * len(bounds)
    total = stored.get()
    for value in values:
        total += value
        if value == value:  # a NaN falls in no bucket (`value <= bound` is never true)
            counts[bisect_left(bounds, value)] += 1  # the first bound >= value
    stored.set(total)
    for bucket, count in zip(buckets, counts, strict=True):
        if count:
            bucket.inc(count)
