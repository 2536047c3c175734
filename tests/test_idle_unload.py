"""Idle unload and reload on demand (scale from zero): the controller and the agent's HTTP path
against the in-memory store, the real ServingCore and the tiny generated model."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from mlx_fleet.source_policy import DEV_POLICY  # models in temporary directories
from mlx_fleet.contract import (IDLE_UNLOADED, RELOADING_ON_DEMAND, Assignment, AssignmentReport,
                                AssignmentState, Keys, LifecyclePolicy, Role)
from mlx_fleet.memstore import MemoryStore
from mlx_fleet.routing.headers import REVISION_HEADER
from node_agent.controller import Controller, ServedModel
from node_agent.openai_api import build_app
from node_agent.registration import Registration
from node_agent.serving import ServingCore
from node_agent.traffic import TrafficManager
from serving_fixtures import mlx_thread_held, safetensors_bytes, wait_for
from test_agent_controller import (ADVERTISED, NODE, TIMEOUT, assignment, complete,  # noqa: F401
                                   core, registration, report_events, store, wait_report)

MODEL = "tiny"
CHAT = "/v1/chat/completions"


def idle_assignment(model_dir: Path, *, idle: int, name: str = "chat", model: str = MODEL,
                    generation: int = 1) -> Assignment:
    a = assignment(name, model_dir, model=model, generation=generation)
    return a.model_copy(update={"lifecycle": LifecyclePolicy(idle_unload_seconds=idle)})


def standby(r: AssignmentReport | None) -> bool:
    return r is not None and r.state == AssignmentState.UNLOADED


def ready(r: AssignmentReport | None) -> bool:
    return r is not None and r.state == AssignmentState.READY


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------


CtlFactory = Callable[..., Awaitable[Controller]]


@pytest.fixture
async def controller(store: MemoryStore, keys: Keys, core: ServingCore,
                     registration: Registration) -> AsyncIterator[CtlFactory]:
    """``await controller(**kw)``: a started Controller with a fast lifecycle task (0.05 s)."""
    ctls: list[Controller] = []

    async def start(**kw) -> Controller:
        kw.setdefault("lifecycle_interval", 0.05)
        ctl = Controller(store, keys, node_name=NODE, core=core, registration=registration,
                         advertise_url=ADVERTISED, **{"source_policy": DEV_POLICY, **kw})
        ctls.append(ctl)
        await ctl.start()
        return ctl

    yield start
    for ctl in ctls:
        await ctl.stop()
    for m in core.models():
        await core.unload_model(m.model_id)


class Http:
    """The agent's HTTP side wired as in node_agent.main: the real app, routed by a real
    TrafficManager that passes requests on to the controller (touch, ensure_loaded)."""

    def __init__(self, tm: TrafficManager, client: TestClient) -> None:
        self.tm, self.client = tm, client

    async def chat(self, **body) -> tuple[int, dict, dict]:
        resp = await self.client.post(CHAT, json={
            "model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}], **body})
        return resp.status, dict(resp.headers), await resp.json()


HttpFactory = Callable[[Controller], Awaitable[Http]]


@pytest.fixture
async def http(store: MemoryStore, keys: Keys, core: ServingCore,
               registration: Registration) -> AsyncIterator[HttpFactory]:
    started: list[Http] = []

    async def start(ctl: Controller) -> Http:
        tm = TrafficManager(store, keys, node_name=NODE, registration=registration,
                            served=ctl.served, crashes=core.crashes,
                            memory_bytes=core.memory_bytes, touch=ctl.touch,
                            ensure_loaded=ctl.ensure_loaded)
        await tm.start()
        app = build_app(core, health=lambda: (True, {}), registry=core.registry,
                        router=lambda: tm)
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        h = Http(tm, client)
        started.append(h)
        return h

    yield start
    for h in started:
        await h.client.close()
        await h.tm.stop()


async def assign_and_wait_ready(store: MemoryStore, keys: Keys, a: Assignment) -> str:
    rkey = keys.report(NODE, a.namespace, a.name, a.revision)
    await store.put(keys.assignment(NODE, a.namespace, a.name, a.revision), a.to_json())
    r = await wait_report(store, rkey, lambda r: r is not None and r.state in (
        AssignmentState.READY, AssignmentState.FAILED))
    assert r is not None and r.state == AssignmentState.READY, r
    return rkey


class Gate:
    """Wraps ``core.load_model``: counts the loads and holds each until :meth:`open`."""

    def __init__(self, core: ServingCore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loads = 0
        self.opened = asyncio.Event()
        real = core.load_model

        async def load_model(*args, **kw):
            self.loads += 1
            await self.opened.wait()
            return await real(*args, **kw)

        monkeypatch.setattr(core, "load_model", load_model)

    def open(self) -> None:
        self.opened.set()


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


async def test_idle_revision_is_unloaded_and_its_memory_returned(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        test_model_dir: Path) -> None:
    ctl = await controller()
    start = (await store.list(keys.root + "/")).revision + 1
    rkey = await assign_and_wait_ready(store, keys, idle_assignment(test_model_dir, idle=1))
    assert core.is_loaded(MODEL, "r1")

    seen = await report_events(store, rkey, start, standby)
    assert [r.state for r in seen if r] == [AssignmentState.LOADING, AssignmentState.READY,
                                            AssignmentState.UNLOADED]
    r = seen[-1]
    assert r is not None and r.reason == IDLE_UNLOADED and r.revision == "r1"
    assert r.resident_bytes == 0 and r.endpoint == ADVERTISED and r.generation == 1
    assert r.freed_bytes > 0
    assert "MLX active+cache" in r.message and "process RSS" in r.message
    # the standby report keeps the capabilities of the revision's load (the router reads them)
    loaded_report = next(x for x in seen if x and x.state == AssignmentState.READY)
    assert loaded_report.capabilities is not None
    assert r.capabilities == loaded_report.capabilities

    # the numbers the agent measured: MLX memory fell, by about the weights it dropped
    unload = ctl.idle_unloaded[(MODEL, "r1")]
    assert unload.before is not None and unload.after is not None
    assert unload.after.mlx_bytes < unload.before.mlx_bytes
    assert unload.freed_bytes == r.freed_bytes == (unload.before.mlx_bytes
                                                   - unload.after.mlx_bytes)
    weights = safetensors_bytes(test_model_dir)
    assert unload.freed_bytes >= weights // 2
    # (MLX memory is per process: other tests' models may be resident, so the decrease is what
    # is asserted — at least half the weights came back, so no reference kept them alive)
    assert unload.before.rss_bytes > 0 and unload.after.rss_bytes > 0
    assert unload.idle_seconds >= 1

    # gone from the core, still assigned and served here, as standby
    assert not core.is_loaded(MODEL, "r1") and core.models() == []
    assert core.memory_bytes(MODEL, "r1") == 0
    assert ctl.served() == {MODEL: ServedModel("default", "chat", {"r1": Role.STABLE},
                                               frozenset({"r1"}))}
    assert ctl.states()["default/chat/r1"]["state"] == "Unloaded"

    # a new generation of the same spec: the standby report follows it (no reload)
    a2 = idle_assignment(test_model_dir, idle=1, generation=2)
    await store.put(keys.assignment(NODE, "default", "chat", "r1"), a2.to_json())
    r2 = await wait_report(store, rkey, lambda r: r is not None and r.generation == 2)
    assert r2 is not None and r2.state == AssignmentState.UNLOADED
    assert r2.reason == IDLE_UNLOADED and r2.freed_bytes == r.freed_bytes
    assert core.models() == [] and ctl.reloads == 0


async def test_request_after_idle_unload_reloads_and_is_served(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        http: HttpFactory, test_model_dir: Path) -> None:
    ctl = await controller()
    h = await http(ctl)
    rkey = await assign_and_wait_ready(store, keys, idle_assignment(test_model_dir, idle=1))
    status, _, want = await h.chat()
    assert status == 200
    await wait_report(store, rkey, standby)
    assert not core.is_loaded(MODEL)
    start = (await store.list(rkey)).revision + 1

    status, headers, body = await h.chat()
    assert status == 200, body
    assert headers[REVISION_HEADER] == "r1"
    assert body["choices"][0]["message"] == want["choices"][0]["message"]  # same model, greedy
    assert core.is_loaded(MODEL, "r1") and ctl.reloads == 1
    assert ctl.served()[MODEL].standby == frozenset()
    seen = await report_events(store, rkey, start, ready)
    assert [(r.state, r.reason) for r in seen if r] == [
        (AssignmentState.LOADING, RELOADING_ON_DEMAND), (AssignmentState.READY, "ModelLoaded")]
    assert seen[-1] is not None and seen[-1].resident_bytes > 0 and seen[-1].freed_bytes == 0

    # and it idles out again
    await wait_report(store, rkey, standby)


async def test_an_embedding_model_idles_out_and_reloads_on_an_embeddings_request(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        http: HttpFactory, tmp_path_factory: pytest.TempPathFactory) -> None:
    """spec.model.task TextEmbedding: unloaded for idleness and reloaded on demand like any
    other model, by a POST /v1/embeddings (which also counts as its use)."""
    from mlx_fleet.testmodel import make_test_model

    emb = make_test_model(tmp_path_factory.mktemp("models") / "emb", embedding=True)
    ctl = await controller()
    h = await http(ctl)
    a = idle_assignment(emb, idle=1).model_copy(update={"task": "TextEmbedding"})
    rkey = await assign_and_wait_ready(store, keys, a)
    body = {"model": MODEL, "input": ["hello", "world"]}
    resp = await h.client.post("/v1/embeddings", json=body)
    assert resp.status == 200
    want = (await resp.json())["data"]
    await wait_report(store, rkey, standby)
    assert not core.is_loaded(MODEL)
    resp = await h.client.post("/v1/embeddings", json=body)
    assert resp.status == 200 and resp.headers[REVISION_HEADER] == "r1"
    assert (await resp.json())["data"] == want              # the same model, reloaded
    assert ctl.reloads == 1 and core.model_info(MODEL).task == "TextEmbedding"
    await wait_report(store, rkey, standby)                 # and it idles out again


async def test_concurrent_requests_share_one_reload(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        http: HttpFactory, test_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = await controller()
    h = await http(ctl)
    rkey = await assign_and_wait_ready(store, keys, idle_assignment(test_model_dir, idle=1))
    await wait_report(store, rkey, standby)

    gate = Gate(core, monkeypatch)
    n = 8
    requests = [asyncio.create_task(h.chat()) for _ in range(n)]
    # every request is waiting for the one reload, which is held at the core's load
    await wait_for(lambda: ctl._demand.reload_waiters.get((MODEL, "r1")) == n and gate.loads == 1,
                   TIMEOUT)
    assert gate.loads == 1 and ctl.reloads == 1
    r = await wait_report(store, rkey, lambda r: r is not None
                          and r.state == AssignmentState.LOADING)
    assert r is not None and r.reason == RELOADING_ON_DEMAND
    gate.open()
    results = await asyncio.gather(*requests)
    assert [status for status, _, _ in results] == [200] * n, results
    assert all(headers[REVISION_HEADER] == "r1" for _, headers, _ in results)
    assert gate.loads == 1 and ctl.reloads == 1  # one load for all of them
    assert await wait_report(store, rkey, lambda r: r is not None and r.state in (
        AssignmentState.READY, AssignmentState.UNLOADED)) is not None


async def test_too_many_waiters_get_429(store: MemoryStore, keys: Keys, core: ServingCore,
                                       controller: CtlFactory, http: HttpFactory,
                                       test_model_dir: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = await controller(max_reload_waiters=2)
    h = await http(ctl)
    rkey = await assign_and_wait_ready(store, keys, idle_assignment(test_model_dir, idle=1))
    await wait_report(store, rkey, standby)

    gate = Gate(core, monkeypatch)
    waiting = [asyncio.create_task(h.chat()) for _ in range(2)]
    await wait_for(lambda: ctl._demand.reload_waiters.get((MODEL, "r1")) == 2 and gate.loads == 1,
                   TIMEOUT)
    status, headers, body = await h.chat()
    assert status == 429, body
    assert int(headers["Retry-After"]) >= 1 and headers[REVISION_HEADER] == "r1"
    assert (body["error"]["type"], body["error"]["code"]) == ("rate_limit_error", "overloaded")
    assert "waiting for revision r1 of tiny to reload (limit 2)" in body["error"]["message"]
    gate.open()
    assert [s for s, _, _ in await asyncio.gather(*waiting)] == [200, 200]
    assert gate.loads == 1


async def test_failed_reload_is_a_503_and_is_retried(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        http: HttpFactory, test_model_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(test_model_dir, model_dir)
    ctl = await controller(retry_backoff=(0.2, 0.2))
    h = await http(ctl)
    rkey = await assign_and_wait_ready(store, keys, idle_assignment(model_dir, idle=1))
    await wait_report(store, rkey, standby)

    model_dir.rename(tmp_path / "gone")  # the disk went away while it was idle
    status, _, body = await h.chat()
    assert status == 503, body
    err = body["error"]
    assert (err["type"], err["code"]) == ("server_error", "model_reload_failed")
    assert "ModelNotFound" in err["message"] and err["param"] is None
    r = await wait_report(store, rkey, lambda r: r is not None
                          and r.state == AssignmentState.FAILED)
    assert r is not None and r.reason == "ModelNotFound"

    (tmp_path / "gone").rename(model_dir)  # back: the retry loads it (resident again)
    assert (await wait_report(store, rkey, ready)) is not None
    status, _, _ = await h.chat()
    assert status == 200


async def test_no_unload_with_idle_zero_or_a_request_in_flight(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: CtlFactory,
        test_model_dir: Path) -> None:
    clock = FakeClock()
    ctl = await controller(clock=clock)
    never = await assign_and_wait_ready(store, keys, idle_assignment(
        test_model_dir, idle=0, name="never", model="never"))
    busy = await assign_and_wait_ready(store, keys, idle_assignment(
        test_model_dir, idle=60, name="busy", model="busy"))

    async def passes(n: int) -> None:
        target = ctl.lifecycle_passes + n
        await wait_for(lambda: ctl.lifecycle_passes >= target, TIMEOUT)

    # a request for "busy" is admitted, and held: the MLX thread is blocked
    running = await core.generate("busy", prompt="Hello", max_tokens=4, temperature=0)
    async with mlx_thread_held(core, TIMEOUT):
        clock.now += 10_000  # far past any idle time
        await passes(3)
        assert core.is_loaded("never") and core.is_loaded("busy")
        assert core.inflight_requests("busy") == 1
        assert ctl.idle_unloaded == {}
    async with running:
        async for _ in running:
            pass

    # idleness counts from the end of the request: not yet ...
    clock.now += 30
    await passes(3)
    assert core.is_loaded("busy")
    # ... then it goes; "never" (idleUnloadSeconds 0) stays
    clock.now += 31
    r = await wait_report(store, busy, standby)
    assert r is not None and r.reason == IDLE_UNLOADED
    assert not core.is_loaded("busy") and core.is_loaded("never")
    assert (await wait_report(store, never, ready)) is not None
    assert isinstance(await complete(core, "never"), str)


async def test_touch_keeps_a_revision_resident(store: MemoryStore, keys: Keys,
                                               core: ServingCore, controller: CtlFactory,
                                               test_model_dir: Path) -> None:
    clock = FakeClock()
    ctl = await controller(clock=clock)
    rkey = await assign_and_wait_ready(store, keys, idle_assignment(test_model_dir, idle=60))
    for _ in range(3):
        clock.now += 45
        ctl.touch(MODEL, "r1")  # a request every 45 s
        target = ctl.lifecycle_passes + 2
        await wait_for(lambda: ctl.lifecycle_passes >= target, TIMEOUT)
        assert core.is_loaded(MODEL, "r1")
    clock.now += 60
    assert (await wait_report(store, rkey, standby)) is not None
