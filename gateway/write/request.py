"""The write route's request, read and checked: target, path, fencing headers -> WriteFacts.

SPEC 2 steps 1 and 5 and the path rule, as functions of the raw request: nothing
here touches the store or the upstream.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from aiohttp import hdrs, web
from multidict import CIMultiDictProxy

from gateway.config.model import DestinationConfig
from gateway.errors import Rejection
from gateway.http.problem import invalid_request
from gateway.policy.decision import WriteFacts, fingerprint
from gateway.write.paths import has_nul
from gateway.write.paths import path_escapes as path_escapes  # the path rule, SPEC 2
from leases.model import IDENT, KEY, generation_of
from leases.reasons import Reason

_ABSOLUTE_FORM = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*")


@dataclass(frozen=True, slots=True)
class Target:
    destination: str
    path: str  # raw, percent-encoding kept; "" for the upstream URL itself
    query: str


def origin_form(raw_target: str) -> str:
    """The request target in origin-form. An absolute-form target (RFC 9112
    3.2.2, `POST http://host/to/...`) loses its scheme and authority, and the
    rest stays raw: the destination's upstream is used whatever host it names."""
    if raw_target.startswith("/"):
        return raw_target
    match = _ABSOLUTE_FORM.match(raw_target)
    if match is None:
        return raw_target
    rest = raw_target[match.end() :]
    return rest if rest.startswith("/") else "/" + rest


def parse_target(raw_path: str) -> Target | None:
    """Split a raw `/to/{destination}{path}?{query}`; None if not a write route."""
    target, _, query = origin_form(raw_path).partition("?")
    if target != "/to" and not target.startswith("/to/"):
        return None
    rest = target[4:]
    name, slash, path = rest.partition("/")
    path = slash + path
    if path == "/":
        path = ""
    return Target(unquote(name), path, query)


def check_shape(headers: CIMultiDictProxy[str]) -> None:
    """Refuse what the parser would have (a header value not UTF-8) and a transfer
    coding other than chunked (RFC 9112 6.1: 501; the body is read de-chunked
    only, and would go on still coded)."""
    unsendable = header_not_utf8(headers)
    if unsendable is not None:
        raise invalid_request(f"the value of header {unsendable} is not UTF-8")
    coding = headers.get(hdrs.TRANSFER_ENCODING)
    if coding is not None and coding.strip().lower() != "chunked":
        raise invalid_request("only the chunked transfer coding is understood", status=501)


def checked_destination(
    request: web.Request, target: Target, destinations: Mapping[str, DestinationConfig]
) -> DestinationConfig:
    """SPEC 2 steps 1-3: the destination named, the method it allows, a path that
    stays under its upstream."""
    destination = destinations.get(target.destination)
    if destination is None:
        raise Rejection(
            Reason.UNKNOWN_DESTINATION,
            f"no destination named {target.destination!r}{_did_you_mean(target, destinations)}",
            destination=target.destination,
        )
    if request.method not in destination.methods:
        raise Rejection(
            Reason.METHOD_NOT_ALLOWED,
            f"{request.method} is not allowed for {destination.name}",
            headers={"Allow": ", ".join(sorted(destination.methods))},
            destination=destination.name,
        )
    if "#" in target.path or "#" in target.query:
        # No server is sent a fragment (RFC 9112 3.2): the upstream URL would drop it,
        # and `..#x` would pass the check below as a segment and reach it as `..`.
        raise Rejection(
            Reason.INVALID_PATH,
            "the request target has a '#': percent-encode it (%23)",
            destination=destination.name,
        )
    if path_escapes(target.path):
        raise Rejection(
            Reason.INVALID_PATH,
            "the path climbs above the upstream's base path or names another host",
            destination=destination.name,
        )
    if has_nul(target.path):
        raise Rejection(
            Reason.INVALID_PATH,
            "the path has an encoded NUL byte (%00)",
            destination=destination.name,
        )
    return destination


def _did_you_mean(target: Target, destinations: Mapping[str, DestinationConfig]) -> str:
    """` (did you mean 'example'?)` for a name close to a configured one, as the
    config errors hint at a misspelt key; "" when none is close. Only destinations
    without worker tokens are named: the hint must not list, one guess at a time,
    the names a caller without a token could not write to (and checking a token
    here would let a 404, never recorded, tell whether a guessed token is right).
    A worker with a token knows its destination's name."""
    if len(target.destination) > 256:
        return ""  # nobody misspells that much; and the comparison grows with it
    open_names = [name for name, d in destinations.items() if d.worker_tokens is None]
    close = difflib.get_close_matches(target.destination, open_names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def write_facts(
    request: web.Request,
    target: Target,
    destination: DestinationConfig,
    body_digest: bytes,
) -> WriteFacts:
    """SPEC 2 step 5: the fencing headers and key checked, the request's fingerprint taken."""
    job_id, generation, owner, key = fencing_headers(request, destination)
    facts = WriteFacts(
        destination=destination.name,
        method=request.method,
        path=target.path,
        query=target.query,
        job_id=job_id,
        generation=generation,
        owner=owner,
        key=key,
        fingerprint=fingerprint(
            request.method,
            target.path,
            target.query,
            request.headers.get("Content-Type", ""),
            body_digest,
        ),
        fencing=destination.fencing,
        upstream_idempotent=destination.upstream_idempotent,
        timeout=destination.timeout,
    )
    return facts


def fencing_headers(
    request: web.Request, destination: DestinationConfig
) -> tuple[str, int, str | None, str | None]:
    """(job_id, generation, owner, key) from the headers, or the step-5 rejection."""
    headers = request.headers
    members: dict[str, Any] = {"destination": destination.name}
    job_id, generation, owner = _fencing(headers, members)
    key = field_value(headers, "Idempotency-Key")
    if not key:
        if destination.require_idempotency_key:
            raise Rejection(
                Reason.MISSING_IDEMPOTENCY_KEY,
                "Idempotency-Key is required",
                generation=generation,
                **members,
            )
        return job_id, generation, owner, None
    checked = _checked_key(key)
    if checked is None:
        raise Rejection(
            Reason.INVALID_IDEMPOTENCY_KEY,
            "Idempotency-Key must be 1-255 visible ASCII characters",
            generation=generation,
            **members,
        )
    return job_id, generation, owner, checked


def _checked_key(key: str) -> str | None:
    """The key, unquoted (the IETF draft's quoted form), if it is 1-255 visible
    ASCII characters; else None."""
    if len(key) >= 2 and key[0] == key[-1] == '"':
        key = key[1:-1]
    return key if KEY.fullmatch(key) else None


def _fencing(
    headers: CIMultiDictProxy[str], members: dict[str, Any]
) -> tuple[str, int, str | None]:
    """(job_id, generation, owner) from the fencing headers; adds `job_id` to the
    rejection's `members` once it is known to be valid."""
    job_id = field_value(headers, "Fencing-Job")
    token = field_value(headers, "Fencing-Token")
    owner = field_value(headers, "Fencing-Owner") or None
    valid_job = IDENT.fullmatch(job_id) is not None
    if valid_job:
        members["job_id"] = job_id  # known, for every refusal below (SPEC 2 members)
    if not job_id or not token:
        missing = "Fencing-Job" if not job_id else "Fencing-Token"
        raise Rejection(Reason.MISSING_FENCING_TOKEN, f"{missing} is required", **members)
    if not valid_job:
        raise Rejection(
            Reason.INVALID_FENCING_TOKEN,
            "Fencing-Job must be 1-256 visible ASCII characters",
            **members,
        )
    generation = generation_of(token)
    if generation is None:
        raise Rejection(
            Reason.INVALID_FENCING_TOKEN,
            "Fencing-Token must be a decimal generation from 1 to 2^63-1, no sign or leading zero",
            **members,
        )
    if owner is not None and not IDENT.fullmatch(owner):
        raise Rejection(
            Reason.INVALID_FENCING_TOKEN,
            "Fencing-Owner must be 1-256 visible ASCII characters",
            **members,
        )
    return job_id, generation, owner


# Checked on their own (visible ASCII; the token compared as bytes), refused with
# their own reasons, and none goes on unchecked.
_OWN_CHECKS = frozenset(
    {"fencing-job", "fencing-token", "fencing-owner", "idempotency-key", "authorization"}
)


def header_not_utf8(headers: CIMultiDictProxy[str]) -> str | None:
    """The name of the first header whose value is not UTF-8 (aiohttp keeps such
    bytes as surrogates, which can be neither hashed nor sent on), else None."""
    for name, value in headers.items():
        if not value.isascii() and name.lower() not in _OWN_CHECKS:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return name
    return None


def valid_fencing(
    headers: CIMultiDictProxy[str],
) -> tuple[str | None, int | None, str | None, str | None]:
    """(job_id, generation, owner, key): each header that passes its own check,
    None for any that is missing or does not. For the record and log line of a
    write refused before (or while) its headers were checked."""
    job_id = field_value(headers, "Fencing-Job")
    owner = field_value(headers, "Fencing-Owner")
    return (
        job_id if IDENT.fullmatch(job_id) else None,
        generation_of(field_value(headers, "Fencing-Token")),
        owner if IDENT.fullmatch(owner) else None,
        _checked_key(field_value(headers, "Idempotency-Key")),
    )


def field_value(headers: CIMultiDictProxy[str], name: str) -> str:
    """The header's field value; "" if absent. Repeated lines are one value joined
    with ", " (RFC 9110 5.3), which no fencing header or key may contain: a
    request that repeats one is refused, never checked on its first copy while
    the upstream receives every copy."""
    values = headers.getall(name, ())
    if len(values) == 1:
        return values[0]
    return ", ".join(values)


def raw_write_path(raw_path: str) -> str:
    """The path and query after `/to/{destination}`, as the rejection log keeps them."""
    target = parse_target(raw_path)
    if target is None:
        return raw_path
    return target.path + (f"?{target.query}" if target.query else "")
