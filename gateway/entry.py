"""The `sinkgate` command's entry point: the CLI is imported inside the Ctrl-C
handler, so an interrupt while its modules load (ssl, structlog, aiohttp: a few
tenths of a second) ends in one line, as one later does, not in a traceback."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from gateway.cli import main as run
    except KeyboardInterrupt:
        print("\nsinkgate: interrupted", file=sys.stderr)
        return 130
    return run()
