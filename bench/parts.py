"""Where a write's CPU goes, by part: py-spy raw stacks bucketed into the parts of
the write path (HTTP server, write route, decision, store, upstream client, log
line, metrics), for the gateway and the plain proxy alike.

    python3 -m bench.parts bench/results/plain-c32.txt bench/results/sqlite-c32.txt

Each sample goes to the part of the innermost frame that names one (a socket
write under the upstream client is the client's; under the server, the
server's). Without `--native` py-spy cannot see into C: time inside a C call is
the calling Python frame's, so `_write_batch`'s own time is its BEGIN/COMMIT
(the fsync), a store function's own time its statements, and the event loop's
own time (`Runner.run`, uvloop's C code: sockets, callbacks) a part of its own.
"""

from __future__ import annotations

import argparse
from pathlib import Path

PARTS = (
    "HTTP server (aiohttp web, writer)",
    "event loop C side (uvloop: sockets, callbacks)",
    "write-route handling (checks, facts, fingerprint, answer)",
    "decision + plan",
    "store, SQL statements (C)",
    "store, BEGIN/COMMIT + fsync (C)",
    "store, Python side (batching, rows)",
    "store hand-off (threads, futures)",
    "upstream client (aiohttp client)",
    "log line",
    "metrics",
    "other",
)

# (substring of a frame, part), tried on each frame from the innermost outwards.
_RULES: tuple[tuple[str, str], ...] = (
    ("structlog", "log line"),
    ("telemetry/logs.py", "log line"),
    ("prometheus_client", "metrics"),
    ("telemetry/metrics.py", "metrics"),
    ("gateway/policy/", "decision + plan"),
    ("_write_batch (leases/sqlite.py)", "store, BEGIN/COMMIT + fsync (C)"),
    ("(store/sqlite.py)", "store, SQL statements (C)"),
    ("store/records.py", "store, Python side (batching, rows)"),
    ("aiosqlite", "store hand-off (threads, futures)"),
    ("in_thread (leases/sqlite.py)", "store hand-off (threads, futures)"),
    ("_flush_loop (leases/sqlite.py)", "store hand-off (threads, futures)"),
    ("SQLiteExecutor", "store hand-off (threads, futures)"),
    ("sqlite_thread", "store hand-off (threads, futures)"),
    ("threading.py", "store hand-off (threads, futures)"),
    ("queue.py", "store hand-off (threads, futures)"),
    ("aiohttp/client", "upstream client (aiohttp client)"),
    ("aiohttp/connector", "upstream client (aiohttp client)"),
    ("Upstreams", "upstream client (aiohttp client)"),
    ("write/upstream.py", "upstream client (aiohttp client)"),
    ("write/", "write-route handling (checks, facts, fingerprint, answer)"),
    ("http/bodies.py", "write-route handling (checks, facts, fingerprint, answer)"),
    ("http/problem.py", "write-route handling (checks, facts, fingerprint, answer)"),
    ("dispatch_writes", "write-route handling (checks, facts, fingerprint, answer)"),
    ("handler (bench/plain_proxy.py)", "write-route handling (checks, facts, fingerprint, answer)"),
)
# Tried only when no frame matched a rule above: aiohttp's writer under the
# upstream client is the client's.
_GENERIC: tuple[tuple[str, str], ...] = (
    ("aiohttp/", "HTTP server (aiohttp web, writer)"),
    ("multidict", "HTTP server (aiohttp web, writer)"),
    ("yarl", "HTTP server (aiohttp web, writer)"),
    ("Runner.run", "event loop C side (uvloop: sockets, callbacks)"),
    ("asyncio/", "event loop C side (uvloop: sockets, callbacks)"),
)


def _frame_key(frame: str) -> str:
    """`func (/x/y/pkg/file.py:123)` -> `func (pkg/file.py)`."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({'/'.join(where.split('/')[-2:])})" if where else name


def part_of(frames: list[str]) -> str:
    """The part a sample's stack (outermost frame first) belongs to."""
    keys = [_frame_key(f) for f in reversed(frames)]
    for rules in (_RULES, _GENERIC):
        for key in keys:
            for needle, part in rules:
                if needle in key:
                    return part
    return "other"


def breakdown(raw: Path, thread: str | None = None) -> tuple[dict[str, float], int]:
    """Share of samples per part in a py-spy `-f raw` file, and the sample count;
    `thread`: only the samples of threads whose name contains it."""
    counts: dict[str, int] = dict.fromkeys(PARTS, 0)
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        thread_name, *frames = stack.split(";")  # the first entry names the thread
        if thread is not None and thread not in thread_name:
            continue
        counts[part_of(frames)] += int(count_text)
        total += int(count_text)
    return {p: c / total if total else 0.0 for p, c in counts.items()}, total


def table(raws: list[Path], cpu_ms: list[float] | None = None, thread: str | None = None) -> str:
    """A markdown table: one column per profile, share (and ms/write when the
    CPU per write of that profile's run, or of that thread, is given)."""
    shares = [breakdown(r, thread)[0] for r in raws]
    head = "| part | " + " | ".join(r.stem for r in raws) + " |"
    lines = [head, "|---|" + "---:|" * len(raws)]
    for part in PARTS:
        if all(s[part] == 0 for s in shares):
            continue
        cells = []
        for i, s in enumerate(shares):
            cell = f"{100 * s[part]:.1f} %"
            if cpu_ms:
                cell += f" ({s[part] * cpu_ms[i]:.3f} ms)"
            cells.append(cell)
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ms_per_write(text: str) -> list[float]:
    """`0.12,0.27`: one figure per file."""
    return [float(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    """Print the by-part table of the raw py-spy files given."""
    parser = argparse.ArgumentParser(
        prog="python3 -m bench.parts", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("raw", nargs="+", type=Path, help="py-spy --format raw files")
    parser.add_argument(
        "--cpu",
        type=ms_per_write,
        help="CPU ms per write of each file's run (of --thread's thread, if given): "
        "each cell then also shows ms per write",
    )
    parser.add_argument(
        "--thread", help="count only the thread whose name contains this (MainThread: the loop)"
    )
    args = parser.parse_args(argv)
    missing = [str(raw) for raw in args.raw if not raw.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    if args.cpu is not None and len(args.cpu) != len(args.raw):
        parser.error(f"--cpu gives {len(args.cpu)} figures for {len(args.raw)} files")
    print(table(args.raw, args.cpu, args.thread))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
