"""Bearer tokens, compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Iterable


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
