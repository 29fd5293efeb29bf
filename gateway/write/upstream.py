"""Forwarding: one pooled ClientSession per destination, header hygiene, and the
translation of client errors into the three outcomes of SPEC 2 step 8."""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import aiohttp
from aiohttp import payload
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from gateway.config.model import HOP_BY_HOP, DestinationConfig
from gateway.config.tls import destination_context
from gateway.errors import GatewayError
from gateway.telemetry.tasks import watched
from leases.net import cannot_connect, errno_name
from leases.reasons import Reason

# Set by the client library for the forwarded request itself.
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "authorization", "expect"}
_NOT_RELAYED = HOP_BY_HOP | {"content-length"}
FENCING_HEADERS = ("Fencing-Job", "Fencing-Token", "Fencing-Owner")
_FENCING_LOWER = frozenset(h.lower() for h in FENCING_HEADERS)
# What the write was checked and fingerprinted on, and SPEC 2 passes on: a worker's
# `Connection` header cannot make these hop-by-hop (the destination's own fence
# and an idempotent upstream rely on them). Empty ones count as missing: not sent.
_CHECKED_LOWER = _FENCING_LOWER | {"idempotency-key"}
# And what says how to read the body, which goes on as it came: a coded body
# without its `Content-Encoding` would reach the upstream with nothing saying so.
_NOT_UNLISTED = _CHECKED_LOWER | {"content-type", "content-encoding"}


class SendFailure(StrEnum):
    """How a forward failed: never sent (key released) or maybe sent (unknown)."""

    UNREACHABLE = Reason.UPSTREAM_UNREACHABLE
    TIMEOUT = Reason.UPSTREAM_TIMEOUT
    DISCONNECTED = Reason.UPSTREAM_DISCONNECTED

    @property
    def maybe_sent(self) -> bool:
        return self is not SendFailure.UNREACHABLE


class ForwardFailed(GatewayError):
    """A forward that got no answer: `failure` says whether it may have been sent."""

    def __init__(self, failure: SendFailure, detail: str) -> None:
        super().__init__(detail)
        self.failure = failure
        self.detail = detail


class TooLateToSend(GatewayError):
    """The request would have reached the wire after its `send_by`: none of it did."""


# aiohttp 3.12 and later keep the request's head until the body's first bytes
# (or the end of a request without one) go out with it: what `_SentBy` relies on.
HEAD_WAITS_FOR_BODY = hasattr(aiohttp.http_writer.StreamWriter, "send_headers")


class _SentBy(payload.BytesPayload):
    """A forward's body, written only before `send_by` (`time.perf_counter`).

    aiohttp keeps the request's head and writes it together with the body's
    first bytes, from a task of its own: on Python 3.11 on a later turn of the
    loop, and where a connection is still being made, once it is. A check before
    `session.request` leaves that much time (a busy turn, a pause) for the
    request to leave after all; here it is made where the first byte reaches the
    socket, with no await between. Until it passes (`started`) nothing of the
    request has left: refused here, or failed before, it sent nothing.
    """

    def __init__(self, body: bytes, send_by: float) -> None:
        super().__init__(body)
        self.send_by = send_by
        self.started = False
        self._writing = False  # inside write_with_length, which may call write

    async def write(self, writer: aiohttp.abc.AbstractStreamWriter) -> None:
        if not self._writing:
            self._check()
        await super().write(writer)

    async def write_with_length(
        self, writer: aiohttp.abc.AbstractStreamWriter, content_length: int | None
    ) -> None:
        self._check()
        self._writing = True
        try:
            await super().write_with_length(writer, content_length)
        finally:
            self._writing = False

    def _check(self) -> None:
        if self.started:  # a client's own retry: the first may have been applied
            raise _SentTwice("the request was already written once")
        if time.perf_counter() >= self.send_by:
            raise TooLateToSend("the request would have left after its verdict's bound")
        self.started = True


class _SentTwice(Exception):
    """A second write of one forward's request, refused (a `maybe_sent` failure)."""


def _unless_started(data: bytes | _SentBy) -> SendFailure:
    """A connection that could not be made: unreachable, unless a byte of this
    request had already left on another one (a client's own retry)."""
    if isinstance(data, _SentBy) and data.started:
        return SendFailure.DISCONNECTED
    return SendFailure.UNREACHABLE


def _unsent(data: bytes | _SentBy) -> bool:
    """Whether nothing of a request failed in `send` can have reached the wire."""
    return isinstance(data, _SentBy) and not data.started


def _too_late_to_send(exc: BaseException) -> bool:
    """Whether `exc` (aiohttp wraps what a body's write raises) came of `_SentBy`."""
    seen: BaseException | None = exc
    for _ in range(4):  # the chain aiohttp makes is one or two deep
        if seen is None:
            return False
        if isinstance(seen, TooLateToSend):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@dataclass(frozen=True, slots=True)
class UpstreamAnswer:
    """The upstream's answer: the whole body, or, when `rest` is set, its first
    bytes (more than the buffer limit) with `rest` still to be relayed."""

    status: int
    headers: CIMultiDict[str]
    body: bytes
    rest: aiohttp.ClientResponse | None = None
    content_length: int | None = None


def _connection_tokens(headers: CIMultiDictProxy[str]) -> set[str]:
    """Header names listed in `Connection` are hop-by-hop for this message too."""
    values = headers.getall("Connection", [])
    return {t.strip().lower() for v in values for t in v.split(",") if t.strip()}


# Built once: per write only a `Connection` header's own tokens are added.
_DROP_FORWARDING_FENCING = frozenset(_NOT_FORWARDED)
_DROP_NOT_FORWARDING_FENCING = frozenset(_NOT_FORWARDED | _FENCING_LOWER)
_DROP_RELAYED = frozenset(_NOT_RELAYED)


def forward_headers(
    incoming: CIMultiDictProxy[str], destination: DestinationConfig
) -> CIMultiDict[str]:
    """End-to-end headers of the worker's request, cleaned and completed."""
    drop = (
        _DROP_FORWARDING_FENCING
        if destination.forward_fencing_headers
        else _DROP_NOT_FORWARDING_FENCING
    )
    if "Connection" in incoming:
        drop = drop | (_connection_tokens(incoming) - _NOT_UNLISTED)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        lower = name.lower()
        # an empty fencing header or key counts as missing (SPEC 2): not passed on
        if lower not in drop and (value.strip() or lower not in _CHECKED_LOWER):
            out.add(name, value)
    for name, value in destination.upstream_headers:
        out[name] = value  # replaces any the worker sent under the same name
    return out


def relay_headers(upstream: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """The upstream's end-to-end answer headers."""
    drop = _DROP_RELAYED
    if "Connection" in upstream:
        drop = drop | _connection_tokens(upstream)
    return CIMultiDict(
        (n, v if v.isascii() else _sendable(v))
        for n, v in upstream.items()
        if n.lower() not in drop
    )


def _sendable(value: str) -> str:
    """A header value that can be stored and sent on. Bytes that were not UTF-8
    (aiohttp keeps them as surrogates, which neither the store's JSON nor the
    server's writer takes) are read as ISO-8859-1, as RFC 9110 5.5 has clients
    read such bytes; they then go on as that text in UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogateescape").decode("latin-1")
    return value


def upstream_url(destination: DestinationConfig, raw_path: str, query: str) -> URL:
    """`{upstream}{path}?{query}` with the worker's percent-encoding kept as is."""
    target = destination.upstream + raw_path + (f"?{query}" if query else "")
    return URL(target, encoded=True)


def _ssl(destination: DestinationConfig) -> ssl.SSLContext | bool:
    """The destination's own trust and client certificate; True: the system's defaults."""
    context = destination_context(destination)
    return True if context is None else context


def _session(dest: DestinationConfig) -> aiohttp.ClientSession:
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=dest.max_in_flight, ttl_dns_cache=60, ssl=_ssl(dest)),
        auto_decompress=False,
        # Forward what the worker sent, not the client library's defaults
        # (an Accept-Encoding it never sent would get it a gzip answer).
        skip_auto_headers=("User-Agent", "Content-Type", "Accept", "Accept-Encoding"),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=forward_timeout(dest, dest.timeout),
    )
    # A forward is one request. aiohttp sends a PUT or DELETE again by itself when
    # the connection drops before the answer (RFC 9112 9.3.1 lets a client retry
    # an idempotent request), though the upstream may have applied the first: a
    # second effect of one write. Not a public option; `_SentBy` refuses a second
    # write of its body as well, where this attribute is not there.
    if hasattr(session, "_retry_connection"):
        session._retry_connection = False
    return session


def forward_timeout(dest: DestinationConfig, seconds: float) -> aiohttp.ClientTimeout:
    """A forward's bound of `seconds` in all. Never rounded up (aiohttp rounds a
    timeout of 5 s or more to the next whole second by default, and the barrier
    counts the destination's `timeout` exactly); the connect bound ends before it,
    so a connection never made is `unreachable` (nothing sent), not a timeout. It
    bounds the whole of making one (`connect`: the name's lookup and every address
    tried), and each socket's connect (`sock_connect`) within it."""
    if seconds > 2 * CONNECT_MARGIN_S:
        connect = min(dest.connect_timeout, seconds - CONNECT_MARGIN_S)
    else:  # all but nothing left: still before the whole bound
        connect = min(dest.connect_timeout, seconds / 2)
    return aiohttp.ClientTimeout(
        total=seconds, connect=connect, sock_connect=connect, ceil_threshold=math.inf
    )


# How much sooner than the whole bound the connect bound ends.
CONNECT_MARGIN_S = 0.01


class _Pool:
    """One destination's session, the requests using it, and whether a reload
    has put it out of service (it is closed when its last request ends)."""

    __slots__ = ("destination", "retired", "session", "stream_until", "users")

    def __init__(self, destination: DestinationConfig) -> None:
        self.destination = destination
        self.session = _session(destination)
        self.users = 0
        self.retired = False
        # Until when an answer it returned may still be relayed from it (loop time).
        self.stream_until = 0.0


class Upstreams:
    """One keep-alive connection pool per destination, owned by the app.

    `replace` (a reload) swaps the pools of changed and removed destinations out;
    a write already past its checks still holds its destination as it was and
    is sent through that destination's old pool, which is closed once its last
    request has ended.
    """

    def __init__(self, destinations: Mapping[str, DestinationConfig]) -> None:
        self._pools = {name: _Pool(dest) for name, dest in destinations.items()}
        self._retired: list[_Pool] = []
        self._timers: list[asyncio.TimerHandle] = []
        self._closing: set[asyncio.Task[None]] = set()

    def _pool(self, destination: DestinationConfig) -> _Pool:
        pool = self._pools.get(destination.name)
        if pool is not None and (
            pool.destination is destination or pool.destination == destination
        ):
            return pool
        for old in self._retired:
            if old.destination == destination:
                return old
        # Checked under a destination whose pool a reload already closed: a pool
        # of its own, closed after this request.
        old = _Pool(destination)
        old.retired = True
        self._retired.append(old)
        return old

    async def replace(self, destinations: Mapping[str, DestinationConfig]) -> None:
        """New pools for added and changed destinations; the old ones retire."""
        for name, pool in list(self._pools.items()):
            new = destinations.get(name)
            if new is not None and new == pool.destination:
                pool.destination = new  # same settings: keep the pool and its connections
                continue
            del self._pools[name]
            pool.retired = True
            self._retired.append(pool)
            if not pool.users:
                await self._close_retired(pool)
        for name, dest in destinations.items():
            if name not in self._pools:
                self._pools[name] = _Pool(dest)

    async def _close_retired(self, pool: _Pool) -> None:
        """Close a retired pool now, or once an answer it may still be relaying
        has run out of time."""
        loop = asyncio.get_running_loop()
        delay = pool.stream_until - loop.time()
        if delay <= 0:
            self._retired.remove(pool)
            await pool.session.close()
            return

        def close_later() -> None:
            if pool.users or pool not in self._retired:
                return  # in use again (or closed meanwhile): its last request closes it
            self._retired.remove(pool)
            task = watched(pool.session.close(), "close-retired-pool")
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

        self._timers.append(loop.call_later(delay, close_later))

    @property
    def retired_open(self) -> int:
        """Pools a reload took out of service that still carry a request."""
        return len(self._retired)

    async def send(
        self,
        destination: DestinationConfig,
        method: str,
        url: URL,
        headers: CIMultiDict[str],
        body: bytes,
        buffer_limit: int,
        until: float | None = None,
        send_by: float | None = None,
    ) -> UpstreamAnswer:
        """Send and read the answer: at most `buffer_limit` + 1 bytes of its body are
        read here; an answer longer than that comes back with `rest` set, for the
        caller to relay and then close. `until` (`time.perf_counter`): the answer's
        deadline, before the destination's `timeout` from now. `send_by`: the
        latest the request may reach the wire; `TooLateToSend` if it would later."""
        pool = self._pool(destination)
        data = body if send_by is None or not HEAD_WAITS_FOR_BODY else _SentBy(body, send_by)
        pool.users += 1
        try:
            if until is None:
                timeout = pool.session.timeout
            else:
                timeout = forward_timeout(destination, max(until - time.perf_counter(), 0.001))
            response = await pool.session.request(
                method, url, headers=headers, data=data, allow_redirects=False, timeout=timeout
            )
            if response.status < 200:
                # A final 1xx (101 to a request that asked for no upgrade) cannot
                # be relayed as an answer; whether the write took effect is unknown.
                response.close()
                raise ForwardFailed(
                    SendFailure.DISCONNECTED, f"the upstream answered {response.status}"
                )
            try:
                payload = await _read_up_to(response, buffer_limit + 1)
            except BaseException:
                response.close()
                raise
            answer = UpstreamAnswer(
                response.status,
                relay_headers(response.headers),
                payload,
                rest=response if len(payload) > buffer_limit else None,
                content_length=response.content_length,
            )
            if answer.rest is None:
                response.release()
            if answer.rest is not None:
                # The forward's own bound (`timeout`) ends the rest's relaying too.
                loop = asyncio.get_running_loop()
                pool.stream_until = loop.time() + destination.timeout + 1
            return answer
        except aiohttp.ConnectionTimeoutError as exc:
            raise ForwardFailed(_unless_started(data), f"connect timeout to {_where(url)}") from exc
        except aiohttp.ClientConnectorError as exc:
            raise ForwardFailed(_unless_started(data), cannot_connect(exc, _where(url))) from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            if _unsent(data):  # the timeout came while the connection was being made
                raise ForwardFailed(
                    SendFailure.UNREACHABLE, f"no connection to {_where(url)} within the timeout"
                ) from exc
            raise ForwardFailed(SendFailure.TIMEOUT, "no answer within the timeout") from exc
        except (aiohttp.ClientError, OSError) as exc:
            if _too_late_to_send(exc):
                raise TooLateToSend(str(exc)) from exc
            if _unsent(data):
                raise ForwardFailed(SendFailure.UNREACHABLE, connection_lost(exc, url)) from exc
            # Connection lost after (part of) the request may have been written.
            raise ForwardFailed(SendFailure.DISCONNECTED, connection_lost(exc, url)) from exc
        finally:
            pool.users -= 1
            if pool.retired and not pool.users:
                await self._close_retired(pool)

    async def close(self) -> None:
        """Close every destination's connection pool, retired ones too."""
        for handle in self._timers:
            handle.cancel()
        pools = [*self._pools.values(), *self._retired]
        await asyncio.gather(*(pool.session.close() for pool in pools))


# What a worker, a log line and a stored rejection may learn of a failed forward:
# fixed words, the upstream's host and port, an errno's name, a limit. Never an
# exception's str or repr: aiohttp's quote the request it was sending, headers
# included, and with them the destination's `[upstream_headers]` secrets.
_ANSWER_MALFORMED = (
    "the upstream's answer could not be parsed (a bad status line, a header over "
    "8190 bytes, or conflicting Content-Length and Transfer-Encoding)"
)


def _where(url: URL) -> str:
    return f"{url.host}:{url.explicit_port or url.port}"


def connection_lost(exc: BaseException, url: URL) -> str:
    """What broke after the request may have been (partly) written, in fixed words."""
    where = _where(url)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return f"{where} closed the connection before its answer was complete"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"{where}: {_ANSWER_MALFORMED}"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return f"{where}: the upstream's answer body was malformed or cut short"
    name = errno_name(exc)
    return f"connection to {where} lost" + (f": {name}" if name else "")


async def _read_up_to(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body's first `limit` bytes, or all of it when shorter."""
    content = response.content
    if response.content_length is not None and response.content_length < limit:
        return await response.read()  # short and announced: one read
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await content.read(limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
