"""Writes refused before their facts: one line each, rate-limited, bounded names."""

from __future__ import annotations

from structlog.testing import capture_logs

from gateway.telemetry.refusals import OTHER, Refusals
from tests.conftest import FakeClock


def test_one_line_per_refusal_up_to_the_rate_then_a_count_of_those_dropped() -> None:
    clock = FakeClock()
    refusals = Refusals(per_second=10, burst=5, clock=clock)
    with capture_logs() as logs:
        for _ in range(50):  # a flood within one instant
            refusals.note("unknown_destination", "exampel", "POST", "10.0.0.7")
        clock.advance(1.0)  # ten lines' worth of time, but a burst holds five
        for _ in range(20):
            refusals.note("method_not_allowed", "payments", "GET", "10.0.0.8")
    lines = [line for line in logs if line["event"] == "write_refused"]
    assert len(lines) == 5 + 5
    assert lines[0] == {
        "event": "write_refused",
        "log_level": "warning",
        "reason": "unknown_destination",
        "destination": "exampel",
        "method": "POST",
        "remote": "10.0.0.7",
    }
    assert lines[5]["suppressed"] == 45 and "suppressed" not in lines[6]
    assert refusals.suppressed == 15
    assert refusals.top(2) == [("exampel", 50), ("payments", 20)]


def test_names_are_bounded() -> None:
    refusals = Refusals(names_max=3)
    for n in range(10):
        refusals.note("unknown_destination", f"name-{n}" * 50, "POST", None)
    assert len(refusals.names) == 4  # three names and (other)
    assert refusals.names[OTHER] == 7
    assert all(len(name) <= 80 for name in refusals.names)
