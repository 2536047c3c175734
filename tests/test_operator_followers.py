"""The operator's etcd followers (:mod:`mlx_fleet_operator.followers`) run by its Runtime on the
in-memory store: the views fill from the store, a compaction while the watches are down is
met by a re-listing (counted in ``mlxfleet_operator_watch_restarts_total``) that catches up
and judges a node that vanished meanwhile, and a follower that keeps failing fails the
liveness probe; and, on the views' callbacks alone, which change wakes whom."""

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
from mlx_fleet.store import KV, Snapshot, WatchEvent
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


async def test_followers_wake_only_on_relevant_changes():
    """Heartbeats must not re-place anything; a node that appears, changes or goes wakes the
    deployments it concerns (a replica on it, or something left unplaced), not every one; a
    changed report wakes its deployment."""

    keys = Keys("/t")
    rt = Runtime(store=None, keys=keys, writer="test")  # the followers' callbacks only
    views = rt.views
    wake = rt.deployment(("default", "llm")).wake          # a replica on mac-a
    other = rt.deployment(("default", "other")).wake       # a replica left unplaced
    settled = rt.deployment(("default", "settled")).wake   # fully placed on mac-b
    rt.deployment(("default", "llm")).placed = {("mac-a", "v1"): None}
    rt.deployment(("default", "settled")).placed = {("mac-b", "v1"): None}
    rt.deployment(("default", "other")).unsettled = True
    rec = node_record("mac-a")

    def ev(key: str, value: bytes, rev: int, type_: str = "PUT") -> WatchEvent:
        return WatchEvent(type=type_, kv=KV(key=key, value=value, mod_revision=rev))

    await views.node_view.apply_snapshot(Snapshot(items=[], revision=1))
    wake.clear(), other.clear(), settled.clear()  # a snapshot that changes the fleet wakes all
    await views.node_view.apply_event(ev(keys.node("mac-a"), rec.to_json(), 2))
    assert wake.is_set() and other.is_set() and set(rt.nodes) == {"mac-a"}
    assert not settled.is_set()
    wake.clear(), other.clear()
    beat = rec.model_copy(update={"heartbeat_unix": rec.heartbeat_unix + 5})
    await views.node_view.apply_event(ev(keys.node("mac-a"), beat.to_json(), 3))
    assert not wake.is_set() and not other.is_set()
    await views.node_view.apply_event(ev(keys.node("mac-a"), b"", 4, "DELETE"))
    # judged a moment later, with whatever else vanished by then (disruption.py); meanwhile
    # its replicas are held
    assert rt.nodes == {} and rt.held_nodes() == {"mac-a"} and not wake.is_set()
    rt.holds.judge()  # what the timer runs: one node of one gone is node loss
    assert wake.is_set() and other.is_set() and not settled.is_set()
    assert rt.held_nodes() == frozenset()
    wake.clear(), other.clear()

    # Reports are per (node, revision); a changed one wakes the deployment and its Canary.
    canary = rt.canary_wakeup(("default", "llm"))
    report_key = keys.report("mac-a", "default", "llm", "v2")
    report = AssignmentReport(node="mac-a", namespace="default", name="llm", revision="v2",
                              state=AssignmentState.LOADING)
    await views.report_view.apply_event(ev(report_key, report.to_json(), 5))
    assert wake.is_set() and canary.is_set() and not other.is_set()
    assert rt.reports[("default", "llm")] == {("mac-a", "v2"): report}
    wake.clear(), canary.clear()
    later = report.model_copy(update={"updated_unix": report.updated_unix + 1})
    await views.report_view.apply_event(ev(report_key, later.to_json(), 6))
    assert not wake.is_set() and not canary.is_set()
    await views.report_view.apply_event(ev(report_key, b"", 7, "DELETE"))
    assert wake.is_set() and canary.is_set() and ("default", "llm") not in rt.reports


async def test_nodes_vanishing_together_are_held_and_released_when_back_or_after_the_hold(
        monkeypatch):
    """Most nodes vanishing within the judging window (etcd revoking every lease as it resumes
    from a freeze): their replicas are held, not re-placed; a node back is released at once, one
    still missing when the hold ends is re-placed then. A lone node lost is re-placed."""
    from mlx_fleet_operator import holds

    monkeypatch.setattr(holds, "HOLD_SECONDS", 30.0)
    keys = Keys("/t")
    now = [100.0]
    rt = Runtime(store=None, keys=keys, writer="test", clock=lambda: now[0])
    views = rt.views
    names = ("mac-a", "mac-b", "mac-c")
    recs = {n: node_record(n) for n in names}
    wakes = {n: rt.deployment(("default", n)).wake for n in names}  # one deployment per node
    for n in names:
        rt.deployment(("default", n)).placed = {(n, "v1"): None}

    def ev(name: str, rev: int, gone: bool = False) -> WatchEvent:
        return WatchEvent(type="DELETE" if gone else "PUT", kv=KV(
            key=keys.node(name), value=b"" if gone else recs[name].to_json(), mod_revision=rev))

    def judge() -> None:
        rt.holds.judge()  # what its timer runs (cancelled)

    await views.node_view.apply_snapshot(Snapshot(items=[ev(n, 1).kv for n in names], revision=1))
    for w in wakes.values():
        w.clear()
    try:
        await views.node_view.apply_event(ev("mac-a", 2, gone=True))
        await views.node_view.apply_event(ev("mac-b", 3, gone=True))
        judge()  # 2 of 3 gone within the window: a disruption
        assert rt.held_nodes() == {"mac-a", "mac-b"}
        assert not any(w.is_set() for w in wakes.values())  # nothing re-placed

        now[0] += 0.05
        await views.node_view.apply_event(ev("mac-a", 4))  # re-registered: released at once
        assert rt.held_nodes() == {"mac-b"} and wakes["mac-a"].is_set()
        assert not wakes["mac-b"].is_set()

        now[0] += 30.0  # the hold ends with mac-b still missing: its replicas are re-placed
        rt.holds.observe()  # what the hold timer runs (cancelled)
        assert rt.held_nodes() == frozenset() and wakes["mac-b"].is_set()
        assert not wakes["mac-c"].is_set()

        for w in wakes.values():
            w.clear()
        await views.node_view.apply_event(ev("mac-c", 5, gone=True))  # 1 of 2: node loss
        assert rt.held_nodes() == {"mac-c"}  # (until judged)
        judge()
        assert rt.held_nodes() == frozenset() and wakes["mac-c"].is_set()
    finally:
        rt.holds.close()


async def test_stats_follower_keeps_the_view_and_wakes_the_canary_on_a_guard_trip_only():
    """stats/<node>/<ns>/<name> fills Runtime.stats; only a report that newly trips the local
    guard wakes the Canary daemon at once (routine stats wait for its next tick)."""

    keys = Keys("/t")
    rt = Runtime(store=None, keys=keys, writer="test")
    views = rt.views
    canary = rt.canary_wakeup(("default", "llm"))
    key = keys.stats("mac-a", "default", "llm")

    def ev(value: bytes, rev: int, type_: str = "PUT") -> WatchEvent:
        return WatchEvent(type=type_, kv=KV(key=key, value=value, mod_revision=rev))

    routine = StatsReport(node="mac-a", namespace="default", name="llm", canary_uid="c1")
    tripped = routine.model_copy(update={"guard_tripped": True, "guard_reason": "3/4 failed"})
    await views.stats_view.apply_snapshot(Snapshot(items=[], revision=1))
    await views.stats_view.apply_event(ev(routine.to_json(), 2))
    assert rt.stats == {("default", "llm"): {"mac-a": routine}} and not canary.is_set()
    await views.stats_view.apply_event(ev(tripped.to_json(), 3))
    assert rt.stats[("default", "llm")]["mac-a"] == tripped and canary.is_set()
    canary.clear()
    await views.stats_view.apply_event(
        ev(tripped.model_copy(update={"updated_unix": 1.0}).to_json(), 4))
    assert not canary.is_set()  # still tripped: not a new trip
    await views.stats_view.apply_event(ev(b"", 5, "DELETE"))
    assert ("default", "llm") not in rt.stats
