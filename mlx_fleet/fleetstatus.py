"""Fleet status as the etcd contract sees it: nodes, their assignments and the agents' reports.

:func:`collect` reads the three prefixes once; :func:`summarize` is a pure function from those
records to table rows; :func:`render` prints them with rich. ``mlx-fleet status`` and the demo
use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from mlx_fleet.contract import Assignment, AssignmentReport, Keys, NodeRecord
from mlx_fleet.store import Store


@dataclass(frozen=True)
class FleetView:
    """Parsed records; malformed values are counted, not raised."""

    nodes: dict[str, NodeRecord]
    assignments: dict[tuple[str, str, str], Assignment]  # (node, namespace, name)
    reports: dict[tuple[str, str, str], AssignmentReport]
    malformed: int = 0
    revision: int = 0


async def collect(store: Store, keys: Keys) -> FleetView:
    """Read ``nodes/``, ``assignments/`` and ``reports/`` (three range reads)."""
    malformed = 0
    nodes: dict[str, NodeRecord] = {}
    assignments: dict[tuple[str, str, str], Assignment] = {}
    reports: dict[tuple[str, str, str], AssignmentReport] = {}
    listing = await store.list(keys.nodes_prefix)
    for kv in listing.items:
        name = keys.parse_node(kv.key)
        try:
            if name:
                nodes[name] = NodeRecord.from_json(kv.value)
        except ValidationError:
            malformed += 1
    for kv in (await store.list(keys.assignments_prefix)).items:
        ref = keys.parse_assignment(kv.key)
        try:
            if ref:
                assignments[ref] = Assignment.from_json(kv.value)
        except ValidationError:
            malformed += 1
    last = await store.list(keys.reports_prefix)
    for kv in last.items:
        ref = keys.parse_report(kv.key)
        try:
            if ref:
                reports[ref] = AssignmentReport.from_json(kv.value)
        except ValidationError:
            malformed += 1
    return FleetView(nodes, assignments, reports, malformed, last.revision)


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"


def summarize(view: FleetView) -> list[dict[str, str]]:
    """One row per node (and per assignment on it): node, chip, memory, health, deployment,
    revision, state, endpoint. Nodes without assignments get one row with ``-`` fields;
    assignments on nodes that vanished are listed with node health ``Gone``."""
    rows: list[dict[str, str]] = []
    names = sorted(set(view.nodes) | {ref[0] for ref in view.assignments})
    for node in names:
        rec = view.nodes.get(node)
        base = {
            "node": node,
            "chip": (f"{rec.capacity.chip}{' (simulated)' if rec.capacity.simulated else ''}"
                     if rec else "-"),
            "memory": (f"{_gib(rec.capacity.memory_available_bytes)} free / "
                       f"{_gib(rec.capacity.memory_total_bytes)}" if rec else "-"),
            "health": rec.health.value if rec else "Gone",
        }
        refs = sorted(ref for ref in view.assignments if ref[0] == node)
        if not refs:
            rows.append({**base, "deployment": "-", "revision": "-", "state": "-", "endpoint": "-"})
        for ref in refs:
            a = view.assignments[ref]
            rep = view.reports.get(ref)
            rows.append({**base, "deployment": f"{a.namespace}/{a.name}", "revision": a.source.revision,
                         "state": (rep.state.value + (f" ({rep.reason})" if rep.reason else "")) if rep
                         else "Pending",
                         "endpoint": rep.endpoint if rep and rep.endpoint else "-"})
    return rows


def render(view: FleetView, console=None) -> None:
    """Print :func:`summarize` as a rich table."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"mlx-fleet (etcd revision {view.revision})")
    for col in ("node", "chip", "memory", "health", "deployment", "revision", "state", "endpoint"):
        table.add_column(col.capitalize())
    for row in summarize(view):
        table.add_row(*row.values())
    console.print(table)
    if view.malformed:
        console.print(f"[yellow]{view.malformed} malformed record(s) ignored[/]")
