"""The operator's etcd followers (:mod:`mlx_fleet_operator.followers`) run by its Runtime on the
in-memory store: the views fill from the store, a compaction while the watches are down is
met by a re-listing (counted in ``mlxfleet_operator_watch_restarts_total``) that catches up
and judges a node that vanished meanwhile, and a follower that keeps failing fails the
liveness probe. (Which change wakes whom: tests/test_operator_kopf.py, on the views alone.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import kopf
import pytest
from prometheus_client import REGISTRY

from fleet_helpers import node_record
from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, Keys,
                                ModelSource, StatsReport)
from mlx_fleet.memstore import MemoryStore
from mlx_fleet.supervise import dead
from mlx_fleet_operator import handlers
from mlx_fleet_operator.runtime import Runtime

GiB = 1024**3
DEP = ("default", "llm")


def restarts(watch: str) -> float:
    value = REGISTRY.get_sample_value("mlxfleet_operator_watch_restarts_total", {"watch": watch})
    assert value is not None
    return value


def report(node: str, revision: str, state: AssignmentState) -> AssignmentReport:
    return AssignmentReport(node=node, namespace=DEP[0], name=DEP[1], revision=revision,
                            state=state)


@pytest.fixture
async def rt(memory_store: MemoryStore, keys: Keys) -> AsyncIterator[Runtime]:
    r = Runtime(memory_store, keys, "test")
    yield r
    await r.close()


async def test_views_fill_from_the_store_and_relist_after_a_compaction(
        rt: Runtime, memory_store: MemoryStore, keys: Keys) -> None:
    store, views = memory_store, rt.views
    await store.put(keys.node("mac-a"), node_record("mac-a").to_json())
    await store.put(keys.node("mac-b"), node_record("mac-b").to_json())
    loading = report("mac-a", "v1", AssignmentState.LOADING)
    await store.put(keys.report("mac-a", *DEP, "v1"), loading.to_json())
    asg = Assignment(namespace=DEP[0], name=DEP[1], served_model_name="llm",
                     source=ModelSource(uri="file:///models/x", revision="v1"),
                     memory_bytes=GiB)
    await store.put(keys.assignment("mac-a", *DEP, "v1"), asg.to_json())
    wake = rt.deployment(DEP).wake
    before = {w: restarts(w) for w in ("nodes", "reports", "stats")}

    rt.start_followers()
    await views.node_view.synced.wait()
    await views.report_view.synced.wait()
    await views.stats_view.synced.wait()
    assert set(rt.nodes) == {"mac-a", "mac-b"} and rt.placement_nodes() is rt.nodes
    assert rt.reports == {DEP: {("mac-a", "v1"): loading}}
    assert rt.stats == {}
    assert [kv.key for kv in rt.assignments.items()] == [keys.assignment("mac-a", *DEP, "v1")]

    # One event each, so every follower is past its listing and watching.
    stats = StatsReport(node="mac-a", namespace=DEP[0], name=DEP[1], canary_uid="c1")
    await views.stats_view.wait_for(await store.put(keys.stats("mac-a", *DEP), stats.to_json()))
    await views.report_view.wait_for(await store.put(
        keys.report("mac-a", *DEP, "v1"), report("mac-a", "v1", AssignmentState.READY).to_json()))
    await views.node_view.wait_for(await store.put(keys.node("mac-c"),
                                                   node_record("mac-c").to_json()))
    assert rt.stats == {DEP: {"mac-a": stats}} and wake.is_set()
    wake.clear()

    # The watches break; meanwhile mac-b goes, a report and the statistics change, and the
    # history is compacted past where the followers would resume.
    assert memory_store.break_watches() >= 3
    await store.delete(keys.node("mac-b"))
    ready_b = report("mac-b", "v1", AssignmentState.READY)
    await store.put(keys.report("mac-b", *DEP, "v1"), ready_b.to_json())
    await store.delete(keys.stats("mac-a", *DEP))
    await store.compact(memory_store.revision)

    await views.node_view.wait_until(lambda nodes: "mac-b" not in nodes)
    await views.report_view.wait_until(lambda r: ("mac-b", *DEP, "v1") in r)
    await views.stats_view.wait_until(lambda s: not s)
    assert {w: restarts(w) - before[w] for w in before} == {"nodes": 1, "reports": 1, "stats": 1}
    assert set(rt.nodes) == {"mac-a", "mac-c"} and rt.stats == {}
    assert rt.reports[DEP][("mac-b", "v1")] == ready_b and wake.is_set()
    assert rt.held_nodes() == {"mac-b"}  # vanished meanwhile: judged like a deleted record
    assert all(h.alive and h.restarts == 0 for h in rt.followers.values())


class FailingStore(MemoryStore):
    """A store whose listings fail with a bug (not a transport error): the followers die."""

    async def list(self, prefix: str):  # type: ignore[override]
        raise RuntimeError(f"bug listing {prefix}")


async def test_a_dead_follower_fails_the_liveness_probe(keys: Keys) -> None:
    async with FailingStore() as store:
        rt = Runtime(store, keys, "test")
        try:
            memo = {"runtime": rt}
            assert await handlers.probe_followers(memo) == {}  # nothing started: nothing down
            rt.start_followers()
            while not dead(rt.followers.values()):
                await asyncio.sleep(0)  # let the followers run their first listing
            with pytest.raises(kopf.PermanentError, match="etcd follower: nodes"):
                await handlers.probe_followers(memo)
            assert not rt.views.node_view.synced.is_set() and rt.placement_nodes() is None
        finally:
            await rt.close()
