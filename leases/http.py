"""The lease store over the gateway's lease API (SPEC 3), with the same interface,
values and errors as the SQLite and PostgreSQL stores.

Every failure to get a clear answer - a connection error, a timeout, a 5xx, an
answer this client does not understand - is `StoreUnavailable`, so `hold()`
treats it as a failed renewal and keeps trying until the worker's own deadline.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any, TypeGuard
from urllib.parse import quote

import aiohttp
from yarl import URL

from . import model, tracing
from .base import Closing
from .errors import JobCompleted, LeaseHeld, LeaseLost, StoreUnavailable
from .model import Lease, LeaseRef
from .net import network_words
from .reasons import Reason
from .urls import redact_url

_LOST_REASONS = frozenset(model.LOST_REASONS)


class HTTPLeaseStore(Closing):
    """A lease store reached through a sinkgate gateway's `/leases/...` routes."""

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        *,
        owns_session: bool,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._base = base_url
        self._session = session
        self._owns_session = owns_session
        self._closed = False
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._headers = dict(headers or {})

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        timeout: float = 10.0,  # noqa: ASYNC109 - bounds each later call, not open()
        session: aiohttp.ClientSession | None = None,
        headers: dict[str, str] | None = None,
        token: str | None = None,
    ) -> HTTPLeaseStore:
        """`url` is the gateway's main listener, e.g. `http://gateway:8480` (a path
        prefix is kept). `timeout` bounds each call; `headers` go with every call
        (e.g. `Authorization`); `token` sends `Authorization: Bearer <token>` for a
        gateway whose lease API requires one. A `session` passed in is used and left
        open."""
        base = _base_url(url)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise ValueError(f"timeout must be a number of seconds, not {type(timeout).__name__}")
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError("timeout must be a positive number of seconds")
        if headers is not None and not (
            isinstance(headers, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
        ):
            raise ValueError("headers must be a dict of str to str")
        if token is not None:
            if not isinstance(token, str) or not token.isascii() or not token.isprintable():
                raise ValueError("token must be printable ASCII")
            headers = {**(headers or {}), "Authorization": f"Bearer {token}"}
        if session is not None and not isinstance(session, aiohttp.ClientSession):
            raise ValueError(f"session must be an aiohttp.ClientSession, not {type(session)}")
        owns = session is None
        return cls(
            base,
            session or aiohttp.ClientSession(),
            owns_session=owns,
            timeout=float(timeout),
            headers=headers,
        )

    async def claim(self, job_id: str, *, owner: str | None = None, ttl: float) -> Lease:
        model.validate_ident(job_id, "job_id")
        owner = model.validate_ident(model.default_owner() if owner is None else owner, "owner")
        ttl = model.validate_ttl(ttl)
        status, doc = await self._call("POST", job_id, "claim", {"owner": owner, "ttl": ttl})
        if status == 200:
            return _lease(doc)
        reason = _reason(doc)
        if reason == Reason.LEASE_HELD:
            expires_in = doc.get("expires_in")
            holder = doc.get("owner")
            current = doc.get("current_generation")
            if isinstance(holder, str) and _is_number(expires_in):
                raise LeaseHeld(
                    job_id,
                    holder,
                    float(expires_in),
                    current if isinstance(current, int) and not isinstance(current, bool) else None,
                )
        elif reason == Reason.JOB_COMPLETED:
            current = doc.get("current_generation")
            raise JobCompleted(
                job_id,
                current if isinstance(current, int) and not isinstance(current, bool) else None,
            )
        raise _unexpected(status, doc, self._base)

    async def get(self, job_id: str) -> Lease | None:
        model.validate_ident(job_id, "job_id")
        status, doc = await self._call("GET", job_id, None, None)
        if status == 200:
            return _lease(doc)
        if status == 404 and _reason(doc) == Reason.LEASE_NOT_HELD:
            return None
        raise _unexpected(status, doc, self._base)

    async def close(self) -> None:
        self._closed = True
        if self._owns_session:
            await self._session.close()

    async def _held(self, op: str, lease: Lease | LeaseRef, ttl: float | None) -> Lease:
        job_id, owner, generation = model.lease_fields(lease)
        body: dict[str, Any] = {"owner": owner, "generation": generation}
        if ttl is not None:
            body["ttl"] = ttl
        status, doc = await self._call("POST", job_id, op, body)
        if status == 200:
            return _lease(doc)
        reason = _reason(doc)
        if status == 409 and reason in _LOST_REASONS:
            current = doc.get("current_generation")
            raise LeaseLost(
                job_id,
                generation,
                reason,
                current_generation=current if _is_int(current) else None,
            )
        raise _unexpected(status, doc, self._base)

    async def _call(
        self, method: str, job_id: str, op: str | None, body: dict[str, Any] | None
    ) -> tuple[int, dict[str, Any]]:
        if self._closed:
            raise StoreUnavailable("store is closed")
        segment = quote(job_id, safe="")
        if segment in (".", ".."):
            # Left bare, a client, proxy or server would read them as path navigation.
            segment = segment.replace(".", "%2E")
        path = f"/leases/{segment}" + ("" if op is None else f"/{op}")
        url = URL(self._base + path, encoded=True)
        data = None if body is None else json.dumps(body).encode()
        headers = {**self._headers, "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"

        def attributes() -> dict[str, Any]:
            host = url.host or ""
            return {
                "http.request.method": method,
                "server.address": host,
                "sinkgate.job_id": job_id,
            }

        try:
            with tracing.client_span(f"sinkgate.lease.{op or 'get'}", headers, attributes) as span:
                async with self._session.request(
                    method, url, data=data, headers=headers, timeout=self._timeout
                ) as resp:
                    status = resp.status
                    raw = await resp.read()
                    tracing.answered(span, status, resp.headers.get("Sinkgate-Rejected"))
        except TimeoutError as exc:
            raise StoreUnavailable(f"lease API {method} {path} timed out") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise StoreUnavailable(
                f"lease API {method} {path} failed: {network_words(exc)}"
            ) from exc
        if status >= 500:
            raise StoreUnavailable(f"lease API {method} {path} answered {status}", status=status)
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            doc = None
        if not isinstance(doc, dict):
            raise StoreUnavailable(
                f"lease API {method} {path} answered {status} without a JSON object: "
                + _not_the_lease_api(self._base),
                status=status,
            )
        return status, doc

    def __repr__(self) -> str:
        return f"HTTPLeaseStore({redact_url(self._base)!r})"


def _base_url(url: object) -> str:
    if not isinstance(url, str):
        raise ValueError(f"store URL must be a string, not {type(url).__name__}")
    try:
        parsed = URL(url)
    except ValueError:
        raise ValueError(f"invalid lease API URL {redact_url(url)!r}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(
            f"lease API URL must be http(s)://host[:port][/prefix], not {redact_url(url)!r}"
        )
    if parsed.query_string or parsed.fragment:
        raise ValueError(f"lease API URL must not carry a query or fragment: {redact_url(url)!r}")
    return str(parsed).rstrip("/")


def _reason(doc: dict[str, Any]) -> str | None:
    reason = doc.get("reason")
    return reason if isinstance(reason, str) else None


def _unexpected(status: int, doc: dict[str, Any], base: str) -> Exception:
    reason = _reason(doc)
    detail = doc.get("detail")
    if status == 400 and reason == Reason.INVALID_REQUEST:
        # The gateway validated what this client already should have: same as locally.
        return ValueError(str(detail or "invalid request"))
    if reason == Reason.STORE_UNAVAILABLE:
        return StoreUnavailable(f"the gateway's store is unavailable: {detail}", status=status)
    if reason is None or reason == Reason.NOT_FOUND:
        # Not the lease API's answer: most often the URL is the admin listener's or
        # the upstream's.
        return StoreUnavailable(
            f"unexpected answer {status} to a lease API call: {_not_the_lease_api(base)}",
            status=status,
        )
    return StoreUnavailable(
        f"unexpected lease API answer {status} {reason}: {detail}", status=status
    )


def _not_the_lease_api(base: str) -> str:
    return (
        f"is {redact_url(base)} the gateway's main listener (its [server] listen), "
        "not the admin listener or an upstream?"
    )


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _lease(doc: dict[str, Any]) -> Lease:
    """A lease object of SPEC 3 -> `Lease`; anything malformed is StoreUnavailable."""
    try:
        job_id = model.validate_ident(doc.get("job_id"), "job_id")
        owner = model.validate_ident(doc.get("owner"), "owner")
        generation = model.validate_generation(doc.get("generation"))
        state = doc.get("state")
        if state not in ("free", "active", "done"):
            raise ValueError(f"unknown state {state!r}")
        until = doc.get("lease_until")
        if not isinstance(until, str):
            raise ValueError("lease_until must be a string")
        lease_until = datetime.fromisoformat(until)
        if lease_until.tzinfo is None:
            raise ValueError("lease_until has no time zone")
        expires_in = doc.get("expires_in")
        if not _is_number(expires_in) or not math.isfinite(expires_in) or expires_in < 0:
            raise ValueError("expires_in must be a non-negative number")
    except ValueError as exc:
        # (only a 200 carries a lease)
        raise StoreUnavailable(f"malformed lease from the lease API: {exc}", status=200) from exc
    return Lease(
        job_id=job_id,
        owner=owner,
        generation=generation,
        state=state,
        lease_until=lease_until.astimezone(UTC),
        expires_in=float(expires_in),
    )
