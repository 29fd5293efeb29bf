"""Bearer tokens, compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from multidict import CIMultiDictProxy


def authorization(headers: CIMultiDictProxy[str]) -> str:
    """The request's one `Authorization` value; "" when it has none or several
    (RFC 9110 allows one: which of two a check reads must not matter)."""
    values = headers.getall("Authorization", [])
    return values[0] if len(values) == 1 else ""


def bearer_matches(authorization: str, tokens: Iterable[str]) -> bool:
    """Whether `Authorization: Bearer <token>` names one of `tokens`.

    Every configured token is compared, with no early exit, so the time taken
    says nothing about which token (or how much of one) matched.
    """
    scheme, _, presented = authorization.partition(" ")
    given = presented.strip().encode("utf-8", "surrogateescape")
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(given, token.encode())
    return scheme.lower() == "bearer" and bool(given) and matched
