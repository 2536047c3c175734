"""Placement from the agents' memory estimates when ``spec.resources.memory`` is unset: the
override wins, else the largest estimate; before any estimate one replica is placed first.
Pure, table-driven."""

from __future__ import annotations

import pytest

from mlx_fleet.contract import AssignmentReport, AssignmentState
from mlx_fleet_operator.placement import place, resolve_memory, revision_estimates
from mlx_fleet_operator.rollout import RevisionTarget, plan_deployment
from mlx_fleet_operator.spec import parse_spec, to_assignment
from mlx_fleet_operator.status import StatusInput, compute_status
from test_placement import GiB, asg, node, req

G = GiB


@pytest.mark.parametrize("override, estimates, want", [
    (3 * G, [5 * G, 4 * G], 3 * G),  # the user's override wins
    (None, [5 * G, 4 * G], 5 * G),   # the largest estimate
    (None, [0, 2 * G], 2 * G),       # no estimate (0) is ignored
    (None, [], None),                # nothing known yet
    (None, [0], None),
])
def test_resolve_memory(override, estimates, want):
    assert resolve_memory(override, estimates) == want


def report(node_: str, revision: str, estimated: int,
           state: AssignmentState = AssignmentState.READY) -> AssignmentReport:
    return AssignmentReport(node=node_, namespace="default", name="llm", revision=revision,
                            state=state, estimated_bytes=estimated)


def test_revision_estimates_take_the_largest_report_in_any_state():
    reports = {
        ("a", "v1"): report("a", "v1", 3 * G), ("b", "v1"): report("b", "v1", 4 * G),
        ("c", "v1"): report("c", "v1", 5 * G, AssignmentState.FAILED),  # refused: counts
        ("a", "v2"): report("a", "v2", 0, AssignmentState.LOADING)}   # none yet
    got = revision_estimates(reports, reports.keys())  # every reporting node holds its slot
    assert got == {"v1": 5 * G}


CASES = [
    # id, request, nodes, stored, nodes placed, waiting, unplaced
    ("no estimate: one replica first, on the node with most free budget", 
     req(3, mem_gib=0, estimate_pending=True), [node("a", 10), node("b", 20), node("c", 15)],
     {}, ("b",), 2, 0),
    ("no estimate, Binpack: still the most free budget",
     req(2, mem_gib=0, estimate_pending=True, strategy="Binpack"),
     [node("a", 10), node("b", 20)], {}, ("b",), 1, 0),
    ("no estimate: replicas already placed stay, none added",
     req(3, mem_gib=0, estimate_pending=True), [node("a"), node("b"), node("c")],
     {"a": [asg("llm", 0)], "b": [asg("llm", 0)]}, ("a", "b"), 1, 0),
    ("no estimate, one replica: nothing waits", req(1, mem_gib=0, estimate_pending=True),
     [node("a")], {}, ("a",), 0, 0),
    ("estimate known: every replica placed with it", req(3, mem_gib=4),
     [node("a"), node("b"), node("c")], {"b": [asg("llm", 0)]}, ("a", "b", "c"), 0, 0),
    ("estimate known and too big for the probe's node: it moves",
     req(1, mem_gib=10), [node("a", 10), node("b", 20)], {"a": [asg("llm", 0)]}, ("b",), 0, 0),
]


@pytest.mark.parametrize("request_, nodes, stored, want, waiting, unplaced",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_place_with_and_without_an_estimate(request_, nodes, stored, want, waiting, unplaced):
    d = place(request_, nodes, stored)
    assert (d.nodes, d.waiting, d.unplaced) == (want, waiting, unplaced)
    assert d.message == ""  # waiting for an estimate is no placement failure


def test_waiting_replicas_are_not_unplaced_in_the_plan_and_show_in_status():
    spec = parse_spec({"model": {"source": "/m", "revision": "v1"}, "replicas": 3})
    assert spec.resources.memory_bytes is None
    r = req(3, mem_gib=0, estimate_pending=True)
    target = RevisionTarget(r, to_assignment(spec, namespace="default", name="llm"))
    assert target.assignment.memory_bytes == 0
    p = plan_deployment(target, None, max_surge=1, max_unavailable=1,
                        nodes=[node("a"), node("b")], assignments={}, ready=set())
    assert (len(p.desired), p.stable.unplaced, p.stable.waiting) == (1, 0, 2)
    status, events = compute_status(StatusInput(
        generation=1, replicas=3, assignments={("a", "v1"): target.assignment},
        unplaced=p.stable.unplaced, waiting=p.stable.waiting, revision="v1"))
    sched = {c["type"]: c for c in status["conditions"]}["Scheduled"]
    assert (sched["status"], sched["reason"]) == ("False", "AwaitingEstimate")
    assert "1/3 replicas placed; 2 wait" in sched["message"]
    deg = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert deg["status"] == "False"
    assert "FailedPlacement" not in [e.reason for e in events]


def test_override_is_still_written_to_the_assignment():
    spec = parse_spec({"model": {"source": "/m", "revision": "v1"},
                       "resources": {"memory": "2Gi"}})
    assert to_assignment(spec, namespace="d", name="n").memory_bytes == 2 * G
    assert to_assignment(spec, namespace="d", name="n", memory_bytes=5 * G).memory_bytes == 5 * G


def test_an_estimate_arriving_rewrites_the_reservation_but_keeps_the_generation():
    """The probe replica reported its estimate: the others are placed with it, and the probe's
    record gets the estimate as its reservation under its stored generation (its Ready report
    stays current: no Pending flicker, no reload)."""
    spec = parse_spec({"model": {"source": "/m", "revision": "v1"}, "replicas": 2})
    probe = to_assignment(spec, namespace="default", name="llm", generation=1)
    known = to_assignment(spec, namespace="default", name="llm", generation=2,
                          memory_bytes=3 * G)
    p = plan_deployment(RevisionTarget(req(2, mem_gib=3), known), None, max_surge=1,
                        max_unavailable=1, nodes=[node("a"), node("b")],
                        assignments={"a": [probe]}, ready={("a", "v1")})
    assert sorted(p.desired) == [("a", "v1"), ("b", "v1")]
    assert p.desired[("a", "v1")].memory_bytes == 3 * G
    assert p.desired[("a", "v1")].generation == 1 and p.desired[("b", "v1")].generation == 2
