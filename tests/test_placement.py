"""Placement: table-driven cases over plain data, plus hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_fleet.contract import (WATERMARK, Assignment, ModelSource, NodeCapacity, NodeHealth,
                                NodeRecord)
from mlx_fleet_operator.placement import (PlacementRequest, is_mine, node_budget_bytes, serves_task,
                                          place, used_by_others)
from mlx_fleet_operator.spec import SpecError, parse_spec, resolve_int_or_percent, to_assignment

GiB = 1024**3


def node(name: str, mem_gib: float = 10, gen: int = 3, health: NodeHealth = NodeHealth.HEALTHY,
         watermark: float = WATERMARK, wired_gib: float = 0, **labels: str) -> NodeRecord:
    return NodeRecord(name=name, address=f"http://{name}:8000", labels=labels, health=health,
                      capacity=NodeCapacity(memory_total_bytes=int(mem_gib * GiB),
                                            memory_available_bytes=int(mem_gib * GiB),
                                            wired_limit_bytes=int(wired_gib * GiB),
                                            # Ultra: room for the sizes used here
                                            # (node_claims bounds memory by the chip)
                                            chip=f"Apple M{gen} Ultra", chip_generation=gen,
                                            memory_watermark=watermark))


def asg(name: str, mem_gib: float, ns: str = "default", served: str | None = None,
        revision: str = "v1") -> Assignment:
    return Assignment(namespace=ns, name=name, served_model_name=served or name,
                      source=ModelSource(uri="/m", revision=revision),
                      memory_bytes=int(mem_gib * GiB))


def req(replicas: int = 1, mem_gib: float = 2, revision: str = "v1", **kw) -> PlacementRequest:
    return PlacementRequest(namespace="default", name="llm", replicas=replicas,
                            memory_bytes=int(mem_gib * GiB), revision=revision, **kw)


CASES = [
    # id, request, nodes, assignments, expected nodes, expected unplaced, message fragment
    ("fits", req(), [node("a")], {}, ("a",), 0, ""),
    ("no nodes", req(), [], {}, (), 1, "no nodes registered"),
    ("memory too small", req(mem_gib=9), [node("a", 10)], {}, (), 1,
     "0/1 nodes fit: 1 insufficient memory (needs 9.0GiB: a 8.0GiB free of 8.0GiB)"),
    ("exactly the watermark", req(mem_gib=8), [node("a", 10)], {}, ("a",), 0, ""),
    ("mixed reasons", req(mem_gib=2, min_chip_generation=4),
     [node("a", 10, gen=3), node("b", 10, gen=3), node("c", 2, gen=4)], {}, (), 1,
     "0/3 nodes fit: 2 below chip generation M4, 1 insufficient memory (needs 2.0GiB: c 1.6GiB free of 1.6GiB)"),
    # the labels a selector matches are the MacNodes' (node_labels; tests/test_node_claims.py
    # has the agent's own, prefixed ones and a rogue agent's)
    ("selector", req(node_selector={"rack": "r1"},
                     node_labels={"a": {"rack": "r2"}, "b": {"rack": "r1"}}),
     [node("a"), node("b"), node("c")], {}, ("b",), 0, ""),
    ("selector none match", req(node_selector={"rack": "r1"}, node_labels={"a": {"rack": "r2"}}),
     [node("a")], {}, (), 1, "0/1 nodes fit: 1 not matching node selector rack=r1"),
    ("chip generation ok", req(min_chip_generation=4), [node("a", gen=3), node("b", gen=5)], {},
     ("b",), 0, ""),
    ("unhealthy", req(), [node("a", health=NodeHealth.DRAINING), node("b", health=NodeHealth.DEGRADED)],
     {}, (), 1, "0/2 nodes fit: 2 not healthy (Degraded, Draining)"),
    ("already placed: no churn", req(), [node("a", 10), node("b", 64)], {"a": [asg("llm", 2)]},
     ("a",), 0, ""),
    ("node gone", req(), [node("b")], {"a": [asg("llm", 2)]}, ("b",), 0, ""),
    ("placed node became unhealthy", req(), [node("a", health=NodeHealth.DRAINING), node("b")],
     {"a": [asg("llm", 2)]}, ("b",), 0, ""),
    ("scale up keeps existing", req(replicas=3), [node("a"), node("b"), node("c"), node("d", 5)],
     {"c": [asg("llm", 2)]}, ("a", "b", "c"), 0, ""),
    ("scale up short", req(replicas=3), [node("a"), node("b", 1)], {}, ("a",), 2,
     "1/2 nodes fit: 1 insufficient memory (needs 2.0GiB: b 819.2MiB free of 819.2MiB); 2 of 3 replicas unplaced"),
    ("scale down: most loaded first", req(replicas=1), [node("a"), node("b"), node("c")],
     {"a": [asg("llm", 2), asg("other", 4)], "b": [asg("llm", 2)], "c": [asg("llm", 2), asg("x", 1)]},
     ("b",), 0, ""),
    ("scale to zero", req(replicas=0), [node("a")], {"a": [asg("llm", 2)]}, (), 0, ""),
    ("spread: most free", req(replicas=1), [node("a", 16), node("b", 32), node("c", 8)], {},
     ("b",), 0, ""),
    ("binpack: least free that fits", req(replicas=1, strategy="Binpack"),
     [node("a", 16), node("b", 32), node("c", 2), node("d", 8)], {}, ("d",), 0, ""),
    ("tie broken by name", req(replicas=1), [node("z"), node("m"), node("b")], {}, ("b",), 0, ""),
    ("binpack tie broken by name", req(replicas=1, strategy="Binpack"), [node("z"), node("m")], {},
     ("m",), 0, ""),
    ("other deployments count", req(mem_gib=4), [node("a", 10), node("b", 10)],
     {"a": [asg("x", 5)], "b": [asg("y", 3)]}, ("b",), 0, ""),
    ("other deployments fill it", req(mem_gib=4), [node("a", 10)], {"a": [asg("x", 5)]}, (), 1,
     "0/1 nodes fit: 1 insufficient memory (needs 4.0GiB: a 3.0GiB free of 8.0GiB)"),
    ("same name other namespace counts", req(mem_gib=4), [node("a", 10)],
     {"a": [asg("llm", 5, ns="prod", served="prod-llm")]}, (), 1, "insufficient memory"),
    # Served model names: one node's OpenAI API serves each `model` id once.
    ("served name taken on one node", req(served_model_name="llama"), [node("a"), node("b", 64)],
     {"b": [asg("other", 1, ns="prod", served="llama")]}, ("a",), 0, ""),
    ("served name taken everywhere", req(served_model_name="llama"), [node("a"), node("b")],
     {"a": [asg("x", 1, ns="a", served="llama")], "b": [asg("y", 1, ns="b", served="llama")]},
     (), 1, "0/2 nodes fit: 2 already serve model name 'llama'"),
    ("served name defaults to the deployment name", req(), [node("a")],
     {"a": [asg("llm", 1, ns="prod")]}, (), 1, "0/1 nodes fit: 1 already serves model name 'llm'"),
    ("placed replica moves off a served-name clash", req(served_model_name="llama"),
     [node("a"), node("b")], {"a": [asg("llm", 2), asg("x", 1, ns="b", served="llama")]},
     ("b",), 0, ""),
    ("own served name does not clash", req(served_model_name="llama"), [node("a")],
     {"a": [asg("llm", 2, served="llama")]}, ("a",), 0, ""),
    ("mixed reasons with served name", req(served_model_name="llama", mem_gib=4),
     [node("a"), node("b", 2)], {"a": [asg("x", 1, ns="b", served="llama")]}, (), 1,
     "0/2 nodes fit: 1 already serves model name 'llama', 1 insufficient memory"),
    ("own assignment does not count against itself", req(mem_gib=8), [node("a", 10)],
     {"a": [asg("llm", 8)]}, ("a",), 0, ""),
    ("grown request moves replica", req(mem_gib=6), [node("a", 10), node("b", 10)],
     {"a": [asg("llm", 2), asg("x", 3)]}, ("b",), 0, ""),
    # Revisions: (deployment, revision) is the identity; other revisions of it are resident too.
    ("another revision of the same deployment counts", req(mem_gib=4, revision="v2"),
     [node("a", 10)], {"a": [asg("llm", 5, revision="v1")]}, (), 1,
     "0/1 nodes fit: 1 insufficient memory (needs 4.0GiB: a 3.0GiB free of 8.0GiB)"),
    ("both revisions fit on one node", req(mem_gib=3, revision="v2"), [node("a", 10)],
     {"a": [asg("llm", 5, revision="v1")]}, ("a",), 0, ""),
    ("another revision is not a placed replica of this one", req(revision="v2"),
     [node("a", 10), node("b", 10)], {"a": [asg("llm", 2, revision="v1")]}, ("b",), 0, ""),
    ("own name on another revision does not clash", req(revision="v2", served_model_name="llama"),
     [node("a", 10)], {"a": [asg("llm", 1, served="llama", revision="v1")]}, ("a",), 0, ""),
    ("placed revision kept next to another one", req(mem_gib=3, revision="v2"),
     [node("a", 10), node("b", 64)], {"a": [asg("llm", 5, revision="v1"),
                                             asg("llm", 3, revision="v2")]}, ("a",), 0, ""),
    # Preferred nodes come first when adding, whatever the strategy says.
    ("preferred beats spread", req(preferred=frozenset({"c"})),
     [node("a", 32), node("b", 16), node("c", 10)], {}, ("c",), 0, ""),
    ("preferred beats binpack", req(strategy="Binpack", preferred=frozenset({"a"})),
     [node("a", 32), node("b", 4)], {}, ("a",), 0, ""),
    ("preferred but full: strategy decides", req(mem_gib=4, preferred=frozenset({"a"})),
     [node("a", 10), node("b", 16), node("c", 32)], {"a": [asg("x", 5)]}, ("c",), 0, ""),
    ("preferred first, then by strategy", req(replicas=2, preferred=frozenset({"b"})),
     [node("a", 16), node("b", 10), node("c", 32)], {}, ("b", "c"), 0, ""),
    ("preferred never moves a placed replica", req(preferred=frozenset({"b"})),
     [node("a", 10), node("b", 64)], {"a": [asg("llm", 2)]}, ("a",), 0, ""),
    ("preferred node must still be eligible", req(preferred=frozenset({"a"}), min_chip_generation=4),
     [node("a", 64, gen=3), node("b", 10, gen=4)], {}, ("b",), 0, ""),
]


@pytest.mark.parametrize("request_, nodes, assignments, want, unplaced, message",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_place(request_, nodes, assignments, want, unplaced, message):
    d = place(request_, nodes, assignments)
    assert d.nodes == want
    assert d.unplaced == unplaced
    if message:
        assert message in d.message
    else:
        assert d.message == "" and d.reasons == ()


def test_diff_fields():
    d = place(req(replicas=2), [node("b"), node("c")], {"a": [asg("llm", 2)], "b": [asg("llm", 2)]})
    assert (d.kept, d.added, d.removed, d.nodes) == (("b",), ("c",), ("a",), ("b", "c"))


def test_duplicate_node_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        place(req(), [node("a"), node("a")], {})


def test_used_by_others_counts_other_revisions_not_this_one():
    on_node = [asg("llm", 2, revision="v1"), asg("llm", 3, revision="v2"), asg("x", 4),
               asg("llm", 5, ns="prod", revision="v2")]
    assert used_by_others(req(revision="v2"), on_node) == (2 + 4 + 5) * GiB
    assert used_by_others(req(revision="v1"), on_node) == (3 + 4 + 5) * GiB
    assert [is_mine(req(revision="v2"), a) for a in on_node] == [False, True, False, False]


@pytest.mark.parametrize("record, budget_gib", [
    (node("a", 10), 8),                                  # the default watermark, 80 % (seed 004)
    (node("a", 10, watermark=0.5), 5),
    (node("a", 10, watermark=1.0), 10),
    (node("a", 64, watermark=0.9, wired_gib=40), 40),    # the GPU wired limit still caps it
    (node("a", 64, watermark=0.5, wired_gib=40), 32),
], ids=["default", "half", "all", "wired cap", "watermark below the cap"])
def test_budget_uses_the_node_watermark(record: NodeRecord, budget_gib: int):
    assert WATERMARK == 0.8
    assert node_budget_bytes(record) == budget_gib * GiB


def test_a_record_without_a_watermark_gets_the_default():
    """Node records of agents older than ``memory_watermark`` parse with 80 %."""
    raw = node("old", 10).model_dump(mode="json")
    del raw["capacity"]["memory_watermark"]
    assert node_budget_bytes(NodeRecord.model_validate(raw)) == 8 * GiB


@pytest.mark.parametrize("nodes, request_gib, strategy, placed, message", [
    # 6 GiB fits 80 % of 10 GiB, not 50 %: the numbers name the node's own budget
    ([node("a", 10, watermark=0.5)], 6, "Spread", (), "a 5.0GiB free of 5.0GiB"),
    ([node("a", 10, watermark=0.5), node("b", 10)], 6, "Spread", ("b",), ""),
    # same memory, the higher watermark has more free budget (Spread) / the lower fits (Binpack)
    ([node("a", 10, watermark=0.5), node("b", 10, watermark=0.9)], 2, "Spread", ("b",), ""),
    ([node("a", 10, watermark=0.5), node("b", 10, watermark=0.9)], 2, "Binpack", ("a",), ""),
    ([node("a", 10, watermark=1.0)], 10, "Spread", ("a",), ""),
], ids=["too low", "elsewhere", "spread", "binpack", "everything"])
def test_placement_uses_each_node_watermark(nodes, request_gib, strategy, placed, message):
    d = place(req(mem_gib=request_gib, strategy=strategy), nodes, {})
    assert tuple(d.nodes) == placed
    assert d.unplaced == 1 - len(placed)
    assert message in d.message


# --- spec parsing ------------------------------------------------------------------------------

SPEC = {"model": {"source": "file:///models/llama", "revision": "v1"}, "resources": {"memory": "2Gi"}}


def test_parse_spec_defaults_and_assignment():
    s = parse_spec(SPEC)
    assert (s.replicas, s.placement.strategy, s.placement.min_chip_generation) == (1, "Spread", 3)
    a = to_assignment(s, namespace="ns", name="llm", uid="u1", generation=4)
    assert a.served_model_name == "llm" and a.memory_bytes == 2 * GiB and a.generation == 4
    assert a.source.uri == "file:///models/llama" and a.serving.max_concurrent_sequences == 8
    s2 = parse_spec({**SPEC, "model": {**SPEC["model"], "servedModelName": "x"},
                     "placement": {"minChipGeneration": "M4", "strategy": "Binpack",
                                   "nodeSelector": {"a": "b"}}})
    assert s2.placement.min_chip_generation == 4 and s2.placement.node_selector == {"a": "b"}
    assert to_assignment(s2, namespace="ns", name="llm").served_model_name == "x"


@pytest.mark.parametrize("patch, field", [
    ({"resources": {"memory": "0"}}, "spec.resources.memory"),
    ({"resources": {"memory": "lots"}}, "spec.resources.memory"),
    ({"replicas": -1}, "spec.replicas"),
    ({"model": {"source": "relative/path", "revision": "v1"}}, "spec.model.source"),
    ({"placement": {"minChipGeneration": "X9"}}, "spec.placement.minChipGeneration"),
    ({"placement": {"strategy": "Random"}}, "spec.placement.strategy"),
    ({"model": None}, "spec.model"),
    ({"strategy": {"rollingUpdate": {"maxSurge": -1}}}, "spec.strategy.rollingUpdate.maxSurge"),
    ({"strategy": {"rollingUpdate": {"maxSurge": "1x"}}}, "spec.strategy.rollingUpdate.maxSurge"),
    ({"strategy": {"rollingUpdate": {"maxUnavailable": "-5%"}}},
     "spec.strategy.rollingUpdate.maxUnavailable"),
    ({"strategy": {"type": "Recreate"}}, "spec.strategy.type"),
])
def test_parse_spec_errors_name_the_field(patch, field):
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        parse_spec({**SPEC, **patch})


@pytest.mark.parametrize("value, total, up, want", [
    (2, 10, True, 2), (0, 10, False, 0), ("25%", 3, True, 1), ("25%", 3, False, 0),
    ("50%", 4, True, 2), ("50%", 5, False, 2), ("50%", 5, True, 3), ("100%", 7, False, 7),
    ("0%", 9, True, 0), ("10%", 0, True, 0),
])
def test_resolve_int_or_percent(value, total, up, want):
    assert resolve_int_or_percent(value, total, round_up=up) == want


@pytest.mark.parametrize("replicas, rolling, want", [
    (1, None, (1, 1)),  # defaults: maxSurge 25% rounded up, maxUnavailable 1
    (4, None, (1, 1)),
    (5, None, (2, 1)),
    (4, {"maxSurge": 0, "maxUnavailable": "50%"}, (0, 2)),
    (3, {"maxSurge": "50%", "maxUnavailable": "50%"}, (2, 1)),
    (3, {"maxSurge": 2, "maxUnavailable": 0}, (2, 0)),
    # both resolve to 0: a surge of 1 instead, so a rollout can always progress
    (3, {"maxSurge": 0, "maxUnavailable": "10%"}, (1, 0)),
    (1, {"maxSurge": "0%", "maxUnavailable": "50%"}, (1, 0)),
])
def test_surge_limits(replicas, rolling, want):
    spec = {**SPEC, "replicas": replicas}
    if rolling is not None:
        spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": rolling}
    assert parse_spec(spec).surge_limits() == want


def test_to_assignment_roles_and_candidate_overrides():
    from mlx_fleet.contract import Role

    s = parse_spec(SPEC)
    stable = to_assignment(s, namespace="ns", name="llm", generation=3)
    assert (stable.role, stable.revision, stable.source.uri) == (Role.STABLE, "v1",
                                                                  "file:///models/llama")
    cand = to_assignment(s, namespace="ns", name="llm", generation=3, role=Role.CANDIDATE,
                         source="file:///models/llama-v2", revision="v2", memory_bytes=3 * GiB)
    assert (cand.role, cand.revision, cand.source.uri, cand.memory_bytes) == (
        Role.CANDIDATE, "v2", "file:///models/llama-v2", 3 * GiB)
    assert cand.served_model_name == stable.served_model_name == "llm"


# --- properties --------------------------------------------------------------------------------

names = st.sampled_from([f"n{i}" for i in range(8)])
node_st = st.builds(node, name=names, mem_gib=st.integers(1, 64), gen=st.integers(3, 5),
                    health=st.sampled_from(list(NodeHealth)))


@st.composite
def scenarios(draw):
    nodes = list({n.name: n for n in draw(st.lists(node_st, max_size=8))}.values())
    others = draw(st.dictionaries(names, st.lists(
        st.builds(asg, name=st.sampled_from(["x", "y", "llm"]), mem_gib=st.integers(1, 16),
                  ns=st.sampled_from(["default", "prod"]), revision=st.sampled_from(["v1", "v2"])),
        max_size=3), max_size=8))
    r = draw(st.builds(req, replicas=st.integers(0, 6), mem_gib=st.integers(1, 32),
                       min_chip_generation=st.integers(3, 5),
                       strategy=st.sampled_from(["Spread", "Binpack"]),
                       preferred=st.frozensets(names, max_size=3)))
    return r, nodes, others


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_properties(scenario):
    r, nodes, assignments = scenario
    d = place(r, nodes, assignments)
    by_name = {n.name: n for n in nodes}
    assert len(set(d.nodes)) == len(d.nodes) <= r.replicas
    assert d.unplaced == r.replicas - len(d.nodes)
    for n in d.nodes:  # never exceeds the budget, only healthy matching nodes
        rec = by_name[n]
        assert used_by_others(r, assignments.get(n, ())) + r.memory_bytes <= node_budget_bytes(rec)
        assert rec.health == NodeHealth.HEALTHY and rec.capacity.chip_generation >= r.min_chip_generation
        assert not any(a.served_model_name == r.model_name and (a.namespace, a.name) != (r.namespace, r.name)
                       for a in assignments.get(n, ()))
    assert place(r, list(reversed(nodes)), dict(reversed(list(assignments.items())))) == d
    assert (d.message != "") == (d.unplaced > 0)
    # stability: placing again on the result changes nothing
    again = {k: [a for a in v if not is_mine(r, a)] for k, v in assignments.items()}
    for n in d.nodes:
        again.setdefault(n, []).append(asg("llm", r.memory_bytes / GiB, revision=r.revision))
    assert place(r, nodes, again).nodes == d.nodes


def test_insufficient_memory_names_the_numbers_per_node_most_free_first():
    nodes = [node(f"m{i}", 8) for i in range(7)]  # 6.4 GiB budget each
    used = {f"m{i}": [asg(f"other{i}", i * 0.5, ns="x", served=f"o{i}")] for i in range(7)}
    d = place(PlacementRequest(namespace="ns", name="big", replicas=1,
                               memory_bytes=int(7 * GiB)), nodes, used)
    assert d.unplaced == 1
    assert d.message == ("0/7 nodes fit: 7 insufficient memory (needs 7.0GiB: "
                         "m0 6.4GiB free of 6.4GiB, m1 5.9GiB free of 6.4GiB, "
                         "m2 5.4GiB free of 6.4GiB, m3 4.9GiB free of 6.4GiB, "
                         "m4 4.4GiB free of 6.4GiB, 2 more)")


def test_the_budget_is_capped_by_the_gpu_wired_limit():
    """One budget rule for operator and agent (mlx_fleet.contract.node_budget_bytes): 80 % of
    unified memory, and never more than the GPU may wire (iogpu.wired_limit_mb)."""
    capped = node("w", 64).model_copy(update={"capacity": node("w", 64).capacity.model_copy(
        update={"wired_limit_bytes": 40 * GiB})})
    assert node_budget_bytes(capped) == 40 * GiB
    assert node_budget_bytes(node("u", 64)) == int(64 * GiB * 0.8)  # 0 = the OS default
    d = place(PlacementRequest(namespace="ns", name="m", replicas=1,
                               memory_bytes=int(45 * GiB)), [capped], {})
    assert d.unplaced == 1 and "w 40.0GiB free of 40.0GiB" in d.message


# -- cordoned nodes (MacNode spec.unschedulable) ------------------------------------------------

@pytest.mark.parametrize("cordoned, current, replicas, want, unplaced, message", [
    # a cordoned node takes no new replica; the reason names it
    ({"a"}, {}, 1, (), 1, "0/1 nodes fit: 1 cordoned"),
    # another node is used instead
    ({"a"}, {}, 1, ("b",), 0, ""),
    # an existing replica on a cordoned node stays (like a cordoned Kubernetes node's pods)
    ({"a"}, {"a": [asg("llm", 2)]}, 1, ("a",), 0, ""),
    # ... but scale up does not add one there
    ({"a", "b"}, {"a": [asg("llm", 2)]}, 2, ("a",), 1, "0/2 nodes fit: 2 cordoned"),
    # a reason that would make the node ineligible anyway is given instead of the cordon
    ({"a"}, {}, 1, (), 1, "0/1 nodes fit: 1 below chip generation M9"),
    # uncordoned: placed again
    (set(), {}, 1, ("a",), 0, ""),
], ids=["alone", "elsewhere", "existing stays", "no scale up there", "other reason first",
        "uncordoned"])
def test_cordoned_nodes_take_no_new_replicas(cordoned, current, replicas, want, unplaced, message):
    nodes = [node("a")] if want != ("b",) else [node("a"), node("b")]
    if len(cordoned) == 2:
        nodes = [node("a"), node("b")]
    kw = {"min_chip_generation": 9} if "M9" in message else {}
    d = place(req(replicas, cordoned=frozenset(cordoned), **kw), nodes, current)
    assert d.nodes == want and d.unplaced == unplaced
    assert d.message.startswith(message) if message else d.message == ""
    assert any(r.endswith(" cordoned") for r in d.reasons) == ("cordoned" in message)


@pytest.mark.parametrize(("node", "placed", "unsettled", "want"), [
    ("a", {}, set(), set()),                                                   # nothing yet
    ("a", {"d1": [("a", "v1")], "d2": [("b", "v1")]}, set(), {"d1"}),          # only its own
    ("c", {"d1": [("a", "v1")], "d2": [("b", "v1")]}, set(), set()),          # a newcomer: none
    ("c", {"d1": [("a", "v1")], "d2": [("b", "v1")]}, {"d2"}, {"d2"}),        # ... but unplaced
    ("b", {"d1": [("a", "v1"), ("b", "v2")]}, set(), {"d1"}),                  # any revision
    ("a", {"d1": [("a", "v1")]}, {"d3"}, {"d1", "d3"}),
], ids=["empty", "hosted", "newcomer", "newcomer-unsettled", "candidate-on-it", "union"])
def test_a_node_change_wakes_only_the_deployments_it_concerns(node, placed, unsettled, want):
    from mlx_fleet_operator.placement import affected_by_node

    assert affected_by_node(node, placed, unsettled) == want


def _tasks(n: NodeRecord, *tasks: str) -> NodeRecord:
    return n.model_copy(update={"tasks": list(tasks)})


@pytest.mark.parametrize(("tasks", "task", "serves"), [
    (None, "TextGeneration", True),          # an agent older than the field: text only
    (None, "TextEmbedding", False),
    (("TextGeneration", "TextEmbedding"), "TextEmbedding", True),
    (("TextGeneration", "TextEmbedding"), "TextGeneration", True),
    (("TextGeneration",), "TextEmbedding", False),
])
def test_serves_task(tasks, task: str, serves: bool) -> None:
    n = node("a") if tasks is None else _tasks(node("a"), *tasks)
    assert serves_task(n, task) is serves  # type: ignore[arg-type]


def test_an_old_agents_record_reads_as_text_generation_only() -> None:
    raw = node("a").model_dump(mode="json")
    del raw["tasks"]
    assert NodeRecord.model_validate(raw).tasks == ["TextGeneration"]


@pytest.mark.parametrize(("task", "want", "unplaced", "message"), [
    ("TextEmbedding", ("new",), 1,
     "1/3 nodes fit: 2 serve no TextEmbedding models (agent too old); 1 of 2 replicas unplaced"),
    ("TextGeneration", ("new", "old-a", "old-b"), 0, ""),
])
def test_embedding_deployments_go_only_to_agents_that_serve_the_task(task, want, unplaced,
                                                                      message) -> None:
    """A rolling upgrade: only the upgraded agent lists TextEmbedding; an embedding deployment
    is placed there (and explained where it cannot be), a chat one anywhere."""
    nodes = [node("old-a"), node("old-b"),
             _tasks(node("new"), "TextGeneration", "TextEmbedding")]
    d = place(req(replicas=2 if task == "TextEmbedding" else 3, task=task), nodes, {})
    assert d.nodes == want and d.unplaced == unplaced
    assert message in d.message
    # an embedding replica already on an old agent's node moves off it
    if task == "TextEmbedding":
        moved = place(req(replicas=1, task=task), nodes, {"old-a": [asg("llm", 2)]})
        assert moved.nodes == ("new",) and "old-a" in moved.removed
