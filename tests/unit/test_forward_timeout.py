"""A forward's aiohttp timeout: exact (the barrier counts the destination's
`timeout` to the millisecond), and its connect bound ending first."""

from __future__ import annotations

import math

import pytest

from gateway.write.upstream import forward_timeout
from tests.harness import destination


@pytest.mark.parametrize(("timeout", "connect"), [(10.0, 2.0), (1.0, 1.0), (0.3, 0.3)])
def test_never_rounded_up_and_the_connect_bound_ends_first(timeout: float, connect: float) -> None:
    dest = destination("pay", "http://127.0.0.1:9/api", timeout=timeout, connect_timeout=connect)
    bound = forward_timeout(dest, timeout)
    assert bound.total == timeout
    # aiohttp rounds a bound of 5 s or more up to the next second unless told not to:
    # a 5.5 s forward would end at 6 s, past the barrier.
    assert bound.ceil_threshold == math.inf
    # the same as the whole bound, a connect that never completes read as a timeout
    # (maybe sent: `unknown`) instead of `unreachable` (nothing sent)
    assert bound.sock_connect is not None and bound.sock_connect < timeout
