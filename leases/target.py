"""The path and query a fenced write sends after `/to/{destination}`, spelled by
the writer itself rather than by an HTTP library, byte for byte as the
TypeScript writer spells them (`clients/typescript/src/writer.ts`).

The gateway fingerprints the path and query as sent, so a job redone by a
worker in the other language must send the same bytes to be replayed. yarl and
the WHATWG URL parser each spell some characters their own way, so neither is
asked: what RFC 3986 allows in a path (and `?` in the query) is kept, and so
is a `%XX` escape, as written; every other character is percent-encoded as
UTF-8: a `%` that starts no escape, `#`, space, `|`, `[`, non-ASCII, and in
the query `'` (which Node's `fetch` would encode on its own). An empty query
is left out, `?` and all. A `params` name
or value keeps only the unreserved characters, and the pairs go in the order
of their spelled names (a JavaScript object puts integer-like names first); a
name given more than once keeps its values in the order given.
The shared table of spellings is `tests/vectors/write_spellings.json`.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping

__all__ = ["Params", "write_target"]

Params = Mapping[str, str | int] | Iterable[tuple[str, str | int]]

_UNRESERVED = re.escape(string.ascii_letters + string.digits + "-._~")
_PATH = re.compile(rf"%[0-9A-Fa-f]{{2}}|[^{_UNRESERVED}!$&'()*+,;=:@/]")
_QUERY = re.compile(rf"%[0-9A-Fa-f]{{2}}|[^{_UNRESERVED}!$&()*+,;=:@/?]")
_PARAM = re.compile(rf"[^{_UNRESERVED}]")


def write_target(path: str, params: Params | None = None) -> str:
    """`path` (already checked by the writer) and `params`, as sent. Raises
    `ValueError` for a lone surrogate, or for `params` that are not a mapping
    or pairs of strings (or ints)."""
    path_part, _, query = path.partition("?")
    # By name only, so a name given twice keeps its values in the order given
    # (a stable sort, as JavaScript's).
    pairs = sorted(
        (
            (_spelled(_PARAM, _param(name)), _spelled(_PARAM, _param(value)))
            for name, value in _pairs(params)
        ),
        key=lambda pair: pair[0],
    )
    parts = [_spelled(_QUERY, query)] if query else []
    parts += [f"{name}={value}" for name, value in pairs]
    # An empty query is no query (yarl drops a lone `?`, fetch would send it).
    return _spelled(_PATH, path_part) + ("?" + "&".join(parts) if parts else "")


def _pairs(params: Params | None) -> list[tuple[object, object]]:
    if params is None:
        return []
    if isinstance(params, Mapping):
        return list(params.items())
    if isinstance(params, str | bytes):
        raise ValueError("params must be a mapping or (name, value) pairs, not a string")
    try:
        pairs = [_pair(pair) for pair in params]
    except TypeError:
        raise ValueError(
            f"params must be a mapping or (name, value) pairs, not {type(params).__name__}"
        ) from None
    if any(pair is None for pair in pairs):
        raise ValueError("params pairs must each be (name, value)")
    return [pair for pair in pairs if pair is not None]


def _pair(pair: object) -> tuple[object, object] | None:
    """A (name, value) pair, or None for anything else (a string of two is no pair)."""
    if isinstance(pair, str | bytes) or not isinstance(pair, Iterable):
        return None
    items = tuple(pair)
    return (items[0], items[1]) if len(items) == 2 else None


def _spelled(pattern: re.Pattern[str], text: str) -> str:
    try:
        return pattern.sub(_escape, text)
    except UnicodeEncodeError:
        raise ValueError(f"{text!r} holds a lone surrogate, which UTF-8 cannot carry") from None


def _escape(match: re.Match[str]) -> str:
    found = match[0]
    if len(found) == 3:  # an escape, kept as written
        return found
    return "".join(f"%{byte:02X}" for byte in found.encode())


def _param(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"params names and values must be strings, not {type(value).__name__}")
