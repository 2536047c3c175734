"""Fleet status rows from etcd records (pure) and the CLI's help text."""

from __future__ import annotations

import subprocess
import sys

from mlx_fleet.cli import build_parser
from mlx_fleet.contract import (
    Assignment,
    AssignmentReport,
    AssignmentState,
    ModelSource,
    NodeCapacity,
    NodeRecord,
    Role,
)
from mlx_fleet.fleetstatus import FleetView, summarize


def _node(name: str) -> NodeRecord:
    return NodeRecord(name=name, address=f"http://{name}:8000",
                      capacity=NodeCapacity(memory_total_bytes=64 << 30, memory_available_bytes=32 << 30,
                                            chip="Apple M3 Max", chip_generation=3, simulated=True))


def _assignment(name: str, revision: str = "v2", role: Role = Role.STABLE) -> Assignment:
    return Assignment(namespace="default", name=name, served_model_name=name, role=role,
                      source=ModelSource(uri="file:///m", revision=revision), memory_bytes=1 << 30)


def test_summarize_joins_nodes_assignments_and_reports() -> None:
    ref = ("mac-a", "default", "llama", "v2")
    view = FleetView(
        nodes={"mac-a": _node("mac-a"), "mac-b": _node("mac-b")},
        assignments={ref: _assignment("llama"),
                     ("mac-gone", "default", "llama", "v2"): _assignment("llama")},
        reports={ref: AssignmentReport(node="mac-a", namespace="default", name="llama",
                                       state=AssignmentState.READY, reason="ModelLoaded",
                                       endpoint="http://mac-a:8000")},
    )
    rows = {(r["node"], r["deployment"]): r for r in summarize(view)}
    ready = rows[("mac-a", "default/llama")]
    assert ready["state"] == "Ready (ModelLoaded)"
    assert ready["endpoint"] == "http://mac-a:8000"
    assert ready["chip"] == "Apple M3 Max (simulated)"
    assert ready["memory"] == "32.0GiB free / 64.0GiB"
    assert ready["revision"] == "v2"
    assert rows[("mac-b", "-")]["state"] == "-"
    gone = rows[("mac-gone", "default/llama")]
    assert (gone["health"], gone["state"]) == ("Gone", "Pending")


def test_summarize_one_row_per_revision_with_its_role() -> None:
    """Two revisions of one deployment on a Mac (a surge, a canary) are two rows; a report
    belongs to its own revision only; non-Stable roles are named next to the revision."""
    view = FleetView(
        nodes={"mac-a": _node("mac-a")},
        assignments={
            ("mac-a", "default", "llama", "v2"): _assignment("llama", "v2"),
            ("mac-a", "default", "llama", "v1"): _assignment("llama", "v1", Role.PREVIOUS),
            ("mac-a", "default", "llama", "v3"): _assignment("llama", "v3", Role.CANDIDATE)},
        reports={("mac-a", "default", "llama", "v1"): AssignmentReport(
            node="mac-a", namespace="default", name="llama", revision="v1",
            state=AssignmentState.READY, endpoint="http://mac-a:8000")},
    )
    rows = [(r["node"], r["deployment"], r["revision"], r["state"], r["endpoint"])
            for r in summarize(view)]
    assert rows == [
        ("mac-a", "default/llama", "v1 (previous)", "Ready", "http://mac-a:8000"),
        ("mac-a", "default/llama", "v2", "Pending", "-"),
        ("mac-a", "default/llama", "v3 (candidate)", "Pending", "-"),
    ]


def test_cli_help_explains_every_command() -> None:
    text = build_parser().format_help()
    for command in ("provision", "dev", "demo", "make-test-model", "status"):
        assert command in text
    res = subprocess.run([sys.executable, "-m", "mlx_fleet.cli", "status", "--help"],
                         capture_output=True, text=True, check=True)
    assert "--etcd-endpoint" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "mlx_fleet.cli", "no-such-command"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
