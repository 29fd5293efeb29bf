"""The chaos run's TCP fault proxy (`--wire-faults`), in the spirit of Toxiproxy.

One `FaultProxy` listens on a free loopback port and relays every connection to
one target (PostgreSQL, or the recording destination). About once a second
(`TICK_S`, jittered) each live connection draws a fault with probability
`share`; a drawn fault is armed on the connection for one direction, picked at
random, and fires on the next chunk of data that crosses it that way, so it
lands in the middle of an exchange: a statement or a request on its way in, a
COMMIT's answer or a response on its way back (the cases a client cannot tell
apart):

- `latency`: for the next `LATENCY_S` seconds every chunk on the connection is
  held for a random delay (jitter up to `max_latency`) before it is relayed;
- `reset`: the chunk is dropped and both sides are reset (TCP RST);
- `stall`: the chunk is held and nothing more is relayed for `stall_s` seconds
  (the connection stops answering), then both sides are reset;
- `late` (the store's wire only, `late_s` given): the chunk is held for
  `late_s` seconds, about the destination's timeout, then relayed: a verdict
  that reaches the gateway too late to be sent, or only just in time.

Kinds come from shuffled decks, so a short run still injects each of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import struct
from dataclasses import dataclass, field

from gateway.tools.chaos.deck import FaultDeck

WIRE_KINDS = ("latency", "reset", "stall")
LATE_KIND = "late"
TICK_S = 1.0
LATENCY_S = 1.0
_CHUNK = 65536
_KEY = re.compile(rb"\r\nIdempotency-Key: *([!-~]+)", re.IGNORECASE)


@dataclass(eq=False)
class _Link:
    """One proxied connection: the client side and the target side."""

    client: tuple[asyncio.StreamReader, asyncio.StreamWriter]
    target: tuple[asyncio.StreamReader, asyncio.StreamWriter]
    armed: str | None = None
    armed_request: bool = True  # the direction the armed fault fires on
    slow_until: float = 0.0
    open_key: str | None = None  # HTTP: the key of a request not answered yet
    unapplied_key: str | None = None  # HTTP: the key of the last non-2xx answer
    closed: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class FaultProxy:
    """A TCP relay to `target_host:target_port` that injects `WIRE_KINDS` faults."""

    def __init__(
        self,
        name: str,
        target_host: str,
        target_port: int,
        *,
        share: float,
        seed: int,
        max_latency: float = 0.1,
        stall_s: tuple[float, float] = (0.5, 2.5),
        late_s: tuple[float, float] | None = None,
        http: bool = False,
    ) -> None:
        self.name = name
        self.target = (target_host, target_port)
        self.share = share
        self.max_latency = max_latency
        self.stall_s = stall_s
        self.late_s = late_s
        self.rng = random.Random(f"{seed}:proxy:{name}")
        self.counts: dict[str, int] = dict.fromkeys(self._kinds(), 0)
        self.connections = 0
        self.http = http
        # HTTP: keys of requests cut on the wire before they all arrived, or
        # whose answer saying they were not applied was cut (whether either
        # reached the other side is unknown, as for the gateway).
        self.cut_keys: dict[str, int] = {}
        self.port = 0
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._deck = FaultDeck(self.rng)

    async def start(self, port: int = 0) -> int:
        """Listen on loopback `port` (0: any free one) and relay (no fault yet);
        returns the port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    def begin(self) -> None:
        """Start injecting faults (once the processes behind it are up)."""
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick(), name=f"proxy-{self.name}")

    async def calm(self) -> None:
        """Stop injecting (a stall under way still ends in its reset); keep relaying."""
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        for link in self._links:
            link.armed = None
            link.slow_until = 0.0

    async def stop(self) -> None:
        """Stop faulting and relaying; every connection is closed."""
        await self.calm()
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            _close(link, reset=False)
        tasks = [t for link in list(self._links) for t in link.tasks]
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            target = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(writer)
            return
        self.connections += 1
        link = _Link((reader, writer), target)
        self._links.add(link)
        link.tasks = [
            asyncio.create_task(self._pump(link, reader, target[1], request=True)),
            asyncio.create_task(self._pump(link, target[0], writer, request=False)),
        ]
        await asyncio.gather(*link.tasks, return_exceptions=True)
        self._links.discard(link)

    async def _pump(
        self, link: _Link, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, request: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        held = False  # a chunk read and not relayed (yet): lost if we stop now
        reset = False
        try:
            while not link.closed:
                chunk = await src.read(_CHUNK)
                if not chunk:
                    break
                held = True
                if self.http:
                    self._follow(link, chunk, request=request)
                if link.armed is not None and link.armed_request == request:
                    kind, link.armed = link.armed, None
                    if kind == "stall":
                        await asyncio.sleep(self.rng.uniform(*self.stall_s))
                    if kind in ("reset", "stall"):
                        reset = True
                        break
                    if kind == LATE_KIND:
                        assert self.late_s is not None
                        await asyncio.sleep(self.rng.uniform(*self.late_s))
                    else:
                        link.slow_until = loop.time() + LATENCY_S
                if loop.time() < link.slow_until:
                    await asyncio.sleep(self.rng.uniform(0, self.max_latency))
                if link.closed:  # e.g. the client gave up while the chunk was held
                    break
                dst.write(chunk)
                await dst.drain()
                held = False
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            # Also when cancelled: the other direction closed the link meanwhile.
            if held and self.http:
                self._lost(link, request=request)
            if not link.closed:
                _close(link, reset=reset)

    def _follow(self, link: _Link, chunk: bytes, *, request: bool) -> None:
        if request:
            match = _KEY.search(chunk)
            if match is not None:
                link.open_key = match.group(1).decode("ascii")
                link.unapplied_key = None
            return
        if chunk.startswith(b"HTTP/") and link.open_key is not None:
            # The answer's head: the request arrived. The destination applies only
            # when it answers 2xx; the key of any other answer was not applied.
            status = chunk[9:12]
            link.unapplied_key = None if status.startswith(b"2") else link.open_key
            link.open_key = None

    def _lost(self, link: _Link, *, request: bool) -> None:
        """A chunk was dropped: the key of a request that did not (all) arrive, or
        of an answer saying it was not applied, is counted as cut."""
        key = link.open_key if request else link.unapplied_key
        if key is not None:
            self.cut_keys[key] = self.cut_keys.get(key, 0) + 1
            link.open_key = link.unapplied_key = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S * self.rng.uniform(0.5, 1.5))
            for link in list(self._links):
                if link.closed or link.armed is not None:
                    continue
                kind = self._draw()
                if kind is not None:
                    link.armed = kind
                    link.armed_request = self.rng.random() < 0.5
                    self.counts[kind] += 1

    def _kinds(self) -> tuple[str, ...]:
        # Read here, not bound at import: tests narrow WIRE_KINDS.
        return WIRE_KINDS if self.late_s is None else (*WIRE_KINDS, LATE_KIND)

    def _draw(self) -> str | None:
        return self._deck.draw(self.share, self._kinds())


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashed peer or a middlebox does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _close(link: _Link, *, reset: bool) -> None:
    link.closed = True
    for _, writer in (link.client, link.target):
        if reset:
            _reset(writer)
        else:
            writer.transport.close()
    for task in link.tasks:
        if task is not asyncio.current_task():
            task.cancel()
