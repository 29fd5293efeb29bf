"""How many failed admin authentications an address may make: after `limit` in
one window, every further attempt from it is answered 429 until the window
ends (SPEC 4; a guessed token needs many tries, an operator's typo one).

A fixed window per remote address, started by its first failure. Memory is
bounded: at most `max_addresses` addresses are remembered, the ones whose
window is oldest forgotten first (a flood from many addresses forgets, at
worst, the oldest of them: each one still gets only `limit` tries per window).
Pure: the caller passes `now`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

LIMIT = 10
WINDOW_S = 60.0
MAX_ADDRESSES = 10_000


@dataclass(slots=True)
class _Window:
    start: float
    failures: int


class FailureThrottle:
    """Failed authentications per remote address, in fixed windows."""

    def __init__(
        self, *, limit: int = LIMIT, window_s: float = WINDOW_S, max_addresses: int = MAX_ADDRESSES
    ) -> None:
        if limit < 1 or window_s <= 0 or max_addresses < 1:
            raise ValueError("limit, window_s and max_addresses must be positive")
        self.limit, self.window_s, self.max_addresses = limit, window_s, max_addresses
        self._windows: OrderedDict[str, _Window] = OrderedDict()

    def __len__(self) -> int:
        return len(self._windows)

    def retry_after(self, remote: str, now: float) -> int | None:
        """Whole seconds until `remote` may try again, or None: it may now."""
        window = self._current(remote, now)
        if window is None or window.failures < self.limit:
            return None
        return max(1, math.ceil(window.start + self.window_s - now))

    def failed(self, remote: str, now: float) -> None:
        """Count one failure of `remote`."""
        window = self._current(remote, now)
        if window is None:
            self._windows[remote] = _Window(now, 1)
            while len(self._windows) > self.max_addresses:
                self._windows.popitem(last=False)  # the oldest window
            return
        window.failures += 1

    def _current(self, remote: str, now: float) -> _Window | None:
        window = self._windows.get(remote)
        if window is not None and now >= window.start + self.window_s:
            del self._windows[remote]  # its window has passed
            return None
        return window
