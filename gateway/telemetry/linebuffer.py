"""JSON log lines written once per event-loop turn instead of once per line.

The gateway writes a line per decision; with structlog's `BytesLogger` each was
its own `write` + `flush` system call (about 5 % of the event loop's samples
under load). Here lines logged from the event-loop thread are appended to a
buffer that one `call_soon` callback writes out at the end of the current loop
turn (or at once past 64 KiB), so a batch of decisions costs one system call.
Lines logged from any other thread, or with no loop running, are written at
once, as before. What a process killed by SIGKILL loses is at most the lines of
the turn it was in; a normal exit writes the buffer out (`atexit`).
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from typing import Any, BinaryIO

_FLUSH_AT = 64 * 1024


class TurnBuffer:
    """The buffer of one output file, shared by every logger writing to it."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._lines: list[bytes] = []
        self._size = 0
        self._scheduled = False
        self._loop_thread: int | None = None
        self._lock = threading.Lock()
        atexit.register(self.flush)

    def write(self, line: bytes) -> None:
        """Queue `line` (with its newline) for the end of this loop turn."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write_now(line)
            return
        self._lines.append(line)
        self._size += len(line)
        if self._size >= _FLUSH_AT:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write out what is queued."""
        self._scheduled = False
        if not self._lines:
            return
        lines, self._lines, self._size = self._lines, [], 0
        self._write_now(b"".join(lines))

    def _write_now(self, data: bytes) -> None:
        with self._lock:
            try:
                self._file.write(data)
                self._file.flush()
            except ValueError:  # the file was closed at interpreter exit
                pass


class TurnBufferedLogger:
    """A structlog logger of rendered `bytes` lines, written through a `TurnBuffer`."""

    __slots__ = ("_buffer", "name")

    def __init__(self, buffer: TurnBuffer, name: str | None = None) -> None:
        self._buffer = buffer
        self.name = name

    def msg(self, message: bytes) -> None:
        """Queue `message` as one line."""
        self._buffer.write(message + b"\n")

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class TurnBufferedLoggerFactory:
    """structlog `logger_factory` for `TurnBufferedLogger`s on one file."""

    def __init__(self, file: BinaryIO) -> None:
        self.buffer = TurnBuffer(file)

    def __call__(self, *args: Any) -> TurnBufferedLogger:
        return TurnBufferedLogger(self.buffer, name=args[0] if args else None)
