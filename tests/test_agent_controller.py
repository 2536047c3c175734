"""The assignment controller against the in-memory store, the real ServingCore and a generated
MLX model. The whole agent against a real etcd (end to end, the CLI's start-up error) is in
tests/test_integration_agent.py."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from mlx_fleet.source_policy import DEV_POLICY  # models in temporary directories
from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, Keys, ModelSource,
                                NodeCapacity, Role)
from mlx_fleet.memstore import MemoryStore
from mlx_fleet.store import Store, StoreError, WatchEvent
from node_agent.controller import Controller, ServedModel
from node_agent.cli import build_parser, config_from_args
from node_agent.registration import Registration
from node_agent.serving import ServingCore
from node_agent.sources import SourceError, resolve_source
from fault_record import FaultRecord
from serving_fixtures import mlx_thread_held, other_model_path, wait_for  # noqa: F401  (a session fixture)

NODE = "mac-1"
ADVERTISED = "http://agent.test:8000"
TIMEOUT = 120  # a model load on two busy CPU cores


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def assignment(name: str, model_dir: Path | str, *, model: str | None = None,
               revision: str = "r1", generation: int = 1, ns: str = "default",
               role: Role = Role.STABLE) -> Assignment:
    uri = model_dir if isinstance(model_dir, str) else f"file://{model_dir}"
    return Assignment(namespace=ns, name=name, generation=generation,
                      served_model_name=model or name,
                      source=ModelSource(uri=uri, revision=revision), memory_bytes=2**20,
                      role=role)


async def put(store: Store, keys: Keys, a: Assignment) -> int:
    return await store.put(keys.assignment(NODE, a.namespace, a.name, a.revision), a.to_json())


async def report_events(store: Store, key: str, start: int,
                        until: Callable[[AssignmentReport | None], bool],
                        timeout: float = TIMEOUT) -> list[AssignmentReport | None]:
    """Reports written to ``key`` from revision ``start`` (None = deleted), up to and including
    the first one satisfying ``until``."""
    seen: list[AssignmentReport | None] = []

    async def collect() -> None:
        async for ev in store.watch(key, start):
            if ev.kv.key != key:
                continue
            r = AssignmentReport.from_json(ev.kv.value) if ev.type == "PUT" else None
            seen.append(r)
            if until(r):
                return

    await asyncio.wait_for(collect(), timeout)
    return seen


async def wait_report(store: Store, key: str,
                      until: Callable[[AssignmentReport | None], bool],
                      timeout: float = TIMEOUT) -> AssignmentReport | None:
    """The first state of the report at ``key`` (now or later) satisfying ``until``."""
    listing = await store.list(key)
    kv = next((kv for kv in listing.items if kv.key == key), None)
    now = AssignmentReport.from_json(kv.value) if kv is not None else None
    if until(now):
        return now
    return (await report_events(store, key, listing.revision + 1, until, timeout))[-1]


def state_is(state: AssignmentState) -> Callable[[AssignmentReport | None], bool]:
    return lambda r: r is not None and r.state == state


def settled(r: AssignmentReport | None) -> bool:
    return r is not None and r.state in (AssignmentState.READY, AssignmentState.FAILED)


async def complete(core: ServingCore, model: str, revision: str | None = None,
                   max_tokens: int = 4) -> str:
    gen = await core.generate(model, revision=revision, prompt="Hello, world!",
                              max_tokens=max_tokens, temperature=0.0)
    return await collect(gen)


async def collect(gen) -> str:
    text = ""
    async with gen:
        async for chunk in gen:
            text += chunk.text
    return text


class Capacity:
    async def __call__(self) -> NodeCapacity:
        return NodeCapacity(memory_total_bytes=64 * 2**30, memory_available_bytes=48 * 2**30,
                            chip="Apple M3 Max", chip_generation=3, simulated=True)


class FlakyStore:
    """The in-memory store, with a switch that breaks the watch stream and keeps new watches
    failing until :meth:`reconnect` (a network partition between agent and etcd watch)."""

    def __init__(self, inner: MemoryStore) -> None:
        self._inner = inner
        self._up = asyncio.Event()
        self._up.set()
        self._broken = asyncio.Event()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def disconnect(self) -> None:
        self._up.clear()
        self._broken.set()
        # the in-memory store hands a live watch its events at once: break its streams too,
        # so none is delivered before the break is seen
        self._inner.break_watches("disconnected (test)")

    def reconnect(self) -> None:
        self._broken.clear()
        self._up.set()

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        if not self._up.is_set():
            raise StoreError("watch refused: disconnected (test)")
        it = self._inner.watch(prefix, start_revision).__aiter__()
        nxt: asyncio.Future | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                brk = asyncio.ensure_future(self._broken.wait())
                try:
                    await asyncio.wait({nxt, brk}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    brk.cancel()
                if not nxt.done():
                    raise StoreError("watch stream broken (test)")
                try:
                    ev = nxt.result()
                except StopAsyncIteration:
                    return
                yield ev
        finally:
            if nxt is not None and not nxt.done():
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt
            await it.aclose()


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def store(memory_or_etcd_store: Store) -> Store:
    """The in-memory store; the real etcd for a test marked ``stores.ON_ETCD``."""
    return memory_or_etcd_store


@pytest.fixture(scope="module")
async def core() -> AsyncIterator[ServingCore]:
    c = ServingCore()
    await c.start()
    yield c
    await c.close()


@pytest.fixture
async def registration(store: Store, keys: Keys) -> AsyncIterator[Registration]:
    reg = Registration(store, keys, node_name=NODE, address=ADVERTISED, capacity=Capacity(),
                       ttl=5)
    await reg.start()
    yield reg
    await reg.stop()


@pytest.fixture
async def flaky(store: MemoryStore) -> FlakyStore:
    return FlakyStore(store)


@pytest.fixture
async def controller(flaky: FlakyStore, keys: Keys, core: ServingCore,
                     registration: Registration) -> AsyncIterator[Controller]:
    ctl = Controller(flaky, keys, node_name=NODE, core=core,  # type: ignore[arg-type]
                     registration=registration, advertise_url=ADVERTISED,
                     source_policy=DEV_POLICY)
    await ctl.start()
    yield ctl
    await ctl.stop()
    for m in core.models():
        await core.unload_model(m.model_id)


# ---------------------------------------------------------------------------------------------
# sources (pure-ish: file system only)
# ---------------------------------------------------------------------------------------------


def test_resolve_source(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert resolve_source(str(model), policy=DEV_POLICY) == model
    assert resolve_source(f"file://{model}", policy=DEV_POLICY) == model
    assert resolve_source(f"file://localhost{model}", policy=DEV_POLICY) == model
    cases = {
        "http://example.com/m/": "UnsupportedSource",
        "s3://bucket/m": "UnsupportedSource",
        "relative/path": "InvalidSource",
        "": "InvalidSource",
        "file://host/abs": "InvalidSource",
        str(tmp_path / "missing"): "ModelNotFound",
        str(tmp_path): "ModelNotFound",  # exists, but no config.json
    }
    for uri, reason in cases.items():
        with pytest.raises(SourceError) as e:
            resolve_source(uri, policy=DEV_POLICY)
        assert e.value.reason == reason, uri
        assert e.value.message


# ---------------------------------------------------------------------------------------------
# controller
# ---------------------------------------------------------------------------------------------


async def test_assignment_loads_serves_and_unloads(store: MemoryStore, keys: Keys,
                                                   core: ServingCore, controller: Controller,
                                                   test_model_dir: Path) -> None:
    rkey = keys.report(NODE, "default", "llama", "r1")
    start = (await store.list(keys.root + "/")).revision + 1
    await put(store, keys, assignment("llama", test_model_dir, model="tiny-llama"))

    seen = await report_events(store, rkey, start, settled)
    assert [r.state for r in seen if r] == [AssignmentState.LOADING, AssignmentState.READY]
    ready = seen[-1]
    assert ready is not None and ready.endpoint == ADVERTISED and ready.revision == "r1"
    assert ready.generation == 1 and ready.resident_bytes > 0 and ready.reason == "ModelLoaded"
    kv = await store.get(rkey)
    assert kv is not None and kv.lease == controller._reg.lease_id

    assert core.is_loaded("tiny-llama", "r1")
    assert isinstance(await complete(core, "tiny-llama"), str)
    state = controller.states()["default/llama/r1"]
    assert {k: state[k] for k in ("model", "revision", "role", "state", "reason")} == {
        "model": "tiny-llama", "revision": "r1", "role": "Stable", "state": "Ready",
        "reason": "ModelLoaded"}
    assert controller.served() == {
        "tiny-llama": ServedModel("default", "llama", {"r1": Role.STABLE})}

    # a new generation with the same spec: report follows, no reload
    info = core.models()[0]
    await put(store, keys, assignment("llama", test_model_dir, model="tiny-llama", generation=2))
    r = await wait_report(store, rkey, lambda r: r is not None and r.generation == 2)
    assert r is not None and r.state == AssignmentState.READY
    assert core.models()[0] is info

    await store.delete(keys.assignment(NODE, "default", "llama", "r1"))
    assert await wait_report(store, rkey, lambda r: r is None) is None
    assert not core.is_loaded("tiny-llama") and controller.served() == {}
    await wait_for(lambda: core.models() == [], TIMEOUT)  # drained (nothing ran), unloaded


async def test_an_embedding_assignment_loads_as_an_embedding_model(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: Controller,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """``task: TextEmbedding`` (spec.model.task) is carried to the load: the revision serves
    embeddings, not generations; a change of task reloads it (it is part of what is loaded)."""
    from mlx_fleet.testmodel import make_test_model
    from node_agent.serving import WrongTask

    emb = make_test_model(tmp_path_factory.mktemp("models") / "emb", embedding=True)
    rkey = keys.report(NODE, "default", "emb", "r1")
    a = assignment("emb", emb).model_copy(update={"task": "TextEmbedding"})
    await put(store, keys, a)
    r = await wait_report(store, rkey, settled)
    assert r is not None and r.state == AssignmentState.READY, r
    [info] = core.models()
    assert info.task == "TextEmbedding" and info.embedding is not None
    out = await core.embed("emb", texts=["hello", "world"])
    assert out.vectors.shape == (2, info.embedding.dimensions)
    with pytest.raises(WrongTask):
        await complete(core, "emb")
    # the same revision as a generation model: reloaded for that task
    await put(store, keys, a.model_copy(update={"task": "TextGeneration", "generation": 2}))
    await wait_for(lambda: [m.task for m in core.models()] == ["TextGeneration"], TIMEOUT)
    assert isinstance(await complete(core, "emb"), str)
    await store.delete(keys.assignment(NODE, "default", "emb", "r1"))
    await wait_for(lambda: core.models() == [], TIMEOUT)


async def test_new_revision_loads_beside_the_old_one_which_drains_then_unloads(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: Controller,
        test_model_dir: Path, other_model_path: Path) -> None:  # noqa: F811
    r1key, r2key = keys.report(NODE, "default", "m", "r1"), keys.report(NODE, "default", "m", "r2")
    await put(store, keys, assignment("m", test_model_dir, revision="r1"))
    assert (await wait_report(store, r1key, settled)).state == AssignmentState.READY  # type: ignore[union-attr]
    old = core.model_info("m", "r1")

    # a rolling update: r2 is a new key next to r1, which becomes Previous until it is removed
    await put(store, keys, assignment("m", other_model_path, revision="r2", generation=2))
    await put(store, keys, assignment("m", test_model_dir, revision="r1", generation=2,
                                      role=Role.PREVIOUS))
    r2 = await wait_report(store, r2key, settled)
    assert r2 is not None and r2.state == AssignmentState.READY and r2.revision == "r2"
    r1 = await wait_report(store, r1key, lambda r: r is not None and r.generation == 2)
    assert r1 is not None and r1.state == AssignmentState.READY and r1.revision == "r1"
    # both resident while both are assigned; a changed role is no reload
    assert [(i.revision, i.path) for i in core.revisions("m")] == [
        ("r1", str(test_model_dir)), ("r2", str(other_model_path))]
    assert core.model_info("m", "r1") is old
    assert core.model_info("m", "r1").created_unix == old.created_unix
    assert controller.served() == {
        "m": ServedModel("default", "m", {"r1": Role.PREVIOUS, "r2": Role.STABLE})}
    assert {k: v["role"] for k, v in controller.states().items()} == {
        "default/m/r1": "Previous", "default/m/r2": "Stable"}
    ref = await complete(core, "m", "r1", max_tokens=16)

    # a request runs on r1; the MLX thread is held so it cannot end before r1 is unassigned
    running = await core.generate("m", revision="r1", prompt="Hello, world!", max_tokens=16,
                                  temperature=0.0)
    async with mlx_thread_held(core, TIMEOUT):
        await store.delete(keys.assignment(NODE, "default", "m", "r1"))
        assert await wait_report(store, r1key, lambda r: r is None) is None
        # draining: no new requests, still resident while its request runs; r2 serves
        assert not core.is_loaded("m", "r1") and core.is_loaded("m", "r2")
        assert core.inflight_requests("m", "r1") == 1
        assert [i.revision for i in core.revisions("m")] == ["r1", "r2"]
        assert controller.served() == {"m": ServedModel("default", "m", {"r2": Role.STABLE})}
    assert await asyncio.wait_for(collect(running), TIMEOUT) == ref  # finished in full
    assert running.finish_reason == "length" and running.completion_tokens == 16
    # then unloaded: its memory is returned
    await wait_for(lambda: [i.revision for i in core.revisions("m")] == ["r2"]
                   and core.memory_bytes("m", "r1") == 0, TIMEOUT)
    assert (await wait_report(store, r2key, settled)).state == AssignmentState.READY  # type: ignore[union-attr]


async def test_changed_source_of_a_revision_reloads_it(store: MemoryStore, keys: Keys,
                                                       core: ServingCore, controller: Controller,
                                                       test_model_dir: Path,
                                                       other_model_path: Path) -> None:  # noqa: F811
    rkey = keys.report(NODE, "default", "m", "r1")
    await put(store, keys, assignment("m", test_model_dir, revision="r1"))
    assert (await wait_report(store, rkey, settled)).state == AssignmentState.READY  # type: ignore[union-attr]
    await put(store, keys, assignment("m", other_model_path, revision="r1", generation=2))
    r = await wait_report(store, rkey, lambda r: settled(r) and r.generation == 2)
    assert r is not None and r.state == AssignmentState.READY and str(other_model_path) in r.message
    assert [(m.model_id, m.revision, m.path) for m in core.models()] == [
        ("m", "r1", str(other_model_path))]


async def test_a_served_name_taken_by_another_deployment_is_refused_until_it_is_freed(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: Controller,
        test_model_dir: Path) -> None:
    """Two deployments assigned the same served model name at once (converged concurrently):
    exactly one loads, the other is Failed/ModelNameConflict naming it; once the first is
    unassigned, the other loads without any change of its own assignment."""
    a = assignment("first", test_model_dir, model="shared")
    b = assignment("second", test_model_dir, model="shared")
    await asyncio.gather(put(store, keys, a), put(store, keys, b))
    ra, rb = [await wait_report(store, keys.report(NODE, "default", n, "r1"), settled)
              for n in ("first", "second")]
    assert ra is not None and rb is not None
    assert sorted([ra.state, rb.state]) == [AssignmentState.FAILED, AssignmentState.READY]
    winner, loser = ("first", "second") if ra.state == AssignmentState.READY else (
        "second", "first")
    refused = rb if winner == "first" else ra
    assert refused.reason == "ModelNameConflict" and winner in refused.message
    assert [m.model_id for m in core.models()] == ["shared"]

    await store.delete(keys.assignment(NODE, "default", winner, "r1"))
    r = await wait_report(store, keys.report(NODE, "default", loser, "r1"), settled_ready)
    assert r is not None and r.generation == 1
    assert controller.served()["shared"].name == loser


async def test_unassigning_a_revision_the_core_is_loading_calls_the_load_off(
        store: MemoryStore, keys: Keys, core: ServingCore, controller: Controller,
        test_model_dir: Path) -> None:
    """The MLX thread is held, so the load is queued on it: unassigning the revision cancels
    its task at once (its report goes while the thread is still held), the core drops the
    load, and nothing of it stays resident."""
    rkey = keys.report(NODE, "default", "queued", "r1")
    async with mlx_thread_held(core, TIMEOUT):
        await put(store, keys, assignment("queued", test_model_dir))
        r = await wait_report(store, rkey, state_is(AssignmentState.LOADING))
        assert r is not None
        await wait_for(lambda: [(p.model_id, p.state) for p in core.loads()]
                       == [("queued", "Queued")], TIMEOUT)  # waiting for the MLX thread
        await store.delete(keys.assignment(NODE, "default", "queued", "r1"))
        assert await wait_report(store, rkey, lambda r: r is None) is None
        await controller.converged()  # its task has ended, the thread still held
        assert controller.served() == {} and controller.states() == {}
    await wait_for(lambda: core.loads() == [], TIMEOUT)
    assert core.models() == [] and not core.is_loaded("queued")


async def test_bad_assignments_fail_with_reason(store: MemoryStore, keys: Keys,
                                                core: ServingCore, controller: Controller,
                                                tmp_path: Path) -> None:
    await put(store, keys, assignment("missing", str(tmp_path / "nope")))
    await put(store, keys, assignment("bucket", "s3://models/Qwen3-0.6B-4bit"))
    await store.put(keys.assignment(NODE, "default", "garbage", "r1"),
                    b'{"generation": 7, "name": ')
    await store.put(keys.assignment(NODE, "default", "partial", "r1"),
                    b'{"generation": 3, "namespace": "default", "name": "partial"}')
    # the key names revision r1, the body revision r2
    await store.put(keys.assignment(NODE, "default", "mismatch", "r1"),
                    assignment("mismatch", tmp_path, revision="r2", generation=4).to_json())
    expected = {"missing": "ModelNotFound", "bucket": "UnsupportedSource",
                "garbage": "InvalidAssignment", "partial": "InvalidAssignment",
                "mismatch": "InvalidAssignment"}
    for name, reason in expected.items():
        r = await wait_report(store, keys.report(NODE, "default", name, "r1"), settled)
        assert r is not None and r.state == AssignmentState.FAILED, name
        assert r.reason == reason and r.message, (name, r)
    partial = await wait_report(store, keys.report(NODE, "default", "partial", "r1"), settled)
    assert partial is not None and partial.generation == 3
    mismatch = await wait_report(store, keys.report(NODE, "default", "mismatch", "r1"), settled)
    assert mismatch is not None and mismatch.generation == 4 and "revision r2" in mismatch.message
    assert core.models() == []
    # a wrong URI is not retried; a missing model (maybe a disk not mounted yet) is
    bucket = await wait_report(store, keys.report(NODE, "default", "bucket", "r1"), settled)
    assert bucket is not None and "attempt" not in bucket.message
    missing = await wait_report(store, keys.report(NODE, "default", "missing", "r1"), settled)
    assert missing is not None and "(attempt 1; retrying in 2s)" in missing.message

    # a new generation of a failed assignment with the same spec: the report follows
    await put(store, keys, assignment("missing", str(tmp_path / "nope"), generation=2))
    r = await wait_report(store, keys.report(NODE, "default", "missing", "r1"),
                          lambda r: r is not None and r.generation == 2)
    assert r is not None and r.state == AssignmentState.FAILED and r.reason == "ModelNotFound"

    # the controller survived and still converges: deleting a failed assignment drops its report
    await store.delete(keys.assignment(NODE, "default", "garbage", "r1"))
    assert await wait_report(store, keys.report(NODE, "default", "garbage", "r1"),
                             lambda r: r is None) is None


async def test_failed_load_is_retried_until_the_model_appears(
        store: MemoryStore, keys: Keys, core: ServingCore, registration: Registration,
        test_model_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "disk" / "model"  # not there yet: a disk that isn't mounted
    ctl = Controller(store, keys, node_name=NODE, core=core, registration=registration,
                     advertise_url=ADVERTISED, retry_backoff=(0.05, 0.2),
                     source_policy=DEV_POLICY)
    rkey = keys.report(NODE, "default", "late", "r1")
    await ctl.start()
    try:
        start = (await store.list(keys.root + "/")).revision + 1
        await put(store, keys, assignment("late", model_dir))
        seen = await report_events(store, rkey, start,
                                   lambda r: r is not None and "attempt 2;" in r.message)
        assert [r.state for r in seen if r] == [AssignmentState.LOADING, AssignmentState.FAILED,
                                                AssignmentState.FAILED]
        assert all(r is not None and r.reason == "ModelNotFound" for r in seen[1:])

        # the disk appears (atomically: a rename of a complete copy)
        shutil.copytree(test_model_dir, tmp_path / "staging")
        model_dir.parent.mkdir()
        (tmp_path / "staging").rename(model_dir)
        more = await report_events(store, rkey, start, settled_ready)
        assert more[-1] is not None and more[-1].endpoint == ADVERTISED
        # retries never flicker through Loading: Failed (attempt n) ... → Ready
        assert [r.state for r in more if r][1:-1] == [AssignmentState.FAILED] * (len(more) - 2)
        assert core.is_loaded("late")
    finally:
        await ctl.stop()
        for m in core.models():
            await core.unload_model(m.model_id)


async def test_retry_timing_follows_the_injected_clock(
        store: MemoryStore, keys: Keys, core: ServingCore, registration: Registration,
        test_model_dir: Path, tmp_path: Path) -> None:
    """The back-off is measured on the controller's clock, not the wall clock: a failed load
    whose model has since appeared is not retried (a new generation is reported Failed
    again) until the injected clock passes its retry time; then the next pass loads it."""
    now = [1000.0]
    model_dir = tmp_path / "model"  # not there yet
    ctl = Controller(store, keys, node_name=NODE, core=core, registration=registration,
                     advertise_url=ADVERTISED, retry_backoff=(60.0, 60.0),
                     clock=lambda: now[0], source_policy=DEV_POLICY)
    rkey = keys.report(NODE, "default", "timed", "r1")
    await ctl.start()
    try:
        await put(store, keys, assignment("timed", model_dir))
        r = await wait_report(store, rkey, settled)
        assert r is not None and r.state == AssignmentState.FAILED
        assert "(attempt 1; retrying in 60s)" in r.message
        shutil.copytree(test_model_dir, model_dir)  # the model appears

        now[0] += 59.0  # not due yet on the injected clock: Failed again, no load
        await put(store, keys, assignment("timed", model_dir, generation=2))
        r = await wait_report(store, rkey, lambda r: r is not None and r.generation == 2)
        assert r is not None and r.state == AssignmentState.FAILED
        assert "(attempt 1; retrying in 60s)" in r.message and not core.is_loaded("timed")

        now[0] += 1.0  # due: the next pass retries, and it loads
        await put(store, keys, assignment("timed", model_dir, generation=3))
        r = await wait_report(store, rkey, lambda r: settled(r) and r.generation == 3)
        assert r is not None and r.state == AssignmentState.READY and core.is_loaded("timed")
    finally:
        await ctl.stop()
        for m in core.models():
            await core.unload_model(m.model_id)


def settled_ready(r: AssignmentReport | None) -> bool:
    return r is not None and r.state == AssignmentState.READY


@pytest.mark.fault("etcd compaction while an agent's watch is down",
                   holds="the agent's assignment follower resumes, meets the compaction, re-lists and "
                         "converges: the assignment added meanwhile is Ready, the one removed is "
                         "unloaded (the agent's controller in the test process, the in-memory "
                         "store; recovery: from the reconnect to converged)")
async def test_watch_relists_after_compaction(store: MemoryStore, keys: Keys, core: ServingCore,
                                              flaky: FlakyStore, controller: Controller,
                                              test_model_dir: Path, fault_record: FaultRecord) -> None:
    ka, kb = keys.report(NODE, "default", "a", "r1"), keys.report(NODE, "default", "b", "r1")
    await put(store, keys, assignment("a", test_model_dir))
    assert (await wait_report(store, ka, settled)).state == AssignmentState.READY  # type: ignore[union-attr]
    assert controller.snapshots == 1

    flaky.disconnect()  # the controller's watch breaks and can't come back yet
    await store.delete(keys.assignment(NODE, "default", "a", "r1"))
    rev = await put(store, keys, assignment("b", test_model_dir))
    await store.compact(rev)  # the events above are gone from the store's history
    flaky.reconnect()
    fault_record.fault_ended()

    assert (await wait_report(store, kb, settled)).state == AssignmentState.READY  # type: ignore[union-attr]
    assert await wait_report(store, ka, lambda r: r is None) is None
    assert controller.snapshots == 2  # resumed, hit the compaction, re-listed
    await wait_for(lambda: [m.model_id for m in core.models()] == ["b"], TIMEOUT)
    fault_record.recovered()
    fault_record.note("re-listed once after the compaction; no assignment missed")


async def test_callback_bug_restarts_the_follower_which_converges(
        store: MemoryStore, keys: Keys, core: ServingCore, registration: Registration,
        test_model_dir: Path) -> None:
    ctl = Controller(store, keys, node_name=NODE, core=core, registration=registration,
                     advertise_url=ADVERTISED, source_policy=DEV_POLICY)
    listed = asyncio.Event()
    real_apply = ctl.follower.apply
    bugs = 0

    def apply(update):
        nonlocal bugs
        if update.listing:
            real_apply(update)
            listed.set()
        elif bugs == 0:  # a bug in the watch callback, once
            bugs += 1
            raise RuntimeError("injected callback bug")
        else:
            real_apply(update)

    ctl.follower.apply = apply  # type: ignore[method-assign]
    await ctl.start()
    try:
        await asyncio.wait_for(listed.wait(), TIMEOUT)
        await put(store, keys, assignment("x", test_model_dir))  # arrives as a watch event
        r = await wait_report(store, keys.report(NODE, "default", "x", "r1"), settled)
        assert r is not None and r.state == AssignmentState.READY
        follow = ctl.tasks[0]
        assert bugs == 1 and follow.restarts == 1
        assert follow.last_error == "RuntimeError: injected callback bug"
        assert ctl.snapshots == 2  # the restarted follower re-listed
    finally:
        await ctl.stop()
        for m in core.models():
            await core.unload_model(m.model_id)


async def test_a_bug_in_one_assignment_s_task_restarts_the_worker_which_converges_it(
        store: MemoryStore, keys: Keys, core: ServingCore, registration: Registration,
        test_model_dir: Path) -> None:
    """An unexpected exception in one assignment's task is raised by the converge worker (so
    /health shows it and the supervisor restarts it); the restarted worker starts that
    assignment's task again, which loads it."""
    ctl = Controller(store, keys, node_name=NODE, core=core, registration=registration,
                     advertise_url=ADVERTISED, source_policy=DEV_POLICY)
    real = ctl._keys_tasks.converge_one
    bugs = 0

    async def converge_one(key, d):  # a bug, once
        nonlocal bugs
        if bugs == 0:
            bugs += 1
            raise RuntimeError("injected task bug")
        return await real(key, d)

    ctl._keys_tasks.converge_one = converge_one  # type: ignore[method-assign]
    await ctl.start()
    try:
        await put(store, keys, assignment("y", test_model_dir))
        r = await wait_report(store, keys.report(NODE, "default", "y", "r1"), settled)
        assert r is not None and r.state == AssignmentState.READY
        worker = ctl.tasks[1]
        assert worker.name == "controller:converge"
        assert bugs == 1 and worker.restarts == 1
        assert worker.last_error == "RuntimeError: injected task bug"
    finally:
        await ctl.stop()
        for m in core.models():
            await core.unload_model(m.model_id)


# ---------------------------------------------------------------------------------------------
# the agent process (main.py wiring)
# ---------------------------------------------------------------------------------------------


def test_cli_parses_every_flag() -> None:
    args = build_parser().parse_args([
        "--node-name", "studio-1", "--etcd-endpoint", "http://etcd.lan:2379",
        "--etcd-prefix", "/fleet", "--listen", "0.0.0.0:9000", "--advertise-url", "http://s:9",
        "--label", "rack=a", "--label", "tier=gold", "--lease-ttl", "9",
        "--simulated-chip", "Apple M4 Max", "--simulated-memory", "128Gi",
        "--max-queued-requests", "5", "--max-loaded-models", "2", "--memory-watermark", "0.9",
        "--log-level", "DEBUG"])
    cfg = config_from_args(args)
    assert (cfg.node_name, cfg.etcd_endpoint, cfg.etcd_prefix) == (
        "studio-1", "http://etcd.lan:2379", "/fleet")
    assert (cfg.listen_host, cfg.listen_port, cfg.advertise_url) == ("0.0.0.0", 9000, "http://s:9")
    assert cfg.labels == {"rack": "a", "tier": "gold"} and cfg.lease_ttl == 9
    assert cfg.simulated_chip == "Apple M4 Max" and cfg.simulated_memory_bytes == 128 * 2**30
    assert cfg.max_queued_requests == 5 and cfg.max_loaded_models == 2
    assert config_from_args(build_parser().parse_args([])).max_loaded_models == 0  # no limit
    assert cfg.memory_watermark == 0.9
    assert config_from_args(build_parser().parse_args([])).memory_watermark == 0.8  # seed 004
    default = config_from_args(build_parser().parse_args([])).serving
    assert default.as_record() == {"prompt_cache": "on", "prompt_cache_bytes": "auto",
                                   "admission_policy": "kv", "stream_buffer_chunks": "1024",
                                   "request_coalescing": "on", "fast_first_token": "on",
                                   "prefill_batch_tokens": "16384"}
    off = config_from_args(build_parser().parse_args([
        "--no-prompt-cache", "--prompt-cache-bytes", "1.5Gi", "--admission-policy", "count",
        "--stream-buffer-chunks", "7", "--no-coalesce-requests", "--no-fast-first-token",
        "--prefill-batch-tokens", "0"])).serving
    assert not off.request_coalescing and not off.fast_first_token
    assert off.prefill_batch_tokens == 0 and off.as_record()["prefill_batch_tokens"] == "0"
    assert (off.prompt_cache, off.prompt_cache_bytes, off.admission_policy,
            off.stream_buffer_chunks) == (False, 1536 * 2**20, "count", 7)
    for bad in (["--listen", "8000"], ["--label", "novalue"], ["--simulated-memory", "64GB"],
                ["--etcd-endpoint", "unix:///run/etcd.sock"], ["--prefill-batch-tokens", "-1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
    with pytest.raises(ValueError, match="is https: --etcd-ca-file is required"):
        config_from_args(build_parser().parse_args(["--etcd-endpoint", "https://etcd:2379"]))


@pytest.mark.parametrize("flag, value", [
    ("--max-queued-requests", "-1"), ("--max-queued-requests", "0"),
    ("--lease-ttl", "0"), ("--lease-ttl", "-5"),
])
def test_cli_rejects_non_positive_counts(flag: str, value: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be at least 1, got {value}" in err


@pytest.mark.parametrize("flag, value, error", [
    ("--prompt-cache-bytes", "1GB", "invalid quantity '1GB'"),
    ("--prompt-cache-bytes", "-1Mi", "must be at least 0 bytes, got '-1Mi'"),
    ("--admission-policy", "fifo", "invalid choice: 'fifo' (choose from 'count', 'kv')"),
    ("--stream-buffer-chunks", "0", "must be at least 1, got 0"),
])
def test_cli_rejects_bad_serving_options(flag: str, value: str, error: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([f"{flag}={value}"])
    assert exc.value.code == 2
    assert f"argument {flag}: {error}" in capsys.readouterr().err


@pytest.mark.parametrize("value, error", [("-1", "must be at least 0, got -1"),
                                          ("two", "expected a whole number, got 'two'")])
def test_cli_rejects_a_bad_model_limit(value: str, error: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--max-loaded-models", value])
    assert exc.value.code == 2
    assert f"argument --max-loaded-models: {error}" in capsys.readouterr().err


@pytest.mark.parametrize("value, error", [
    ("0", "must be a fraction in (0, 1] such as 0.8, got '0'"),
    ("1.5", "must be a fraction in (0, 1] such as 0.8, got '1.5'"),
    ("-0.2", "must be a fraction in (0, 1] such as 0.8, got '-0.2'"),
    ("nan", "must be a fraction in (0, 1] such as 0.8, got 'nan'"),
    ("inf", "must be a fraction in (0, 1] such as 0.8, got 'inf'"),
    ("80%", "expected a fraction in (0, 1] such as 0.8, got '80%'"),
    ("", "expected a fraction in (0, 1] such as 0.8, got ''"),
])
def test_cli_rejects_a_bad_memory_watermark(value: str, error: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([f"--memory-watermark={value}"])
    assert exc.value.code == 2
    assert f"argument --memory-watermark: {error}" in capsys.readouterr().err
