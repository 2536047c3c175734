"""Layering rules, checked against the real import graph: the import-linter contracts (in
pyproject.toml: pure decision modules import no I/O library; operator, agent and router stay
apart; mlx_fleet imports none of them), and no import cycle between modules of mlx_fleet,
node_agent, mlx_fleet_operator and mlx_fleet_router (grimp, import-linter's own graph
library)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mlx_fleet", "node_agent", "mlx_fleet_operator", "mlx_fleet_router")

#: Import cycles allowed, each by its exact set of modules (a cycle that grows, or any other,
#: fails). None today; an entry needs a reason and an issue that removes it.
ALLOWED_CYCLES: frozenset[frozenset[str]] = frozenset()


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def test_no_package_shadows_stdlib_operator() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()
    import operator

    assert hasattr(operator, "itemgetter")  # still the standard library's module


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module
    (Tarjan's algorithm), each sorted, in sorted order. Every import counts: module level, inside
    a function, under ``TYPE_CHECKING``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return sorted(cycles)


def describe(graph: grimp.ImportGraph, cycle: list[str]) -> str:
    """One cycle for a failure message: its modules, then each import between them with its
    line (``a:12 imports b``)."""
    members = set(cycle)
    lines = [" ↔ ".join(cycle)]
    for importer in cycle:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            for d in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"    {importer}:{d['line_number']} imports {imported}: "
                             f"{d['line_contents']}")
    return "\n".join(lines)


def project_graph() -> grimp.ImportGraph:
    for package in PACKAGES:  # the graph of this checkout, not of another installed copy
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.origin is not None, package
        assert Path(spec.origin).resolve().is_relative_to(ROOT), (
            f"{package} is imported from {spec.origin}, not from {ROOT}: put the checkout first "
            "on PYTHONPATH (see docs/development.md)")
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def test_no_import_cycle() -> None:
    graph = project_graph()
    cycles = [c for c in import_cycles(graph) if frozenset(c) not in ALLOWED_CYCLES]
    assert not cycles, ("import cycles (move the piece both sides need into its own module):\n"
                        + "\n".join(describe(graph, c) for c in cycles))


def test_every_allowed_cycle_still_exists() -> None:
    """An exception that no longer applies is deleted, so it can't hide a new cycle later."""
    found = {frozenset(c) for c in import_cycles(project_graph())}
    stale = sorted(sorted(c) for c in ALLOWED_CYCLES - found)
    assert not stale, f"these cycles are gone: remove them from ALLOWED_CYCLES: {stale}"


def test_import_cycles_finds_each_cycle_and_only_cycles() -> None:
    graph = grimp.ImportGraph()
    for importer, imported in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"),  # a 3-cycle
                               ("p.c", "p.d"), ("p.d", "p.e"),                   # a chain out
                               ("p.x", "p.y"), ("p.y", "p.x"),                   # a 2-cycle
                               ("p.x", "p.a")]:                                  # joins them
        graph.add_import(importer=importer, imported=imported)
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"], ["p.x", "p.y"]]
    graph.add_import(importer="p.e", imported="p.x")  # a → … → e → x → a: one cycle of all
    assert import_cycles(graph) == [["p.a", "p.b", "p.c", "p.d", "p.e", "p.x", "p.y"]]
    assert describe(graph, ["p.x", "p.y"]).splitlines()[0] == "p.x ↔ p.y"
