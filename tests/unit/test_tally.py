"""`Tally`: the write path's metric updates of one event-loop turn, applied at its
end, export exactly what the same updates applied one by one export."""

from __future__ import annotations

import asyncio

from gateway.telemetry.metrics import Metrics

# One turn's values of one histogram, observed together: some on a bucket's bound,
# one past the last, the sum not associative (0.1 + 0.2 + 0.3).
UPDATES = [
    ("forwarded", 0.0123),
    ("replayed", 0.5),
    ("replayed", 7.25),
    ("rejected", 1e-4),
    ("replayed", 0.1),
    ("replayed", 0.2),
    ("replayed", 0.3),
    ("rejected", 0.0005),
    ("forwarded", 12.0),
]


def apply(metrics: Metrics, *, tallied: bool) -> None:
    """The same updates, one by one or through the tally."""
    for decision, seconds in UPDATES:
        writes = metrics.child(metrics.writes, "pay", decision)
        latency = metrics.child(metrics.store_latency, "decide")
        if tallied:
            metrics.tally.add(writes)
            metrics.tally.observe(latency, seconds)
            metrics.tally.add(metrics.waiting)
            metrics.tally.add(metrics.waiting, -1.0)
            metrics.tally.add(metrics.waiting)
        else:
            writes.inc()
            latency.observe(seconds)
            metrics.waiting.inc()
            metrics.waiting.dec()
            metrics.waiting.inc()


def samples(metrics: Metrics) -> list[tuple[str, dict[str, str], float]]:
    """Every exported sample but the creation times (which differ by registry)."""
    return [
        (s.name, s.labels, s.value)
        for family in metrics.registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    ]


async def test_a_turns_updates_are_applied_at_its_end_with_the_same_values() -> None:
    one_by_one, tallied = Metrics(), Metrics()
    apply(one_by_one, tallied=False)
    apply(tallied, tallied=True)
    before = tallied.registry.get_sample_value("sinkgate_waiting_writes")
    assert before == 0.0  # pending until the turn ends
    await asyncio.sleep(0)
    assert samples(tallied) == samples(one_by_one)
    sums = [
        m.registry.get_sample_value("sinkgate_store_latency_seconds_sum", {"op": "decide"})
        for m in (one_by_one, tallied)
    ]
    expected = 0.0
    for _, seconds in UPDATES:
        expected += seconds
    assert sums[0] == sums[1] == expected


async def test_a_scrape_sees_what_the_turn_counted_so_far() -> None:
    metrics = Metrics()
    metrics.tally.add(metrics.child(metrics.writes, "pay", "replayed"), 3)
    assert (
        b'sinkgate_writes_total{decision="replayed",destination="pay"} 3.0' in (metrics.render()[0])
    )


def test_without_an_event_loop_an_update_is_applied_at_once() -> None:
    metrics = Metrics()
    metrics.tally.add(metrics.waiting, 2)
    metrics.tally.observe(metrics.wait_seconds, 0.2)
    assert metrics.registry.get_sample_value("sinkgate_waiting_writes") == 2.0
    assert metrics.registry.get_sample_value("sinkgate_wait_seconds_count") == 1.0


async def test_a_histograms_sum_grows_value_by_value() -> None:
    """Values observed together are added to the sum one at a time, as one by one:
    0.1 then 0.2 then 0.3 is 0.6000000000000001, where 0.1 + (0.2 + 0.3) is 0.6."""
    one_by_one, tallied = Metrics(), Metrics()
    for metrics in (one_by_one, tallied):
        metrics.wait_seconds.observe(0.1)
    for seconds in (0.2, 0.3):
        one_by_one.wait_seconds.observe(seconds)
        tallied.tally.observe(tallied.wait_seconds, seconds)
    await asyncio.sleep(0)
    assert samples(tallied) == samples(one_by_one)
    assert tallied.registry.get_sample_value("sinkgate_wait_seconds_sum") == (0.1 + 0.2) + 0.3
