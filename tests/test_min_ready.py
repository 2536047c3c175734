"""spec.lifecycle.minReady: parsing, the pure pin (spec.pin_replicas) and its effect through
reconcile.plan — the first minReady Stable replicas by node name carry ``lifecycle.pinned``,
and a steady state writes nothing. Pure: no cluster."""

from __future__ import annotations

import pytest

from mlx_fleet.contract import Assignment, Keys, LifecyclePolicy, Role
from mlx_fleet.store import KV
from mlx_fleet_operator import reconcile as rc
from mlx_fleet_operator.rollout import same_for_node
from mlx_fleet_operator.spec import SpecError, parse_spec, pin_replicas
from test_rollout import THREE, asg, target

BASE = {"model": {"source": "/m", "revision": "v1"}, "resources": {"memory": "1Gi"}}


@pytest.mark.parametrize(("replicas", "min_ready", "error"), [
    (None, None, None),             # default 0
    (3, 0, None),
    (3, 3, None),
    (None, 1, None),                # replicas defaults to 1
    (0, 0, None),
    (2, 3, "spec.lifecycle.minReady (3) must not exceed spec.replicas (2)"),
    (None, 2, "spec.lifecycle.minReady (2) must not exceed spec.replicas (1)"),
    (3, -1, "spec.lifecycle.minReady: Input should be greater than or equal to 0"),
])
def test_min_ready_is_parsed_and_bounded(replicas, min_ready, error) -> None:
    spec = {**BASE}
    if replicas is not None:
        spec["replicas"] = replicas
    if min_ready is not None:
        spec["lifecycle"] = {"minReady": min_ready}
    if error is None:
        assert parse_spec(spec).lifecycle.min_ready == (min_ready or 0)
    else:
        with pytest.raises(SpecError) as e:
            parse_spec(spec)
        assert error in str(e.value)


def pinned(a: Assignment) -> Assignment:
    return a.model_copy(update={"lifecycle": LifecyclePolicy(pinned=True)})


def pins(desired) -> set[tuple[str, str]]:
    return {slot for slot, a in desired.items() if a.lifecycle.pinned}


@pytest.mark.parametrize(("nodes", "min_ready", "want"), [
    (["c", "a", "b"], 0, set()),
    (["c", "a", "b"], 1, {("a", "v1")}),
    (["c", "a", "b"], 2, {("a", "v1"), ("b", "v1")}),
    (["c", "a", "b"], 5, {("a", "v1"), ("b", "v1"), ("c", "v1")}),
])
def test_first_replicas_by_node_name_are_pinned(nodes, min_ready, want) -> None:
    desired = {(n, "v1"): asg("v1") for n in nodes}
    out = pin_replicas(desired, revision="v1", min_ready=min_ready, stored={}, same=same_for_node)
    assert pins(out) == want
    assert set(out) == set(desired)


def test_only_the_stable_revision_is_pinned() -> None:
    desired = {("a", "v2"): asg("v2"), ("a", "v1"): asg("v1", Role.PREVIOUS),
               ("b", "v3"): asg("v3", Role.CANDIDATE), ("c", "v2"): asg("v2")}
    out = pin_replicas(desired, revision="v2", min_ready=1, stored={}, same=same_for_node)
    assert pins(out) == {("a", "v2")}


def test_a_stored_record_that_already_says_it_is_kept_as_is() -> None:
    stored_a = pinned(asg("v1", gen=1))
    desired = {("a", "v1"): asg("v1", gen=4), ("b", "v1"): asg("v1", gen=4)}
    out = pin_replicas(desired, revision="v1", min_ready=1, stored={("a", "v1"): stored_a},
                       same=same_for_node)
    assert out[("a", "v1")] is stored_a  # same for the node: no write, generation kept
    assert not out[("b", "v1")].lifecycle.pinned


def _view(keys: Keys, stored: dict[str, Assignment]) -> rc.FleetView:
    items = {}
    for n, a in stored.items():
        key = keys.assignment(n, "ns", "llm", a.revision)
        items[n] = [rc.StoredAssignment(key, KV(key, a.to_json(), 3), a)]
    return rc.FleetView(nodes={n.name: n for n in THREE}, assignments=items, epoch=None,
                        revision=3)


def test_reconcile_plan_pins_and_then_writes_nothing() -> None:
    keys = Keys("/t")
    fresh = rc.plan(keys, _view(keys, {}), "ns", "llm",
                    rc.Intent(stable=target("v1", 2, gen=4), min_ready=1))
    assert pins(fresh.desired) == {("a", "v1")} and len(fresh.ops) == 2
    # the next reconcile over what was written: nothing to change
    again = rc.plan(keys, _view(keys, {n: a for (n, _), a in fresh.desired.items()}), "ns",
                    "llm", rc.Intent(stable=target("v1", 2, gen=5), min_ready=1))
    assert again.ops == () and pins(again.desired) == {("a", "v1")}
    # minReady lowered to 0: only the pinned node's record is rewritten
    unpin = rc.plan(keys, _view(keys, {n: a for (n, _), a in fresh.desired.items()}), "ns",
                    "llm", rc.Intent(stable=target("v1", 2, gen=6), min_ready=0))
    assert pins(unpin.desired) == set()
    assert [op.key for op in unpin.ops if hasattr(op, "value") and "assignments" in op.key] == [
        keys.assignment("a", "ns", "llm", "v1")]


def test_the_deployment_intent_carries_min_ready() -> None:
    from mlx_fleet_operator.sync import deployment_intent

    spec = parse_spec({**BASE, "replicas": 3, "lifecycle": {"minReady": 2}})
    intent = deployment_intent(spec, ("ns", "llm"), uid="u", generation=1, candidate=None)
    assert intent.min_ready == 2
    assert not intent.stable.assignment.lifecycle.pinned  # pinned per node by reconcile.plan
