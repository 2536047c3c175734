"""Served-name conflicts: the shared rule (mlx_fleet.routing.names), the operator's decision
over the deployments it knows (mlx_fleet_operator.served_names) and the condition, event and
status.router it yields (status.compute_status). Table-driven, pure."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given, settings, strategies as st

from mlx_fleet.contract import Assignment, ModelSource, Role
from mlx_fleet.routing import names
from mlx_fleet_operator import served_names
from mlx_fleet_router.table import build
from mlx_fleet_operator.status import StatusInput, compute_status

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
T1 = T0 + dt.timedelta(minutes=5)


def asg(ns: str, name: str, served: str, revision: str = "v1",
        role: Role = Role.STABLE) -> Assignment:
    return Assignment(namespace=ns, name=name, generation=1, served_model_name=served,
                      source=ModelSource(uri="/m", revision=revision), memory_bytes=1, role=role)


@pytest.mark.parametrize("claims, want", [
    ([], {}),
    ([("llm", "a/x")], {}),
    ([("llm", "a/x"), ("llm", "a/x")], {}),  # one deployment, two assignments
    ([("llm", "a/y"), ("llm", "a/x")], {"llm": ("a/x", "a/y")}),
    ([("llm", "a/x"), ("llm", "b/x")], {"llm": ("a/x", "b/x")}),  # across namespaces in scope
    ([("llm", "a/x"), ("other", "a/y")], {}),
    ([("m", "a/x"), ("m", "a/y"), ("m", "a/z"), ("n", "a/z")], {"m": ("a/x", "a/y", "a/z")}),
], ids=["none", "one", "one deployment twice", "two", "two namespaces", "distinct names",
        "three"])
def test_conflicts(claims, want):
    assert names.conflicts(claims) == want


def placed(*assignments: Assignment) -> dict:
    out: dict = {}
    for i, a in enumerate(assignments):
        out.setdefault((a.namespace, a.name), {})[(f"mac-{i}", a.source.revision)] = a
    return out


A, B, C = ("ns", "a"), ("ns", "b"), ("other", "c")

RIVAL_CASES = [
    # id, placed, key, rivals
    ("alone", placed(asg(*A, "llm")), A, {}),
    ("distinct names", placed(asg(*A, "llm"), asg(*B, "b")), A, {}),
    ("shared", placed(asg(*A, "llm"), asg(*B, "llm")), A, {"llm": ("ns/b",)}),
    ("both sides see it", placed(asg(*A, "llm"), asg(*B, "llm")), B, {"llm": ("ns/a",)}),
    ("three, other namespace", placed(asg(*A, "llm"), asg(*B, "llm"), asg(*C, "llm")), A,
     {"llm": ("ns/b", "other/c")}),
    # a rolling update renaming the model: the Previous replica still claims the old name
    ("previous revision's name", placed(asg(*A, "new", "v2"), asg(*A, "old", "v1", Role.PREVIOUS),
                                        asg(*B, "old")), A, {"old": ("ns/b",)}),
    ("no assignments claim nothing", {A: {}, **placed(asg(*B, "a"))}, A, {}),
    ("unknown deployment", placed(asg(*B, "llm")), A, {}),
]


@pytest.mark.parametrize("placed_, key, want", [c[1:] for c in RIVAL_CASES],
                         ids=[c[0] for c in RIVAL_CASES])
def test_rivals(placed_, key, want):
    assert served_names.rivals(key, placed_) == want


@pytest.mark.parametrize("before, after, want", [
    ({}, {}, set()),
    ({"llm": ("ns/b",)}, {"llm": ("ns/b",)}, set()),  # unchanged: nobody to wake
    ({}, {"llm": ("ns/b",)}, {B}),  # a rival gained shows the conflict
    ({"llm": ("ns/b",)}, {}, {B}),  # a rival lost clears it
    ({"llm": ("ns/b",)}, {"llm": ("ns/b", "other/c")}, {B, C}),  # b's message names c now
    ({"old": ("ns/b",)}, {"new": ("other/c",)}, {B, C}),  # renamed from one clash to another
], ids=["none", "unchanged", "gained", "lost", "third joins", "renamed"])
def test_to_wake(before, after, want):
    assert served_names.to_wake(before, after) == want


def conflict(status):
    [c] = [c for c in status["conditions"] if c["type"] == "ServedNameConflict"]
    return c


def inp(rivals=None, **kw):
    return StatusInput(generation=3, replicas=0, served_name="llm", rivals=rivals or {}, **kw)


def test_condition_false_without_rivals():
    status, events = compute_status(inp(), None, T0)
    c = conflict(status)
    assert (c["status"], c["reason"]) == ("False", "NoConflict")
    assert "'llm'" in c["message"] and c["observedGeneration"] == 3
    assert not [e for e in events if "ServedName" in e.reason]


def test_condition_names_the_other_deployment_and_warns_once():
    s1, e1 = compute_status(inp({"llm": ("ns/b",)}), None, T0)
    c = conflict(s1)
    assert (c["status"], c["reason"]) == ("True", "NameClaimedByAnother")
    assert "'llm'" in c["message"] and "ns/b" in c["message"]
    assert "model_name_conflict" in c["message"]
    assert [(e.type, e.reason) for e in e1 if "ServedName" in e.reason] == [
        ("Warning", "ServedNameConflict")]
    assert "ns/b" in [e for e in e1 if e.reason == "ServedNameConflict"][0].message
    # unchanged: no new event, the transition time stays
    s2, e2 = compute_status(inp({"llm": ("ns/b",)}), s1, T1)
    assert not [e for e in e2 if "ServedName" in e.reason]
    assert conflict(s2)["lastTransitionTime"] == c["lastTransitionTime"]
    # a third claimant: warned again, naming both
    s3, e3 = compute_status(inp({"llm": ("ns/b", "other/c")}), s2, T1)
    [w] = [e for e in e3 if e.reason == "ServedNameConflict"]
    assert "ns/b" in w.message and "other/c" in w.message
    # cleared: False again, a Normal event, a new transition time
    s4, e4 = compute_status(inp(), s3, T1)
    assert (conflict(s4)["status"], conflict(s4)["reason"]) == ("False", "NoConflict")
    assert conflict(s4)["lastTransitionTime"] != c["lastTransitionTime"]
    assert [(e.type, e.reason) for e in e4 if "ServedName" in e.reason] == [
        ("Normal", "ServedNameConflictResolved")]


def test_condition_also_with_an_invalid_spec():
    status, _ = compute_status(inp({"llm": ("ns/b",)}, spec_error="spec.replicas: bad"), None, T0)
    assert conflict(status)["status"] == "True"


@pytest.mark.parametrize("router_url, served, want", [
    (None, "llm", None),
    ("http://router:8080", "llm", {"url": "http://router:8080", "model": "llm"}),
    ("http://router:8080", "", None),  # invalid spec: no served name known
], ids=["no router", "router", "no name"])
def test_status_router(router_url, served, want):
    status, _ = compute_status(StatusInput(generation=1, replicas=0, served_name=served,
                                           router_url=router_url), None, T0)
    assert status["router"] == want


def test_spec_served_name_defaults_to_the_object_name():
    from mlx_fleet_operator.spec import parse_spec, to_assignment
    base = {"model": {"source": "/m", "revision": "v1"}, "replicas": 1}
    spec = parse_spec(base)
    assert spec.served_name("obj") == "obj"
    assert to_assignment(spec, namespace="ns", name="obj").served_model_name == "obj"
    named = parse_spec({**base, "model": {**base["model"], "servedModelName": "llama"}})
    assert named.served_name("obj") == "llama"
    assert to_assignment(named, namespace="ns", name="obj").served_model_name == "llama"


# -- one rule: the operator's condition says exactly what the router refuses ----------------
_assignments = st.lists(st.tuples(st.sampled_from(["mac-a", "mac-b"]),
                                  st.sampled_from(["ns", "other"]),
                                  st.sampled_from(["a", "b", "c"]),
                                  st.sampled_from(["v1", "v2"]),
                                  st.sampled_from(["llm", "chat", "code"])), max_size=12)


@settings(max_examples=200, deadline=None)
@given(_assignments)
def test_operator_rivals_match_the_router_refusals(rows):
    stored = {(node, ns, name, rev): asg(ns, name, served, rev)
              for node, ns, name, rev, served in rows}
    router = build(nodes={}, assignments=stored, reports={})
    placed_: dict = {}
    for (node, ns, name, rev), a in stored.items():
        placed_.setdefault((ns, name), {})[(node, rev)] = a
    assert dict(router.conflicts) == names.conflicts(served_names.claims(placed_))
    for key in placed_:
        me = served_names.deployment_id(key)
        want = {m: tuple(d for d in ds if d != me)
                for m, ds in router.conflicts.items() if me in ds}
        assert served_names.rivals(key, placed_) == want
