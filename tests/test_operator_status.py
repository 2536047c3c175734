"""status.compute_status: table-driven, pure."""

from __future__ import annotations

import datetime as dt

import pytest

from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, ModelSource,
                                NodeCapacity, NodeRecord)
from mlx_fleet_operator.status import StatusInput, compute_status, status_changed

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
T1 = T0 + dt.timedelta(minutes=5)


def asg(gen: int = 2) -> Assignment:
    return Assignment(namespace="ns", name="llm", generation=gen, served_model_name="llm",
                      source=ModelSource(uri="/m", revision="v1"), memory_bytes=1)


def rep(node: str, state: AssignmentState, gen: int = 2, **kw) -> AssignmentReport:
    return AssignmentReport(node=node, namespace="ns", name="llm", generation=gen, state=state,
                            endpoint=f"http://{node}:8000", **kw)


def rec(node: str) -> NodeRecord:
    return NodeRecord(name=node, address=f"http://{node}:9000",
                      capacity=NodeCapacity(memory_total_bytes=1, memory_available_bytes=1,
                                            chip="Apple M3", chip_generation=3))


def conds(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


R, F, L = AssignmentState.READY, AssignmentState.FAILED, AssignmentState.LOADING

CASES = [
    # id, input, ready replicas, conditions, state per node
    ("scaled to zero", StatusInput(generation=2, replicas=0), 0,
     {"Ready": ("True", "ScaledToZero"), "Progressing": ("False", "Complete"),
      "Degraded": ("False", "AsExpected")}, {}),
    ("no report yet", StatusInput(generation=2, replicas=1, assignments={"a": asg()},
                                  nodes={"a": rec("a")}), 0,
     {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("True", "ReplicasStarting"),
      "Degraded": ("False", "AsExpected")}, {"a": "Pending"}),
    ("loading", StatusInput(generation=2, replicas=1, assignments={"a": asg()},
                            reports={"a": rep("a", L)}), 0,
     {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("True", "ReplicasStarting")},
     {"a": "Loading"}),
    ("all ready", StatusInput(generation=2, replicas=2, assignments={"a": asg(), "b": asg()},
                              reports={"a": rep("a", R), "b": rep("b", R)}), 2,
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "Complete"),
      "Degraded": ("False", "AsExpected")}, {"a": "Ready", "b": "Ready"}),
    ("stale report does not count", StatusInput(generation=3, replicas=1, assignments={"a": asg(3)},
                                                reports={"a": rep("a", R, gen=2)}), 0,
     {"Ready": ("False", "ReplicasNotReady")}, {"a": "Pending"}),
    ("failed", StatusInput(generation=2, replicas=2, assignments={"a": asg(), "b": asg()},
                           reports={"a": rep("a", R), "b": rep("b", F, reason="LoadFailed",
                                                             message="no such file")}), 1,
     {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("False", "ReplicaFailed"),
      "Degraded": ("True", "ReplicaFailed")}, {"a": "Ready", "b": "Failed"}),
    ("unplaced", StatusInput(generation=2, replicas=2, assignments={"a": asg()},
                             reports={"a": rep("a", R)}, unplaced=1,
                             placement_message="1/2 nodes fit: 1 insufficient memory"), 1,
     {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("False", "FailedPlacement"),
      "Degraded": ("True", "FailedPlacement")}, {"a": "Ready"}),
    ("invalid spec", StatusInput(generation=2, replicas=1, spec_error="spec.replicas: bad"), 0,
     {"Ready": ("False", "InvalidSpec"), "Degraded": ("True", "InvalidSpec")}, {}),
]


@pytest.mark.parametrize("inp, ready, want_conds, states", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_compute_status(inp, ready, want_conds, states):
    status, _ = compute_status(inp, None, T0)
    assert status["observedGeneration"] == inp.generation
    assert status["replicas"] == len(inp.assignments) and status["readyReplicas"] == ready
    got = conds(status)
    for k, v in want_conds.items():
        assert got[k] == v, k
    assert {n["name"]: n["state"] for n in status["nodes"]} == states
    assert all(c["observedGeneration"] == inp.generation for c in status["conditions"])
    assert all(c["lastTransitionTime"] == "2025-01-01T00:00:00Z" for c in status["conditions"])


def test_endpoints_only_ready_and_fallback_to_node_address():
    status, _ = compute_status(StatusInput(
        generation=2, replicas=2, assignments={"a": asg(), "b": asg()},
        reports={"a": rep("a", R), "b": rep("b", L)}, nodes={"a": rec("a"), "b": rec("b")}), None, T0)
    assert status["endpoints"] == ["http://a:8000"]
    s2, _ = compute_status(StatusInput(generation=2, replicas=1, assignments={"c": asg()},
                                       nodes={"c": rec("c")}), None, T0)
    assert s2["nodes"][0]["endpoint"] == "http://c:9000"


def test_last_transition_time_kept_when_status_unchanged():
    inp = StatusInput(generation=2, replicas=1, assignments={"a": asg()}, reports={"a": rep("a", L)})
    first, _ = compute_status(inp, None, T0)
    inp2 = StatusInput(generation=2, replicas=1, assignments={"a": asg()},
                       reports={"a": rep("a", R)})
    second, _ = compute_status(inp2, first, T1)
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert times["Ready"] == "2025-01-01T00:05:00Z"  # False -> True
    assert times["Progressing"] == "2025-01-01T00:05:00Z"  # True -> False
    assert times["Degraded"] == "2025-01-01T00:00:00Z"  # False all along
    third, events = compute_status(inp2, second, T1 + dt.timedelta(hours=1))
    assert third == second and events == [] and not status_changed(second, third)


EVENT_CASES = [
    ("placed", None, {"a": None}, [("Normal", "Placed")]),
    ("placed and ready at once", None, {"a": R}, [("Normal", "Placed"), ("Normal", "ReplicaReady")]),
    ("becomes ready", {"a": L}, {"a": R}, [("Normal", "ReplicaReady")]),
    ("stays ready", {"a": R}, {"a": R}, []),
    ("fails", {"a": L}, {"a": F}, [("Warning", "ReplicaFailed")]),
    ("stays failed", {"a": F}, {"a": F}, []),
]


@pytest.mark.parametrize("before, after, want", [c[1:] for c in EVENT_CASES],
                         ids=[c[0] for c in EVENT_CASES])
def test_events(before, after, want):
    def inp(states):
        return StatusInput(generation=2, replicas=1, assignments={n: asg() for n in states},
                           reports={n: rep(n, s, reason="LoadFailed" if s == F else "",
                                           message="boom" if s == F else "")
                                    for n, s in states.items() if s is not None})
    prev = compute_status(inp(before), None, T0)[0] if before else None
    _, events = compute_status(inp(after), prev, T1)
    assert [(e.type, e.reason) for e in events] == want
    if want and want[-1][1] == "ReplicaFailed":
        assert "LoadFailed: boom" in events[-1].message


def test_failed_placement_event_once_per_message():
    inp = StatusInput(generation=1, replicas=1, unplaced=1, placement_message="0/1 nodes fit: x")
    s1, e1 = compute_status(inp, None, T0)
    assert [(e.type, e.reason, e.message) for e in e1] == [("Warning", "FailedPlacement",
                                                            "0/1 nodes fit: x")]
    _, e2 = compute_status(inp, s1, T1)
    assert e2 == []
    _, e3 = compute_status(StatusInput(generation=1, replicas=1, unplaced=1,
                                       placement_message="0/2 nodes fit: y"), s1, T1)
    assert [e.reason for e in e3] == ["FailedPlacement"]


def test_scale_up_keeps_ready_replicas_ready():
    """2 → 3 replicas (a new metadata.generation) must not flap the two Ready replicas: the plan
    keeps their stored assignments (generation 1) untouched, so their reports still match."""
    from mlx_fleet.contract import Keys
    from mlx_fleet.store import KV
    from mlx_fleet_operator import reconcile as rc
    from mlx_fleet_operator.placement import PlacementRequest

    keys = Keys("/t")
    stored = {n: rc.StoredAssignment(keys.assignment(n, "ns", "llm"),
                                     KV(keys.assignment(n, "ns", "llm"), asg(1).to_json(), 10),
                                     asg(1)) for n in ("a", "b")}
    nodes = {n: rec(n).model_copy(update={"capacity": rec(n).capacity.model_copy(
        update={"memory_total_bytes": 1 << 30})}) for n in ("a", "b", "c")}
    view = rc.FleetView(nodes=nodes, assignments={n: [s] for n, s in stored.items()},
                        epoch=None, revision=10)
    request = PlacementRequest(namespace="ns", name="llm", replicas=3, memory_bytes=1)
    p = rc.plan(keys, view, request, asg(2))
    assert {n: a.generation for n, a in p.desired.items()} == {"a": 1, "b": 1, "c": 2}
    assert [op.key for op in p.ops] == [keys.assignment("c", "ns", "llm")]  # only the new one

    before, _ = compute_status(StatusInput(generation=1, replicas=2, assignments={
        "a": asg(1), "b": asg(1)}, reports={"a": rep("a", R, gen=1), "b": rep("b", R, gen=1)}),
        None, T0)
    after, events = compute_status(StatusInput(
        generation=2, replicas=3, assignments=p.desired,
        reports={"a": rep("a", R, gen=1), "b": rep("b", R, gen=1)}), before, T1)
    assert after["observedGeneration"] == 2 and after["readyReplicas"] == 2
    assert after["endpoints"] == ["http://a:8000", "http://b:8000"]
    assert {n["name"]: n["state"] for n in after["nodes"]} == {"a": "Ready", "b": "Ready",
                                                               "c": "Pending"}
    assert [e.reason for e in events] == ["Placed"]


def test_changed_model_rewrites_every_assignment():
    """What the node serves changed (revision): every replica gets the new record."""
    from mlx_fleet.contract import Keys
    from mlx_fleet.store import KV
    from mlx_fleet_operator import reconcile as rc
    from mlx_fleet_operator.placement import PlacementRequest

    keys = Keys("/t")
    key = keys.assignment("a", "ns", "llm")
    view = rc.FleetView(nodes={"a": rec("a").model_copy(update={"capacity": rec("a").capacity.model_copy(
        update={"memory_total_bytes": 1 << 30})})},
        assignments={"a": [rc.StoredAssignment(key, KV(key, asg(1).to_json(), 10), asg(1))]},
        epoch=None, revision=10)
    new = asg(2).model_copy(update={"source": ModelSource(uri="/m", revision="v2")})
    p = rc.plan(keys, view, PlacementRequest(namespace="ns", name="llm", replicas=1,
                                             memory_bytes=1), new)
    assert p.desired == {"a": new} and [op.key for op in p.ops] == [key]
    assert not rc.same_for_node(asg(1), new) and rc.same_for_node(asg(1), asg(7))


def _crd_condition_required() -> list[str]:
    import pathlib

    import yaml

    crd = yaml.safe_load((pathlib.Path(__file__).parents[1] / "crds"
                          / "mlx-fleet.io_modeldeployments.yaml").read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    return status["properties"]["conditions"]["items"]["required"]


def test_conditions_carry_every_field_the_crd_requires():
    """Like metav1.Condition: type, status, lastTransitionTime, reason, message — always."""
    required = _crd_condition_required()
    assert set(required) >= {"type", "status", "lastTransitionTime", "reason", "message"}
    inputs = [c[1] for c in CASES] + [StatusInput(generation=1, replicas=1, unplaced=1,
                                                  placement_message="")]
    for inp in inputs:
        status, _ = compute_status(inp, None, T0)
        for c in status["conditions"]:
            assert all(isinstance(c.get(k), str) for k in required), c
            assert c["reason"] and len(c["message"]) <= 32768


def test_replicas_is_observed_not_desired():
    """status.replicas counts placed replicas (assignments); spec.replicas stays the desired."""
    status, _ = compute_status(StatusInput(generation=1, replicas=3, assignments={"a": asg()},
                                           unplaced=2, placement_message="1/1 nodes fit"), None, T0)
    assert status["replicas"] == 1 and status["readyReplicas"] == 0
    assert "0/3 replicas ready" in {c["type"]: c for c in status["conditions"]}["Ready"]["message"]
