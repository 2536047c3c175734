"""rollout.plan_deployment: table-driven over plain data (node records, assignments), plus a few
multi-round simulations that check the rolling-update invariants round by round."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, Keys, ModelSource,
                                NodeCapacity, NodeHealth, NodeRecord, Role)
from mlx_fleet.store import KV
from mlx_fleet_operator import reconcile as rc
from mlx_fleet_operator.placement import PlacementRequest, node_budget_bytes, place
from mlx_fleet_operator.rollout import RevisionTarget, plan_deployment, same_for_node

GiB = 1024**3
S, P, C = Role.STABLE, Role.PREVIOUS, Role.CANDIDATE


def node(name: str, mem_gib: float = 10, health: NodeHealth = NodeHealth.HEALTHY) -> NodeRecord:
    """10 GiB → an 8 GiB budget: two 4 GiB revisions fit side by side, two 5 GiB ones don't."""
    return NodeRecord(name=name, address=f"http://{name}:8000", health=health,
                      capacity=NodeCapacity(memory_total_bytes=int(mem_gib * GiB),
                                            memory_available_bytes=int(mem_gib * GiB),
                                            chip="Apple M3 Max", chip_generation=3))


def asg(rev: str, role: Role = S, gen: int = 1, mem: float = 4, name: str = "llm",
        uri: str = "/m") -> Assignment:
    return Assignment(namespace="ns", name=name, generation=gen, served_model_name=name,
                      source=ModelSource(uri=f"{uri}/{rev}", revision=rev),
                      memory_bytes=int(mem * GiB), role=role)


def target(rev: str, replicas: int = 1, mem: float = 4, role: Role = S,
           gen: int = 2) -> RevisionTarget:
    return RevisionTarget(
        PlacementRequest(namespace="ns", name="llm", replicas=replicas,
                         memory_bytes=int(mem * GiB), revision=rev),
        asg(rev, role, gen=gen, mem=mem))


def placed(*slots: tuple[str, Assignment]) -> dict[str, list[Assignment]]:
    out: dict[str, list[Assignment]] = {}
    for n, a in slots:
        out.setdefault(n, []).append(a)
    return out


def triples(plan) -> set[tuple[str, str, Role]]:
    return {(n, r, a.role) for (n, r), a in plan.desired.items()}


def run(stable: RevisionTarget, stored: dict[str, list[Assignment]], nodes: list[NodeRecord], *,
        candidate: RevisionTarget | None = None, surge: int = 1, unavailable: int = 1,
        ready=(), failed=(), held=frozenset()):
    return plan_deployment(stable, candidate, max_surge=surge, max_unavailable=unavailable,
                           nodes=nodes, assignments=stored, ready=set(ready), failed=set(failed),
                           held=frozenset(held))


THREE = [node("a"), node("b"), node("c")]
V1_ON_AB = placed(("a", asg("v1")), ("b", asg("v1")))
V1_ON_AB_5G = placed(("a", asg("v1", mem=5)), ("b", asg("v1", mem=5)))
BOTH = placed(("a", asg("v2")), ("b", asg("v2")), ("a", asg("v1", P)), ("b", asg("v1", P)))

CASES = [
    # id, stable, stored, nodes, options, desired (node, revision, role), rollout reason
    ("fresh deployment", target("v1", 2), {}, THREE, {},
     {("a", "v1", S), ("b", "v1", S)}, "Complete"),
    ("steady state", target("v1", 2), V1_ON_AB, THREE, {"ready": {("a", "v1"), ("b", "v1")}},
     {("a", "v1", S), ("b", "v1", S)}, "Complete"),
    ("edit, both fit: new next to old, the spare node untouched", target("v2", 2), V1_ON_AB,
     THREE, {"ready": {("a", "v1"), ("b", "v1")}},
     {("a", "v2", S), ("b", "v2", S), ("a", "v1", P), ("b", "v1", P)}, "RollingUpdate"),
    ("new loading: old kept everywhere", target("v2", 2), BOTH, THREE,
     {"ready": {("a", "v1"), ("b", "v1")}},
     {("a", "v2", S), ("b", "v2", S), ("a", "v1", P), ("b", "v1", P)}, "RollingUpdate"),
    ("new Ready on one node: previous removed there only", target("v2", 2), BOTH, THREE,
     {"ready": {("a", "v2"), ("a", "v1"), ("b", "v1")}},
     {("a", "v2", S), ("b", "v2", S), ("b", "v1", P)}, "RollingUpdate"),
    ("new Ready on replicas nodes: every previous removed", target("v2", 2), BOTH, THREE,
     {"ready": {("a", "v2"), ("b", "v2"), ("a", "v1"), ("b", "v1")}},
     {("a", "v2", S), ("b", "v2", S)}, "Complete"),
    ("new Ready elsewhere on replicas nodes: the surplus previous goes", target("v2", 1),
     placed(("b", asg("v2", mem=5)), ("a", asg("v1", P, mem=5))), [node("a"), node("b")],
     {"ready": {("b", "v2"), ("a", "v1")}}, {("b", "v2", S)}, "Complete"),
    ("no room, no spare: one previous goes (maxUnavailable 1)", target("v2", 2, mem=5),
     V1_ON_AB_5G, [node("a"), node("b")], {"ready": {("a", "v1"), ("b", "v1")}},
     {("b", "v1", P)}, "RollingUpdate"),
    ("no room, maxUnavailable 2: both may go", target("v2", 2, mem=5), V1_ON_AB_5G,
     [node("a"), node("b")], {"ready": {("a", "v1"), ("b", "v1")}, "unavailable": 2},
     set(), "RollingUpdate"),
    ("no room, maxUnavailable 0: blocked, nothing removed", target("v2", 2, mem=5), V1_ON_AB_5G,
     [node("a"), node("b")], {"ready": {("a", "v1"), ("b", "v1")}, "unavailable": 0},
     {("a", "v1", P), ("b", "v1", P)}, "Blocked"),
    ("no room but a load under way: nothing removed", target("v2", 2, mem=5),
     placed(("a", asg("v2", mem=5)), ("b", asg("v1", P, mem=5))), [node("a"), node("b")],
     {"ready": {("b", "v1")}}, {("a", "v2", S), ("b", "v1", P)}, "RollingUpdate"),
    ("no room, the last previous goes once the new one serves", target("v2", 2, mem=5),
     placed(("a", asg("v2", mem=5)), ("b", asg("v1", P, mem=5))), [node("a"), node("b")],
     {"ready": {("a", "v2"), ("b", "v1")}}, {("a", "v2", S)}, "RollingUpdate"),
    ("no room, 1 replica, maxUnavailable 1: the only previous goes", target("v2", 1, mem=5),
     placed(("a", asg("v1", mem=5))), [node("a")], {"ready": {("a", "v1")}}, set(),
     "RollingUpdate"),
    ("spare node: surge onto it, bounded by maxSurge 1", target("v2", 2, mem=5), V1_ON_AB_5G,
     [node("a"), node("b"), node("c"), node("d")], {"ready": {("a", "v1"), ("b", "v1")}},
     {("c", "v2", S), ("a", "v1", P), ("b", "v1", P)}, "RollingUpdate"),
    ("spare nodes: maxSurge 2", target("v2", 2, mem=5), V1_ON_AB_5G,
     [node("a"), node("b"), node("c"), node("d"), node("e")],
     {"ready": {("a", "v1"), ("b", "v1")}, "surge": 2},
     {("c", "v2", S), ("d", "v2", S), ("a", "v1", P), ("b", "v1", P)}, "RollingUpdate"),
    ("new Ready on the spare node: a previous goes, nothing extra surges", target("v2", 2, mem=5),
     placed(("c", asg("v2", mem=5)), ("a", asg("v1", P, mem=5)), ("b", asg("v1", P, mem=5))),
     [node("a"), node("b"), node("c"), node("d")],
     {"ready": {("c", "v2"), ("a", "v1"), ("b", "v1")}},
     {("c", "v2", S), ("b", "v1", P)}, "RollingUpdate"),
    ("new failed everywhere it landed: stalled, previous kept on every node", target("v2", 2),
     BOTH, THREE, {"ready": {("a", "v1"), ("b", "v1")}, "failed": {("a", "v2"), ("b", "v2")}},
     {("a", "v2", S), ("b", "v2", S), ("a", "v1", P), ("b", "v1", P)}, "Stalled"),
    ("new failed on one node: stalled, the node it serves on switched", target("v2", 2), BOTH,
     THREE, {"ready": {("a", "v2"), ("a", "v1"), ("b", "v1")}, "failed": {("b", "v2")}},
     {("a", "v2", S), ("b", "v2", S), ("b", "v1", P)}, "Stalled"),
    ("stalled: nothing removed to make room", target("v2", 2, mem=5),
     placed(("a", asg("v2", mem=5)), ("b", asg("v1", P, mem=5))), [node("a"), node("b")],
     {"ready": {("b", "v1")}, "failed": {("a", "v2")}}, {("a", "v2", S), ("b", "v1", P)},
     "Stalled"),
    ("previous on a vanished node is dropped", target("v2", 2),
     placed(("a", asg("v2")), ("a", asg("v1", P)), ("b", asg("v2")), ("b", asg("v1", P))),
     [node("a"), node("c")], {"ready": {("a", "v1"), ("b", "v1")}},
     {("a", "v2", S), ("c", "v2", S), ("a", "v1", P)}, "RollingUpdate"),
    ("previous on an unhealthy node is dropped", target("v2", 1),
     placed(("a", asg("v1", P)), ("b", asg("v2"))),
     [node("a", health=NodeHealth.DRAINING), node("b")], {"ready": {("a", "v1")}},
     {("b", "v2", S)}, "Complete"),
    ("rollback to a previous revision still loading: it turns Stable, the other Previous",
     target("v1", 1), placed(("a", asg("v2")), ("a", asg("v1", P))), [node("a")],
     {"ready": {("a", "v2")}}, {("a", "v1", S), ("a", "v2", P)}, "RollingUpdate"),
    # nodes that vanished together (a control-plane disruption, disruption.py): held
    ("every node vanished, held: the replicas stay where they are", target("v1", 2), V1_ON_AB,
     [], {"held": {"a", "b"}}, {("a", "v1", S), ("b", "v1", S)}, "Complete"),
    ("the same, not held (node loss): dropped, nothing to place them on", target("v1", 2),
     V1_ON_AB, [], {}, set(), "Complete"),
    ("one node back, one held: neither moves to the spare node", target("v1", 2), V1_ON_AB,
     THREE[::2], {"held": {"b"}, "ready": {("a", "v1")}}, {("a", "v1", S), ("b", "v1", S)},
     "Complete"),
    ("mid rolling update, the node of the previous revision held: it keeps serving",
     target("v2", 1), placed(("a", asg("v2")), ("b", asg("v1", P))), [node("a")],
     {"held": {"b"}}, {("a", "v2", S), ("b", "v1", P)}, "RollingUpdate"),
    ("mid rolling update, new revision Ready elsewhere, the previous one's node held: kept, "
     "no room is made on a node that is away", target("v2", 2),
     placed(("a", asg("v2")), ("b", asg("v1", P))), [node("a")],
     {"held": {"b"}, "ready": {("a", "v2")}}, {("a", "v2", S), ("b", "v1", P)}, "RollingUpdate"),
    ("rollback to a previous revision that is Ready: the other goes at once",
     target("v1", 1), placed(("a", asg("v2")), ("a", asg("v1", P))), [node("a")],
     {"ready": {("a", "v1"), ("a", "v2")}}, {("a", "v1", S)}, "Complete"),
]


@pytest.mark.parametrize("stable, stored, nodes, opts, want, reason", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_plan_deployment(stable, stored, nodes, opts, want, reason):
    p = run(stable, stored, nodes, **opts)
    assert triples(p) == want
    assert p.rollout.reason == reason
    assert set(p.rollout.previous) == {(n, r) for n, r, role in want if role == P}
    assert p.stable.nodes == tuple(sorted(n for n, r, role in want if r == stable.request.revision))
    assert p.stable.unplaced == stable.request.replicas - len(p.stable.nodes)
    assert p.candidate is None
    # every Stable record is the target's (or a stored one equal but for the generation)
    for (n, r), a in p.desired.items():
        if a.role == S:
            assert same_for_node(a, stable.assignment)


def test_no_room_one_node_at_a_time_never_two_at_once():
    """Both revisions never fit on one Mac, no spare Mac, maxUnavailable 1: round by round, one
    previous replica goes, the new revision lands there, becomes Ready, then the next goes.
    At no point are two nodes down at once."""
    nodes = [node("a"), node("b"), node("c")]
    stored = {n: [asg("v1", mem=5)] for n in ("a", "b", "c")}
    history = simulate(target("v2", 3, mem=5), stored, nodes, surge=1, unavailable=1, rounds=12)
    assert [sorted(h) for h in history[:7]] == [
        [("b", "v1", P), ("c", "v1", P)],                      # a's v1 goes to make room
        [("a", "v2", S), ("b", "v1", P), ("c", "v1", P)],      # v2 lands on a
        [("a", "v2", S), ("c", "v1", P)],                      # Ready on a: b's v1 goes
        [("a", "v2", S), ("b", "v2", S), ("c", "v1", P)],
        [("a", "v2", S), ("b", "v2", S)],
        [("a", "v2", S), ("b", "v2", S), ("c", "v2", S)],
        [("a", "v2", S), ("b", "v2", S), ("c", "v2", S)],      # converged
    ]


def test_no_room_blocked_message_has_the_numbers():
    p = run(target("v2", 2, mem=5), V1_ON_AB_5G, [node("a"), node("b")], unavailable=0,
            ready={("a", "v1"), ("b", "v1")})
    assert p.rollout.reason == "Blocked"
    msg = p.rollout.message
    assert "0/2 replicas Ready at revision v2" in msg and "maxUnavailable=0" in msg
    assert "2 insufficient memory (needs 5.0GiB: a 3.0GiB free of 8.0GiB, b 3.0GiB free of 8.0GiB)" in msg
    assert "v1 on a, v1 on b" in msg
    assert p.stable.unplaced == 2


def test_rolling_and_stalled_messages():
    p = run(target("v2", 2), BOTH, THREE, ready={("a", "v2"), ("a", "v1"), ("b", "v1")})
    assert p.rollout.message == "1/2 replicas Ready at revision v2; still serving v1 on b"
    s = run(target("v2", 2), BOTH, THREE, ready={("a", "v1"), ("b", "v1")},
            failed={("b", "v2")})
    assert "revision v2 failed on b" in s.rollout.message
    assert "still serving v1 on a, v1 on b" in s.rollout.message


def test_making_room_is_a_rolling_update_not_a_failure():
    """Removing a previous replica to make room is the rollout moving: the status says
    RollingUpdate, not Blocked nor FailedPlacement, although the new revision is unplaced."""
    from mlx_fleet_operator.status import StatusInput, compute_status

    p = run(target("v2", 2, mem=5), V1_ON_AB_5G, [node("a"), node("b")],
            ready={("a", "v1"), ("b", "v1")})
    assert p.rollout.reason == "RollingUpdate"
    assert p.rollout.message == ("0/2 replicas Ready at revision v2; removed v1 on a to make room "
                                 "for revision v2; still serving v1 on b")
    assert p.stable.unplaced == 2 and "insufficient memory" in p.stable.message
    status, events = compute_status(StatusInput(
        generation=2, replicas=2, assignments=p.desired, revision="v2",
        reports={("b", "v1"): AssignmentReport(node="b", namespace="ns", name="llm", generation=1,
                                               revision="v1", state=AssignmentState.READY)},
        unplaced=p.stable.unplaced, placement_message=p.stable.message,
        rollout_reason=p.rollout.reason, rollout_message=p.rollout.message), None)
    got = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert got["Progressing"] == ("True", "RollingUpdate")
    assert got["Degraded"] == ("False", "AsExpected")
    assert not {"RolloutBlocked", "FailedPlacement"} & {e.reason for e in events}


def test_surge_is_trimmed_to_max_surge_and_reported_unplaced():
    p = run(target("v2", 2, mem=5), V1_ON_AB_5G, [node("a"), node("b"), node("c"), node("d")],
            ready={("a", "v1"), ("b", "v1")})
    assert p.stable.nodes == ("c",) and p.stable.unplaced == 1
    serving_nodes = {n for n, _ in p.desired}
    assert len(serving_nodes) <= 2 + 1  # replicas + maxSurge


def test_previous_role_retag_keeps_generation_and_content():
    """Turning the old Stable record into Previous changes only its role: the generation stays,
    so the agent's Ready report for it still counts."""
    stored_v1 = asg("v1", gen=7)
    p = run(target("v2", 1, gen=9), placed(("a", stored_v1)), [node("a")],
            ready={("a", "v1")})
    prev = p.desired[("a", "v1")]
    assert prev.role == P and prev.generation == 7
    assert prev.model_dump(exclude={"role"}) == stored_v1.model_dump(exclude={"role"})
    assert p.desired[("a", "v2")].generation == 9
    # already Previous: the very stored record is kept (no write)
    already = asg("v1", P, gen=7)
    p2 = run(target("v2", 1), placed(("a", asg("v2")), ("a", already)), [node("a")],
             ready={("a", "v1")})
    assert p2.desired[("a", "v1")] is already


def test_stored_records_equal_but_for_generation_are_reused():
    s_a, s_b = asg("v1", gen=1), asg("v1", gen=1)
    p = run(target("v1", 3, gen=5), placed(("a", s_a), ("b", s_b)), THREE,
            ready={("a", "v1"), ("b", "v1")})
    assert p.desired[("a", "v1")] is s_a and p.desired[("b", "v1")] is s_b
    assert p.desired[("c", "v1")].generation == 5
    # a change the node must act on (another source) is a new record
    changed = dataclasses.replace(target("v1", 2, gen=5), assignment=asg("v1", gen=5, uri="/x"))
    p2 = run(changed, placed(("a", s_a), ("b", s_b)), THREE)
    assert p2.desired[("a", "v1")] is not s_a and p2.desired[("a", "v1")].source.uri == "/x/v1"


def test_reused_records_mean_no_write():
    """Through reconcile.plan: a new generation that changes nothing for the nodes puts nothing."""
    keys = Keys("/t")
    items = {}
    for n in ("a", "b"):
        a = asg("v1", gen=1)
        key = keys.assignment(n, "ns", "llm", "v1")
        items[n] = [rc.StoredAssignment(key, KV(key, a.to_json(), 3), a)]
    view = rc.FleetView(nodes={n.name: n for n in THREE}, assignments=items, epoch=None,
                        revision=3)
    p = rc.plan(keys, view, "ns", "llm", rc.Intent(stable=target("v1", 2, gen=4)))
    assert p.ops == () and set(p.desired) == {("a", "v1"), ("b", "v1")}


# --- the candidate ------------------------------------------------------------------------------


def test_candidate_next_to_stable_where_both_fit():
    p = run(target("v1", 2), V1_ON_AB, THREE, candidate=target("v3", 1, role=C),
            ready={("a", "v1"), ("b", "v1")})
    assert triples(p) == {("a", "v1", S), ("b", "v1", S), ("a", "v3", C)}
    assert p.candidate is not None and p.candidate.nodes == ("a",) and p.candidate.unplaced == 0
    assert p.rollout.reason == "Complete"


def test_candidate_counts_against_memory():
    """With the candidate next to it, node a is full: nothing else of 1 GiB fits there."""
    p = run(target("v1", 2), V1_ON_AB, THREE, candidate=target("v3", 1, role=C))
    after = placed(*[(n, a) for (n, _), a in p.desired.items()])
    other = PlacementRequest(namespace="ns", name="other", replicas=3, memory_bytes=1 * GiB,
                             revision="x")
    d = place(other, THREE, after)
    assert d.nodes == ("b", "c") and "insufficient memory (needs 1.0GiB: a 0B free of 8.0GiB)" in d.message
    for n in THREE:
        assert sum(a.memory_bytes for a in after.get(n.name, [])) <= node_budget_bytes(n)


def test_candidate_elsewhere_when_only_one_fits():
    p = run(target("v1", 2, mem=5), V1_ON_AB_5G, THREE, candidate=target("v3", 1, mem=5, role=C))
    assert triples(p) == {("a", "v1", S), ("b", "v1", S), ("c", "v3", C)}


def test_candidate_unplaced_with_the_numbers():
    p = run(target("v1", 2, mem=5), V1_ON_AB_5G, [node("a"), node("b")],
            candidate=target("v3", 1, mem=5, role=C))
    assert triples(p) == {("a", "v1", S), ("b", "v1", S)}
    assert p.candidate is not None and p.candidate.nodes == () and p.candidate.unplaced == 1
    assert p.candidate.message == ("0/2 nodes fit: 2 insufficient memory "
                                   "(needs 5.0GiB: a 3.0GiB free of 8.0GiB, b 3.0GiB free of "
                                   "8.0GiB)")


def test_stored_candidate_is_not_displaced_by_the_stable():
    """A candidate already resident counts against the stable revision's placement too."""
    stored = placed(("b", asg("v1", mem=5)), ("a", asg("v3", C, mem=5)))
    p = run(target("v1", 2, mem=5), stored, [node("a"), node("b")],
            candidate=target("v3", 1, mem=5, role=C), ready={("b", "v1"), ("a", "v3")})
    assert triples(p) == {("b", "v1", S), ("a", "v3", C)}
    assert p.stable.unplaced == 1 and "insufficient memory" in p.stable.message


def test_candidate_is_never_a_previous_revision():
    p = run(target("v2", 1), placed(("a", asg("v2")), ("a", asg("v3", C))), [node("a")],
            candidate=target("v3", 1, role=C), ready={("a", "v2"), ("a", "v3")})
    assert triples(p) == {("a", "v2", S), ("a", "v3", C)}
    assert p.rollout.reason == "Complete" and p.rollout.previous == ()


def test_promotion_turns_candidate_records_stable_and_removes_the_old_stable():
    """The candidate revision becomes spec.model.revision (and no candidate any more): its
    stored records turn into Stable where they are, the old stable goes where the new one is
    Ready, and nothing new is loaded elsewhere."""
    stored = placed(("a", asg("v1")), ("b", asg("v1")), ("a", asg("v2", C)), ("b", asg("v2", C)))
    p = run(target("v2", 2, gen=3), stored, THREE,
            ready={("a", "v1"), ("b", "v1"), ("a", "v2"), ("b", "v2")})
    assert triples(p) == {("a", "v2", S), ("b", "v2", S)}
    assert p.rollout.reason == "Complete" and p.stable.added == ()
    # only the role changed: the records keep their generation, so the agents' Ready reports
    # stay current (no Pending flicker)
    assert [a.generation for a in p.desired.values()] == [1, 1]  # asg() default, not gen=3


def test_an_ended_canarys_candidate_is_removed_at_once():
    """Rolled back or aborted: the candidate is not a previous revision of a rollout — it
    never takes stable traffic, even where the stable revision is not Ready."""
    stored = placed(("a", asg("v1")), ("a", asg("v2", C)), ("b", asg("v2", C)))
    p = run(target("v1", 2), stored, THREE, ready={("a", "v2"), ("b", "v2")})
    assert {r for _, r, _ in triples(p)} == {"v1"}


def test_promotion_of_a_candidate_on_fewer_nodes():
    stored = placed(("a", asg("v1")), ("b", asg("v1")), ("a", asg("v2", C)))
    p = run(target("v2", 2, gen=3), stored, THREE,
            ready={("a", "v1"), ("b", "v1"), ("a", "v2")})
    # Ready on a: a's v1 goes; b gets v2 next to its v1 (preferred), not the spare c.
    assert triples(p) == {("a", "v2", S), ("b", "v2", S), ("b", "v1", P)}
    assert p.rollout.reason == "RollingUpdate"


# --- multi-round simulation ------------------------------------------------------------------


def simulate(stable: RevisionTarget, stored: dict[str, list[Assignment]],
             nodes: list[NodeRecord], *, surge: int, unavailable: int, rounds: int,
             fails: frozenset[str] = frozenset()) -> list[set[tuple[str, str, Role]]]:
    """Apply each round's desired state; a slot is Ready one round after it appears (Failed
    instead for revisions in ``fails``). Checks the invariants of every round."""
    state = {(n, a.revision): a for n, items in stored.items() for a in items}
    ready = set(state)
    replicas = stable.request.replicas
    history = []
    budgets = {n.name: node_budget_bytes(n) for n in nodes}
    for _ in range(rounds):
        failed = {s for s in ready if s[1] in fails}
        p = run(stable, placed(*[(n, a) for (n, _), a in state.items()]), nodes, surge=surge,
                unavailable=unavailable, ready=ready - failed, failed=failed)
        history.append(triples(p))
        serving_before = {n for n, r in ready - failed}
        serving_after = {n for n, r in set(p.desired) & (ready - failed)}
        assert len(serving_after) >= min(len(serving_before), replicas - unavailable), history
        for n, budget in budgets.items():
            assert sum(a.memory_bytes for (m, _), a in p.desired.items() if m == n) <= budget
        assert len({n for n, _ in p.desired}) <= replicas + surge, history
        ready = set(p.desired)  # loaded by the next round
        state = dict(p.desired)
    return history


@pytest.mark.parametrize("mem, spare, surge, unavailable, replicas", [
    (4, 0, 1, 1, 3),   # both fit: in place
    (5, 0, 1, 1, 3),   # no room: one at a time
    (5, 0, 1, 2, 3),   # no room: two at a time
    (5, 1, 1, 0, 3),   # a spare Mac, no unavailability allowed
    (5, 2, 2, 1, 2),
])
def test_rollout_converges_within_the_limits(mem, spare, surge, unavailable, replicas):
    names = [f"n{i}" for i in range(replicas + spare)]
    nodes = [node(n) for n in names]
    stored = {n: [asg("v1", mem=mem)] for n in names[:replicas]}
    history = simulate(target("v2", replicas, mem=mem), stored, nodes, surge=surge,
                       unavailable=unavailable, rounds=4 * replicas + 2)
    final = history[-1]
    assert len(final) == replicas and all(r == "v2" and role == S for _, r, role in final)
    assert history[-2] == final  # converged, stays put


def test_failed_revision_never_takes_the_old_one_down():
    nodes = [node("a"), node("b")]
    stored = {n: [asg("v1", mem=5)] for n in ("a", "b")}
    history = simulate(target("v2", 2, mem=5), stored, nodes, surge=1, unavailable=1, rounds=6,
                       fails=frozenset({"v2"}))
    # one replica made room, v2 failed there: from then on b keeps serving v1, round after round
    assert history[-1] == history[-2] == {("a", "v2", S), ("b", "v1", P)}


# --- reports feed the rollout through reconcile.report_slots -----------------------------------


def test_report_slots_only_count_the_stored_generation():
    keys = Keys("/t")
    stored = {("a", "v1"): asg("v1", P, gen=1), ("a", "v2"): asg("v2", gen=2),
              ("b", "v2"): asg("v2", gen=2), ("c", "v2"): asg("v2", gen=2)}
    items: dict[str, list[rc.StoredAssignment]] = {}
    for (n, r), a in stored.items():
        key = keys.assignment(n, "ns", "llm", r)
        items.setdefault(n, []).append(rc.StoredAssignment(key, KV(key, a.to_json(), 2), a))
    view = rc.FleetView(nodes={}, assignments=items, epoch=None, revision=2)

    def report(n, r, state, gen):
        return AssignmentReport(node=n, namespace="ns", name="llm", revision=r, state=state,
                                generation=gen)

    R, F = AssignmentState.READY, AssignmentState.FAILED
    ready, failed = rc.report_slots(view, "ns", "llm", {
        ("a", "v1"): report("a", "v1", R, 1), ("a", "v2"): report("a", "v2", R, 1),  # stale
        ("b", "v2"): report("b", "v2", F, 2), ("c", "v2"): report("c", "v2", R, 2),
        ("d", "v2"): report("d", "v2", R, 2)})  # no assignment there
    assert (ready, failed) == ({("a", "v1"), ("c", "v2")}, {("b", "v2")})


# --- properties ----------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(mems=st.lists(st.integers(6, 24), min_size=1, max_size=5), replicas=st.integers(1, 4),
       surge=st.integers(0, 3), unavailable=st.integers(0, 3), m1=st.integers(1, 6),
       m2=st.integers(1, 6))
def test_rollout_properties(mems, replicas, surge, unavailable, m1, m2):
    """From any steady state, every round keeps the budget, the surge bound and availability
    (checked inside :func:`simulate`); with maxUnavailable > 0 and room for the new revision
    alone on ``replicas`` nodes, the rollout finishes with only the new revision left."""
    if surge == 0 and unavailable == 0:
        surge = 1  # as DeploymentSpec.surge_limits does
    nodes = [node(f"n{i}", m) for i, m in enumerate(mems)]
    start = run(target("v1", replicas, mem=m1), {}, nodes)
    stored = placed(*[(n, a) for (n, _), a in start.desired.items()])
    history = simulate(target("v2", replicas, mem=m2), stored, nodes, surge=surge,
                       unavailable=unavailable, rounds=4 * replicas + 4)
    fit = sum(1 for n in nodes if node_budget_bytes(n) >= m2 * GiB)
    if unavailable > 0 and fit >= replicas:
        assert len(history[-1]) == replicas
        assert {(r, role) for _, r, role in history[-1]} == {("v2", S)}
