"""`sinkgate init [DIR]` (SPEC 6): a commented gateway file and one example
destination from the templates this package carries, never over a file that
is already there."""

from __future__ import annotations

import argparse
import shlex
import sys
from importlib import resources
from pathlib import Path

from gateway.config.model import DEFAULT_CONFIG_PATH

# (template, where it goes under DIR)
FILES = (("gateway.toml", "gateway.toml"), ("example.toml", "destinations/example.toml"))
DEFAULT_DIR = str(Path(DEFAULT_CONFIG_PATH).parent)


def template(name: str) -> str:
    """The text of one shipped template."""
    return resources.files("gateway.config").joinpath("templates", name).read_text("utf-8")


def main(args: argparse.Namespace) -> int:
    """Write the files; exit 1 naming the first that is in the way, before writing
    any. A write that fails midway takes back what it wrote: all or nothing."""
    directory = Path(args.dir)
    targets = [(directory / where, template(name)) for name, where in FILES]
    for path, _ in targets:
        if path.exists() or path.is_symlink():
            return _refuse(f"{path} already exists; not overwriting it")
        blocking = _not_a_directory(path.parent)
        if blocking is not None:
            return _refuse(f"{blocking} is not a directory; cannot write {path}")
    written: list[Path] = []
    for path, text in targets:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("x", encoding="utf-8") as fh:  # "x": never over a file made meanwhile
                fh.write(text)
        except OSError as exc:
            for done in written:
                done.unlink(missing_ok=True)
            return _refuse(f"cannot write {path}: {exc.strerror or exc}")
        written.append(path)
    for path in written:
        print(f"wrote {path}")
    # quoted for the shell, so the lines can be pasted as they are
    config = shlex.quote(str(directory / "gateway.toml"))
    option = "" if args.dir == DEFAULT_DIR else f" --config {config}"
    example = directory / "destinations" / "example.toml"
    print(
        f"\nnext: point upstream in {example} at your service, then\n"
        f"  sinkgate check-config{option}\n"
        f"  sinkgate serve{option}\n"
        f"  curl http://127.0.0.1:8480/healthz"
    )
    return 0


def _refuse(message: str) -> int:
    print(f"sinkgate: {message}", file=sys.stderr)
    return 1


def _not_a_directory(folder: Path) -> Path | None:
    """The first of `folder` and its parents that exists but is no directory."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None
