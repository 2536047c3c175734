"""status.compute_status: table-driven, pure."""

from __future__ import annotations

import datetime as dt

import pytest

from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, DownloadProgress,
                                ModelSource, NodeCapacity, NodeRecord, Role)
from mlx_fleet_operator.status import StatusInput, compute_status, status_changed

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
T1 = T0 + dt.timedelta(minutes=5)


def asg(gen: int = 2, revision: str = "v1", role: Role = Role.STABLE) -> Assignment:
    return Assignment(namespace="ns", name="llm", generation=gen, served_model_name="llm",
                      source=ModelSource(uri="/m", revision=revision), memory_bytes=1, role=role)


def rep(node: str, state: AssignmentState, gen: int = 2, revision: str = "v1",
        **kw) -> AssignmentReport:
    return AssignmentReport(node=node, namespace="ns", name="llm", generation=gen, state=state,
                            revision=revision, endpoint=f"http://{node}:8000", **kw)


def rec(node: str) -> NodeRecord:
    return NodeRecord(name=node, address=f"http://{node}:9000",
                      capacity=NodeCapacity(memory_total_bytes=1, memory_available_bytes=1,
                                            chip="Apple M3 Max", chip_generation=3))


def conds(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


R, F, L = AssignmentState.READY, AssignmentState.FAILED, AssignmentState.LOADING
SA, SB, SC = ("a", "v1"), ("b", "v1"), ("c", "v1")  # (node, revision) slots

CASES = [
    # id, input, ready replicas, conditions, state per node
    ("scaled to zero", StatusInput(generation=2, replicas=0), 0,
     {"Ready": ("True", "ScaledToZero"), "Progressing": ("False", "Complete"),
      "Degraded": ("False", "AsExpected")}, {}),
    ("no report yet", StatusInput(generation=2, replicas=1, assignments={SA: asg()},
                                  nodes={"a": rec("a")}), 0,
     {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("True", "ReplicasStarting"),
      "Degraded": ("False", "AsExpected")}, {"a": "Pending"}),
    ("loading", StatusInput(generation=2, replicas=1, assignments={SA: asg()},
                            reports={SA: rep("a", L)}), 0,
     {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("True", "ReplicasStarting")},
     {"a": "Loading"}),
    ("all ready", StatusInput(generation=2, replicas=2, assignments={SA: asg(), SB: asg()},
                              reports={SA: rep("a", R), SB: rep("b", R)}), 2,
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "Complete"),
      "Degraded": ("False", "AsExpected")}, {"a": "Ready", "b": "Ready"}),
    ("stale report does not count", StatusInput(generation=3, replicas=1, assignments={SA: asg(3)},
                                                reports={SA: rep("a", R, gen=2)}), 0,
     {"Ready": ("False", "ReplicasNotReady")}, {"a": "Pending"}),
    ("failed", StatusInput(generation=2, replicas=2, assignments={SA: asg(), SB: asg()},
                           reports={SA: rep("a", R), SB: rep("b", F, reason="LoadFailed",
                                                             message="no such file")}), 1,
     {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("False", "ReplicaFailed"),
      "Degraded": ("True", "ReplicaFailed")}, {"a": "Ready", "b": "Failed"}),
    ("unplaced", StatusInput(generation=2, replicas=2, assignments={SA: asg()},
                             reports={SA: rep("a", R)}, unplaced=1,
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
        generation=2, replicas=2, assignments={SA: asg(), SB: asg()},
        reports={SA: rep("a", R), SB: rep("b", L)}, nodes={"a": rec("a"), "b": rec("b")}),
        None, T0)
    assert status["endpoints"] == ["http://a:8000"]
    s2, _ = compute_status(StatusInput(generation=2, replicas=1, assignments={SC: asg()},
                                       nodes={"c": rec("c")}), None, T0)
    assert s2["nodes"][0]["endpoint"] == "http://c:9000"


def test_last_transition_time_kept_when_status_unchanged():
    inp = StatusInput(generation=2, replicas=1, assignments={SA: asg()},
                      reports={SA: rep("a", L)})
    first, _ = compute_status(inp, None, T0)
    inp2 = StatusInput(generation=2, replicas=1, assignments={SA: asg()},
                       reports={SA: rep("a", R)})
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
        return StatusInput(generation=2, replicas=1,
                           assignments={(n, "v1"): asg() for n in states},
                           reports={(n, "v1"): rep(n, s, reason="LoadFailed" if s == F else "",
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


def _plan_inputs(stored_gen: int, nodes: tuple[str, ...], all_nodes: tuple[str, ...]):
    from mlx_fleet.contract import Keys
    from mlx_fleet.store import KV
    from mlx_fleet_operator import reconcile as rc

    keys = Keys("/t")
    stored = {n: rc.StoredAssignment(keys.assignment(n, "ns", "llm", "v1"),
                                     KV(keys.assignment(n, "ns", "llm", "v1"),
                                        asg(stored_gen).to_json(), 10), asg(stored_gen))
              for n in nodes}
    records = {n: rec(n).model_copy(update={"capacity": rec(n).capacity.model_copy(
        update={"memory_total_bytes": 1 << 30})}) for n in all_nodes}
    view = rc.FleetView(nodes=records, assignments={n: [s_] for n, s_ in stored.items()},
                        epoch=None, revision=10)
    return keys, view


def _intent(replicas: int, assignment: Assignment):
    from mlx_fleet_operator import reconcile as rc
    from mlx_fleet_operator.placement import PlacementRequest
    from mlx_fleet_operator.rollout import RevisionTarget

    request = PlacementRequest(namespace="ns", name="llm", replicas=replicas, memory_bytes=1,
                               revision=assignment.revision)
    return rc.Intent(stable=RevisionTarget(request, assignment))


def test_scale_up_keeps_ready_replicas_ready():
    """2 → 3 replicas (a new metadata.generation) must not flap the two Ready replicas: the plan
    keeps their stored assignments (generation 1) untouched, so their reports still match."""
    from mlx_fleet_operator import reconcile as rc

    keys, view = _plan_inputs(1, ("a", "b"), ("a", "b", "c"))
    p = rc.plan(keys, view, "ns", "llm", _intent(3, asg(2)))
    assert {slot: a.generation for slot, a in p.desired.items()} == {
        SA: 1, SB: 1, SC: 2}
    assert [op.key for op in p.ops] == [keys.assignment("c", "ns", "llm", "v1")]  # only the new one

    reports = {SA: rep("a", R, gen=1), SB: rep("b", R, gen=1)}
    before, _ = compute_status(StatusInput(generation=1, replicas=2, assignments={
        SA: asg(1), SB: asg(1)}, reports=reports), None, T0)
    after, events = compute_status(StatusInput(
        generation=2, replicas=3, assignments=p.desired, reports=reports), before, T1)
    assert after["observedGeneration"] == 2 and after["readyReplicas"] == 2
    assert after["updatedReplicas"] == 2
    assert after["endpoints"] == ["http://a:8000", "http://b:8000"]
    assert {n["name"]: n["state"] for n in after["nodes"]} == {"a": "Ready", "b": "Ready",
                                                               "c": "Pending"}
    assert [e.reason for e in events] == ["Placed"]


def test_changed_model_rewrites_every_assignment():
    """What the node serves changed (same revision, new source): every replica gets the new
    record in place. A new *revision* is a new assignment next to the old one instead."""
    from mlx_fleet_operator import reconcile as rc
    from mlx_fleet_operator.rollout import same_for_node

    keys, view = _plan_inputs(1, ("a",), ("a",))
    key = keys.assignment("a", "ns", "llm", "v1")
    new = asg(2).model_copy(update={"source": ModelSource(uri="/m2", revision="v1")})
    p = rc.plan(keys, view, "ns", "llm", _intent(1, new))
    assert p.desired == {SA: new} and [op.key for op in p.ops] == [key]
    assert not same_for_node(asg(1), new) and same_for_node(asg(1), asg(7))
    assert not same_for_node(asg(1), asg(1, role=Role.PREVIOUS))

    v2 = asg(2, revision="v2")
    p2 = rc.plan(keys, view, "ns", "llm", _intent(1, v2))
    assert p2.desired == {("a", "v2"): v2, SA: asg(1, role=Role.PREVIOUS)}
    assert sorted(op.key for op in p2.ops) == [key, keys.assignment("a", "ns", "llm", "v2")]
    assert p2.rollout.reason == "RollingUpdate"


# --- revisions: rolling updates and candidates -------------------------------------------------

S, P, C = Role.STABLE, Role.PREVIOUS, Role.CANDIDATE


def roll(replicas: int, slots: dict[tuple[str, str, Role], AssignmentState | None],
         rollout: str = "Complete", message: str = "", **kw) -> StatusInput:
    """A StatusInput at spec revision v2 from (node, revision, role) → reported state."""
    return StatusInput(
        generation=2, replicas=replicas, revision="v2", rollout_reason=rollout,
        rollout_message=message,
        assignments={(n, r): asg(revision=r, role=role) for n, r, role in slots},
        reports={(n, r): rep(n, st, revision=r, reason="LoadFailed" if st == F else "",
                             message="boom" if st == F else "")
                 for (n, r, _), st in slots.items() if st is not None}, **kw)


ROLL_CASES = [
    # id, input, (replicas, ready, updated), conditions, endpoints
    ("surge in place: old keeps serving",
     roll(1, {("a", "v2", S): L, ("a", "v1", P): R}, "RollingUpdate", "0/1 replicas Ready"),
     (1, 1, 0),
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("True", "ReplicasStarting"),
      "Degraded": ("False", "AsExpected")}, ["http://a:8000"]),
    ("rolling, nothing loading",
     roll(2, {("a", "v2", S): R, ("b", "v1", P): R}, "RollingUpdate", "1/2 replicas Ready"),
     (2, 2, 1),
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("True", "RollingUpdate"),
      "Degraded": ("False", "AsExpected")}, ["http://a:8000", "http://b:8000"]),
    ("a node serves once, whichever revision",
     roll(2, {("a", "v2", S): R, ("a", "v1", P): R}, "RollingUpdate"), (1, 1, 1),
     {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("True", "RollingUpdate")},
     ["http://a:8000"]),
    ("stalled: new failed, old serves",
     roll(1, {("a", "v2", S): F, ("a", "v1", P): R}, "Stalled", "v2 failed on a"), (1, 1, 0),
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "RolloutStalled"),
      "Degraded": ("True", "ReplicaFailed")}, ["http://a:8000"]),
    ("stalled beats starting",
     roll(2, {("a", "v2", S): F, ("a", "v1", P): R, ("b", "v2", S): L, ("b", "v1", P): R},
          "Stalled", "v2 failed on a"), (2, 2, 0),
     {"Progressing": ("False", "RolloutStalled"), "Degraded": ("True", "ReplicaFailed")},
     ["http://a:8000", "http://b:8000"]),
    ("blocked: no room, nothing may go",
     roll(2, {("a", "v1", P): R, ("b", "v1", P): R}, "Blocked", "maxUnavailable=0",
          unplaced=2, placement_message="0/2 nodes fit: 2 insufficient memory"), (2, 2, 0),
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "RolloutBlocked"),
      "Degraded": ("False", "AsExpected")}, ["http://a:8000", "http://b:8000"]),
    ("candidate listed, never counted",
     roll(1, {("a", "v2", S): R, ("b", "v3", C): F, ("a", "v3", C): L}), (1, 1, 1),
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "Complete"),
      "Degraded": ("False", "AsExpected")}, ["http://a:8000"]),
    ("only a candidate is Ready",
     roll(1, {("a", "v2", S): L, ("b", "v3", C): R}), (1, 0, 0),
     {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("True", "ReplicasStarting")}, []),
]


@pytest.mark.parametrize("inp, counts, want_conds, endpoints", [c[1:] for c in ROLL_CASES],
                         ids=[c[0] for c in ROLL_CASES])
def test_status_during_rollout(inp, counts, want_conds, endpoints):
    status, _ = compute_status(inp, None, T0)
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == counts
    got = conds(status)
    for k, v in want_conds.items():
        assert got[k] == v, k
    assert status["endpoints"] == endpoints
    assert {(n["name"], n["revision"], n["role"]) for n in status["nodes"]} == {
        (n, r, role.value) for n, r, role in (
            (slot[0], slot[1], a.role) for slot, a in inp.assignments.items())}
    if inp.rollout_reason in ("Stalled", "Blocked", "RollingUpdate") and (
            got["Progressing"][1] != "ReplicasStarting"):
        assert {c["type"]: c for c in status["conditions"]}["Progressing"]["message"] == (
            inp.rollout_message)


def test_node_entries_carry_revision_role_and_their_own_report():
    status, _ = compute_status(roll(1, {("a", "v2", S): L, ("a", "v1", P): R}, "RollingUpdate"),
                               None, T0)
    assert [(n["name"], n["revision"], n["role"], n["state"]) for n in status["nodes"]] == [
        ("a", "v1", "Previous", "Ready"), ("a", "v2", "Stable", "Loading")]


def _events(before: StatusInput | None, after: StatusInput):
    prev = compute_status(before, None, T0)[0] if before else None
    return [(e.type, e.reason) for e in compute_status(after, prev, T1)[1]]


def test_new_revision_next_to_old_one_is_placed_per_revision():
    """A Placed event for the new revision on a node that already hosts the old one."""
    assert _events(roll(1, {("a", "v1", S): R}), roll(1, {("a", "v2", S): None,
                                                          ("a", "v1", P): R}, "RollingUpdate")) == [
        ("Normal", "Placed")]


def test_rollout_warnings_once_per_transition():
    stalled = roll(1, {("a", "v2", S): F, ("a", "v1", P): R}, "Stalled", "v2 failed on a")
    assert _events(roll(1, {("a", "v2", S): L, ("a", "v1", P): R}, "RollingUpdate"), stalled) == [
        ("Warning", "ReplicaFailed"), ("Warning", "RolloutStalled")]
    assert _events(stalled, stalled) == []
    blocked = roll(2, {("a", "v1", P): R, ("b", "v1", P): R}, "Blocked", "no room", unplaced=2,
                   placement_message="0/2 nodes fit")
    assert _events(roll(2, {("a", "v1", S): R, ("b", "v1", S): R}), blocked) == [
        ("Warning", "RolloutBlocked")]
    assert _events(blocked, blocked) == []
    # Blocked while a rollout is under way does not claim FailedPlacement.
    assert ("Warning", "FailedPlacement") not in _events(None, blocked)


ROLLOUT_FLOWS = [
    # id, successive inputs; RolloutComplete must be posted exactly at the last one
    ("surge in place, one node", [
        roll(1, {("a", "v1", S): R}),
        roll(1, {("a", "v2", S): L, ("a", "v1", P): R}, "RollingUpdate"),
        roll(1, {("a", "v2", S): R})]),
    ("surge in place, two nodes", [
        roll(2, {("a", "v1", S): R, ("b", "v1", S): R}),
        roll(2, {("a", "v2", S): L, ("a", "v1", P): R, ("b", "v2", S): L, ("b", "v1", P): R},
             "RollingUpdate"),
        roll(2, {("a", "v2", S): R, ("b", "v2", S): L, ("b", "v1", P): R}, "RollingUpdate"),
        roll(2, {("a", "v2", S): R, ("b", "v2", S): R})]),
    ("surge onto a spare node", [
        roll(1, {("a", "v1", S): R}),
        roll(1, {("b", "v2", S): L, ("a", "v1", P): R}, "RollingUpdate"),
        roll(1, {("b", "v2", S): R, ("a", "v1", P): R}, "RollingUpdate"),
        roll(1, {("b", "v2", S): R})]),
    ("stalled, then fixed", [
        roll(1, {("a", "v2", S): F, ("a", "v1", P): R}, "Stalled"),
        roll(1, {("a", "v2", S): R})]),
]


@pytest.mark.parametrize("steps", [c[1] for c in ROLLOUT_FLOWS], ids=[c[0] for c in ROLLOUT_FLOWS])
def test_rollout_complete_posted_once_when_the_last_previous_goes(steps):
    status = None
    posted = []
    for i, inp in enumerate(steps):
        status, events = compute_status(inp, status, T0 + dt.timedelta(minutes=i))
        posted.append([e for e in events if e.reason == "RolloutComplete"])
    assert [len(p) for p in posted] == [0] * (len(steps) - 1) + [1]
    assert posted[-1][0].type == "Normal" and "Revision v2" in posted[-1][0].message
    assert conds(status)["Progressing"] == ("False", "Complete")
    assert status["updatedReplicas"] == steps[-1].replicas
    # and not again on the next, unchanged round
    assert [e for e in compute_status(steps[-1], status, T1)[1]
            if e.reason == "RolloutComplete"] == []


def test_no_rollout_complete_for_a_fresh_deployment_or_a_scale_up():
    fresh = [roll(2, {("a", "v2", S): None, ("b", "v2", S): None}),
             roll(2, {("a", "v2", S): L, ("b", "v2", S): R}),
             roll(2, {("a", "v2", S): R, ("b", "v2", S): R}),
             roll(3, {("a", "v2", S): R, ("b", "v2", S): R, ("c", "v2", S): L}),
             roll(3, {("a", "v2", S): R, ("b", "v2", S): R, ("c", "v2", S): R})]
    status = None
    for inp in fresh:
        status, events = compute_status(inp, status, T1)
        assert "RolloutComplete" not in [e.reason for e in events]


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
    status, _ = compute_status(StatusInput(generation=1, replicas=3, assignments={SA: asg()},
                                           unplaced=2, placement_message="1/1 nodes fit"), None, T0)
    assert status["replicas"] == 1 and status["readyReplicas"] == 0
    assert "0/3 replicas ready" in {c["type"]: c for c in status["conditions"]}["Ready"]["message"]


# ---------------------------------------------------------------------------------------------
# idle-unloaded replicas (standby)
# ---------------------------------------------------------------------------------------------

U = AssignmentState.UNLOADED


def idle(node: str, gen: int = 2, revision: str = "v1") -> AssignmentReport:
    return rep(node, U, gen=gen, revision=revision, reason="IdleUnloaded", freed_bytes=4096,
               message="no request for 300s (idleUnloadSeconds 300): unloaded")


def reloading(node: str) -> AssignmentReport:
    return rep(node, L, reason="ReloadingOnDemand", message="reloading on demand")


STANDBY_CASES = [
    # id, assignments, reports, replicas, ready, updated, endpoints, conditions, states
    ("idle-unloaded counts as ready", {SA: asg(), SB: asg()},
     {SA: rep("a", R), SB: idle("b")}, 2, 2, 2, ["http://a:8000", "http://b:8000"],
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "Complete"),
      "Degraded": ("False", "AsExpected")}, {SA: "Ready", SB: "Unloaded"}),
    ("every replica idle-unloaded", {SA: asg()}, {SA: idle("a")}, 1, 1, 1, ["http://a:8000"],
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "Complete"),
      "Degraded": ("False", "AsExpected")}, {SA: "Unloaded"}),
    ("reloading on demand is not starting", {SA: asg()}, {SA: reloading("a")}, 1, 1, 1,
     ["http://a:8000"],
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "Complete")},
     {SA: "Loading"}),
    ("an ordinary load is starting", {SA: asg()}, {SA: rep("a", L, reason="LoadingModel")},
     1, 0, 0, [], {"Ready": ("False", "ReplicasNotReady"),
                   "Progressing": ("True", "ReplicasStarting")}, {SA: "Loading"}),
    ("Unloaded for another reason is not serving", {SA: asg()},
     {SA: rep("a", U, reason="Stopped")}, 1, 0, 0, [],
     {"Ready": ("False", "ReplicasNotReady")}, {SA: "Unloaded"}),
    ("evicted under memory pressure counts as ready", {SA: asg()},
     {SA: rep("a", U, reason="Evicted", freed_bytes=4096)}, 1, 1, 1, ["http://a:8000"],
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "Complete")},
     {SA: "Unloaded"}),
    ("OnDemand awaiting its first request counts as ready", {SA: asg()},
     {SA: rep("a", U, reason="AwaitingRequest")}, 1, 1, 1, ["http://a:8000"],
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "Complete")},
     {SA: "Unloaded"}),
    ("predictive prefetch is not starting", {SA: asg()},
     {SA: rep("a", L, reason="PredictivePrefetch")}, 1, 1, 1, ["http://a:8000"],
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "Complete")},
     {SA: "Loading"}),
    ("stale standby report does not count", {SA: asg(3)}, {SA: idle("a", gen=2)}, 1, 0, 0, [],
     {"Ready": ("False", "ReplicasNotReady")}, {SA: "Pending"}),
    ("standby previous revision serves during a rollout",
     {SA: asg(role=Role.PREVIOUS), ("a", "v2"): asg(revision="v2")},
     {SA: idle("a"), ("a", "v2"): rep("a", L, revision="v2", reason="LoadingModel")},
     1, 1, 0, ["http://a:8000"],
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("True", "ReplicasStarting")},
     {SA: "Unloaded", ("a", "v2"): "Loading"}),
    ("a standby candidate changes nothing", {SA: asg(), ("a", "v2"): asg(revision="v2",
                                                                       role=Role.CANDIDATE)},
     {SA: rep("a", R), ("a", "v2"): idle("a", revision="v2")}, 1, 1, 1, ["http://a:8000"],
     {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "Complete")},
     {SA: "Ready", ("a", "v2"): "Unloaded"}),
]


@pytest.mark.parametrize("assignments, reports, replicas, ready, updated, endpoints, "
                         "want_conds, states", [c[1:] for c in STANDBY_CASES],
                         ids=[c[0] for c in STANDBY_CASES])
def test_standby_replicas(assignments, reports, replicas, ready, updated, endpoints, want_conds,
                          states):
    gen = max(a.generation for a in assignments.values())
    status, _ = compute_status(StatusInput(generation=gen, replicas=replicas,
                                           assignments=assignments, reports=reports), None, T0)
    assert (status["readyReplicas"], status["updatedReplicas"]) == (ready, updated)
    assert status["endpoints"] == endpoints
    got = conds(status)
    for k, v in want_conds.items():
        assert got[k] == v, k
    # listed with its real state
    assert {(n["name"], n["revision"]): n["state"] for n in status["nodes"]} == states


def test_standby_is_listed_with_its_reason_and_named_in_the_ready_message():
    status, _ = compute_status(StatusInput(generation=2, replicas=2,
                                           assignments={SA: asg(), SB: asg()},
                                           reports={SA: rep("a", R), SB: idle("b")}), None, T0)
    b = next(n for n in status["nodes"] if n["name"] == "b")
    assert (b["state"], b["reason"]) == ("Unloaded", "IdleUnloaded")
    assert "idleUnloadSeconds 300" in b["message"] and b["endpoint"] == "http://b:8000"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["message"] == "2/2 replicas ready (1 in standby: not resident, loaded on demand)"


def test_idle_unload_and_reload_cycle_keeps_ready_and_posts_its_own_events():
    def inp(report):
        return StatusInput(generation=2, replicas=1, assignments={SA: asg()},
                           reports={SA: report})

    s0, _ = compute_status(inp(rep("a", R)), None, T0)
    steps = [(idle("a"), [("Normal", "ReplicaIdleUnloaded")]),
             (reloading("a"), []),
             (rep("a", R), [("Normal", "ReplicaReloaded")]),
             (idle("a"), [("Normal", "ReplicaIdleUnloaded")]),
             (rep("a", R), [("Normal", "ReplicaReloaded")])]  # a reload whose Loading was missed
    prev, t = s0, T0
    for report, want in steps:
        t += dt.timedelta(minutes=5)
        status, events = compute_status(inp(report), prev, t)
        assert [(e.type, e.reason) for e in events] == want, report.state
        # Ready, Progressing and Degraded never move: no transition time changes
        assert [(c["type"], c["status"], c["lastTransitionTime"])
                for c in status["conditions"]] == [
            (c["type"], c["status"], c["lastTransitionTime"]) for c in s0["conditions"]]
        prev = status
    _, events = compute_status(inp(idle("a")), None, T0)
    assert [e.reason for e in events] == ["Placed", "ReplicaIdleUnloaded"]
    # each way into standby has its own event
    for reason, event in (("Evicted", "ReplicaEvicted"),
                          ("AwaitingRequest", "ReplicaAwaitingRequest")):
        _, events = compute_status(inp(idle("a").model_copy(update={"reason": reason})),
                                   s0, T1)
        assert [e.reason for e in events] == [event]
    # a standby replica that fails to reload is a failure like any other
    _, events = compute_status(inp(rep("a", F, reason="ModelNotFound", message="gone")),
                               compute_status(inp(idle("a")), None, T0)[0], T1)
    assert [(e.type, e.reason) for e in events] == [("Warning", "ReplicaFailed")]


# ---------------------------------------------------------------------------------------------
# Scheduled condition and drained (withdrawn) replicas
# ---------------------------------------------------------------------------------------------

UNFIT = ("0/2 nodes fit: 1 cordoned, 1 insufficient memory (needs 8.0GiB: b 3.2GiB free of "
         "6.4GiB)")


@pytest.mark.parametrize("inp, want", [
    (StatusInput(generation=2, replicas=2, assignments={SA: asg(), SB: asg()}),
     ("True", "Scheduled", "2/2 replicas placed")),
    (StatusInput(generation=2, replicas=0), ("True", "Scheduled", "0/0 replicas placed")),
    (StatusInput(generation=2, replicas=2, assignments={SA: asg()}, unplaced=1,
                 placement_message=UNFIT), ("False", "Unschedulable", UNFIT)),
    (StatusInput(generation=2, replicas=1, spec_error="spec.replicas: bad"),
     ("False", "InvalidSpec", "spec.replicas: bad")),
], ids=["placed", "scaled to zero", "unschedulable", "invalid spec"])
def test_scheduled_condition(inp, want):
    status, _ = compute_status(inp, None, T0)
    [c] = [c for c in status["conditions"] if c["type"] == "Scheduled"]
    assert (c["status"], c["reason"], c["message"]) == want


def test_unschedulable_is_cleared_once_placed():
    unfit = StatusInput(generation=2, replicas=1, unplaced=1, placement_message=UNFIT)
    status, events = compute_status(unfit, None, T0)
    assert conds(status)["Scheduled"] == ("False", "Unschedulable")
    assert [e.reason for e in events if e.type == "Warning"] == ["FailedPlacement"]
    placed_ = StatusInput(generation=2, replicas=1, assignments={SA: asg()})
    status, _ = compute_status(placed_, status, T1)
    [c] = [c for c in status["conditions"] if c["type"] == "Scheduled"]
    assert (c["status"], c["reason"]) == ("True", "Scheduled")
    assert c["lastTransitionTime"] == "2025-01-01T00:05:00Z"


def test_withdrawn_replica_leaves_the_endpoints_and_the_counts():
    inp = StatusInput(generation=2, replicas=1, assignments={SA: asg(), SB: asg()},
                      reports={SA: rep("a", R), SB: rep("b", R)}, withdrawn=frozenset({SA}))
    status, _ = compute_status(inp, None, T0)
    assert status["endpoints"] == ["http://b:8000"]
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (1, 1, 1)
    entry = {n["name"]: n for n in status["nodes"]}["a"]
    assert (entry["state"], entry["reason"]) == ("Ready", "Withdrawn")
    assert conds(status)["Ready"] == ("True", "ReplicasReady")
    assert conds(status)["Progressing"] == ("False", "Complete")


def test_prefetching_replicas_show_their_download():
    p = DownloadProgress(bytes_done=12 * 2**20, bytes_total=48 * 2**20,
                         rate_bytes_per_second=3 * 2**20, eta_seconds=12.4, files_done=1,
                         files_total=3)
    status, _ = compute_status(StatusInput(
        generation=2, replicas=2, assignments={SA: asg(), SB: asg()},
        reports={SA: rep("a", AssignmentState.PREFETCHING, progress=p),
                 SB: rep("b", AssignmentState.READY)}), None, T0)
    a, b = (next(n for n in status["nodes"] if n["name"] == x) for x in "ab")
    assert a["download"] == {"bytesDone": 12 * 2**20, "bytesTotal": 48 * 2**20,
                             "bytesPerSecond": 3 * 2**20, "etaSeconds": 12,
                             "text": "12.0MiB / 48.0MiB · 3.0MiB/s · ETA 0:00:12 · 1/3 files"}
    assert "download" not in b
    assert status["downloads"] == "a: 12.0MiB / 48.0MiB · 3.0MiB/s · ETA 0:00:12 · 1/3 files"
    # once loaded, the download is gone from the status
    done, _ = compute_status(StatusInput(
        generation=2, replicas=2, assignments={SA: asg(), SB: asg()},
        reports={SA: rep("a", AssignmentState.READY), SB: rep("b", AssignmentState.READY)}),
        status, T0)
    assert done["downloads"] == "" and all("download" not in n for n in done["nodes"])
