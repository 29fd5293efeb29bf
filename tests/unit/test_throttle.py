"""The failed-authentication throttle: a fixed window per address, bounded memory."""

from __future__ import annotations

import pytest

from gateway.admin.throttle import FailureThrottle


def test_an_address_waits_after_its_limit_until_its_window_passes() -> None:
    throttle = FailureThrottle(limit=3, window_s=60)
    for _ in range(3):
        assert throttle.retry_after("a", 100.0) is None
        throttle.failed("a", 100.0)
    assert throttle.retry_after("a", 100.0) == 60
    assert throttle.retry_after("a", 159.5) == 1  # whole seconds, never 0
    assert throttle.retry_after("b", 100.0) is None  # another address
    assert throttle.retry_after("a", 160.0) is None  # the window has passed
    throttle.failed("a", 160.0)
    assert throttle.retry_after("a", 160.0) is None  # a new window, one failure in it


def test_memory_is_bounded_by_forgetting_the_oldest_windows() -> None:
    throttle = FailureThrottle(limit=1, window_s=60, max_addresses=100)
    for n in range(1000):
        throttle.failed(f"10.0.{n // 256}.{n % 256}", float(n) / 100)
    assert len(throttle) == 100
    assert throttle.retry_after("10.0.3.231", 10.0) is not None  # the newest is kept
    assert throttle.retry_after("10.0.0.0", 10.0) is None  # the oldest forgotten


@pytest.mark.parametrize("bad", [{"limit": 0}, {"window_s": 0}, {"max_addresses": 0}])
def test_nonsense_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        FailureThrottle(**bad)  # type: ignore[arg-type]
