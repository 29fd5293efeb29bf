"""PURE: the `Prefer: wait=N` of a write (RFC 7240), and the wait it is given.

Only the `wait` preference is read (SPEC 2 "Waiting"): several preferences may
come in one header or several, comma separated, each with `;` parameters, and
a value may be a token or a quoted string. The first `wait` counts (RFC 7240
section 2: a preference given twice is read once). A value that is not a whole
number of seconds, or is zero, is no preference at all: the write does not wait.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

# One preference: its name, then an optional `= value` (token or quoted string),
# then anything up to the next comma outside quotes (its parameters).
# Every repetition is possessive (`*+`, `++`): a value ending in an unmatched
# quote must fail in one pass, not backtrack over every way of splitting it.
_PREFERENCE = re.compile(
    r"""\s*+(?P<name>[!#$%&'*+\-.^_`|~0-9A-Za-z]++)\s*+"""
    r"""(?:=\s*+(?:"(?P<quoted>(?:[^"\\]++|\\.)*+)"|(?P<token>[^\s,;"]*+)))?"""
    r"""(?P<rest>(?:[^,"]++|"(?:[^"\\]++|\\.)*+")*+)(?:,|$)"""
)
# A `Prefer` value longer than this is not read (no wait): a `wait=N` needs a
# few bytes, and a value the size of a whole header is not worth scanning.
MAX_VALUE = 1024
_SECONDS = re.compile(r"[0-9]{1,12}")


def wait_preference(values: Iterable[str]) -> int | None:
    """The `wait=N` of the `Prefer` header values, N >= 1; None when absent,
    malformed or zero."""
    for value in values:
        if len(value) > MAX_VALUE:
            continue
        position = 0
        while position < len(value):
            match = _PREFERENCE.match(value, position)
            if match is None or match.end() == position:
                break  # not a preference list from here on: nothing more to read
            position = match.end()
            if match["name"].lower() != "wait":
                continue
            seconds = match["quoted"] if match["quoted"] is not None else match["token"]
            if seconds is None or not _SECONDS.fullmatch(seconds) or int(seconds) == 0:
                return None
            return int(seconds)
    return None


def applied_wait(preference: int | None, max_wait: float) -> int:
    """The wait the gateway applies, in whole seconds: the preference capped by
    the destination's `max_wait` (a part of a second in it does not count).
    0: the write does not wait, and nothing says a preference was applied."""
    if preference is None:
        return 0
    return min(preference, math.floor(max_wait))
