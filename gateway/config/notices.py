"""What is valid in a configuration but most likely not meant: `check-config`
prints it, `serve` logs it at start and a reload when it applies the files."""

from __future__ import annotations

import os

from gateway.config.model import Config, short_tokens


def config_warnings(config: Config) -> list[str]:
    """What is valid but most likely not meant, one line each."""
    found = [short.message for short in short_tokens(config) if not short.exposed]
    found += [
        f"{path}: not read: a destination file's name ends in .toml, in lower case"
        for path in config.unread_files
    ]
    for _, dest in sorted(config.destinations.items()):
        for header in dest.headers_named_like_keys:
            found.append(
                f"{os.path.relpath(dest.source)}: [upstream_headers] {header}: a header named "
                f"like the destination key {header!r}, sent on every forward; a key written "
                "below the [upstream_headers] table belongs to it: move it above the table"
            )
    return found
