"""PURE: a time filter's duration back from now (`250ms`, `15m`, `1h`, `7d`, `2w`),
read one way by the admin API's filters and by the admin CLI (which sends the
moment it names, by its own clock)."""

from __future__ import annotations

import re

# ASCII digits only (`re.ASCII` is moot for [0-9], which names them): `٣h` is no
# duration. At most 9 digits and 6 decimals: no float's rounding to explain.
_RELATIVE = re.compile(r"([0-9]{1,9}(?:\.[0-9]{1,6})?)(ms|s|m|h|d|w)")
# The config's duration units (ms too), and weeks.
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def seconds_back(text: str) -> float | None:
    """The seconds `text` reaches back from now (`15m` -> 900.0); None when it is
    no such duration (a date-time, say)."""
    match = _RELATIVE.fullmatch(text)
    if match is None:
        return None
    return float(match.group(1)) * _UNITS[match.group(2)]
