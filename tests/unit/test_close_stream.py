"""A forward whose handler was cancelled while its answer was still to be
relayed: the answer's rest (the upstream's response, holding its connection)
is closed, not left open until the session goes away."""

from __future__ import annotations

import asyncio
from typing import Any

from multidict import CIMultiDict

from gateway.write.relay import close_stream
from gateway.write.upstream import UpstreamAnswer


class _Rest:
    closed = False

    def close(self) -> None:
        self.closed = True


async def test_the_rest_of_a_forwards_answer_is_closed() -> None:
    rest = _Rest()
    answer = UpstreamAnswer(200, CIMultiDict(), b"first bytes", rest=rest)  # type: ignore[arg-type]
    forward: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    forward.set_result((answer, None, object()))  # what `_forward` returns
    close_stream(forward)
    assert rest.closed
