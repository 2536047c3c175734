"""The convergence executor (node_agent.controller and node_agent.convergence) on the in-memory
store and a fake serving core: the follower, the registration and the reports are the real
ones, the core only records what it is asked (loads that can be held, unloads and drains that
can be held), so the executor's ordering is observed without etcd or MLX: a renamed assignment drains its old name first, a revision assigned again while it
drains loads only after the drain, a load withdrawn while the core holds it leaves nothing, and
an unassigned key is forgotten entirely (its record swept)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from mlx_fleet.source_policy import DEV_POLICY  # models in temporary directories
from mlx_fleet.contract import AssignmentState, Keys, Role
from mlx_fleet.memstore import MemoryStore
from node_agent.controller import Controller, ServedModel
from node_agent.metrics import AgentMetrics
from node_agent.registration import Registration
from node_agent.serving import DEFAULT_MAX_CHOICES, MemoryUsage, ModelInfo
from node_agent.serving.capabilities import TOOL_CALLING_SERVED
from node_agent.serving.errors import LOAD_FAILURE_TEXT, ModelLoadError
from node_agent.serving.types import TokenizerFeatures
from serving_fixtures import wait_for
from test_agent_controller import (ADVERTISED, NODE, TIMEOUT, assignment, put,  # noqa: F401
                                   registration, settled, state_is, wait_report)

Ident = tuple[str, str]


class FakeCore:
    """The serving core's surface the executor uses. ``hold_loads`` / ``hold_unloads``: set
    to hold loads / unloads until :meth:`release`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = AgentMetrics(self.registry)
        self.resident: dict[Ident, str] = {}   # ident → path; serving
        self.draining: set[Ident] = set()      # being unloaded (no new requests)
        self.events: list[tuple[str, Ident]] = []
        self.hold_loads = False
        self.hold_unloads = False
        #: raised by every load when set (a failing MLX load)
        self.load_error: Exception | None = None
        self._released = asyncio.Event()
        self.max_choices = DEFAULT_MAX_CHOICES   # the n bound a loaded revision reports

    def release(self) -> None:
        self._released.set()

    async def load_model(self, model_id: str, path, *, revision: str,
                         max_concurrent_sequences: int, max_context_tokens: int,
                         task: str = "TextGeneration") -> ModelInfo:
        ident = (model_id, revision)
        self.events.append(("load", ident))
        if self.hold_loads:
            await self._released.wait()
        if self.load_error is not None:
            raise self.load_error
        self.resident[ident] = str(path)
        self.events.append(("loaded", ident))
        # its tokenizer has a tool parser (reported only once the agent serves tool calls)
        return ModelInfo(model_id, revision, str(path), 0, max_concurrent_sequences,
                         max_context_tokens, features=TokenizerFeatures(tool_parser="json_tools"),
                         task=task)

    async def unload_model(self, model_id: str, revision: str | None = None, *,
                           drain_seconds: float = 0.0) -> None:
        ident = (model_id, revision or "")
        if ident not in self.resident:
            return
        self.draining.add(ident)
        self.events.append(("unload", ident))
        if self.hold_unloads:
            await self._released.wait()
        del self.resident[ident]
        self.draining.discard(ident)
        self.events.append(("unloaded", ident))

    def models(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(model_id=m, revision=r) for m, r in sorted(self.resident)]

    def is_loaded(self, model_id: str, revision: str | None = None) -> bool:
        return any(m == model_id and (revision is None or r == revision)
                   and (m, r) not in self.draining for m, r in self.resident)

    def inflight_requests(self, model_id: str | None = None, revision: str | None = None) -> int:
        return 0

    def memory_bytes(self, model_id: str, revision: str) -> int:
        return 2**20 if (model_id, revision) in self.resident else 0

    async def memory_usage(self) -> MemoryUsage:
        return MemoryUsage(len(self.resident) * 2**20, 0, 2**30)


@pytest.fixture
async def store(memory_store: MemoryStore) -> MemoryStore:
    """The in-memory store stands in for etcd in this module."""
    return memory_store


@pytest.fixture
async def fake() -> FakeCore:
    return FakeCore()


@pytest.fixture
async def controller(store: MemoryStore, keys: Keys, fake: FakeCore,
                     registration: Registration) -> AsyncIterator[Controller]:
    ctl = Controller(store, keys, node_name=NODE, core=fake,  # type: ignore[arg-type]
                     registration=registration, advertise_url=ADVERTISED,
                     lifecycle_interval=3600.0, source_policy=DEV_POLICY)
    await ctl.start()
    yield ctl
    fake.release()
    await ctl.stop()


async def test_a_renamed_assignment_drains_its_old_name_then_loads_the_new(
        store: MemoryStore, keys: Keys, fake: FakeCore, controller: Controller,
        test_model_dir: Path) -> None:
    rkey = keys.report(NODE, "default", "chat", "r1")
    await put(store, keys, assignment("chat", test_model_dir, model="old-name"))
    first = await wait_report(store, rkey, settled)
    assert first is not None and first.state == AssignmentState.READY
    # the Ready report carries the loaded revision's capabilities: its limits, and its
    # tokenizer's tool parser once this build serves tool calls
    caps = first.capabilities
    assert caps is not None and caps.task == "TextGeneration"
    assert caps.max_context_tokens == assignment("chat", test_model_dir).serving.max_context_tokens
    assert (caps.tool_calling, caps.tool_parser) == (
        (True, "json_tools") if TOOL_CALLING_SERVED else (False, None))
    # logprobs (OpenAI's top 20) and n within the agent's --max-choices and the batch
    assert (caps.logprobs, caps.max_top_logprobs) == (True, 20)
    assert caps.max_n == min(fake.max_choices, assignment(
        "chat", test_model_dir).serving.max_concurrent_sequences)
    await put(store, keys, assignment("chat", test_model_dir, model="new-name", generation=2))
    r = await wait_report(store, rkey, lambda r: settled(r) and r.generation == 2)
    assert r is not None and r.state == AssignmentState.READY
    await wait_for(lambda: list(fake.resident) == [("new-name", "r1")], TIMEOUT)
    assert fake.events.index(("unload", ("old-name", "r1"))) < fake.events.index(
        ("load", ("new-name", "r1")))
    assert controller.served() == {
        "new-name": ServedModel("default", "chat", {"r1": Role.STABLE})}


async def test_a_revision_assigned_again_while_it_drains_loads_after_the_drain(
        store: MemoryStore, keys: Keys, fake: FakeCore, controller: Controller,
        test_model_dir: Path) -> None:
    rkey = keys.report(NODE, "default", "m", "r1")
    a = assignment("m", test_model_dir)
    await put(store, keys, a)
    assert (await wait_report(store, rkey, settled)).state == AssignmentState.READY  # type: ignore[union-attr]
    fake.hold_unloads = True
    await store.delete(keys.assignment(NODE, "default", "m", "r1"))
    assert await wait_report(store, rkey, lambda r: r is None) is None
    await wait_for(lambda: ("m", "r1") in fake.draining, TIMEOUT)  # the drain is held

    await put(store, keys, a.model_copy(update={"generation": 2}))
    # its task waits for the drain: nothing is loaded again while the old copy drains
    await wait_for(lambda: controller.states().get("default/m/r1", {}).get("state")
                   == "Loading", TIMEOUT)
    assert fake.events[-1] == ("unload", ("m", "r1"))
    fake.release()
    r = await wait_report(store, rkey, lambda r: settled(r) and r.generation == 2)
    assert r is not None and r.state == AssignmentState.READY
    assert fake.events[-4:] == [("unload", ("m", "r1")), ("unloaded", ("m", "r1")),
                                ("load", ("m", "r1")), ("loaded", ("m", "r1"))]


async def test_a_load_withdrawn_while_the_core_holds_it_leaves_nothing(
        store: MemoryStore, keys: Keys, fake: FakeCore, controller: Controller,
        test_model_dir: Path) -> None:
    rkey = keys.report(NODE, "default", "q", "r1")
    fake.hold_loads = True
    await put(store, keys, assignment("q", test_model_dir))
    assert await wait_report(store, rkey, state_is(AssignmentState.LOADING)) is not None
    await wait_for(lambda: fake.events == [("load", ("q", "r1"))], TIMEOUT)
    await store.delete(keys.assignment(NODE, "default", "q", "r1"))
    assert await wait_report(store, rkey, lambda r: r is None) is None
    await controller.converged()
    assert fake.resident == {} and controller.served() == {} and controller.states() == {}


async def test_unassigned_keys_are_forgotten_entirely(
        store: MemoryStore, keys: Keys, fake: FakeCore, controller: Controller,
        test_model_dir: Path, tmp_path: Path) -> None:
    """Loaded, failed and invalid assignments: once unassigned and retired, nothing of them is
    left in the controller (one record per key, swept in one place)."""
    await put(store, keys, assignment("ok", test_model_dir))
    await put(store, keys, assignment("missing", str(tmp_path / "nope")))
    await store.put(keys.assignment(NODE, "default", "garbage", "r1"), b"{")
    for name in ("ok", "missing", "garbage"):
        assert await wait_report(store, keys.report(NODE, "default", name, "r1"),
                                 settled) is not None
    await controller.converged()
    assert len(controller._rt.records) == 3
    for name in ("ok", "missing", "garbage"):
        await store.delete(keys.assignment(NODE, "default", name, "r1"))
    for name in ("ok", "missing", "garbage"):
        assert await wait_report(store, keys.report(NODE, "default", name, "r1"),
                                 lambda r: r is None) is None
    await wait_for(lambda: fake.resident == {} and not controller._rt.draining, TIMEOUT)
    await controller.converged()
    assert controller._rt.records == {}


@pytest.mark.parametrize("error, reason", [
    (RuntimeError("[metal] cannot map {dir}/model.safetensors"), "LoadFailed"),
    (ModelLoadError("LoadFailed", "OSError: [Errno 5] Input/output error: '{dir}/x'"),
     "LoadFailed"),
    (ModelLoadError("ModelNotFound", "no model (config.json) at {dir}"), "ModelNotFound"),
])
async def test_a_failed_load_reports_no_path_and_no_exception_text(
        store: MemoryStore, keys: Keys, fake: FakeCore, controller: Controller,
        test_model_dir: Path, tmp_path: Path, error: Exception, reason: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 19 review: a report's message (so status.nodes[].message and events) names the
    problem without the agent's local paths or an exception's text; the agent's log has them."""
    secret = str(tmp_path / "cache")
    if isinstance(error, ModelLoadError):
        error = ModelLoadError(error.reason, error.message.format(dir=secret))
    else:
        error = type(error)(str(error).format(dir=secret))
    fake.load_error = error
    rkey = keys.report(NODE, "default", "broken", "r1")
    await put(store, keys, assignment("broken", test_model_dir))
    r = await wait_report(store, rkey, settled)
    assert r is not None and (r.state, r.reason) == (AssignmentState.FAILED, reason)
    assert r.message.startswith(LOAD_FAILURE_TEXT[reason])  # + the retry's " (attempt 1; …)"
    for leak in (secret, str(test_model_dir), type(error).__name__, "Errno", "[metal]"):
        assert leak not in r.message
    assert secret in caplog.text  # the detail stays in the agent's log


async def test_model_files_refused_report_no_directory(
        store: MemoryStore, keys: Keys, fake: FakeCore, controller: Controller,
        test_model_dir: Path, tmp_path: Path) -> None:
    """A model directory without weights (the test model's other files copied): the report
    says what is missing, not where."""
    import shutil

    model = tmp_path / "private-models" / "m"
    shutil.copytree(test_model_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    rkey = keys.report(NODE, "default", "noweights", "r1")
    await put(store, keys, assignment("noweights", model))
    r = await wait_report(store, rkey, settled)
    assert r is not None and (r.state, r.reason) == (AssignmentState.FAILED, "NoWeights")
    assert str(tmp_path) not in r.message and "private-models" not in r.message, r.message
