"""The forwarded path's rule (SPEC 2 "Paths"): a pure function of the raw path.

A path is refused when a `..` segment would climb above the upstream's base
path (`%2F` and `%5C` inside a segment count as separators for this check), or
when a URL parser downstream could read it as naming another host: it begins
with two slashes or backslashes in any mix (`//host`, `/\\host`), or its first
segment is a scheme followed by two of them (`/http://host`), also once its
`.` and `..` segments are removed, as a server that normalises it would
(`/x/..//host`, `/.//host`). Percent-encoded forms such as `/http:%2F%2Fhost`
and `/%40host` name no host and pass. A segment with path parameters counts as
what comes before its `;` (`..;x` is `..` to Tomcat and the like).
"""

from __future__ import annotations

import re
from urllib.parse import unquote

# WHATWG URL parsers treat `\` as `/` in http(s) URLs, so both count.
_NETWORK_PATH = re.compile(r"/[/\\]")
_SCHEME_THEN_AUTHORITY = re.compile(r"/[A-Za-z][A-Za-z0-9+.-]*:[/\\]{2}")
_SEPARATOR = re.compile(r"[/\\]")


def names_another_host(path: str) -> bool:
    """True if `path` (raw, starting with `/` or empty) could be read as an
    authority, as it is or once its dot segments are removed."""
    if _NETWORK_PATH.match(path) or _SCHEME_THEN_AUTHORITY.match(path):
        return True
    if "." not in path and "%" not in path:
        return False  # no dot segment to remove
    normalised = _without_dot_segments(path)
    return bool(_NETWORK_PATH.match(normalised) or _SCHEME_THEN_AUTHORITY.match(normalised))


def climbs_above_base(path: str) -> bool:
    """True if `..` segments, decoded, would climb above the upstream's base path."""
    if ".." not in path and "%" not in path:
        return False  # no segment is, or decodes to, `..`
    depth = 0
    for raw_segment in path.split("/"):
        for segment in _SEPARATOR.split(unquote(raw_segment)):
            segment = _dots(segment)
            if segment == "..":
                depth -= 1
                if depth < 0:
                    return True
            elif segment not in ("", "."):
                depth += 1
    return False


def _dots(segment: str) -> str:
    """A decoded segment as a dot-segment check reads it: without path parameters."""
    return segment.split(";", 1)[0] if ";" in segment else segment


def _without_dot_segments(path: str) -> str:
    """RFC 3986 5.2.4 on the raw path, dot segments recognised decoded; empty
    segments are kept (they are what `//` is made of)."""
    kept: list[str] = []
    for raw_segment in path.split("/")[1:]:
        segment = _dots(unquote(raw_segment))
        if segment == "..":
            if kept:
                kept.pop()
        elif segment != ".":
            kept.append(raw_segment)
    return "/" + "/".join(kept)


def has_nul(path: str) -> bool:
    """True if `path` carries an encoded NUL byte, which has no use in a path and
    cuts it short for an upstream written in C."""
    return "%00" in path


def path_escapes(path: str) -> bool:
    """True if `path` would climb above the base path or name another host."""
    return names_another_host(path) or climbs_above_base(path)
