"""One exception root for the gateway, and the answer a rejection becomes.

Each reason's HTTP status comes from the table in `leases.reasons`; the handlers
raise `Rejection` and one place turns it into problem+json.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

# The store boundary raises the lease module's StoreUnavailable for every driver
# or I/O failure, in both packages; the gateway answers it with 503 and fails closed.
from leases.errors import StoreUnavailable as StoreUnavailable
from leases.reasons import REASONS, title_of

# Derived from the one table of reasons (leases.reasons).
STATUS_BY_REASON: dict[str, int] = {reason: info.status for reason, info in REASONS.items()}
TITLE_BY_REASON: dict[str, str] = {reason: title_of(reason) for reason in REASONS}
_RETRY_AFTER: dict[str, int] = {reason: 1 for reason, info in REASONS.items() if info.retry_later}

# The challenge a 401 carries (RFC 9110 11.6.1): worker and lease API tokens.
WORKER_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="sinkgate"'}

# A URN: stable and ours, and never mistaken for a page someone should fetch.
PROBLEM_TYPE_BASE = "urn:sinkgate:problem:"


class GatewayError(Exception):
    """Root of the errors the gateway raises on purpose."""


class ConfigError(GatewayError):
    """The configuration is invalid. Each of `errors` is one line naming the file
    and the key; the message is all of them, one per line."""

    def __init__(self, *errors: str) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors

    @classmethod
    def of(cls, problems: Iterable[ConfigError]) -> ConfigError:
        """One error carrying every line of `problems`, in order."""
        return cls(*(line for problem in problems for line in problem.errors))


class EnvironmentConfigError(ConfigError):
    """A file that is right for a process with other variables: one its `*_env` key
    names is unset, empty or holds a token it may not. A reload refuses a key of a
    restart-only section for it, instead of failing (the restart checks it).
    `key`: the dotted key it was found at."""

    def __init__(self, error: str, *, key: str) -> None:
        super().__init__(error)
        self.key = key


class Rejection(GatewayError):
    """An answer the gateway makes itself: problem+json with `Sinkgate-Rejected`."""

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        status: int | None = None,
        retry_after: int | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
        **members: Any,
    ) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.status = status if status is not None else STATUS_BY_REASON[reason]
        # A reason the table marks `retry_later` always says when: 1 s unless told.
        self.retry_after = retry_after if retry_after is not None else _RETRY_AFTER.get(reason)
        self.headers = headers or {}  # ones HTTP requires with the status (Allow, ...)
        self.close = close  # the answer closes the connection (a body left unread)
        self.members = {k: v for k, v in members.items() if v is not None}
        # What the write's line adds for this refusal: of a `Prefer: wait` it ended
        # (or came before any wait of), `prefer_wait`, and `wait`, `waited_ms` if
        # the write was held; `too_late` for a verdict that came too late to send.
        self.line_extra: dict[str, Any] | None = None

    def problem(self) -> dict[str, Any]:
        """The RFC 9457 body."""
        return {
            "type": PROBLEM_TYPE_BASE + self.reason,
            "title": TITLE_BY_REASON.get(self.reason, self.reason),
            "status": self.status,
            "detail": self.detail,
            "reason": self.reason,
            **self.members,
        }


def os_error_words(exc: OSError) -> str:
    """`Connection refused`, not asyncio's `Connect call failed (...)`; the
    class's name where the error says nothing (asyncio's bare
    `ConnectionResetError()` for a peer gone mid-handshake)."""
    if exc.errno:
        return os.strerror(exc.errno)
    return str(exc) or type(exc).__name__
