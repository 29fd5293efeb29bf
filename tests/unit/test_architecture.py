"""The house's seams: no import cycles (none hidden inside a function either), and the
import-linter contracts of pyproject.toml kept."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[2]


def import_cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_cycle_finder_finds_a_cycle_through_three_modules() -> None:
    edges = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": []}
    assert import_cycles(edges) == [["a", "b", "c"]]
    assert import_cycles({"a": ["b"], "b": []}) == []


def test_gateway_and_leases_have_no_import_cycle() -> None:
    """grimp also reads imports inside functions, so a cycle dodged that way counts."""
    graph = grimp.build_graph("gateway", "leases")
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    assert import_cycles(edges) == []


def test_the_import_contracts_are_kept() -> None:
    """In a process of its own: lint-imports reads pyproject.toml from its working
    directory, and configures logging in a way that would disable other loggers."""
    result = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def package_of(module: str) -> str:
    """`gateway.store.sqlite` -> `gateway.store`; a top module is its own package."""
    return ".".join(module.split(".")[:2])


def test_gateway_packages_have_no_import_cycle() -> None:
    """The module-level check above misses a ring of packages (write imports store,
    store imports another module of write): the package graph has no cycle either.
    The layers contract in pyproject.toml says the same; this names the cycle.
    Checked by hand: `import gateway.write.paths` inside a function of
    gateway/store/janitor.py fails this test and the contracts, not the one above."""
    graph = grimp.build_graph("gateway", cache_dir=None)
    edges: dict[str, set[str]] = {}
    for module in graph.modules:
        imported = {package_of(m) for m in graph.find_modules_directly_imported_by(module)}
        edges.setdefault(package_of(module), set()).update(
            p for p in imported if p.startswith("gateway.") and p != package_of(module)
        )
    assert import_cycles(edges) == []


def test_every_gateway_logger_is_named_under_gateway() -> None:
    """One logger namespace: `gateway.<package>`, never `sinkgate.*` beside it."""
    named = re.compile(r"get_logger\(\"([^\"]*)\"\)")
    strays = [
        f"{path.relative_to(REPO)}: {name}"
        for path in (REPO / "gateway").rglob("*.py")
        for name in named.findall(path.read_text(encoding="utf-8"))
        if not name.startswith("gateway.")
    ]
    assert strays == []
