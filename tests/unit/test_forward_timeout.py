"""A forward's aiohttp timeout: exact (the barrier counts the destination's
`timeout` to the millisecond), and its connect bound ending first."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict
from yarl import URL

from gateway.write.upstream import ForwardFailed, SendFailure, Upstreams, forward_timeout
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


class _SlowResolver:
    """A name lookup that takes a second."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list:
        await asyncio.sleep(1.0)
        return []

    async def close(self) -> None:
        pass


async def test_a_connection_never_made_within_the_bound_is_unreachable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The name's lookup counts against the connect bound, which ends before the
    whole one: nothing was sent, so the key is released (SPEC 2 step 8), where
    the whole bound firing first would have left it `unknown` for an operator."""
    monkeypatch.setattr(aiohttp.connector, "DefaultResolver", _SlowResolver)
    dest = destination("pay", "http://upstream.example:9/api", timeout=10.0, connect_timeout=2.0)
    upstreams = Upstreams({"pay": dest})
    try:
        with pytest.raises(ForwardFailed) as failed:
            await upstreams.send(
                dest,
                "POST",
                URL("http://upstream.example:9/api/x"),
                CIMultiDict(),
                b"{}",
                1024,
                until=time.perf_counter() + 0.3,  # a verdict that came late
            )
    finally:
        await upstreams.close()
    assert failed.value.failure is SendFailure.UNREACHABLE
    assert not failed.value.failure.maybe_sent
