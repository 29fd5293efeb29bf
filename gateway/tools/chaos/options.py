"""The command line of `sinkgate chaos`: its options, and the settings refused up
front (exit 2) because they would only fail once the run is under way."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from gateway.config.keys import MAX_WORKERS
from gateway.tools.chaos import late as late_mode
from leases.model import validate_ttl
from leases.urls import url_problem


def _positive(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text.removesuffix("s"))
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        return value

    return parse


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _port_range(text: str) -> range:
    """`LOW-HIGH`, both included, within 1-65535."""
    low, sep, high = text.partition("-")
    try:
        span = range(int(low), int(high) + 1)
    except ValueError:
        span = range(0)
    if not sep or not span or span.start < 1 or span.stop > 65536:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH within 1-65535, got {text!r}")
    return span


def ports_needed(args: argparse.Namespace) -> int:
    """Listening ports the run takes at most: two per gateway, the destination,
    and a fault proxy before the store and one before the destination."""
    gateways: int = args.gateways
    return 2 * gateways + 1 + (2 if args.wire_faults else 0)


# Each gateway is a process of its own, capped as `serve --workers` is.
MAX_GATEWAYS = MAX_WORKERS


def _store_url_shape(url: str) -> bool:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return False
    scheme = scheme.lower()
    return (scheme == "sqlite" and rest.startswith("/") and len(rest) > 1) or scheme in (
        "postgresql",
        "postgres",
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sinkgate chaos",
        description="Inject faults into a live gateway setup and check that no stale or "
        "duplicate effect reaches the destination. Exit 1 on any violation.",
    )
    _add_load_options(p)
    _add_setup_options(p)
    late_mode.add_options(p)
    return p


def _add_load_options(p: argparse.ArgumentParser) -> None:
    """How much work, and how the workers misbehave."""
    p.add_argument("--workers", type=_positive(int), default=12, help="concurrent workers (12)")
    p.add_argument("--jobs", type=_positive(int), default=40, help="jobs to complete (40)")
    p.add_argument("--steps", type=_positive(int), default=3, help="effect writes per job (3)")
    p.add_argument(
        "--duration", type=_positive(float), default=25.0, help="target seconds of work (25)"
    )
    p.add_argument("--ttl", type=_positive(float), default=1.0, help="lease ttl, seconds (1.0)")
    p.add_argument(
        "--pause-rate", type=_rate, default=0.2, help="chance a job's worker freezes (0.2)"
    )
    p.add_argument(
        "--max-pause", type=_positive(float), default=3.0, help="longest freeze, seconds (3)"
    )
    p.add_argument(
        "--clock-skew", type=_rate, default=0.2, help="max drift of worker clocks (0.2=±20%%)"
    )


def _add_setup_options(p: argparse.ArgumentParser) -> None:
    """What runs (store, gateways, destination), what faults it, and the output."""
    p.add_argument("--store", metavar="URL", help="sqlite:///path or postgresql://... "
                   "(default: a temporary SQLite file)")  # fmt: skip
    p.add_argument(
        "--gateways",
        type=_positive(int),
        default=1,
        help=f"gateway processes (1, at most {MAX_GATEWAYS})",
    )
    p.add_argument(
        "--kill-every",
        type=_positive(float),
        metavar="SECONDS",
        help="kill -9 a gateway this often",
    )
    p.add_argument(
        "--upstream-faults", type=_rate, default=0.2, help="share of upstream faults (0.2)"
    )
    p.add_argument(
        "--store-faults", type=_rate, default=0.0, help="share of time the store is faulted (0)"
    )
    p.add_argument(
        "--wire-faults",
        type=_rate,
        default=0.0,
        help="chance per second that a proxied connection is faulted (0)",
    )
    p.add_argument(
        "--ports",
        type=_port_range,
        metavar="LOW-HIGH",
        help="loopback ports the run listens on, e.g. 20000-20100 (default: drawn below "
        "the kernel's range for outgoing connections)",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
    p.add_argument(
        "--bypass-gateway", action="store_true", help="write straight to the destination"
    )
    p.add_argument(
        "--upstream-idempotent",
        action="store_true",
        help="the destination deduplicates by key (upstream_idempotent = true)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work dir (configs, logs)")


def _unwritable(path: Path) -> str | None:
    """Why the report could not be written at `path` (None: it can), found by
    opening it as the end of the run will (a file made here is removed again)."""
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        path.unlink(missing_ok=True)
    return None


def settings_problem(args: argparse.Namespace) -> str | None:
    """Settings that would only fail once the run is under way (every worker's claim
    refused, the report unwritable), refused up front: exit 2, never counted as
    violations."""
    try:
        validate_ttl(args.ttl)
    except ValueError as exc:
        return f"--ttl: {exc}"
    if args.gateways > MAX_GATEWAYS:
        return f"--gateways: at most {MAX_GATEWAYS}, got {args.gateways}"
    if args.store is not None and not _store_url_shape(args.store):
        # found only once a gateway reads its config, after the destination started
        return "--store: expected sqlite:///path or postgresql://..."
    if args.store is not None and (problem := url_problem(args.store)) is not None:
        # urllib's and asyncpg's words for it may quote the password
        return f"--store: the URL cannot be read: {problem}"
    if args.ports is not None and len(args.ports) < ports_needed(args):
        first, last = args.ports.start, args.ports.stop - 1
        return f"--ports {first}-{last}: the run needs {ports_needed(args)} ports"
    if args.max_pause < args.ttl * 1.3:
        return "--max-pause must be at least 1.3 x --ttl"
    if (problem := late_mode.settings_problem(args)) is not None:
        return problem
    if args.json:
        report = Path(args.json).resolve()
        if not report.parent.is_dir():
            return f"--json {args.json}: no such directory for the report"
        if report.is_dir():
            return f"--json {args.json}: a directory, not a file for the report"
        if (problem := _unwritable(report)) is not None:
            return f"--json {args.json}: cannot be written: {problem}"
    return None
