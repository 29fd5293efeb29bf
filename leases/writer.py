"""Fenced writes from a worker: every request goes through the gateway's `/to/...`
route with the lease's fencing headers and an idempotency key.

    async with hold(store, "job-42", owner="worker-a", ttl=30) as lease:
        async with FencedWriter("http://gateway:8480", lease) as writer:
            result = await writer.post("payments", "/charges", json=charge, step="charge")

Gateway rejections (answers carrying `Sinkgate-Rejected`) raise one exception per
family; upstream answers come back untouched as `WriteResult`, whatever their
status: one in the destination's `retryable_statuses` (429, 502-504 by default)
was not stored, so the caller raises rather than leave `hold` (which would
complete the job with nothing done). Keys derived from
(job id, step) are the same for every worker redoing the job, so a second
worker gets the first one's stored result instead of producing a second effect.
"""

from __future__ import annotations

import asyncio
import hashlib
import json as jsonlib
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import quote

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from . import model, tracing
from .hold import HeldLease, Hold
from .model import MAX_KEY_LENGTH, VISIBLE, Lease
from .net import network_words
from .prefer import MAX_VALUE, preferences, whole
from .reasons import Reason
from .rejections import (
    GATEWAY_TIMEOUT,
    GATEWAY_UNREACHABLE,
    BadWrite,
    DuplicateWrite,
    GatewayRejected,
    GatewayUnavailable,
    StaleWrite,
    rejection_from_response,
)
from .target import Params, write_target

__all__ = [
    "BadWrite",
    "DuplicateWrite",
    "FencedWriter",
    "GatewayRejected",
    "GatewayUnavailable",
    "StaleWrite",
    "WriteResult",
    "derive_key",
    "rejection_from_response",
]

_RETRIED = frozenset({Reason.OLDER_GENERATION_IN_FLIGHT, Reason.REQUEST_IN_PROGRESS})
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Header names and values a request can carry (as the TypeScript writer checks them).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# What RFC 9110 5.5 leaves out of a field value: the control characters but HTAB.
_UNSENDABLE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# The M of the gateway's `Preference-Applied: wait=M`.
_SECONDS = re.compile(r"[0-9]{1,12}")
_OWN_HEADERS = frozenset(
    {"fencing-job", "fencing-token", "fencing-owner", "idempotency-key", "authorization"}
)
# The connection's and the body's framing, the HTTP client's to set: Node's fetch
# refuses all but Content-Length, and a Content-Length of the caller's that is not
# the body's length hangs or cuts the request. Refused alike in both writers.
_CONNECTION_HEADERS = frozenset(
    {"connection", "content-length", "expect", "keep-alive", "transfer-encoding", "upgrade"}
)


# --- results and keys ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WriteResult:
    """The upstream's answer as the gateway relayed it (or replayed it)."""

    status: int
    headers: CIMultiDictProxy[str]
    body: bytes
    replayed: bool

    def json(self) -> Any:
        return jsonlib.loads(self.body)

    def text(self, encoding: str = "utf-8") -> str:
        return self.body.decode(encoding)


def derive_key(job_id: str, step: str) -> str:
    """The idempotency key of `step` of `job_id`: deterministic, generation-free.

    Readable prefix for the rejection log and admin, then a hash of the exact
    (job_id, step) pair, so long or unusual ids stay within 255 visible ASCII and
    ("a:b", "c") never collides with ("a", "b:c").
    """
    model.validate_ident(job_id, "job_id")
    if not isinstance(step, str) or not step:
        raise ValueError("step must be a non-empty string")
    digest = hashlib.sha256(jsonlib.dumps([job_id, step]).encode()).hexdigest()[:32]
    readable = "_".join(VISIBLE.findall(step)) or "step"
    return f"{job_id[:120]}:{readable[:80]}:{digest}"


def _validate_key(key: object) -> str:
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise ValueError("idempotency_key must be a string of 1-255 visible ASCII characters")
    if not VISIBLE.fullmatch(key):
        raise ValueError("idempotency_key must be visible ASCII (0x21-0x7E)")
    return key


# --- the writer ----------------------------------------------------------------------------


class FencedWriter:
    """Sends writes through the gateway under one lease: a plain `Lease`, or what
    `hold()` yields (or its `Hold`), whose loss it checks before every send."""

    def __init__(
        self,
        gateway_url: str,
        lease: Lease | Hold,
        *,
        session: aiohttp.ClientSession | None = None,
        token: str | None = None,
        max_retries: int = 5,
        max_retry_wait: float = 5.0,
        timeout: float = 60.0,
        wait: int = 5,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        base = URL(gateway_url) if isinstance(gateway_url, str) else None
        if base is None or base.scheme not in ("http", "https") or not base.host:
            raise ValueError(f"gateway_url must be http(s)://host[:port], not {gateway_url!r}")
        if isinstance(lease, HeldLease):
            lease = lease.hold  # what hold() yields: check its live state before each send
        if not isinstance(lease, Lease | Hold):
            raise ValueError(f"lease must be a Lease or a Hold, not {type(lease).__name__}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError("max_retries must be an integer >= 0")
        if isinstance(max_retry_wait, bool) or not _seconds(max_retry_wait) >= 0:
            raise ValueError("max_retry_wait must be a number of seconds >= 0")
        # Finite and above 0: aiohttp reads 0 as no timeout at all, and inf overflows.
        model.validate_seconds("timeout", timeout)
        if isinstance(wait, bool) or not isinstance(wait, int) or wait < 0:
            raise ValueError("wait must be a whole number of seconds >= 0")
        if token is not None and not (isinstance(token, str) and VISIBLE.fullmatch(token)):
            raise ValueError("token must be visible ASCII")
        self._base = str(base.with_query(None).with_fragment(None)).rstrip("/")
        self._lease = lease
        self._session = session
        self._owns_session = session is None
        self._token = token
        self._prefer = f"wait={wait}" if wait > 0 else None
        self.max_retries = max_retries
        self.max_retry_wait = _seconds(max_retry_wait)  # an int past the floats: inf
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._sleep = sleep

    @property
    def lease(self) -> Lease:
        """The lease the next write is fenced with (a Hold's latest renewal)."""
        return self._lease.lease if isinstance(self._lease, Hold) else self._lease

    async def post(self, destination: str, path: str = "", **kw: Any) -> WriteResult:
        return await self.request("POST", destination, path, **kw)

    async def put(self, destination: str, path: str = "", **kw: Any) -> WriteResult:
        return await self.request("PUT", destination, path, **kw)

    async def patch(self, destination: str, path: str = "", **kw: Any) -> WriteResult:
        return await self.request("PATCH", destination, path, **kw)

    async def delete(self, destination: str, path: str = "", **kw: Any) -> WriteResult:
        return await self.request("DELETE", destination, path, **kw)

    async def request(
        self,
        method: str,
        destination: str,
        path: str = "",
        *,
        json: Any = None,
        data: bytes | str | None = None,
        headers: Mapping[str, str] | None = None,
        params: Params | None = None,
        idempotency_key: str | None = None,
        step: str | None = None,
    ) -> WriteResult:
        """Send one write; retry while an older generation or the same key is in
        flight, at most `max_retries` times. Each write asks the gateway to hold it
        until that settles (`Prefer: wait`, up to `wait` seconds); a refusal that
        says the wait was applied is retried at once (the gateway has waited), and
        counts as a retry once such waits add up to the `Retry-After` (at most
        `max_retry_wait`) the writer would have slept; one that does not (an older
        gateway, `max_wait = "0s"`, too many waiting) after its `Retry-After`.

        Raises `LeaseLost` (from a lost `Hold`) before sending, `GatewayRejected`
        subclasses for gateway refusals, `ValueError` for bad arguments.
        """
        url = self._url(method, destination, path, params)
        if (idempotency_key is None) == (step is None):
            raise ValueError("pass exactly one of idempotency_key and step")
        key = (
            _validate_key(idempotency_key)
            if idempotency_key is not None
            else derive_key(self.lease.job_id, step)  # type: ignore[arg-type]
        )
        body, content_type = _body(json, data)
        sent = self._headers(headers, content_type, key)
        retries = 0
        held = 0.0  # seconds the gateway held the write since the last retry counted
        while True:
            if isinstance(self._lease, Hold):
                self._lease.check()  # raises LeaseLost: no effect under a lost lease
            lease = self.lease
            sent["Fencing-Job"] = lease.job_id
            sent["Fencing-Token"] = str(lease.generation)
            sent["Fencing-Owner"] = lease.owner
            status, answer_headers, answer = await self._send(method, url, body, sent)
            if "Sinkgate-Rejected" not in answer_headers:
                replayed = answer_headers.get("Idempotent-Replayed", "").lower() == "true"
                if replayed and _stored_fence_refusal(status, answer):
                    raise rejection_from_response(status, answer_headers, answer)
                return WriteResult(status, answer_headers, answer, replayed)
            rejection = rejection_from_response(status, answer_headers, answer)
            if rejection.reason not in _RETRIED:
                raise rejection
            applied = _applied_wait(answer_headers)
            if applied is not None:
                # The gateway held the write (and is asked again at once). A retry is
                # counted when the holds add up to the sleep it stands for, so that a
                # destination's short `max_wait` leaves the writer as patient as one
                # that does not wait.
                held += applied
                if held < self._backoff(rejection.retry_after, retries + 1):
                    continue
            if retries >= self.max_retries:
                raise rejection
            retries += 1
            held = 0.0
            if applied is None:
                await self._sleep(self._backoff(rejection.retry_after, retries))

    def _headers(
        self, given: Mapping[str, str] | None, content_type: str | None, key: str
    ) -> CIMultiDict[str]:
        """The caller's headers with the writer's own, but for the fencing ones
        (set before each send, from the lease as it is then). A caller's `Prefer`
        (say `return=representation` for the upstream) is kept, the writer's
        `wait=N` after it."""
        sent = CIMultiDict(given or {})
        for name, value in sent.items():
            if not _TOKEN.fullmatch(name):
                raise ValueError(f"header name {name!r} is not an HTTP token")
            if not isinstance(value, str) or _UNSENDABLE.search(value):
                raise ValueError(
                    f"header {name}: a value is a string without control characters (tabs aside)"
                )
        clash = sorted(name for name in sent if name.lower() in _OWN_HEADERS)
        if clash:
            raise ValueError(f"the writer sets {clash[0]} itself; pass it as an argument")
        framing = sorted(name for name in sent if name.lower() in _CONNECTION_HEADERS)
        if framing:
            raise ValueError(f"{framing[0]} is the HTTP client's to set, not a header to pass")
        if content_type is not None and "Content-Type" not in sent:
            sent["Content-Type"] = content_type
        sent["Idempotency-Key"] = key
        prefer = _prefer(sent.popall("Prefer", []), self._prefer)
        if prefer is not None:
            sent["Prefer"] = prefer
        if self._token is not None:
            sent["Authorization"] = f"Bearer {self._token}"
        return sent

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> FencedWriter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _backoff(self, retry_after: float | None, retries: int) -> float:
        wait = retry_after if retry_after is not None else 0.05 * 2 ** (retries - 1)
        return min(wait, self.max_retry_wait)

    def _url(self, method: str, destination: str, path: str, params: Params | None) -> URL:
        if not isinstance(method, str) or not re.fullmatch(r"[A-Za-z]+", method):
            raise ValueError(f"invalid method {method!r}")
        if not isinstance(destination, str) or not destination or "/" in destination:
            raise ValueError(f"destination must be a name without '/', not {destination!r}")
        if destination in (".", ".."):
            raise ValueError(f"destination must not be '.' or '..', not {destination!r}")
        if not isinstance(path, str):
            raise ValueError(f"path must be a string, not {type(path).__name__}")
        if _CONTROL.search(path):
            # The URL parser drops tabs and newlines, which would join "." and "." into "..".
            raise ValueError(f"path must not contain control characters: {path!r}")
        if path and not path.startswith("/"):
            path = "/" + path
        segments = path.split("?", 1)[0].split("/")
        if any(seg.lower().replace("%2e", ".") in (".", "..") for seg in segments):
            # The URL would be normalised on the way (possibly out of /to/...).
            raise ValueError(f"path must not contain '.' or '..' segments: {path!r}")
        # The path is the caller's, percent-escapes included, spelled as both
        # writers spell it (escapes such as %2F kept as they are).
        route = f"{self._base}/to/{quote(destination, safe='')}"
        url = URL(route + write_target(path, params), encoded=True)
        # What is sent, as yarl parsed it: still under this destination's route.
        prefix = URL(route).raw_path
        if url.raw_path != prefix and not url.raw_path.startswith(prefix + "/"):
            raise ValueError(f"path {path!r} leaves {prefix}/")
        return url

    async def _send(
        self,
        method: str,
        url: URL,
        body: bytes | None,
        headers: CIMultiDict[str],
    ) -> tuple[int, CIMultiDictProxy[str], bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            attributes = partial(_span_attributes, method, url, headers)
            with tracing.client_span("sinkgate.write", headers, attributes) as span:
                async with self._session.request(
                    method.upper(),
                    url,
                    data=body,
                    headers=headers,
                    allow_redirects=False,  # a redirect is the upstream's answer, relayed
                    timeout=self._timeout,
                ) as resp:
                    tracing.answered(span, resp.status, resp.headers.get("Sinkgate-Rejected"))
                    return resp.status, resp.headers, await resp.read()
        except TimeoutError as exc:
            raise GatewayUnavailable(
                GATEWAY_TIMEOUT,
                None,
                f"no answer from the gateway within {self._timeout.total:g} s",
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise GatewayUnavailable(
                GATEWAY_UNREACHABLE, None, f"{_unanswered(exc)}: {network_words(exc)}"
            ) from exc


def _unanswered(exc: BaseException) -> str:
    """What a write that got no answer may have done: nothing, if no connection was
    made; else the gateway may have it (a retry with the same key is decided by it)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "cannot reach the gateway"
    return "no usable answer from the gateway, which may have the write"


def _applied_wait(headers: CIMultiDictProxy[str]) -> float | None:
    """The seconds `Preference-Applied: wait=M` says the gateway held the write;
    None when it did not. An applied wait whose M cannot be read counts as a whole
    retry's worth (inf)."""
    values = headers.getall("Preference-Applied", [])
    if not values:
        return None
    for name, value in preferences(values):
        if name == "wait" and value is not None and _SECONDS.fullmatch(value):
            # 0 held nothing, and added to the sum would never count a retry:
            # asked again at once, for ever. Counted as a whole retry instead.
            return float(value) if int(value) > 0 else math.inf
    return math.inf


def _prefer(given: list[str], wait: str | None) -> str | None:
    """One `Prefer` value: the caller's preferences first, then the writer's
    `wait=N`. Checked as the gateway will read what is sent (the values stripped
    and joined): a `wait` of the caller's is a bad argument (the writer's `wait`
    option says it, and the gateway reads only the first `wait` it finds); so
    is, under a wait of the writer's, a value the gateway would not read to its
    end (not a preference list, or the whole longer than it reads): the
    writer's `wait` after it would never be seen."""
    stripped = [value.strip() for value in given if value.strip()]
    callers = ", ".join(stripped)
    # Any length: a `wait` in a value too long for the gateway to read is refused
    # all the same, and the length is said by the check on the merged value.
    if any(name == "wait" for name, _ in preferences([callers], None)):
        raise ValueError(
            f"Prefer {callers[:80]!r}: the writer sets the wait preference itself; "
            "pass wait= to FencedWriter"
        )
    if wait is None:
        return callers or None
    if not whole(callers, None):
        raise ValueError(
            f"Prefer {callers[:80]!r} is not a list of preferences (RFC 7240): the gateway "
            "would stop reading it there and never see the writer's wait"
        )
    merged = ", ".join([*stripped, wait])
    if len(merged) > MAX_VALUE:
        raise ValueError(
            f"Prefer: with the writer's {wait} it is {len(merged)} characters, and the "
            f"gateway reads at most {MAX_VALUE}"
        )
    return merged


def _seconds(value: object) -> float:
    """`value` as seconds; NaN (which no comparison admits) for anything but a number."""
    if not isinstance(value, int | float):
        return math.nan
    try:
        return float(value)
    except OverflowError:  # an int past the floats' range
        return math.inf


def _stored_fence_refusal(status: int, body: bytes) -> bool:
    """A replay of the destination's own fence refusal (SPEC 3.1): the first
    answer carried `Sinkgate-Rejected: stale_generation` and raised `StaleWrite`,
    but a replay carries no `Sinkgate-Rejected` (SPEC 2), only the stored status
    and problem body. It is the same refusal, so it raises the same way."""
    if status != 409:
        return False
    try:
        problem = jsonlib.loads(body)
    except (ValueError, RecursionError):  # an upstream's own 409, whatever its body
        return False
    return isinstance(problem, dict) and problem.get("reason") == Reason.STALE_GENERATION


def _span_attributes(method: str, url: URL, headers: Mapping[str, str]) -> dict[str, Any]:
    """A write's client span: HTTP semantic conventions and the fencing it carries."""
    attributes: dict[str, Any] = {
        "http.request.method": method.upper(),
        "url.full": str(url.with_user(None).with_query(None)),
        "server.address": url.host or "",
        "sinkgate.job_id": headers["Fencing-Job"],
        "sinkgate.generation": int(headers["Fencing-Token"]),
        "sinkgate.idempotency_key": headers["Idempotency-Key"],
    }
    if url.port is not None:
        attributes["server.port"] = url.port
    return attributes


def _body(json: Any, data: bytes | str | None) -> tuple[bytes | None, str | None]:
    if json is not None and data is not None:
        raise ValueError("pass json or data, not both")
    if json is not None:
        # Sorted and compact: two workers sending the same payload send the same
        # bytes, so the gateway's fingerprint matches and the second gets a replay.
        text = jsonlib.dumps(json, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return text.encode(), "application/json"
    if isinstance(data, str):
        return data.encode(), "text/plain; charset=utf-8"
    if data is None:
        return None, None
    if isinstance(data, bytes):  # said, not left to aiohttp: the TypeScript writer says it too
        return data, "application/octet-stream"
    raise ValueError(f"data must be bytes or str, not {type(data).__name__}")
