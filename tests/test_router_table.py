"""The fleet router's routing table (mlx_fleet_router.table.build): which replicas are Ready per
served model name, scope by namespace, the served-name conflict — table tests on plain data."""

from __future__ import annotations

import pytest

from mlx_fleet.capabilities import (CHAT_PATH, EMBEDDINGS_PATH, ModelCapabilities,
                                    required_capabilities)
from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, ModelSource,
                                NodeCapacity, NodeHealth, NodeRecord, ServingParams,
                                StatsReport, TrafficSplit, IDLE_UNLOADED)
from mlx_fleet_router.table import Replica, Table, build

CAP = NodeCapacity(memory_total_bytes=64 << 30, memory_available_bytes=60 << 30,
                   chip="Apple M4 Max", chip_generation=4)


def node(name: str, health: NodeHealth = NodeHealth.HEALTHY) -> NodeRecord:
    return NodeRecord(name=name, address=f"http://{name}:8000", capacity=CAP, health=health)


def asg(ns: str, name: str, rev: str, *, served: str = "chat", gen: int = 1,
        batch: int = 8) -> Assignment:
    return Assignment(namespace=ns, name=name, generation=gen, served_model_name=served,
                      source=ModelSource(uri="file:///m", revision=rev), memory_bytes=1,
                      serving=ServingParams(max_concurrent_sequences=batch))


def rep(node_: str, ns: str, name: str, rev: str, state: AssignmentState = AssignmentState.READY,
        *, gen: int = 1, reason: str = "", endpoint: str | None = None,
        capabilities: ModelCapabilities | None = None) -> AssignmentReport:
    return AssignmentReport(node=node_, namespace=ns, name=name, generation=gen, revision=rev,
                            state=state, reason=reason, capabilities=capabilities,
                            endpoint=f"http://{node_}:8000/" if endpoint is None else endpoint)


def split(ns: str = "team", name: str = "chat", uid: str = "u1") -> TrafficSplit:
    return TrafficSplit(namespace=ns, name=name, served_model_name="chat", stable_revision="r1",
                        candidate_revision="r2", weight=10, canary_uid=uid)


K_A = ("mac-a", "team", "chat", "r1")
K_B = ("mac-b", "team", "chat", "r1")


def ready(table: Table, model: str = "chat") -> list[tuple[str, str]]:
    return [(r.node, r.revision) for r in table.models[model].replicas]


@pytest.mark.parametrize("case, reports, nodes, expected", [
    ("both Ready", {K_A: rep(*K_A), K_B: rep(*K_B)}, ["mac-a", "mac-b"],
     [("mac-a", "r1"), ("mac-b", "r1")]),
    ("no report yet", {K_A: rep(*K_A)}, ["mac-a", "mac-b"], [("mac-a", "r1")]),
    ("loading", {K_A: rep(*K_A), K_B: rep(*K_B, AssignmentState.LOADING)}, ["mac-a", "mac-b"],
     [("mac-a", "r1")]),
    ("failed", {K_A: rep(*K_A, AssignmentState.FAILED)}, ["mac-a"], []),
    ("standby serves", {K_A: rep(*K_A, AssignmentState.UNLOADED, reason=IDLE_UNLOADED)},
     ["mac-a"], [("mac-a", "r1")]),
    ("report of an older generation", {K_A: rep(*K_A, gen=0), K_B: rep(*K_B)},
     ["mac-a", "mac-b"], [("mac-b", "r1")]),
    ("node record gone (lease lost)", {K_A: rep(*K_A), K_B: rep(*K_B)}, ["mac-b"],
     [("mac-b", "r1")]),
])
def test_ready_replicas(case, reports, nodes, expected):
    table = build(nodes={n: node(n) for n in nodes},
                  assignments={K_A: asg("team", "chat", "r1"), K_B: asg("team", "chat", "r1")},
                  reports=reports)
    assert ready(table) == expected, case
    assert table.models["chat"].deployment == "team/chat"
    assert not table.conflicts


def test_endpoint_from_report_else_node_address_and_draining_is_cordoned():
    table = build(nodes={"mac-a": node("mac-a"), "mac-b": node("mac-b", NodeHealth.DRAINING)},
                  assignments={K_A: asg("team", "chat", "r1", batch=4),
                               K_B: asg("team", "chat", "r1")},
                  reports={K_A: rep(*K_A, endpoint="http://mac-a.example:9000/"),
                           K_B: rep(*K_B, endpoint="")})
    assert table.models["chat"].replicas == (
        Replica("mac-a", "r1", "http://mac-a.example:9000", cordoned=False, batch_limit=4),
        Replica("mac-b", "r1", "http://mac-b:8000", cordoned=True, batch_limit=8))


def test_two_revisions_and_the_split_and_guard():
    k2 = ("mac-b", "team", "chat", "r2")
    records = dict(nodes={"mac-a": node("mac-a"), "mac-b": node("mac-b")},
                   assignments={K_A: asg("team", "chat", "r1"), k2: asg("team", "chat", "r2")},
                   reports={K_A: rep(*K_A), k2: rep(*k2)},
                   splits={("team", "chat"): split()})
    served = build(**records).models["chat"]
    assert served.revisions == ("r1", "r2")
    assert served.split == split()
    assert served.guard_tripped is False
    tripped = StatsReport(node="mac-b", namespace="team", name="chat", canary_uid="u1",
                          guard_tripped=True)
    assert build(**records, stats={("mac-b", "team", "chat"): tripped}).models[
        "chat"].guard_tripped is True
    # a trip of an earlier canary (another uid) does not count for this split
    old = tripped.model_copy(update={"canary_uid": "u0"})
    assert build(**records, stats={("mac-b", "team", "chat"): old}).models[
        "chat"].guard_tripped is False


def test_scope_by_namespace():
    k_other = ("mac-a", "other", "chat2", "r1")
    records = dict(nodes={"mac-a": node("mac-a")},
                   assignments={K_A: asg("team", "chat", "r1"),
                                k_other: asg("other", "chat2", "r1", served="other-chat")},
                   reports={K_A: rep(*K_A), k_other: rep(*k_other)})
    assert set(build(**records).models) == {"chat", "other-chat"}
    assert set(build(**records, namespaces={"team"}).models) == {"chat"}
    assert set(build(**records, namespaces=set()).models) == set()


def test_served_name_conflict_refuses_the_name_in_scope_only():
    k_other = ("mac-b", "other", "chat", "r1")
    records = dict(nodes={"mac-a": node("mac-a"), "mac-b": node("mac-b")},
                   assignments={K_A: asg("team", "chat", "r1"),
                                k_other: asg("other", "chat", "r1")},  # both serve "chat"
                   reports={K_A: rep(*K_A)})  # the other is not even Ready: still a claim
    table = build(**records)
    assert "chat" not in table.models
    assert table.conflicts == {"chat": ("other/chat", "team/chat")}
    scoped = build(**records, namespaces={"team"})
    assert ready(scoped) == [("mac-a", "r1")]
    assert not scoped.conflicts


def test_assigned_without_a_ready_replica_is_known_but_empty():
    table = build(nodes={}, assignments={K_A: asg("team", "chat", "r1")}, reports={})
    assert table.models["chat"].replicas == ()
    assert table.models["chat"].revisions == ()


TOOLS = ModelCapabilities(tool_calling=True, tool_parser="json_tools", max_n=2)
PLAIN = ModelCapabilities()
TOOL_BODY = {"tools": [{"type": "function", "function": {"name": "f"}}]}


@pytest.mark.parametrize(("caps_a", "caps_b", "body", "missing"), [
    (PLAIN, TOOLS, TOOL_BODY, None),                 # mac-b has it
    (PLAIN, None, TOOL_BODY, None),                  # mac-b unknown: it may
    (PLAIN, PLAIN, TOOL_BODY, ("tools", None)),
    (PLAIN, TOOLS, {"n": 3}, ("n", 2)),              # the largest bound offered
    (PLAIN, PLAIN, {}, None),
])
def test_replicas_carry_their_reported_capabilities(caps_a, caps_b, body, missing):
    table = build(nodes={"mac-a": node("mac-a"), "mac-b": node("mac-b", NodeHealth.DRAINING)},
                  assignments={K_A: asg("team", "chat", "r1"), K_B: asg("team", "chat", "r1")},
                  reports={K_A: rep(*K_A, capabilities=caps_a),
                           K_B: rep(*K_B, capabilities=caps_b)})
    served = table.models["chat"]
    assert [r.capabilities for r in served.replicas] == [caps_a, caps_b]
    got = served.missing(required_capabilities(CHAT_PATH, body))
    # a cordoned replica's capability still counts (availability is the picker's concern)
    assert (None if got is None else (got.param, got.limit)) == missing


def test_a_model_without_replicas_misses_nothing():
    table = build(nodes={}, assignments={K_A: asg("team", "chat", "r1")}, reports={})
    assert table.models["chat"].missing(required_capabilities(CHAT_PATH, TOOL_BODY)) is None


@pytest.mark.parametrize(("task", "path", "body", "missing"), [
    # a replica of an older agent (no capabilities) is known by its assignment's task
    ("TextGeneration", CHAT_PATH, TOOL_BODY, None),            # it may serve tools
    ("TextEmbedding", CHAT_PATH, {}, ("model", "wrong_model_task")),
    ("TextEmbedding", CHAT_PATH, TOOL_BODY, ("model", "wrong_model_task")),
    ("TextEmbedding", EMBEDDINGS_PATH, {"input": "x"}, None),
    ("TextGeneration", EMBEDDINGS_PATH, {"input": "x"}, ("model", "wrong_model_task")),
])
def test_an_unknown_replica_carries_its_assignments_task(task, path, body, missing):
    a = asg("team", "chat", "r1").model_copy(update={"task": task})
    table = build(nodes={"mac-a": node("mac-a")}, assignments={K_A: a},
                  reports={K_A: rep(*K_A)})
    (replica,) = table.models["chat"].replicas
    assert replica.capabilities is None and replica.task == task
    got = table.models["chat"].missing(required_capabilities(path, body))
    assert (None if got is None else (got.param, got.code)) == missing
