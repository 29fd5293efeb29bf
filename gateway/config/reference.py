"""The configuration reference (docs/configuration.md), generated from the key
declarations of `gateway.config.keys`, so the page cannot drift from the loader.

    python3 -m gateway.config.reference docs/configuration.md

A unit test compares the page with `reference()`.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gateway.config import keys
from gateway.config.reader import format_duration, format_size

_INTRO = """\
<!-- Generated from gateway/config/keys.py by `python3 -m gateway.config.reference
docs/configuration.md`; tests/unit/test_docs.py fails when it is not current. -->
# Configuration reference

Every key of the two kinds of file, with its default and what it is for;
[SPEC.md](SPEC.md) section 5 is the contract. Every key may be left out
(the default then applies) except the ones marked *required*. Unknown keys are
errors, reported with the file, the key and the nearest known name; durations
take the units `ms`, `s`, `m`, `h`, `d` (`"10s"`), sizes `B`, `KiB`, `MiB`,
`GiB` (`"1MiB"`). `sinkgate check-config` reads both kinds of file and prints
what it found, or every error at once. `sinkgate init` writes a commented
config to start from.

A reload (`SIGHUP`, `POST /admin/reload`) applies the destination files and
the keys marked *reload*; it leaves a change to a key marked *restart* unapplied
(logged as `reload_refused`) until the next start.
"""

_DESTINATION_NOTE = """\
A destination file is `<dir>/<name>.toml` under `[destinations] dir`; its name
(the file's stem) is the destination in `/to/{destination}/...`. Every key sits
at the top of the file, above any table: TOML puts a key written below a
`[table]` line inside that table.

The `[upstream_headers]` table sets headers on every forwarded request,
replacing a worker's header of the same name: a value is a string, or
`{ env = "VAR", format = "Bearer {}" }` to read a secret from the environment
(an unset variable is an error). `check-config` warns about a header named
like one of the keys above (most likely a key written below the table).
"""


def reference() -> str:
    """The whole page, as Markdown."""
    parts = [_INTRO, "## `gateway.toml`\n"]
    for section in keys.GATEWAY_FILE:
        parts.append(f"### `[{section.name}]`\n")
        parts.append(_table(section, with_reload=True))
    parts.append("## A destination file (`destinations/<name>.toml`)\n")
    parts.append(_DESTINATION_NOTE)
    parts.append(_table(keys.DESTINATION, with_reload=False))
    return "\n".join(parts)


def _table(section: keys.Section, *, with_reload: bool) -> str:
    head = ["key", "default", "what it is for"] + (["applied by"] if with_reload else [])
    rows = [_row(head), _row(["---"] * len(head))]
    for key in section.keys.values():
        cells = [f"`{key.name}`", _default(key), key.help]
        if with_reload:
            cells.append("restart" if section.restarts(key) else "reload")
        rows.append(_row(cells))
    return "\n".join(rows) + "\n"


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _default(key: keys.Key) -> str:
    """The default as it would be written in the file."""
    if key.required is not None:
        return "*required*"
    value = key.default
    kind = getattr(key.read, "__qualname__", "").split(".")[0]
    if value is None:
        return "unset"
    if value == ():  # a table of names (upstream_headers, operators): none set
        return "none"
    if kind == "duration":
        return f'`"{format_duration(value)}"`'
    if kind == "size":
        return f'`"{format_size(value)}"`'
    return f"`{_toml(value)}`"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return _toml(value.value)
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, frozenset):
        return _toml(tuple(sorted(value)))
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int):
        if isinstance(value[0], str) and not isinstance(value[1], bool):  # (host, port)
            host, port = value
            return f'"{host}:{port}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return str(value)


def main(argv: list[str]) -> int:
    """Write the page to the path given (or print it)."""
    if argv:
        Path(argv[0]).write_text(reference(), encoding="utf-8")
    else:
        sys.stdout.write(reference())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
