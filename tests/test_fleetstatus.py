"""Fleet status rows from etcd records (pure) and the CLI's help text."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from rich.console import Console

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
from mlx_fleet.capabilities import ModelCapabilities
from mlx_fleet.fleetstatus import FleetView, breaker_text, capabilities_text, render, summarize
from mlx_fleet.routing.fleet import FleetRouting, RoutedMac


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


@pytest.mark.parametrize("mac, text", [
    (None, "-"),
    (RoutedMac(node="m"), "closed"),
    (RoutedMac(node="m", reason="TrialFailed"), "closed"),  # closed again after a trial
    (RoutedMac(node="m", state="open", reason="ConnectionRefused", half_open_in_seconds=41.2),
     "open (ConnectionRefused, half-open in 42 s)"),
    (RoutedMac(node="m", state="open", reason="ErrorRate", half_open_in_seconds=0.0),
     "open (ErrorRate, half-open in 0 s)"),
    (RoutedMac(node="m", state="half-open", reason="HealthProbes"), "half-open (HealthProbes)"),
    (RoutedMac(node="m", state="half-open", reason="ErrorRate", trial_in_flight=True),
     "half-open (ErrorRate, trial out)"),
    (RoutedMac(node="m", state="open"), "open"),
])
def test_breaker_text(mac, text) -> None:
    assert breaker_text(mac) == text


@pytest.mark.parametrize("caps, text", [
    (None, "-"),
    (ModelCapabilities(), "generate"),
    (ModelCapabilities(tool_calling=True, tool_parser="json_tools", structured_outputs=True,
                       logprobs=True, max_top_logprobs=20, max_n=4),
     "generate, tools (json_tools), json, logprobs ≤20, n ≤4"),
    (ModelCapabilities(task="TextEmbedding", embeddings=True), "embeddings"),
    (ModelCapabilities(task="TextEmbedding"), "embed (not served)"),
])
def test_capabilities_text(caps, text) -> None:
    assert capabilities_text(caps) == text


def test_status_shows_each_revisions_reported_capabilities() -> None:
    ref = ("mac-a", "default", "llama", "v2")
    view = FleetView(
        nodes={"mac-a": _node("mac-a")},
        assignments={ref: _assignment("llama"),
                     ("mac-a", "default", "coder", "v2"): _assignment("coder")},
        reports={ref: AssignmentReport(node="mac-a", namespace="default", name="llama",
                                       state=AssignmentState.READY,
                                       capabilities=ModelCapabilities(max_n=2))})
    rows = {r["deployment"]: r["capabilities"] for r in summarize(view)}
    assert rows == {"default/llama": "generate, n ≤2", "default/coder": "-"}
    out = io.StringIO()
    render(view, Console(file=out, width=300))
    assert "Capabilities" in out.getvalue() and "generate, n ≤2" in out.getvalue()


def _two_macs() -> FleetView:
    ref = ("mac-a", "default", "llama", "v2")
    return FleetView(
        nodes={"mac-a": _node("mac-a"), "mac-b": _node("mac-b")},
        assignments={ref: _assignment("llama"),
                     ("mac-a", "default", "coder", "v2"): _assignment("coder")},
        reports={ref: AssignmentReport(node="mac-a", namespace="default", name="llama",
                                       state=AssignmentState.READY,
                                       endpoint="http://mac-a:8000")},
    )


@pytest.mark.parametrize("routing, expected", [
    # no router view: the etcd columns only
    (None, [("mac-a", "default/coder", None, None), ("mac-a", "default/llama", None, None),
            ("mac-b", "-", None, None)]),
    # the breaker is per Mac: every row of a node shows it; a node the router does not route
    # to shows "-"
    (FleetRouting(macs=(RoutedMac(node="mac-a", state="open", reason="ErrorRate",
                                  half_open_in_seconds=9.5, in_flight=0),)),
     [("mac-a", "default/coder", "open (ErrorRate, half-open in 10 s)", "0"),
      ("mac-a", "default/llama", "open (ErrorRate, half-open in 10 s)", "0"),
      ("mac-b", "-", "-", "-")]),
    # a Mac only the router knows (etcd already dropped it) is listed, not hidden
    (FleetRouting(macs=(RoutedMac(node="mac-b", in_flight=3),
                        RoutedMac(node="mac-c", state="half-open", trial_in_flight=True,
                                  reason="HealthProbes"))),
     [("mac-a", "default/coder", "-", "-"), ("mac-a", "default/llama", "-", "-"),
      ("mac-b", "-", "closed", "3"), ("mac-c", "-", "half-open (HealthProbes, trial out)", "0")]),
    (FleetRouting(), [("mac-a", "default/coder", "-", "-"), ("mac-a", "default/llama", "-", "-"),
                      ("mac-b", "-", "-", "-")]),
])
def test_summarize_merges_the_routers_view(routing, expected) -> None:
    rows = summarize(_two_macs(), routing)
    assert [(r["node"], r["deployment"], r.get("breaker"), r.get("in-flight"))
            for r in rows] == expected
    etcd_only = summarize(_two_macs())
    # the router's view only adds columns (and rows): the etcd cells are unchanged
    assert [{k: v for k, v in r.items() if k not in ("breaker", "in-flight")}
            for r in rows[:len(etcd_only)]] == etcd_only
    if routing is not None and len(rows) > len(etcd_only):
        extra = rows[-1]
        assert (extra["health"], extra["state"], extra["endpoint"]) == ("-", "-", "-")


def test_render_shows_the_breaker_columns_only_with_a_router_view() -> None:
    def text(routing: FleetRouting | None) -> str:
        out = io.StringIO()
        render(_two_macs(), Console(file=out, width=300), routing=routing)
        return out.getvalue()

    assert "Breaker" not in text(None) and "In-flight" not in text(None)
    shown = text(FleetRouting(macs=(RoutedMac(node="mac-a", state="open",
                                              reason="ConnectionRefused",
                                              half_open_in_seconds=30.0),)))
    assert "Breaker" in shown and "In-flight" in shown
    assert "open (ConnectionRefused, half-open in 30 s)" in shown


def test_cli_help_explains_every_command() -> None:
    text = build_parser().format_help()
    for command in ("provision", "dev", "demo", "make-test-model", "status"):
        assert command in text
    res = subprocess.run([sys.executable, "-m", "mlx_fleet.cli", "status", "--help"],
                         capture_output=True, text=True, check=True)
    assert "--etcd-endpoint" in res.stdout
    assert "--router" in res.stdout and "MLX_FLEET_ROUTER_URL" in res.stdout
    assert "--router-key-file" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "mlx_fleet.cli", "no-such-command"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
