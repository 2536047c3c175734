"""Loads never stall serving: the serving core reads a model's weights in chunks between the
other revisions' decode steps (node_agent.serving.loading). The pure chunk planning is
table-tested; the core is tested on real generated models, with an ordered trace of what its MLX
thread did (decode steps, weight chunks, unloads) instead of timings."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from mlx_fleet.testmodel import make_test_model
from node_agent.serving import ModelLoadError, ServingCore
from node_agent.serving.loading import (LoadPacing, Materialization, chunk_budget_bytes,
                                        due_time, next_chunk, rate_after_confirm, update_rate)
from serving_fixtures import tiny_model_path, wait_for  # noqa: F401

MiB = 2**20
BOUND = 60          # seconds: a call that has not returned by then is hung
LONG = 4000         # tokens: longer than any load here
SMALL_CHUNKS = LoadPacing(max_chunk_bytes=64 * 1024)   # every array a chunk of its own, about


# -- pure planning --------------------------------------------------------------------------

P = LoadPacing(chunk_seconds=0.05, max_chunk_bytes=512 * MiB, probe_chunk_bytes=4 * MiB)


@pytest.mark.parametrize("pacing, decoding, rate, expected", [
    (P, False, None, 512 * MiB),                # nothing decodes: the ceiling
    (P, False, 1e9, 512 * MiB),
    (P, True, None, 4 * MiB),                   # decoding, no rate yet: the probe
    (LoadPacing(max_chunk_bytes=MiB), True, None, MiB),   # the probe never exceeds the ceiling
    (P, True, 1e9, 50_000_000),                 # 50 ms × 1 GB/s
    (LoadPacing(chunk_seconds=0.01), True, 1e9, 10_000_000),
    (P, True, 1e11, 512 * MiB),                 # capped by the ceiling
    (P, True, 1.0, 1),                          # never below one byte (next_chunk takes one array)
    (P, True, 0.0, 4 * MiB),                    # an unusable rate counts as none
])
def test_chunk_budget(pacing: LoadPacing, decoding: bool, rate: float | None,
                      expected: int) -> None:
    assert chunk_budget_bytes(pacing, decoding=decoding, bytes_per_second=rate) == expected


@pytest.mark.parametrize("submitted, nbytes, rate, margin, expected", [
    (10.0, 1000, 1000.0, 1.0, 11.0),        # the expected read time
    (10.0, 1000, 1000.0, 1.25, 11.25),      # ... with the margin
    (10.0, 1000, None, 1.25, 10.0),         # no rate: at once (then measured)
    (10.0, 1000, 0.0, 1.25, 10.0),
])
def test_due_time(submitted: float, nbytes: int, rate: float | None, margin: float,
                  expected: float) -> None:
    assert due_time(submitted, nbytes, rate, margin) == pytest.approx(expected)


@pytest.mark.parametrize("rate, nbytes, submitted, confirmed, blocked, expected", [
    (None, 1000, 0.0, 1.0, 0.5, 1000.0),        # waited: the read ended now, as measured
    (3000.0, 1000, 0.0, 1.0, 0.5, 1000.0),      # ... replacing a stale, too high estimate
    (None, 1000, 0.0, 1.0, 0.0, 1000.0),        # did not wait: at least bytes / elapsed
    (800.0, 1000, 0.0, 1.0, 0.0, 1000.0),       # ... the bound beats the grown estimate
    (1000.0, 1000, 0.0, 1.0, 0.0, 1100.0),      # ... the grown estimate beats the bound
    (1000.0, 0, 0.0, 1.0, 0.0, 1000.0),         # nothing read: unchanged
    (None, 1000, 1.0, 1.0, 0.0, None),          # too short to time: unchanged
])
def test_rate_after_confirm(rate: float | None, nbytes: int, submitted: float, confirmed: float,
                            blocked: float, expected: float | None) -> None:
    got = rate_after_confirm(rate, nbytes, submitted, confirmed, blocked)
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize("sizes, start, budget, expected", [
    ([10, 10, 10], 0, 25, 2),
    ([10, 10, 10], 0, 30, 3),
    ([10, 10, 10], 0, 1000, 3),
    ([10, 10, 10], 1, 10, 2),
    ([50, 10, 10], 0, 25, 1),      # an array over the budget is a chunk of its own
    ([10, 50, 10], 0, 25, 1),      # ... and is not joined to the one before
    ([10, 50, 10], 1, 25, 2),
    ([10, 10], 2, 100, 2),         # nothing left
    ([], 0, 100, 0),
    ([0, 0, 5], 0, 1, 2),
])
def test_next_chunk(sizes: list[int], start: int, budget: int, expected: int) -> None:
    assert next_chunk(sizes, start, budget) == expected


@pytest.mark.parametrize("rate, nbytes, seconds, expected", [
    (None, 1000, 1.0, 1000.0),      # the first measurement as is
    (1000.0, 3000, 1.0, 2000.0),    # half old, half new
    (1000.0, 0, 1.0, 1000.0),       # an empty chunk measures nothing
    (1000.0, 100, 0.0, 1000.0),     # nor does one too short to time
    (None, 100, 0.0, None),
])
def test_update_rate(rate: float | None, nbytes: int, seconds: float,
                     expected: float | None) -> None:
    assert update_rate(rate, nbytes, seconds) == expected


@pytest.mark.parametrize("kwargs", [{"chunk_seconds": 0}, {"chunk_seconds": -1},
                                    {"chunk_seconds": 61}, {"confirm_margin": 0.9},
                                    {"max_chunk_bytes": 0},
                                    {"probe_chunk_bytes": 0}])
def test_pacing_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LoadPacing(**kwargs)


# -- the core ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def big_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wider and deeper than the tiny model (~12 MB): several chunks at 64 KiB."""
    return make_test_model(tmp_path_factory.mktemp("models") / "big", hidden_size=256,
                           num_layers=4, seed=2)


@pytest_asyncio.fixture
async def core() -> AsyncIterator[ServingCore]:
    c = ServingCore(registry=CollectorRegistry(), load_pacing=SMALL_CHUNKS)
    await c.start()
    yield c
    await asyncio.wait_for(c.close(), BOUND)


@pytest.fixture
def trace(core: ServingCore, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple]]:
    """What the core's MLX thread does, in order: ``("step", model_id)`` for every decode step,
    ``("chunk", model_id)`` for every weight chunk read, ``("unload", model_id)``."""
    events: list[tuple] = []
    engine = core._engine
    step, unload, real_eval = engine.step, engine.unload, Materialization.eval_arrays

    def traced_step(res) -> None:
        events.append(("step", res.key[0]))
        step(res)

    def traced_unload(key, *args, **kw) -> None:
        events.append(("unload", key[0]))
        unload(key, *args, **kw)

    def traced_eval(arrays) -> None:
        if core._loads:                      # (not another core's load)
            events.append(("chunk", core._loads[0].info.model_id))
        real_eval(arrays)

    monkeypatch.setattr(engine, "step", traced_step)
    monkeypatch.setattr(engine, "unload", traced_unload)
    monkeypatch.setattr(Materialization, "eval_arrays", staticmethod(traced_eval))
    yield events


def chunks_of(events: list[tuple], model_id: str) -> list[int]:
    return [i for i, e in enumerate(events) if e == ("chunk", model_id)]


async def greedy(core: ServingCore, model_id: str) -> str:
    gen = await core.generate(model_id, prompt="The quick brown fox", max_tokens=8,
                              temperature=0)
    return "".join([c.text async for c in gen])


async def test_decoding_goes_on_while_another_model_loads(
        core: ServingCore, trace: list[tuple], tiny_model_path: Path,  # noqa: F811
        big_model_path: Path) -> None:
    await core.load_model("x", tiny_model_path, revision="r1", max_context_tokens=8192)
    stream = await core.generate("x", prompt="Once upon a time", max_tokens=LONG,
                                 temperature=0)
    await asyncio.wait_for(stream.__anext__(), BOUND)
    during_load = 0
    loading = asyncio.create_task(core.load_model("y", big_model_path, revision="r1"))
    async for _ in stream:
        if loading.done():
            break
        during_load += 1
    stream.cancel()
    info = await asyncio.wait_for(loading, BOUND)
    assert info.model_id == "y" and core.is_loaded("y") and core.loads() == []
    chunks = chunks_of(trace, "y")
    assert len(chunks) > 3                                  # the load was cut into chunks
    # x decoded between y's first and last chunk: the load did not stop it
    x_steps = [i for i, e in enumerate(trace) if e == ("step", "x")]
    between = [i for i in x_steps if chunks[0] < i < chunks[-1]]
    assert len(between) >= len(chunks) - 1 > 0
    assert during_load > 0                                  # and its tokens reached the caller
    assert len(await greedy(core, "y")) > 0


@pytest.mark.parametrize("overlap", [True, False])
async def test_while_others_decode_reads_are_submitted_not_waited_for(
        overlap: bool, tiny_model_path: Path, big_model_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlapped (the default): while x decodes, y's chunks are handed to ``mx.async_eval``
    and confirmed later; ``overlap=False``: every chunk is a synchronous read. Either way the
    weights read are the same as a lone load's."""
    submitted: list[int] = []
    real_submit = Materialization.submit_arrays

    def counting(arrays) -> None:
        submitted.append(len(arrays))
        real_submit(arrays)
    monkeypatch.setattr(Materialization, "submit_arrays", staticmethod(counting))
    c = ServingCore(registry=CollectorRegistry(),
                    load_pacing=LoadPacing(overlap=overlap, max_chunk_bytes=64 * 1024))
    await c.start()
    try:
        await c.load_model("x", tiny_model_path, revision="r1", max_context_tokens=8192)
        stream = await c.generate("x", prompt="Once upon a time", max_tokens=LONG,
                                  temperature=0)
        await asyncio.wait_for(stream.__anext__(), BOUND)
        loading = asyncio.create_task(c.load_model("y", big_model_path, revision="r1"))
        async for _ in stream:
            if loading.done():
                break
        stream.cancel()
        await asyncio.wait_for(loading, BOUND)
        assert (len(submitted) > 3) if overlap else submitted == []
        overlapped = await greedy(c, "y")
    finally:
        await asyncio.wait_for(c.close(), BOUND)
    lone = ServingCore(registry=CollectorRegistry())
    await lone.start()
    try:
        await lone.load_model("y", big_model_path, revision="r1")
        assert await greedy(lone, "y") == overlapped
    finally:
        await asyncio.wait_for(lone.close(), BOUND)


async def test_a_lone_load_reads_in_one_chunk_and_equals_a_chunked_one(
        core: ServingCore, trace: list[tuple], big_model_path: Path) -> None:
    await core.load_model("y", big_model_path, revision="r1")     # 64 KiB chunks
    assert len(chunks_of(trace, "y")) > 3
    chunked = await greedy(core, "y")
    lone = ServingCore(registry=CollectorRegistry())                # default pacing
    await lone.start()
    try:
        seen: list[int] = []
        real = Materialization.eval_arrays

        def count(arrays) -> None:
            seen.append(len(arrays))
            real(arrays)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Materialization, "eval_arrays", staticmethod(count))
            await lone.load_model("y", big_model_path, revision="r1")
        assert len(seen) == 1                   # nothing decoding: one chunk of everything
        assert await greedy(lone, "y") == chunked
    finally:
        await lone.close()


async def test_a_failing_chunk_fails_the_load_and_leaves_nothing(
        core: ServingCore, tiny_model_path: Path, big_model_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    await core.load_model("x", tiny_model_path, revision="r1")
    real = Materialization.eval_arrays
    calls = {"n": 0}

    def failing(arrays) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("[load_safetensors] read error (injected)")
        real(arrays)
    monkeypatch.setattr(Materialization, "eval_arrays", staticmethod(failing))
    with pytest.raises(ModelLoadError) as exc:
        await asyncio.wait_for(core.load_model("y", big_model_path, revision="r1"), BOUND)
    assert exc.value.reason == "LoadFailed" and "injected" in exc.value.message
    assert not core.is_loaded("y") and [m.model_id for m in core.models()] == ["x"]
    assert core.loads() == [] and core.memory_bytes("y", "r1") == 0
    assert len(await greedy(core, "x")) > 0                 # the rest serves on
    monkeypatch.setattr(Materialization, "eval_arrays", staticmethod(real))
    await core.load_model("y", big_model_path, revision="r1")   # and it loads on a retry
    assert core.is_loaded("y")


class Gate:
    """Holds the MLX thread inside the ``at``-th weight chunk until :meth:`open`; ``reached``
    is set (on the loop) when it is there."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int) -> None:
        self.reached = asyncio.Event()
        self._go = threading.Event()
        self._n = 0
        loop = asyncio.get_running_loop()
        real = Materialization.eval_arrays

        def gated(arrays) -> None:
            self._n += 1
            if self._n == at:
                loop.call_soon_threadsafe(self.reached.set)
                self._go.wait(BOUND)
            real(arrays)
        monkeypatch.setattr(Materialization, "eval_arrays", staticmethod(gated))

    async def open(self) -> None:
        self._go.set()


async def test_unload_during_a_load_calls_it_off(
        core: ServingCore, big_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = (await core.memory_usage()).active_bytes
    gate = Gate(monkeypatch, at=2)
    loading = asyncio.create_task(core.load_model("y", big_model_path, revision="r1"))
    await asyncio.wait_for(gate.reached.wait(), BOUND)
    [progress] = core.loads()
    assert (progress.model_id, progress.chunks) == ("y", 1)
    assert 0 < progress.done_bytes < progress.total_bytes
    # the unload runs first (up to its wait), then the thread is let go
    await asyncio.wait_for(asyncio.gather(core.unload_model("y"), gate.open()), BOUND)
    assert loading.done()                        # unload returned after the load was dropped
    with pytest.raises(ModelLoadError) as exc:
        await loading
    assert exc.value.reason == "Cancelled"
    assert not core.is_loaded("y") and core.models() == [] and core.loads() == []
    after = (await core.memory_usage()).active_bytes
    assert after - before < progress.total_bytes // 4    # what it had read was freed
    await core.load_model("y", big_model_path, revision="r1")   # a later load is unaffected
    assert core.is_loaded("y")


async def test_close_during_a_load_fails_it(big_model_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    c = ServingCore(registry=CollectorRegistry(), load_pacing=SMALL_CHUNKS)
    await c.start()
    gate = Gate(monkeypatch, at=2)
    loading = asyncio.create_task(c.load_model("y", big_model_path, revision="r1"))
    await asyncio.wait_for(gate.reached.wait(), BOUND)
    await asyncio.wait_for(asyncio.gather(c.close(), gate.open()), BOUND)
    with pytest.raises(ModelLoadError) as exc:
        await asyncio.wait_for(loading, BOUND)
    assert exc.value.reason == "NotStarted"
    assert c.models() == [] and c.loads() == []


async def test_loads_queue_and_unloads_pass_them(
        core: ServingCore, trace: list[tuple], tiny_model_path: Path,  # noqa: F811
        big_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await core.load_model("z", tiny_model_path, revision="r1")
    real_eval = Materialization.eval_arrays                   # the tracing one
    gate_at = len(trace) + 2
    reached, go = asyncio.Event(), threading.Event()
    loop = asyncio.get_running_loop()

    def gated(arrays) -> None:
        real_eval(arrays)
        if len(trace) == gate_at:              # inside the first load's second chunk
            loop.call_soon_threadsafe(reached.set)
            go.wait(BOUND)
    monkeypatch.setattr(Materialization, "eval_arrays", staticmethod(gated))

    async def release() -> None:
        go.set()
    first = asyncio.create_task(core.load_model("y1", big_model_path, revision="r1"))
    second = asyncio.create_task(core.load_model("y2", big_model_path, revision="r1"))
    await asyncio.wait_for(reached.wait(), BOUND)
    await asyncio.wait_for(asyncio.gather(core.unload_model("z"), release()), BOUND)
    await asyncio.wait_for(asyncio.gather(first, second), BOUND)
    # the tokenizers load on worker threads, so either load may reach the MLX thread first
    order = [m.model_id for m in core.models()]
    assert sorted(order) == ["y1", "y2"]
    first_id, second_id = order
    a, b = chunks_of(trace, first_id), chunks_of(trace, second_id)
    unloaded = trace.index(("unload", "z"))
    assert a[0] < unloaded < a[-1]              # the unload did not wait for the load
    assert a[-1] < b[0]                         # one load materialises at a time, in order


async def test_unload_of_a_queued_load_calls_it_off(
        core: ServingCore, trace: list[tuple], big_model_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch, at=2)
    first = asyncio.create_task(core.load_model("y1", big_model_path, revision="r1"))
    await asyncio.wait_for(gate.reached.wait(), BOUND)
    second = asyncio.create_task(core.load_model("y2", big_model_path, revision="r1"))
    await wait_for(lambda: [(p.model_id, p.state) for p in core.loads()] == [
        ("y1", "ReadingWeights"), ("y2", "Queued")])
    await asyncio.wait_for(asyncio.gather(core.unload_model("y2"), gate.open()), BOUND)
    with pytest.raises(ModelLoadError) as exc:
        await second
    assert exc.value.reason == "Cancelled"
    await asyncio.wait_for(first, BOUND)
    assert [m.model_id for m in core.models()] == ["y1"]
    assert chunks_of(trace, "y2") == []                  # it never read a byte


async def test_unload_while_the_tokenizer_loads_calls_the_load_off(
        core: ServingCore, trace: list[tuple], big_model_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import node_agent.serving.revisions as revisions_module

    # The tokenizer stage is held until the unload has been asked for (else the stage may end
    # and a weight chunk start before the unload arrives: a race, not the case under test).
    asked, real = threading.Event(), revisions_module.load_tokenizer

    def held_tokenizer(path):
        asked.wait(BOUND)
        return real(path)

    monkeypatch.setattr(revisions_module, "load_tokenizer", held_tokenizer)
    loading = asyncio.create_task(core.load_model("y", big_model_path, revision="r1"))
    await wait_for(lambda: [p.state for p in core.loads()] == ["LoadingTokenizer"])
    unloading = asyncio.create_task(core.unload_model("y"))
    await wait_for(lambda: unloading.done() or all(j.cancelled for j in core._loading))
    asked.set()
    await asyncio.wait_for(unloading, BOUND)
    assert loading.done()
    with pytest.raises(ModelLoadError) as exc:
        await loading
    assert exc.value.reason == "Cancelled"
    assert core.models() == [] and core.loads() == [] and chunks_of(trace, "y") == []


async def test_the_same_load_twice_reads_the_weights_once(
        core: ServingCore, trace: list[tuple], big_model_path: Path) -> None:
    first, second = await asyncio.wait_for(asyncio.gather(
        core.load_model("y", big_model_path, revision="r1", max_concurrent_sequences=2),
        core.load_model("y", big_model_path, revision="r1", max_concurrent_sequences=3)), BOUND)
    assert (first.max_concurrent_sequences, second.max_concurrent_sequences) == (2, 3)
    assert core.model_info("y") == second and second.created_unix == first.created_unix
    assert ("unload", "y") not in trace                  # not loaded twice (nor replaced)
    n = len(chunks_of(trace, "y"))
    await core.load_model("y", big_model_path, revision="r1", max_concurrent_sequences=3)
    assert len(chunks_of(trace, "y")) == n
