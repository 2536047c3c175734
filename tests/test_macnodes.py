"""MacNode: the pure status mirror and a mirror round (table tests, a fake API). The operator
mirroring a node record into a MacNode and honouring its cordon on the real control plane, and
the CLI's cordon of an unknown node, are in tests/test_integration_operator.py."""

from __future__ import annotations

import json

import pytest

from fleet_helpers import node_record
from mlx_fleet.contract import (Assignment, ModelSource, NodeCapacity, NodeHealth, NodeRecord,
                                node_budget_bytes)
from mlx_fleet_operator import macnodes
from mlx_fleet_operator.macnodes import gone_status, macnode_status, status_changed

GiB = 1024**3


def rec(health: NodeHealth = NodeHealth.HEALTHY, wired: int = 0, beat: float = 1_700_000_000.0,
        simulated: bool = True, limit: int = 0, watermark: float = 0.8) -> NodeRecord:
    return NodeRecord(name="mac-a", address="http://mac-a:8000", health=health,
                      heartbeat_unix=beat,
                      capacity=NodeCapacity(memory_total_bytes=64 * GiB,
                                            memory_available_bytes=60 * GiB,
                                            wired_limit_bytes=wired, chip="Apple M4 Max",
                                            chip_generation=4, simulated=simulated,
                                            max_loaded_models=limit,
                                            memory_watermark=watermark))


def asg(name: str, gib: int, revision: str = "v1", ns: str = "default") -> Assignment:
    return Assignment(namespace=ns, name=name, served_model_name=name,
                      source=ModelSource(uri="/m", revision=revision), memory_bytes=gib * GiB)


@pytest.mark.parametrize("record, assignments, want", [
    (rec(), [], {"health": "Healthy", "memoryReservedBytes": 0, "loadedModels": [],
                 "modelCount": 0, "memoryBudgetBytes": node_budget_bytes(64 * GiB, 0),
                 "memoryWatermark": 0.8, "maxLoadedModels": 0}),
    # the agent's --memory-watermark: the budget and the summary follow it
    (rec(watermark=0.5), [asg("a", 2)], {"memoryWatermark": 0.5,
                                          "memoryBudgetBytes": 32 * GiB,
                                          "memory": "2.0GiB / 32.0GiB"}),
    (rec(wired=24 * GiB, watermark=0.5), [], {"memoryBudgetBytes": 24 * GiB}),
    (rec(limit=2), [asg("a", 2)], {"modelCount": 1, "maxLoadedModels": 2}),
    (rec(), [asg("b", 4), asg("a", 2, "v2"), asg("a", 2, "v1")],
     {"memoryReservedBytes": 8 * GiB, "modelCount": 3, "memory": "8.0GiB / 51.2GiB",
      "loadedModels": ["default/a@v1", "default/a@v2", "default/b@v1"]}),
    (rec(wired=32 * GiB), [], {"memoryBudgetBytes": 32 * GiB}),
    (rec(NodeHealth.DRAINING, simulated=False), [], {"health": "Draining", "simulated": False}),
    (rec(), [], {"chip": "Apple M4 Max", "chipGeneration": 4, "memoryTotalBytes": 64 * GiB,
                 "address": "http://mac-a:8000", "simulated": True,
                 "lastSeen": "2023-11-14T22:13:20Z", "unschedulable": False}),
], ids=["empty", "watermark", "wired cap below the watermark", "model limit",
        "reserved and models", "wired cap", "health", "static fields"])
def test_macnode_status(record, assignments, want):
    got = macnode_status(record, assignments)
    assert {k: got[k] for k in want} == want


def test_gone_keeps_the_last_facts_and_clears_the_load():
    live = macnode_status(rec(), [asg("a", 2)], unschedulable=True)
    gone = gone_status(live, unschedulable=True)
    assert gone["health"] == "Gone" and gone["chip"] == "Apple M4 Max"
    assert (gone["memoryReservedBytes"], gone["loadedModels"], gone["modelCount"]) == (0, [], 0)
    assert gone["memory"] == "0B / 51.2GiB"
    assert gone["lastSeen"] == live["lastSeen"] and gone["unschedulable"] is True


@pytest.mark.parametrize("old, new, changed", [
    (None, {"health": "Healthy"}, True),
    ({"health": "Healthy", "lastSeen": "2024-01-01T00:00:00Z"},
     {"health": "Healthy", "lastSeen": "2024-01-01T00:00:10Z"}, False),  # a heartbeat only
    ({"health": "Healthy", "lastSeen": "2024-01-01T00:00:00Z"},
     {"health": "Healthy", "lastSeen": "2024-01-01T00:01:00Z"}, True),  # refreshed each minute
    ({"health": "Healthy", "lastSeen": "2024-01-01T00:00:00Z"},
     {"health": "Degraded", "lastSeen": "2024-01-01T00:00:00Z"}, True),
    ({"health": "Healthy"}, {"health": "Healthy"}, False),
], ids=["new", "heartbeat", "minute", "health", "same"])
def test_status_changed(old, new, changed):
    assert status_changed(old, new) is changed


def test_cordoned_reads_spec_unschedulable():
    objs = [{"metadata": {"name": "a"}, "spec": {"unschedulable": True}},
            {"metadata": {"name": "b"}, "spec": {"unschedulable": False}},
            {"metadata": {"name": "c"}}]
    assert macnodes.cordoned(objs) == frozenset({"a"})



class _FakeMacNodeAPI:
    """The three CustomObjectsApi calls of a mirror round, over a dict, counting writes."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.creates: list[str] = []
        self.patches: list[tuple[str, dict]] = []

    def list_cluster_custom_object(self, *_args, **_kw) -> dict:
        return {"items": [json.loads(json.dumps(o)) for o in self.objects.values()]}

    def create_cluster_custom_object(self, _g, _v, _p, body, **_kw) -> dict:
        name = body["metadata"]["name"]
        self.creates.append(name)
        self.objects[name] = {**body, "metadata": {**body["metadata"], "generation": 1}}
        return json.loads(json.dumps(self.objects[name]))

    def patch_cluster_custom_object_status(self, _g, _v, _p, name, body, **_kw) -> None:
        self.patches.append((name, body["status"]))
        self.objects[name]["status"] = body["status"]


def test_a_new_macnode_is_patched_once_with_its_generation():
    """A mirror round creates the missing MacNode and patches its status once, observing the
    created object's generation; the next round, with nothing changed, writes nothing (before,
    the status said generation 0 and every new MacNode was patched again the next round)."""
    from mlx_fleet_operator.macnode_mirror import macnode_round as _macnode_round

    api, cache = _FakeMacNodeAPI(), {}
    nodes = {"mac-a": node_record("mac-a")}
    assert _macnode_round(api, nodes, {}, cache, {}) == (frozenset(), frozenset(), {})
    assert api.creates == ["mac-a"]
    [(name, status)] = api.patches
    assert name == "mac-a" and status["conditions"][0]["observedGeneration"] == 1
    _macnode_round(api, nodes, {}, cache, {})
    _macnode_round(api, nodes, {}, {}, {})  # a restarted operator (no cache): the stored status
    assert len(api.patches) == 1 and api.creates == ["mac-a"]
