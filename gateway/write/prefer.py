"""PURE: the `Prefer: wait=N` of a write (RFC 7240), and the wait it is given.

Only the `wait` preference is read (SPEC 2 "Waiting"), from the header values
as `leases.prefer` reads them. The first `wait` counts (RFC 7240
section 2: a preference given twice is read once). A value that is not a whole
number of seconds, or is zero, is no preference at all: the write does not wait.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from leases.prefer import MAX_VALUE, preferences
from leases.prefer import whole as whole_preferences
from leases.prefer import without as preference_without

__all__ = [
    "MAX_VALUE",
    "applied_wait",
    "preference_without",
    "wait_preference",
    "whole_preferences",
]

_SECONDS = re.compile(r"[0-9]+")
# Longer than any `max_wait` (100 years): a larger N is read as this, and capped
# like any other (its digits are not turned into an int: there may be thousands).
LONGEST = 10**12


def wait_preference(values: Iterable[str]) -> int | None:
    """The `wait=N` of the `Prefer` header values, N >= 1 (at most `LONGEST`);
    None when absent, malformed or zero."""
    for name, seconds in preferences(values):
        if name != "wait":
            continue
        if seconds is None or not _SECONDS.fullmatch(seconds):
            return None
        digits = seconds.lstrip("0")
        if not digits:
            return None
        return LONGEST if len(digits) > 12 else int(digits)
    return None


def applied_wait(preference: int | None, max_wait: float) -> int:
    """The wait the gateway applies, in whole seconds: the preference capped by
    the destination's `max_wait` (a part of a second in it does not count).
    0: the write does not wait, and nothing says a preference was applied."""
    if preference is None:
        return 0
    return min(preference, math.floor(max_wait))
