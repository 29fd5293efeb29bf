"""Writes refused before their facts are known (SPEC 2 steps 1-4: an unknown
destination, a method, size, a slow body, a bad path or header) and not for a
worker token or fencing header (those the rejection log keeps): they reach
neither the store nor the rejection log, so they are said here.

One `write_refused` log line per refusal, with the reason, the destination name
as asked for, the method and the worker's address, at most `per_second` a
second on average (bursts of `burst`): a flood cannot fill the disk. Lines
dropped meanwhile are counted and said on the next line that is written
(`suppressed`). The names asked for most are kept for the admin page, at most
`names_max` of them (later new names count as `(other)`): `/to/<anything>` must
not grow memory without bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("gateway.write")

NAME_MAX = 80  # characters of a name kept, in the log and the counts
OTHER = "(other)"


class LineBudget:
    """At most `per_second` log lines a second on average (bursts of `burst`) for
    lines anybody can cause; `allow()` says whether the next one is written."""

    def __init__(
        self,
        *,
        per_second: float = 10.0,
        burst: int = 100,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_second, self.burst = per_second, burst
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self.suppressed = 0  # lines dropped since the last one written

    def allow(self) -> dict[str, int] | None:
        """None: over the rate (the line is dropped, and counted); else the fields
        the written line adds (`suppressed`: how many were dropped before it)."""
        now = self._clock()
        elapsed = max(0.0, now - self._last)  # a clock stepped back adds nothing
        self._tokens = min(self.burst, self._tokens + elapsed * self.per_second)
        self._last = now
        if self._tokens < 1:
            self.suppressed += 1
            return None
        self._tokens -= 1
        extra = {"suppressed": self.suppressed} if self.suppressed else {}
        self.suppressed = 0
        return extra


class Refusals:
    """Counts and rate-limited log lines of writes refused before their facts."""

    def __init__(
        self,
        *,
        per_second: float = 10.0,
        burst: int = 100,
        names_max: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.names_max = names_max
        self.budget = LineBudget(per_second=per_second, burst=burst, clock=clock)
        self.names: dict[str, int] = {}

    @property
    def suppressed(self) -> int:
        return self.budget.suppressed

    def note(self, reason: str | None, destination: str, method: str, remote: str | None) -> None:
        """One refused write: counted under its name, logged unless over the rate."""
        name = destination[:NAME_MAX]
        if name not in self.names and len(self.names) >= self.names_max:
            name = OTHER
        self.names[name] = self.names.get(name, 0) + 1
        extra = self.budget.allow()
        if extra is None:
            return
        log.warning(
            "write_refused",
            reason=reason,
            destination=destination[:NAME_MAX],
            method=method,
            remote=remote,
            **extra,
        )

    def top(self, n: int = 5) -> list[tuple[str, int]]:
        """The `n` names refused most, most first."""
        return sorted(self.names.items(), key=lambda item: (-item[1], item[0]))[:n]


_STORE_DOWN = LineBudget()


def reset_store_unavailable_budget() -> None:
    """Give `store_unavailable` its whole burst again (each test starts with it,
    whatever the tests before it spent)."""
    global _STORE_DOWN
    _STORE_DOWN = LineBudget()


def store_unavailable(op: str, error: str, **fields: object) -> None:
    """The `store_unavailable` warning: the driver's words, which the caller's 503
    does not carry. At a bounded rate, one budget per process: while the store is
    down, every write and lease call (and `/readyz`, anybody's) would make one."""
    extra = _STORE_DOWN.allow()
    if extra is not None:
        log.warning("store_unavailable", op=op, error=error, **fields, **extra)
