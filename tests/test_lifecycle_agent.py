"""The agent's lifecycle beyond idle unload, on the in-memory store and real parts (the
ServingCore, the tiny generated model): eviction under memory pressure (least recently used
first, memory measured freed), the minReady pin, predictive prefetch from the usage history,
Eager vs OnDemand, the lifecycle metrics and ``GET /v1/models`` listing standby models.

Time is the controller's injected clock and the lifecycle is driven by explicit calls
(``unload_idle``, ``tick``, ``observe``); the background lifecycle task is parked (an interval
of an hour)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from mlx_fleet.source_policy import DEV_POLICY
from mlx_fleet.contract import (AWAITING_REQUEST, EVICTED, IDLE_UNLOADED, PREDICTIVE_PREFETCH,
                                Assignment, AssignmentState, Keys)
from mlx_fleet.quantity import format_bytes
from mlx_fleet.memstore import MemoryStore
from node_agent import memory_estimate
from node_agent.controller import INSUFFICIENT_MEMORY, MODEL_LIMIT
from node_agent.openai_api import build_app
from node_agent.serving import ServingCore
from node_agent.sources import resolve_source
from serving_fixtures import mlx_thread_held, safetensors_bytes, wait_for
from test_agent_controller import (TIMEOUT, collect, core, registration,  # noqa: F401
                                   report_events, settled, store, wait_report)
from test_idle_unload import (CtlFactory, FakeClock, assign_and_wait_ready,  # noqa: F401
                              controller, idle_assignment, ready, standby)

PARKED = 3600.0  # lifecycle_interval: the background task never runs during a test
NO_RETRY = (3600.0, 3600.0)


def lifecycle(a: Assignment, **policy) -> Assignment:
    return a.model_copy(update={"lifecycle": a.lifecycle.model_copy(update=policy)})


def estimate(model_dir: Path) -> int:
    """The controller's estimate of one tiny-model revision at the default serving limits."""
    params = idle_assignment(model_dir, idle=0).serving
    return memory_estimate.estimate(model_dir, max_context_tokens=params.max_context_tokens,
                                    max_concurrent_sequences=params.max_concurrent_sequences
                                    ).total_bytes


def sample(core: ServingCore, name: str, **labels: str) -> float | None:
    return core.registry.get_sample_value(name, labels)


async def test_a_load_that_does_not_fit_evicts_the_least_recently_used_idle_model(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        test_model_dir: Path) -> None:
    need = estimate(test_model_dir)
    clock = FakeClock()
    ctl = await controller(clock=clock, lifecycle_interval=PARKED,
                           budget_bytes=2 * need + need // 2)  # two fit, three don't
    evictions_before = sample(core, "mlxfleet_agent_model_unloads_total", reason=EVICTED) or 0
    timed_before = sample(core, "mlxfleet_agent_model_unload_seconds_count", reason=EVICTED) or 0
    a = await assign_and_wait_ready(store, keys, idle_assignment(
        test_model_dir, idle=300, name="a", model="a"))
    clock.now += 1
    b = await assign_and_wait_ready(store, keys, idle_assignment(
        test_model_dir, idle=300, name="b", model="b"))
    clock.now += 5
    ctl.touch("a", "r1")  # a request for a: b is now the least recently used

    c = await assign_and_wait_ready(store, keys, idle_assignment(
        test_model_dir, idle=300, name="c", model="c"))
    rb = await wait_report(store, b, standby)
    assert rb is not None and rb.reason == EVICTED and rb.resident_bytes == 0
    assert "evicted" in rb.message and "c revision r1" in rb.message
    assert core.is_loaded("a") and core.is_loaded("c") and not core.is_loaded("b")
    assert (await wait_report(store, a, ready)) is not None  # a untouched

    # the memory really came back: measured before and after the unload
    ev = ctl.evicted[("b", "r1")]
    assert ev.before is not None and ev.after is not None
    assert ev.after.mlx_bytes < ev.before.mlx_bytes
    assert rb.freed_bytes == ev.freed_bytes == ev.before.mlx_bytes - ev.after.mlx_bytes
    assert ev.freed_bytes >= safetensors_bytes(test_model_dir) // 2
    assert ctl.served()["b"].standby == frozenset({"r1"}) and ctl.idle_unloaded == {}
    assert sample(core, "mlxfleet_agent_model_unloads_total",
                  reason=EVICTED) == evictions_before + 1
    assert sample(core, "mlxfleet_agent_model_unload_seconds_count",
                  reason=EVICTED) == timed_before + 1
    assert sample(core, "mlxfleet_agent_model_unload_seconds_sum", reason=EVICTED) > 0

    # a request for b reloads it, evicting the least recently used of the others (a)
    await ctl.converged()
    clock.now += 5
    ctl.touch("c", "r1")
    start = (await store.list(b)).revision + 1
    await ctl.ensure_loaded("b", "r1")
    assert core.is_loaded("b") and core.is_loaded("c") and not core.is_loaded("a")
    ra = await wait_report(store, a, standby)
    assert ra is not None and ra.reason == EVICTED and "b revision r1" in ra.message
    seen = await report_events(store, b, start, ready)
    assert [r.state for r in seen if r] == [AssignmentState.LOADING, AssignmentState.READY]
    assert [r.estimated_bytes for r in seen if r] == [need, need]  # known from its last load


async def test_pinned_model_is_never_idle_unloaded_nor_evicted(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        test_model_dir: Path) -> None:
    need = estimate(test_model_dir)
    budget = need + need // 2  # one fits
    clock = FakeClock()
    ctl = await controller(clock=clock, lifecycle_interval=PARKED, budget_bytes=budget,
                           retry_backoff=NO_RETRY)
    a = await assign_and_wait_ready(store, keys, lifecycle(idle_assignment(
        test_model_dir, idle=1, name="a", model="a"), pinned=True))
    await ctl.converged()
    clock.now += 10_000  # far past its idleUnloadSeconds
    assert await ctl.unload_idle() == []

    b = idle_assignment(test_model_dir, idle=1, name="b", model="b")
    rkey = keys.report("mac-1", "default", "b", "r1")
    await store.put(keys.assignment("mac-1", "default", "b", "r1"), b.to_json())
    r = await wait_report(store, rkey, settled)
    assert r is not None and r.state == AssignmentState.FAILED
    assert r.reason == INSUFFICIENT_MEMORY
    assert r.estimated_bytes == need  # the operator re-places it with its size
    assert format_bytes(need) in r.message and format_bytes(budget) in r.message
    assert "pinned" in r.message
    assert core.is_loaded("a") and not core.is_loaded("b") and ctl.evicted == {}
    assert (await wait_report(store, a, ready)) is not None

    # unpinned (minReady lowered): no reload, and now its idleness unloads it
    await store.put(keys.assignment("mac-1", "default", "a", "r1"),
                    lifecycle(idle_assignment(test_model_dir, idle=1, name="a", model="a",
                                              generation=2), pinned=False).to_json())
    assert (await wait_report(store, a, lambda r: r is not None and r.generation == 2)).state \
        == AssignmentState.READY
    await ctl.converged()
    assert await ctl.unload_idle() == [("a", "r1")]
    ra = await wait_report(store, a, standby)
    assert ra is not None and ra.reason == IDLE_UNLOADED


async def test_predictive_prefetch_reloads_a_periodic_model_before_its_next_request(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        test_model_dir: Path) -> None:
    clock = FakeClock()
    t0 = clock.now
    ctl = await controller(clock=clock, lifecycle_interval=PARKED, prefetch_window_seconds=30)
    a = await assign_and_wait_ready(store, keys, idle_assignment(
        test_model_dir, idle=60, name="a", model="a"))
    b = await assign_and_wait_ready(store, keys, idle_assignment(
        test_model_dir, idle=60, name="b", model="b"))
    await ctl.converged()  # the pass that loaded b let go of it
    # a: a request every 120 s (a cron job); b: irregular
    for t in (0, 120, 240, 360):
        clock.now = t0 + t
        ctl.touch("a", "r1")
    for t in (0, 20, 300, 330):
        clock.now = t0 + t
        ctl.touch("b", "r1")

    clock.now = t0 + 421  # both idle for more than 60 s: unloaded; a's next request due at 480
    assert await ctl.tick() == []  # 480 is beyond the 30 s window
    assert (await wait_report(store, a, standby)) is not None
    assert (await wait_report(store, b, standby)) is not None
    assert not core.is_loaded("a") and not core.is_loaded("b")

    clock.now = t0 + 455  # now within the window
    start = (await store.list(a)).revision + 1
    tasks = await ctl.tick()
    assert len(tasks) == 1 and ctl.prefetches == 1
    for t in tasks:
        await t
    assert core.is_loaded("a") and not core.is_loaded("b")
    seen = await report_events(store, a, start, ready)
    assert [(r.state, r.reason) for r in seen if r] == [
        (AssignmentState.LOADING, PREDICTIVE_PREFETCH), (AssignmentState.READY, "ModelLoaded")]
    # the request at 480 finds it warm: no reload on demand
    clock.now = t0 + 480
    await ctl.ensure_loaded("a", "r1")
    assert ctl.reloads == 0 and ctl.served()["a"].standby == frozenset()
    assert await ctl.tick() == []  # nothing else to prefetch; b stays standby
    assert not core.is_loaded("b")


async def test_eager_loads_at_once_and_on_demand_waits_for_the_first_request(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        test_model_dir: Path) -> None:
    resolved: list[str] = []

    def resolve(uri: str) -> Path:
        resolved.append(uri)
        return resolve_source(uri, policy=DEV_POLICY)  # a temporary directory

    ctl = await controller(lifecycle_interval=PARKED, resolve=resolve)
    eager = idle_assignment(test_model_dir, idle=300, name="eager", model="eager")
    assert eager.lifecycle.prefetch == "Eager"
    await assign_and_wait_ready(store, keys, eager)
    assert core.is_loaded("eager") and resolved == [eager.source.uri]

    lazy = lifecycle(idle_assignment(test_model_dir, idle=300, name="lazy", model="lazy"),
                     prefetch="OnDemand")
    rkey = keys.report("mac-1", "default", "lazy", "r1")
    await store.put(keys.assignment("mac-1", "default", "lazy", "r1"), lazy.to_json())
    r = await wait_report(store, rkey, standby)
    assert r is not None and r.reason == AWAITING_REQUEST and r.endpoint
    assert "OnDemand" in r.message
    assert not core.is_loaded("lazy") and resolved == [eager.source.uri]  # nothing fetched
    assert ctl.served()["lazy"].standby == frozenset({"r1"})

    # GET /v1/models lists both, the standby one marked as such
    app = build_app(core, health=lambda: (True, {}), registry=core.registry,
                    standby=ctl.standby_models)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        listed = await (await client.get("/v1/models")).json()
        by_id = {m["id"]: m for m in listed["data"]}
        assert by_id["eager"]["status"] == "loaded" and "standby_reason" not in by_id["eager"]
        # a loaded card has its capabilities (text generation, n within its batch, the
        # limits); the never-loaded standby card has none (unknown), checked whole below
        caps = by_id["eager"]["capabilities"]
        assert (caps["task"], caps["max_n"], caps["max_context_tokens"], caps["embeddings"]) == (
            "TextGeneration", min(core.max_choices, eager.serving.max_concurrent_sequences),
            4096, False)
        assert by_id["lazy"] == {"id": "lazy", "object": "model",
                                 "created": by_id["lazy"]["created"], "owned_by": "mlx-fleet",
                                 "revision": "r1", "max_context_tokens": 4096,
                                 "status": "standby", "standby_reason": AWAITING_REQUEST}

        # the first request fetches and loads it
        await ctl.ensure_loaded("lazy", "r1")
        assert core.is_loaded("lazy") and resolved == [eager.source.uri, lazy.source.uri]
        assert (await wait_report(store, rkey, ready)) is not None
        listed = await (await client.get("/v1/models")).json()
        assert {(m["id"], m["status"]) for m in listed["data"]} >= {
            ("eager", "loaded"), ("lazy", "loaded")}


async def test_lifecycle_metrics_and_a_removed_revision_leaves_no_series(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        test_model_dir: Path) -> None:
    need = estimate(test_model_dir)
    clock = FakeClock()
    ctl = await controller(clock=clock, lifecycle_interval=PARKED, budget_bytes=4 * need)
    loads = sample(core, "mlxfleet_agent_model_loads_total", reason="Assigned") or 0
    a = await assign_and_wait_ready(store, keys, idle_assignment(
        test_model_dir, idle=300, name="m", model="m"))
    assert sample(core, "mlxfleet_agent_model_loads_total", reason="Assigned") == loads + 1
    clock.now += 42
    await ctl.observe()
    assert sample(core, "mlxfleet_agent_model_idle_seconds", model="m", revision="r1") == 42
    weights = sample(core, "mlxfleet_agent_memory_bytes", kind="weights")
    assert weights is not None and weights >= safetensors_bytes(test_model_dir) // 2
    assert sample(core, "mlxfleet_agent_memory_bytes", kind="kv_cache") is not None
    assert sample(core, "mlxfleet_agent_memory_bytes", kind="mlx_cache") is not None
    free = sample(core, "mlxfleet_agent_memory_bytes", kind="free")
    assert free is not None and 0 < free <= 3 * need
    assert sample(core, "mlxfleet_agent_model_loaded", model="m", revision="r1") == 1

    # the assignment goes: once drained, no series names the revision any more
    await store.delete(keys.assignment("mac-1", "default", "m", "r1"))
    assert (await wait_report(store, a, lambda r: r is None)) is None

    def series_of_m() -> list[str]:
        return [f"{m.name}{s.labels}" for m in core.registry.collect() for s in m.samples
                if s.labels.get("model") == "m"]

    await wait_for(lambda: not core.is_loaded("m") and series_of_m() == [], TIMEOUT)
    assert sample(core, "mlxfleet_agent_model_unloads_total", reason="Unassigned") >= 1
    assert sample(core, "mlxfleet_agent_model_unload_seconds_count", reason="Unassigned") == \
        sample(core, "mlxfleet_agent_model_unloads_total", reason="Unassigned")
    assert ctl.history.times(("m", "r1")) == ()


# ---------------------------------------------------------------------------------------------
# the node's limit on loaded models (--max-loaded-models; seed 004)
# ---------------------------------------------------------------------------------------------


async def test_model_limit_evicts_the_idle_model_and_a_request_brings_it_back(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        test_model_dir: Path) -> None:
    clock = FakeClock()
    ctl = await controller(clock=clock, lifecycle_interval=PARKED, max_loaded_models=1)
    a = await assign_and_wait_ready(store, keys, idle_assignment(
        test_model_dir, idle=300, name="a", model="a"))
    clock.now += 5

    # no memory budget at all: the count alone evicts a to standby
    b = await assign_and_wait_ready(store, keys, idle_assignment(
        test_model_dir, idle=300, name="b", model="b"))
    ra = await wait_report(store, a, standby)
    assert ra is not None and ra.reason == EVICTED and ra.resident_bytes == 0
    assert "b revision r1" in ra.message and "limit of 1 loaded models" in ra.message
    assert core.is_loaded("b") and not core.is_loaded("a") and len(core.models()) == 1
    assert ctl.served()["a"].standby == frozenset({"r1"})

    # a request for a reloads it, evicting b: never more than one resident
    await ctl.converged()
    clock.now += 5
    start = (await store.list(a)).revision + 1
    await ctl.ensure_loaded("a", "r1")
    assert core.is_loaded("a") and not core.is_loaded("b") and len(core.models()) == 1
    rb = await wait_report(store, b, standby)
    assert rb is not None and rb.reason == EVICTED and "a revision r1" in rb.message
    seen = await report_events(store, a, start, ready)
    assert [r.state for r in seen if r] == [AssignmentState.LOADING, AssignmentState.READY]


async def test_model_limit_refuses_a_load_when_the_resident_model_is_pinned(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        test_model_dir: Path) -> None:
    ctl = await controller(lifecycle_interval=PARKED, max_loaded_models=1,
                           retry_backoff=NO_RETRY)
    a = await assign_and_wait_ready(store, keys, lifecycle(idle_assignment(
        test_model_dir, idle=300, name="a", model="a"), pinned=True))
    await ctl.converged()

    b = idle_assignment(test_model_dir, idle=300, name="b", model="b")
    rkey = keys.report("mac-1", "default", "b", "r1")
    await store.put(keys.assignment("mac-1", "default", "b", "r1"), b.to_json())
    r = await wait_report(store, rkey, settled)
    assert r is not None and r.state == AssignmentState.FAILED and r.reason == MODEL_LIMIT
    assert r.estimated_bytes == estimate(test_model_dir)
    assert "would be loaded model 2" in r.message and "limit is 1" in r.message
    assert "pinned" in r.message and "retrying in" in r.message  # retried, like memory
    # waiting for its retry, a new generation is reported Failed again: still with the size
    await store.put(keys.assignment("mac-1", "default", "b", "r1"),
                    b.model_copy(update={"generation": 2}).to_json())
    r = await wait_report(store, rkey, lambda r: r is not None and r.generation == 2)
    assert r is not None and r.state == AssignmentState.FAILED and r.reason == MODEL_LIMIT
    assert r.estimated_bytes == estimate(test_model_dir)
    assert core.is_loaded("a") and not core.is_loaded("b") and ctl.evicted == {}
    assert (await wait_report(store, a, ready)) is not None


async def test_model_limit_waits_for_a_request_in_flight_then_the_retry_evicts(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        test_model_dir: Path) -> None:
    ctl = await controller(lifecycle_interval=PARKED, max_loaded_models=1,
                           retry_backoff=(0.1, 0.1))
    a = await assign_and_wait_ready(store, keys, idle_assignment(
        test_model_dir, idle=300, name="a", model="a"))
    await ctl.converged()

    # a request for a is admitted and cannot finish: the MLX thread is held
    async with mlx_thread_held(core, TIMEOUT):
        gen = asyncio.create_task(core.generate("a", prompt="Hello", max_tokens=4,
                                                temperature=0))
        await wait_for(lambda: core.inflight_requests("a") == 1, TIMEOUT)

        b = idle_assignment(test_model_dir, idle=300, name="b", model="b")
        rkey = keys.report("mac-1", "default", "b", "r1")
        await store.put(keys.assignment("mac-1", "default", "b", "r1"), b.to_json())
        r = await wait_report(store, rkey, settled)
        assert r is not None and r.state == AssignmentState.FAILED and r.reason == MODEL_LIMIT
        assert "serving requests" in r.message and "limit is 1" in r.message
        assert core.is_loaded("a") and ctl.evicted == {}
    running = await gen
    assert isinstance(await collect(running), str)  # the request was served to its end

    # the request is over: the retry evicts a and loads b
    assert (await wait_report(store, rkey, ready)) is not None
    ra = await wait_report(store, a, standby)
    assert ra is not None and ra.reason == EVICTED
    assert core.is_loaded("b") and not core.is_loaded("a")


async def test_predictive_prefetch_does_not_evict_for_the_model_limit(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        test_model_dir: Path) -> None:
    clock = FakeClock()
    t0 = clock.now
    ctl = await controller(clock=clock, lifecycle_interval=PARKED, prefetch_window_seconds=30,
                           max_loaded_models=1)
    a = await assign_and_wait_ready(store, keys, idle_assignment(
        test_model_dir, idle=300, name="a", model="a"))
    b = await assign_and_wait_ready(store, keys, idle_assignment(
        test_model_dir, idle=10, name="b", model="b"))
    ra = await wait_report(store, a, standby)
    assert ra is not None and ra.reason == EVICTED  # the limit: one resident
    await ctl.converged()
    for t in (0, 120, 240, 360):  # a: a request every 120 s, served while b was away
        clock.now = t0 + t
        ctl.touch("a", "r1")
    clock.now = t0 + 450
    ctl.touch("b", "r1")

    clock.now = t0 + 455  # a's next request (480) is within the window, but b is resident
    assert await ctl.tick() == [] and ctl.prefetches == 0
    assert core.is_loaded("b") and not core.is_loaded("a")

    clock.now = t0 + 462  # b idle for its 10 s: unloaded, and a's prefetch has room
    tasks = await ctl.tick()
    assert len(tasks) == 1 and ctl.prefetches == 1
    for t in tasks:
        await t
    assert core.is_loaded("a") and not core.is_loaded("b")
    rb = await wait_report(store, b, standby)
    assert rb is not None and rb.reason == IDLE_UNLOADED
