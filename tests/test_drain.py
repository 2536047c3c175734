"""Drain, pure: placement leaves a draining node out, rollout.plan_deployment keeps each drained
replica serving until its replacement is Ready, withdraws it, then removes it; the MacNode's
Drained condition and ``mlx-fleet drain``'s reading of it. Table-driven over plain data, plus
a multi-round simulation that checks serving capacity never drops."""

from __future__ import annotations

import dataclasses

import pytest

from mlx_fleet.contract import Role
from mlx_fleet.nodecli import drain_progress
from mlx_fleet_operator.macnodes import drained_condition, draining
from mlx_fleet_operator.placement import PlacementRequest, place
from mlx_fleet_operator.rollout import RevisionTarget, plan_deployment
from test_rollout import GiB, asg, node, placed, target, triples

S, P, C = Role.STABLE, Role.PREVIOUS, Role.CANDIDATE
DRAIN_A = frozenset({"a"})


def drained(t: RevisionTarget, nodes: frozenset[str] = DRAIN_A) -> RevisionTarget:
    """``t`` with ``nodes`` draining (a drained Mac is cordoned too, as the CRD requires)."""
    return dataclasses.replace(t, request=dataclasses.replace(t.request, draining=nodes,
                                                              cordoned=nodes))


def plan(stable, stored, nodes, *, candidate=None, ready=(), released=(), surge=1,
         unavailable=1):
    return plan_deployment(stable, candidate, max_surge=surge, max_unavailable=unavailable,
                           nodes=nodes, assignments=stored, ready=set(ready),
                           released=set(released))


AB = [node("a"), node("b")]
ABC = [node("a"), node("b"), node("c")]

CASES = [
    # id, stable, stored, nodes, options, desired, moving, withdraw
    ("room elsewhere: replacement added next to the drained replica, which keeps serving",
     drained(target("v1")), placed(("a", asg("v1"))), AB, {"ready": {("a", "v1")}},
     {("a", "v1", S), ("b", "v1", S)}, {("a", "v1")}, set()),
    ("replacement still loading: nothing removed", drained(target("v1")),
     placed(("a", asg("v1")), ("b", asg("v1"))), AB, {"ready": {("a", "v1")}},
     {("a", "v1", S), ("b", "v1", S)}, {("a", "v1")}, set()),
    ("replacement Ready: the drained replica is withdrawn, still assigned",
     drained(target("v1")), placed(("a", asg("v1")), ("b", asg("v1"))), AB,
     {"ready": {("a", "v1"), ("b", "v1")}}, {("a", "v1", S), ("b", "v1", S)}, set(),
     {("a", "v1")}),
    ("withdrawal published: the drained replica is removed", drained(target("v1")),
     placed(("a", asg("v1")), ("b", asg("v1"))), AB,
     {"ready": {("a", "v1"), ("b", "v1")}, "released": {("a", "v1")}},
     {("b", "v1", S)}, set(), set()),
    ("a drained replica that does not serve is no capacity: replaced, not kept",
     drained(target("v1")), placed(("a", asg("v1"))), AB, {}, {("b", "v1", S)}, set(), set()),
    ("no room elsewhere: it stays where it is", drained(target("v1", mem=5)),
     placed(("a", asg("v1", mem=5))), [node("a"), node("b", 5)], {"ready": {("a", "v1")}},
     {("a", "v1", S)}, {("a", "v1")}, set()),
    ("the only node: it stays", drained(target("v1")), placed(("a", asg("v1"))), [node("a")],
     {"ready": {("a", "v1")}}, {("a", "v1", S)}, {("a", "v1")}, set()),
    ("two replicas, one drained: the other stays, the replacement on the spare node",
     drained(target("v1", 2)), placed(("a", asg("v1")), ("b", asg("v1"))), ABC,
     {"ready": {("a", "v1"), ("b", "v1")}},
     {("a", "v1", S), ("b", "v1", S), ("c", "v1", S)}, {("a", "v1")}, set()),
    ("two nodes drained, one spare: one moves, the other stays",
     drained(target("v1", 2), frozenset({"a", "b"})),
     placed(("a", asg("v1")), ("b", asg("v1")), ("c", asg("v1"))), ABC,
     {"ready": {("a", "v1"), ("b", "v1"), ("c", "v1")}},
     {("a", "v1", S), ("b", "v1", S), ("c", "v1", S)}, {("a", "v1")}, {("b", "v1")}),
    ("during a rollout: the previous revision on the drained node keeps serving while the new "
     "one loads elsewhere; the new one's load there is dropped",
     drained(target("v2")), placed(("a", asg("v2")), ("a", asg("v1", P))), AB,
     {"ready": {("a", "v1")}}, {("b", "v2", S), ("a", "v1", P)}, set(), set()),
    ("during a rollout: new revision Ready elsewhere, the previous one is withdrawn",
     drained(target("v2")), placed(("b", asg("v2")), ("a", asg("v1", P))), AB,
     {"ready": {("a", "v1"), ("b", "v2")}}, {("b", "v2", S), ("a", "v1", P)}, set(),
     {("a", "v1")}),
]


@pytest.mark.parametrize("stable, stored, nodes, opts, want, moving, withdraw",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_drain_plan(stable, stored, nodes, opts, want, moving, withdraw):
    p = plan(stable, stored, nodes, **opts)
    assert triples(p) == want
    assert set(p.drain.moving) == moving
    assert set(p.drain.withdraw) == withdraw
    # the stable decision never counts a drained replica as placed
    assert not set(p.stable.nodes) & stable.request.draining
    # a withdrawn record is the stored one, untouched (no write, no reload)
    for slot in withdraw:
        assert p.desired[slot] in stored[slot[0]]


def test_no_room_elsewhere_says_why_with_the_numbers():
    p = plan(drained(target("v1", mem=5)), placed(("a", asg("v1", mem=5))),
             [node("a"), node("b", 5)], ready={("a", "v1")})
    assert p.stable.unplaced == 1
    assert "1 draining" in p.drain.blocked and "insufficient memory" in p.drain.blocked
    assert "needs 5.0GiB" in p.drain.blocked and "b 4.0GiB free of 4.0GiB" in p.drain.blocked
    assert "v1 on a cannot move and keeps serving" in p.drain.blocked
    assert p.stable.message == p.drain.blocked  # → Scheduled=False, FailedPlacement event


def test_drain_during_a_canary_moves_both_revisions():
    stable = drained(target("v1"))
    cand = drained(target("v2", role=C))
    stored = placed(("a", asg("v1")), ("a", asg("v2", C)))
    p = plan(stable, stored, AB, candidate=cand, ready={("a", "v1"), ("a", "v2")})
    assert triples(p) == {("a", "v1", S), ("a", "v2", C), ("b", "v1", S), ("b", "v2", C)}
    assert set(p.drain.moving) == {("a", "v1"), ("a", "v2")} and not p.drain.blocked
    # both Ready on b: both withdrawn, then removed
    stored = placed(*[(n, a) for (n, _), a in p.desired.items()])
    ready = {("a", "v1"), ("a", "v2"), ("b", "v1"), ("b", "v2")}
    p = plan(stable, stored, AB, candidate=cand, ready=ready)
    assert set(p.drain.withdraw) == {("a", "v1"), ("a", "v2")}
    p = plan(stable, stored, AB, candidate=cand, ready=ready, released=p.drain.withdraw)
    assert triples(p) == {("b", "v1", S), ("b", "v2", C)}


def test_canary_candidate_with_no_room_elsewhere_stays_and_says_why():
    stable = drained(target("v1"))
    cand = drained(target("v2", role=C))
    stored = placed(("a", asg("v1")), ("a", asg("v2", C)))
    # b fits one 4 GiB revision only: the stable moves, the candidate stays on a
    p = plan(stable, stored, [node("a"), node("b", 6)], candidate=cand,
             ready={("a", "v1"), ("a", "v2")})
    assert triples(p) == {("a", "v1", S), ("a", "v2", C), ("b", "v1", S)}
    assert "v2 on a cannot move" in p.drain.blocked


def test_placement_explains_a_draining_node():
    req = PlacementRequest(namespace="ns", name="llm", replicas=1, memory_bytes=GiB,
                           revision="v1", draining=DRAIN_A, cordoned=DRAIN_A)
    d = place(req, [node("a")], placed(("a", asg("v1"))))
    assert d.nodes == () and d.removed == ("a",) and d.unplaced == 1
    assert d.message == "0/1 nodes fit: 1 draining"


def simulate(stable, stored, nodes, rounds):
    """Each round's desired state is applied; a slot is Ready one round after it appears; a
    withdrawal is published one round after it is planned. Checks, every round, that the
    revision serves (Ready and not withdrawn) on at least ``min(before, replicas)`` nodes."""
    state = {(n, a.revision): a for n, items in stored.items() for a in items}
    ready, released = set(state), set()
    replicas = stable.request.replicas
    history = []
    for _ in range(rounds):
        p = plan(stable, placed(*[(n, a) for (n, _), a in state.items()]), nodes,
                 ready=ready, released=released)
        history.append(triples(p))
        serving_before = {s for s in ready if s in state} - released
        serving_after = {s for s in p.desired if s in ready} - set(p.drain.withdraw)
        assert len(serving_after) >= min(len(serving_before), replicas), history
        ready, released, state = set(p.desired), set(p.drain.withdraw), dict(p.desired)
    return history


@pytest.mark.parametrize("replicas, spare", [(1, 1), (2, 1), (2, 2), (3, 3)])
def test_drain_converges_without_losing_capacity(replicas, spare):
    names = [f"n{i}" for i in range(replicas + spare)]
    stored = {n: [asg("v1")] for n in names[:replicas]}
    stable = drained(target("v1", replicas), frozenset({"n0"}))
    history = simulate(stable, stored, [node(n) for n in names], rounds=6)
    assert history[-1] == history[-2]  # converged
    assert not any(n == "n0" for n, _, _ in history[-1])
    assert len(history[-1]) == replicas


# --- the MacNode's Drained condition and the CLI's reading of it ---------------------------

@pytest.mark.parametrize("is_draining, models, blocked, want", [
    (False, ["ns/a@v1"], "", ("False", "DrainNotRequested")),
    (True, ["ns/a@v1"], "", ("False", "Draining")),
    (True, ["ns/a@v1"], "0/1 nodes fit: 1 draining", ("False", "DrainBlocked")),
    (True, [], "", ("True", "Drained")),
])
def test_drained_condition(is_draining, models, blocked, want):
    c = drained_condition(is_draining, models, blocked, generation=3,
                          now="2025-01-01T00:00:00Z")
    assert (c["status"], c["reason"]) == want and c["observedGeneration"] == 3
    if is_draining:
        assert all(m in c["message"] for m in models) and blocked in c["message"]


def test_drained_condition_keeps_its_transition_time():
    first = drained_condition(True, ["ns/a@v1"], now="2025-01-01T00:00:00Z")
    again = drained_condition(True, ["ns/b@v1"], previous={"conditions": [first]},
                              now="2025-01-01T00:05:00Z")
    assert again["lastTransitionTime"] == "2025-01-01T00:00:00Z"
    done = drained_condition(True, [], previous={"conditions": [again]},
                             now="2025-01-01T00:06:00Z")
    assert done["lastTransitionTime"] == "2025-01-01T00:06:00Z"


def test_draining_needs_the_cordon_too():
    objs = [{"metadata": {"name": "a"}, "spec": {"unschedulable": True, "drain": True}},
            {"metadata": {"name": "b"}, "spec": {"unschedulable": False, "drain": True}},
            {"metadata": {"name": "c"}, "spec": {"unschedulable": True}}]
    assert draining(objs) == frozenset({"a"})


def macnode(cond: dict | None, models: int = 1) -> dict:
    return {"status": {"modelCount": models, "conditions": [cond] if cond else []}}


@pytest.mark.parametrize("obj, generation, want", [
    (macnode(None), 2, (False, False, "Pending")),
    (macnode({"type": "Drained", "status": "True", "reason": "Drained",
              "observedGeneration": 1}), 2, (False, False, "Pending")),  # an older request's
    (macnode({"type": "Drained", "status": "False", "reason": "Draining",
              "observedGeneration": 2}), 2, (True, False, "Draining")),
    (macnode({"type": "Drained", "status": "True", "reason": "Drained",
              "observedGeneration": 3}, 0), 2, (True, True, "Drained")),
])
def test_cli_reads_the_drain_of_its_own_generation(obj, generation, want):
    p = drain_progress(obj, generation)
    assert (p.observed, p.done, p.reason) == want


@pytest.mark.parametrize("timeout", ["0", "-3", "nan", "inf", "soon"])
def test_cli_drain_timeout_must_be_positive_seconds(timeout, capsys):
    from mlx_fleet.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["drain", "mac-a", "--timeout", timeout])
    assert e.value.code == 2
    assert "--timeout: must be a finite number of seconds > 0" in capsys.readouterr().err
