"""Issue 19, finding 10: what placement believes of an agent's record (mlx_fleet_operator.
node_claims, mlx_fleet.chips). Labels a node selector matches come from the MacNode (the cluster
admin's) or carry the agent prefix; memory counts up to what the chip can have. Table tests of the
pure rules, then a rogue agent's record against placement and the MacNode status."""

from __future__ import annotations

import pytest

from mlx_fleet.chips import (LARGEST_UNIFIED_MEMORY_BYTES, chip_generation, chip_model,
                             max_unified_memory_bytes)
from mlx_fleet.contract import NodeCapacity, NodeRecord
from mlx_fleet_operator.macnodes import gone_status, macnode_status
from mlx_fleet_operator.node_claims import (AGENT_LABEL_PREFIX, claims, ignored_labels,
                                            node_label, trusted_generation,
                                            trusted_memory_bytes)
from mlx_fleet_operator.placement import PlacementRequest, node_budget_bytes, place

GiB = 2**30
RACK = f"{AGENT_LABEL_PREFIX}rack"


def record(name: str, *, chip: str = "Apple M4 Max", gen: int = 4, mem_gib: float = 64,
           labels: dict[str, str] | None = None) -> NodeRecord:
    return NodeRecord(name=name, address=f"https://{name}.example:8000", labels=labels or {},
                      capacity=NodeCapacity(memory_total_bytes=int(mem_gib * GiB),
                                            memory_available_bytes=int(mem_gib * GiB),
                                            chip=chip, chip_generation=gen))


@pytest.mark.parametrize("chip, model, gib", [
    ("Apple M1", (1, ""), 16), ("Apple M1 Pro", (1, "Pro"), 32), ("Apple M1 Max", (1, "Max"), 64),
    ("Apple M1 Ultra", (1, "Ultra"), 128), ("Apple M2", (2, ""), 24), ("Apple M2 Max", (2, "Max"), 96),
    ("Apple M2 Ultra", (2, "Ultra"), 192), ("Apple M3", (3, ""), 24), ("Apple M3 Pro", (3, "Pro"), 36),
    ("Apple M3 Max", (3, "Max"), 128), ("Apple M3 Ultra", (3, "Ultra"), 512),
    ("Apple M4", (4, ""), 32), ("Apple M4 Pro", (4, "Pro"), 64), ("Apple M4 Max", (4, "Max"), 128),
    ("apple m4 max", (4, "Max"), 128), ("Apple M5", (5, ""), 32),
    # not in the table: the most any Mac has
    ("Apple M4 Ultra", (4, "Ultra"), 512), ("Apple M9", (9, ""), 512),
    ("Intel(R) Core(TM) i9", None, 512), ("", None, 512),
])
def test_chip_memory_table(chip: str, model: tuple[int, str] | None, gib: int) -> None:
    assert chip_model(chip) == model
    assert max_unified_memory_bytes(chip) == gib * GiB
    assert chip_generation(chip) == (model[0] if model else 0)
    assert max_unified_memory_bytes(chip) <= LARGEST_UNIFIED_MEMORY_BYTES


@pytest.mark.parametrize("key, agent, macnode, seen", [
    ("tier", {"tier": "secure"}, {}, None),                      # self-asserted: ignored
    ("tier", {"tier": "secure"}, {"tier": "batch"}, "batch"),    # the admin's wins
    ("tier", {}, {"tier": "secure"}, "secure"),
    (RACK, {RACK: "a"}, {}, "a"),                                # the agent's own prefix
    (RACK, {RACK: "a"}, {RACK: "b"}, "b"),                       # the admin may override it
    (RACK, {}, {}, None),
    ("agent.mlx-fleet.io.evil.example/rack", {"agent.mlx-fleet.io.evil.example/rack": "a"}, {},
     None),                                                      # not the prefix
])
def test_node_label(key: str, agent: dict[str, str], macnode: dict[str, str],
                    seen: str | None) -> None:
    assert node_label(record("m", labels=agent), key, macnode) == seen


@pytest.mark.parametrize("chip, gen, mem_gib, counted_gib, counted_gen", [
    ("Apple M4 Max", 4, 64, 64, 4),
    ("Apple M4 Max", 4, 128, 128, 4),
    ("Apple M4 Max", 4, 1024, 128, 4),        # a terabyte claimed: an M4 Max has 128 GB at most
    ("Apple M3", 3, 64, 24, 3),
    ("Apple M3 Max", 9, 64, 64, 3),           # the generation the name says
    ("Apple M3 Max", 2, 64, 64, 2),           # a lower claim stands
    ("Intel(R) Xeon(R)", 5, 64, 64, 0),       # no Apple chip: generation 0
    ("Apple M9 Ultra", 9, 4096, 512, 9),      # unknown chip: the most any Mac has
])
def test_capacity_bounds(chip: str, gen: int, mem_gib: int, counted_gib: int,
                         counted_gen: int) -> None:
    c = record("m", chip=chip, gen=gen, mem_gib=mem_gib).capacity
    assert trusted_memory_bytes(c) == counted_gib * GiB
    assert trusted_generation(c) == counted_gen


def test_ignored_labels_are_the_unprefixed_ones() -> None:
    assert ignored_labels({"tier": "x", RACK: "a", "kubernetes.io/hostname": "m"}) == (
        "kubernetes.io/hostname", "tier")


# -- a rogue agent ------------------------------------------------------------------------------


def test_rogue_agents_labels_and_memory_do_not_attract_a_deployment() -> None:
    """``secure`` (an M4 Max with 64 GiB) carries the admin's ``tier=secure`` label on its
    MacNode. ``rogue``, with an agent credential, claims ``tier=secure`` and a terabyte of
    memory on an M4 Max in its own record: placement ignores the label (the deployment goes to
    ``secure`` only), and counts at most 128 GiB for it, so a 200 GiB replica fits nowhere."""
    secure = record("secure")
    rogue = record("rogue", mem_gib=1024, labels={"tier": "secure", RACK: "r1"})
    request = PlacementRequest(namespace="ns", name="llm", replicas=2, memory_bytes=8 * GiB,
                               revision="v1", node_selector={"tier": "secure"},
                               node_labels={"secure": {"tier": "secure"}})
    decision = place(request, [secure, rogue], {})
    assert decision.nodes == ("secure",) and decision.unplaced == 1
    assert "1 not matching node selector tier=secure" in decision.message
    # the agent's own prefixed label is believed
    by_rack = PlacementRequest(namespace="ns", name="r", replicas=1, memory_bytes=8 * GiB,
                               revision="v1", node_selector={RACK: "r1"})
    assert place(by_rack, [secure, rogue], {}).nodes == ("rogue",)
    # the memory: 80 % of 128 GiB, not of 1 TiB
    assert node_budget_bytes(rogue) == int(128 * GiB * 0.8)
    huge = PlacementRequest(namespace="ns", name="big", replicas=1, memory_bytes=200 * GiB,
                            revision="v1")
    decision = place(huge, [secure, rogue], {})
    assert decision.nodes == () and "insufficient memory" in decision.message


def test_rogue_agent_is_flagged_on_its_macnode() -> None:
    rogue = record("rogue", mem_gib=1024, labels={"tier": "secure", RACK: "r1"})
    found = claims(rogue)
    assert not found.accepted and found.ignored == ("tier",)
    status = macnode_status(rogue, [], now="2026-01-01T00:00:00Z")
    [cond] = [c for c in status["conditions"] if c["type"] == "ClaimsAccepted"]
    assert (cond["status"], cond["reason"]) == ("False", "ClaimsIgnored")
    assert "label(s) tier ignored for placement" in cond["message"]
    assert "1.0TiB is more than a Mac with Apple M4 Max can have: placement counts 128.0GiB" \
        in cond["message"]
    assert status["memoryBudgetBytes"] == node_budget_bytes(rogue)  # what placement counts
    # the condition survives the record's loss (kept with health Gone)
    gone = gone_status(status, now="2026-01-01T00:01:00Z")
    assert [c["type"] for c in gone["conditions"]] == ["Drained", "ClaimsAccepted"]
    honest = macnode_status(record("ok", labels={RACK: "a"}), [], previous=status,
                            now="2026-01-01T00:02:00Z")
    [cond] = [c for c in honest["conditions"] if c["type"] == "ClaimsAccepted"]
    assert (cond["status"], cond["reason"]) == ("True", "AsReported")
    assert cond["lastTransitionTime"] == "2026-01-01T00:02:00Z"


# -- through the operator, on a real API server --------------------------------------------------


@pytest.mark.integration
async def test_rogue_agent_through_the_operator(control_plane, keys, namespace, tmp_path) -> None:
    """Two records in etcd: ``sec`` (honest, no labels) and ``rogue`` (an agent credential's
    claims: ``tier=secure`` and a terabyte). The cluster admin labels ``sec``'s MacNode
    ``tier=secure``; a two-replica deployment selecting it lands on ``sec`` alone (the rogue
    does not match), and the rogue's MacNode says why in ``ClaimsAccepted``."""
    import asyncio
    import json
    import uuid

    from fleet_helpers import node_record, stub_manifest, until_assignments
    from mlx_fleet.store import EtcdStore
    from test_integration_operator import kwait
    from test_operator_kopf import running_operator

    sec, rogue = f"sec-{uuid.uuid4().hex[:6]}", f"rogue-{uuid.uuid4().hex[:6]}"
    honest = node_record(sec)
    liar = node_record(rogue).model_copy(update={
        "labels": {"tier": "secure"},
        "capacity": node_record(rogue).capacity.model_copy(
            update={"memory_total_bytes": 1024 * GiB})})
    with running_operator(control_plane, keys, namespace, tmp_path / "operator.log"):
        async with EtcdStore(control_plane.etcd_url) as store:
            lease = await store.grant_lease(60)
            try:
                await store.put(keys.node(sec), honest.to_json(), lease=lease)
                await store.put(keys.node(rogue), liar.to_json(), lease=lease)
                for mac in (sec, rogue):
                    await kwait(control_plane, f"macnode/{mac}", "create")
                await kwait(control_plane, f"macnode/{rogue}",
                            'jsonpath={.status.conditions[?(@.type=="ClaimsAccepted")].reason}'
                            "=ClaimsIgnored")
                obj = json.loads((await asyncio.to_thread(
                    control_plane.kubectl, "get", "macnode", rogue, "-o", "json")).stdout)
                [cond] = [c for c in obj["status"]["conditions"]
                          if c["type"] == "ClaimsAccepted"]
                assert "label(s) tier ignored for placement" in cond["message"]
                assert "placement counts 128.0GiB" in cond["message"]
                assert obj["status"]["memoryBudgetBytes"] == int(128 * GiB * 0.8)
                await kwait(control_plane, f"macnode/{sec}",
                            'jsonpath={.status.conditions[?(@.type=="ClaimsAccepted")].reason}'
                            "=AsReported")

                await asyncio.to_thread(control_plane.kubectl, "label", "macnode", sec,
                                        "tier=secure")
                name = f"llm-{uuid.uuid4().hex[:6]}"
                await asyncio.to_thread(
                    control_plane.kubectl, "apply", "-f", "-", input=stub_manifest(
                        name, namespace, replicas=2,
                        placement={"nodeSelector": {"tier": "secure"}}))
                placed = await until_assignments(store, keys, lambda v: sec in v)
                assert placed[sec].name == name and rogue not in placed
                # the status of that placement (the one that saw the label) names the rogue out
                await kwait(control_plane, f"modeldeployment/{name}",
                            f"jsonpath={{.status.nodes[*].name}}={sec}", namespace)
                md = json.loads((await asyncio.to_thread(
                    control_plane.kubectl, "get", "modeldeployment", name, "-n", namespace,
                    "-o", "json")).stdout)
                [deg] = [c for c in md["status"]["conditions"] if c["type"] == "Degraded"]
                assert "1 not matching node selector tier=secure" in deg["message"], deg
                assert [n["name"] for n in md["status"]["nodes"]] == [sec]
            finally:
                await store.revoke_lease(lease)
                for mac in (sec, rogue):
                    await asyncio.to_thread(control_plane.kubectl, "delete", "macnode", mac,
                                            "--wait=false", check=False)
