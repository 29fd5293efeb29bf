"""PURE: the preferences of `Prefer` header values (RFC 7240), read one way by the
gateway (the `wait` it honours) and by the writers (a caller's own preferences).

Several preferences may come in one header or several, comma separated, each
with `;` parameters, and a value may be a token or a quoted string (a comma
inside quotes separates nothing); empty elements are skipped. A header value
that stops being a preference list is read up to there; one longer than
`MAX_VALUE` is not read at all.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

__all__ = ["MAX_VALUE", "preferences", "whole", "without"]

# One preference: its name, then an optional `= value` (token or quoted string),
# then anything up to the next comma outside quotes (its parameters).
# Every repetition is possessive (`*+`, `++`): a value ending in an unmatched
# quote must fail in one pass, not backtrack over every way of splitting it.
_PREFERENCE = re.compile(
    r"""\s*+(?P<name>[!#$%&'*+\-.^_`|~0-9A-Za-z]++)\s*+"""
    r"""(?:=\s*+(?:"(?P<quoted>(?:[^"\\]++|\\.)*+)"|(?P<token>[^\s,;"]*+)))?"""
    r"""(?P<rest>(?:[^,"]++|"(?:[^"\\]++|\\.)*+")*+)(?:,|$)"""
)
_EMPTY = re.compile(r"[ \t,]*+")  # empty elements, and the space around them
# A `Prefer` value longer than this is not read: a `wait=N` needs a few bytes,
# and a value the size of a whole header is not worth scanning.
MAX_VALUE = 1024


def preferences(
    values: Iterable[str], longest: int | None = MAX_VALUE
) -> Iterator[tuple[str, str | None]]:
    """Each preference of the header `values`, in order: its name lower-cased,
    and its value (a quoted one unquoted no further) or None when it has none.
    A value longer than `longest` is not read (None: any length is)."""
    for value in values:
        if longest is not None and len(value) > longest:
            continue
        for match, _ in _elements(value):
            given = match["quoted"] if match["quoted"] is not None else match["token"]
            yield match["name"].lower(), given


def whole(value: str, longest: int | None = MAX_VALUE) -> bool:
    """Whether `value` is read to its end: a preference list (or only empty
    elements) no longer than `longest` (None: any length)."""
    if longest is not None and len(value) > longest:
        return False
    elements = list(_elements(value))
    if elements:
        return elements[-1][1] == len(value)
    empty = _EMPTY.match(value)
    assert empty is not None  # it matches the empty string too
    return empty.end() == len(value)


def without(values: Iterable[str], name: str) -> list[str]:
    """The header `values` with every element named `name` (lower-case) taken
    out, the others kept as written. Where a value stops being a preference
    list, the rest of it is kept as it is (where its elements end cannot be
    told). Values left empty are dropped. Unlike `preferences`, any length is
    read: these are answer headers, bounded by the HTTP client's own limits."""
    kept = []
    for value in values:
        if name not in value.lower():
            kept.append(value)
            continue
        elements = list(_elements(value))
        read = elements[-1][1] if elements else 0
        others = [m.group().strip(" \t,") for m, _ in elements if m["name"].lower() != name]
        rest = value[read:].strip(" \t")
        value = ", ".join([*others, *([rest] if rest else [])])
        if value:
            kept.append(value)
    return kept


def _elements(value: str) -> Iterator[tuple[re.Match[str], int]]:
    """Each element's match, and where reading stopped after it (the end of
    `value` when the whole value is a preference list)."""
    position = 0
    while position < len(value):
        # Empty elements (`, wait=5`, `a,, b`) are skipped (RFC 9110 section 5.6.1).
        skipped = _EMPTY.match(value, position)
        assert skipped is not None  # it matches the empty string too
        if skipped.end() == len(value):
            return
        match = _PREFERENCE.match(value, skipped.end())
        if match is None or match.end() == skipped.end():
            return  # not a preference list from here on: nothing more to read
        position = match.end()
        after = _EMPTY.match(value, position)
        assert after is not None
        yield match, after.end()
