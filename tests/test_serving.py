"""ServingCore against a real generated model loaded through mlx_lm: generation, limits,
continuous batching through BatchGenerator, cancellation, unload, several models, several
revisions of one model (side by side, unloaded one at a time, drained), crash counts and memory
estimates; plus the pure admission and stop-string functions, table-tested."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from node_agent.serving import (ContextLengthExceeded, GenerationAborted, ModelInfo,
                                ModelLoadError, ModelNotLoaded, Overloaded, ServingCore)
from node_agent.memory_estimate import KV_CACHE_STEP_TOKENS
from node_agent.serving.admission import (MAX_RETRY_AFTER_SECONDS, DrainRate, admit, admit_kv,
                                          kv_budget_bytes, request_kv_bytes,
                                          retry_after_seconds, waiting_requests)
from node_agent.serving.detokenize import apply_stops, next_text
from fault_record import FaultRecord
from serving_fixtures import (other_model_path, safetensors_bytes, tiny_model_path,  # noqa: F401
                              wait_for)

LONG = 4000  # more tokens than any test lets a request run


@pytest_asyncio.fixture(scope="module")
async def core(tiny_model_path: Path) -> AsyncIterator[ServingCore]:  # noqa: F811
    c = ServingCore(registry=CollectorRegistry())
    await c.start()
    await c.load_model("m", tiny_model_path, revision="r1", max_concurrent_sequences=4,
                       max_context_tokens=8192)
    yield c
    await c.close()


def sample(core: ServingCore, name: str, **labels: str) -> float | None:
    return core.registry.get_sample_value(name, labels)


async def collect(gen) -> str:
    return "".join([c.text async for c in gen])


async def test_load_is_idempotent_and_reports_info(core: ServingCore, tiny_model_path: Path) -> None:  # noqa: F811
    info = core.model_info("m")
    assert isinstance(info, ModelInfo)
    assert (info.model_id, info.revision, info.path) == ("m", "r1", str(tiny_model_path))
    assert (info.max_concurrent_sequences, info.max_context_tokens) == (4, 8192)
    again = await core.load_model("m", tiny_model_path, revision="r1",
                                  max_concurrent_sequences=4, max_context_tokens=8192)
    assert again is info
    assert core.is_loaded("m") and not core.is_loaded("other")
    assert [m.model_id for m in core.models()] == ["m"]
    assert sample(core, "mlxfleet_agent_model_loaded", model="m", revision="r1") == 1
    assert sample(core, "mlxfleet_agent_model_load_seconds_count", model="m", revision="r1") == 1


async def test_load_errors(core: ServingCore, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as exc:
        await core.load_model("x", tmp_path / "missing", revision="r")
    assert exc.value.reason == "ModelNotFound"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError) as exc:
        await core.load_model("x", broken, revision="r")
    assert exc.value.reason == "LoadFailed" and exc.value.message
    assert not core.is_loaded("x")
    # the core still serves afterwards
    gen = await core.generate("m", prompt="Hello", max_tokens=2, temperature=0)
    assert len([c async for c in gen]) == 2


async def test_greedy_generation_is_deterministic_and_ends_by_length(core: ServingCore) -> None:
    g1 = await core.generate("m", prompt="The quick brown fox", max_tokens=12, temperature=0)
    t1 = await collect(g1)
    g2 = await core.generate("m", prompt="The quick brown fox", max_tokens=12, temperature=0)
    t2 = await collect(g2)
    assert t1 == t2 and t1
    assert g1.finish_reason == "length" and g1.completion_tokens == 12
    assert g1.prompt_tokens > 0
    # the second identical prompt reused the first one's KV cache (mlx-lm LRUPromptCache)
    assert (sample(core, "mlxfleet_agent_prompt_cache_hits_total", model="m", revision="r1")
            or 0) >= 1


async def test_chat_messages_use_the_chat_template(core: ServingCore) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    gen = await core.generate("m", messages=msgs, max_tokens=3, temperature=0)
    await collect(gen)
    # "<s><|user|>\nHi</s>\n<|assistant|>\n": more tokens than the raw "Hi"
    raw = await core.generate("m", prompt="Hi", max_tokens=1, temperature=0)
    await collect(raw)
    assert gen.prompt_tokens > raw.prompt_tokens + 3


async def test_stop_string_truncates_decoded_text(core: ServingCore) -> None:
    full = await collect(await core.generate("m", prompt="Once upon a time", max_tokens=24,
                                             temperature=0))
    printable = [i for i in range(2, len(full) - 3) if full[i:i + 3].isprintable()
                 and full[i:i + 3] == full[i:i + 3].strip()]
    assert printable, full
    i = printable[0]
    stop = full[i:i + 3]
    cut = full.index(stop)
    gen = await core.generate("m", prompt="Once upon a time", max_tokens=24, temperature=0,
                              stop=["never-appears", stop])
    text = await collect(gen)
    assert text == full[:cut]
    assert gen.finish_reason == "stop"
    assert core.active_sequences("m") == 0


# (stops, held, segment) -> (emitted, held now, reason)
STOP_CASES = [
    ([], "", "abc", ("abc", "", None)),                       # no stop strings: all goes out
    (["END"], "", "abcE", ("abc", "E", None)),                # a possible start is held back
    (["END"], "E", "N", ("", "EN", None)),                    # ... across segments
    (["END"], "EN", "Dtail", ("", "", "stop")),               # completed: cut before it
    (["END"], "EN", "X", ("ENX", "", None)),                  # not a stop after all: released
    (["xy"], "", "ax", ("a", "x", None)),
    (["xy"], "x", "b", ("xb", "", None)),
    (["xy"], "", "abxyzxy", ("ab", "", "stop")),              # the first occurrence wins
    (["later", "ab"], "", "1ab2later", ("1", "", "stop")),    # whichever stop string is first
    (["abc", "bd"], "", "zab", ("z", "ab", None)),            # longest possible prefix is held
    (["abc", "bd"], "ab", "d", ("a", "", "stop")),            # held text joins the search
    (["aaa"], "", "aaaa", ("", "", "stop")),
    (["stop"], "", "", ("", "", None)),                       # an empty segment changes nothing
    (["ab"], "a", "", ("", "a", None)),
]


@pytest.mark.parametrize("stops,held,segment,expected", STOP_CASES)
def test_apply_stops(stops, held, segment, expected) -> None:
    assert apply_stops(stops, held, segment) == expected


# (stops, held, segment, mlx-lm's finish_reason) -> (emitted, held now, reason)
FINISH_CASES = [
    (["END"], "", "abE", None, ("ab", "E", None)),
    (["END"], "", "abE", "length", ("abE", "", "length")),   # the end releases held text
    (["END"], "E", "", "stop", ("E", "", "stop")),           # EOS: nothing new, held goes out
    (["END"], "E", "ND!", "length", ("", "", "stop")),       # a stop string beats the length
    ([], "", "x", "length", ("x", "", "length")),
]


@pytest.mark.parametrize("stops,held,segment,finish,expected", FINISH_CASES)
def test_next_text(stops, held, segment, finish, expected) -> None:
    assert next_text(stops, held, segment, finish) == expected


# (key, in flight, batch limits, max queued) -> None (admitted) or the waiting count refused at
A, B, C = ("a", "r1"), ("a", "r2"), ("b", "r1")
ADMISSION_CASES = [
    (A, {}, {A: 1}, 0, None),                                  # a free slot: always admitted
    (A, {A: 3}, {A: 4}, 0, None),
    (A, {A: 1}, {A: 1}, 1, None),                              # full batch, queue has room
    (A, {A: 2}, {A: 1}, 1, 1),                                 # full batch, full queue
    (A, {A: 9}, {A: 4}, 5, 5),
    (A, {A: 12}, {A: 2}, 10, 10),
    (A, {A: 1, B: 3}, {A: 1, B: 1}, 2, 2),                     # other revisions' waiters count
    (B, {A: 1, B: 0}, {A: 1, B: 1}, 0, None),                  # ... but not against free slots
    (A, {A: 1, C: 5}, {A: 1}, 1, None),                        # in flight for unloaded: ignored
    (C, {A: 3, C: 2}, {A: 1, C: 2}, 2, 2),
]


@pytest.mark.parametrize("key,inflight,limits,max_queued,expected", ADMISSION_CASES)
def test_admission(key, inflight, limits, max_queued, expected) -> None:
    refused = admit(key, inflight, limits, max_queued)
    if expected is None:
        assert refused is None
    else:
        assert (refused.bound, refused.waiting) == ("count", expected)
        assert f"{expected} requests are already waiting (limit {max_queued})" in refused.message


S = KV_CACHE_STEP_TOKENS
# (need, running, waiting, slot free, budget) -> None (admitted) or waiting count refused at
KV_CASES = [
    (100, [], [], True, 0, None),                      # no budget known: no bound
    (100, [900], [], True, 500, None),                 # a free slot: admitted whatever the bytes
    (100, [400], [], False, 500, None),                # must wait, fits exactly
    (101, [400], [], False, 500, 0),                   # must wait, 1 byte over
    (100, [200, 100], [100], False, 500, None),
    (100, [200, 100], [100, 1], False, 500, 2),        # the waiting ones count too
    (1, [], [600], False, 500, 1),                     # already over: nothing more waits
]


@pytest.mark.parametrize("need,running,waiting,slot_free,budget,expected", KV_CASES)
def test_kv_admission(need, running, waiting, slot_free, budget, expected) -> None:
    refused = admit_kv(need, running, waiting, slot_free=slot_free, budget_bytes=budget)
    if expected is None:
        assert refused is None
    else:
        assert (refused.bound, refused.waiting) == ("kv", expected)
        assert f"budget of {budget}" in refused.message


@pytest.mark.parametrize("per_token,prompt,max_tokens,expected", [
    (10, 1, 1, 10 * S),                 # rounded up to mlx-lm's KVCache step
    (10, S, 0, 10 * S),
    (10, S, 1, 10 * 2 * S),
    (0, 5000, 5000, 0),                 # unknown size per token
])
def test_request_kv_bytes(per_token, prompt, max_tokens, expected) -> None:
    assert request_kv_bytes(per_token, prompt, max_tokens) == expected


def test_kv_budget_is_twice_the_reservation() -> None:
    # the reservation: memory_estimate's kv_cache_bytes at the revision's limits
    assert kv_budget_bytes(10, 1000, 4) == 2 * 10 * 4 * 1024


@pytest.mark.parametrize("waiting,rate,expected", [
    (10, None, 1),                       # nothing measured yet
    (10, 0.0, 1),
    (0, 2.0, 1),                         # at least 1
    (10, 2.0, 5),                        # ceil(waiting / rate)
    (11, 2.0, 6),
    (3, 0.5, 6),
    (1000, 0.1, MAX_RETRY_AFTER_SECONDS),  # capped
])
def test_retry_after_seconds(waiting, rate, expected) -> None:
    assert retry_after_seconds(waiting, rate) == expected


def test_drain_rate_counts_busy_time_only() -> None:
    r = DrainRate(window_seconds=1.0, weight=0.5)
    assert r.per_second is None
    r.busy(100.0)
    r.busy(100.2)                          # already busy: the clock keeps running
    r.completed(100.5, idle_after=False)   # half a window: no sample yet
    assert r.per_second is None
    r.completed(101.0, idle_after=False)   # 2 in 1 s
    assert r.per_second == 2.0
    r.completed(101.25, idle_after=True)   # work ran out: 1 in 0.25 s = 4/s, averaged in
    assert r.per_second == 3.0
    r.busy(500.0)                          # 400 idle seconds do not count
    r.completed(501.0, idle_after=True)    # 1 in 1 s
    assert r.per_second == 2.0
    r.busy(600.0)
    r.idle()                               # cancelled, not completed: no sample
    r.busy(700.0)
    r.completed(701.0, idle_after=True)
    assert r.per_second == 1.5
    with pytest.raises(ValueError):
        DrainRate(window_seconds=0)


def test_waiting_requests() -> None:
    assert waiting_requests({}, {A: 1}) == 0
    assert waiting_requests({A: 3, B: 1, C: 7}, {A: 1, B: 2}) == 2


async def test_sampling_with_temperature_and_seed(core: ServingCore) -> None:
    texts = []
    for _ in range(2):
        gen = await core.generate("m", prompt="Hello", max_tokens=10, temperature=1.0,
                                  top_p=0.9, seed=1234)
        texts.append(await collect(gen))
    assert texts[0] == texts[1]


async def test_context_limit(core: ServingCore) -> None:
    with pytest.raises(ContextLengthExceeded) as exc:
        await core.generate("m", prompt="Hello", max_tokens=8192, temperature=0)
    assert exc.value.max_context_tokens == 8192
    with pytest.raises(ValueError):
        await core.generate("m", prompt="Hello", max_tokens=0)
    with pytest.raises(ModelNotLoaded):
        await core.generate("nope", prompt="Hello", max_tokens=1)
    assert core.inflight_requests() == 0


async def test_second_request_joins_the_running_batch(core: ServingCore) -> None:
    first = await core.generate("m", prompt="The sun rises", max_tokens=LONG, temperature=0)
    async with first:
        await first.__anext__()                       # first is decoding
        second = await core.generate("m", prompt="Water boils", max_tokens=LONG,
                                     temperature=0)
        async with second:
            await second.__anext__()
            await wait_for(lambda: core.active_sequences("m") == 2)
            assert first.finish_reason is None and second.finish_reason is None
            assert sample(core, "mlxfleet_agent_batch_occupancy", model="m", revision="r1") == 2
    # leaving `async with` cancelled both: they leave the batch
    await wait_for(lambda: core.active_sequences("m") == 0)
    assert core.inflight_requests() == 0


async def test_cancelling_the_consumer_stops_generation(core: ServingCore) -> None:
    gen = await core.generate("m", prompt="Tokens are generated", max_tokens=LONG, temperature=0)
    got_one = asyncio.Event()

    async def consume() -> None:
        async for _ in gen:
            got_one.set()

    task = asyncio.create_task(consume())
    await got_one.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: core.active_sequences("m") == 0)
    assert core.inflight_requests() == 0 and core.queued_requests() == 0


async def test_requests_beyond_the_batch_wait_then_run(core: ServingCore) -> None:
    gens = [await core.generate("m", prompt=f"Number {i}", max_tokens=4, temperature=0)
            for i in range(6)]                       # batch holds 4
    texts = await asyncio.gather(*[collect(g) for g in gens])
    assert all(g.finish_reason == "length" and g.completion_tokens == 4 for g in gens)
    assert len(texts) == 6
    assert core.peak_active_sequences("m") <= 4
    assert core.queued_requests() == 0 and core.active_sequences() == 0


async def test_overloaded_when_admission_is_full(tiny_model_path: Path) -> None:  # noqa: F811
    c = ServingCore(max_queued_requests=1)
    await c.start()
    try:
        await c.load_model("m", tiny_model_path, revision="r1", max_concurrent_sequences=1)
        running = await c.generate("m", prompt="a", max_tokens=LONG, temperature=0)
        waiting = await c.generate("m", prompt="b", max_tokens=2, temperature=0)
        with pytest.raises(Overloaded) as exc:
            await c.generate("m", prompt="c", max_tokens=2, temperature=0)
        assert exc.value.retry_after_seconds >= 1
        await running.__anext__()
        assert c.queued_requests("m") == 1 and c.active_sequences("m") == 1
        running.cancel()
        assert await collect(waiting) is not None and waiting.finish_reason == "length"
        await wait_for(lambda: c.active_sequences() == 0)
    finally:
        await c.close()


async def test_several_models_unload_and_replace(tiny_model_path: Path, tmp_path: Path) -> None:  # noqa: F811
    registry = CollectorRegistry()
    c = ServingCore(registry=registry)
    await c.start()
    try:
        await c.load_model("a", tiny_model_path, revision="r1")
        await c.load_model("b", tiny_model_path, revision="r1")
        ga = await c.generate("a", prompt="Hello", max_tokens=5, temperature=0)
        gb = await c.generate("b", prompt="Hello", max_tokens=5, temperature=0)
        ta, tb = await asyncio.gather(collect(ga), collect(gb))
        assert ta == tb  # same weights, greedy

        long = await c.generate("a", prompt="Hello", max_tokens=LONG, temperature=0)
        await long.__anext__()
        await c.unload_model("a")
        with pytest.raises(GenerationAborted):
            async for _ in long:
                pass
        assert not c.is_loaded("a") and c.is_loaded("b")
        assert registry.get_sample_value("mlxfleet_agent_model_loaded",
                                         {"model": "a", "revision": "r1"}) == 0
        await c.unload_model("a")  # unknown: no-op
        with pytest.raises(ModelNotLoaded):
            await c.generate("a", prompt="x", max_tokens=1)

        # a new revision loads next to the old one (no longer replaces it)
        info = await c.load_model("b", tiny_model_path, revision="r2")
        assert info.revision == "r2" and [m.revision for m in c.models()] == ["r1", "r2"]
        assert c.model_info("b") is info and c.is_loaded("b", "r1")
        for rev in ("r1", "r2"):
            assert registry.get_sample_value("mlxfleet_agent_model_loaded",
                                             {"model": "b", "revision": rev}) == 1
        g = await c.generate("b", prompt="x", max_tokens=2)
        await collect(g)
        assert g.revision == "r2"                    # no revision named: the newest
        await c.unload_model("b")                    # no revision named: all of them
        assert c.models() == [] and not c.is_loaded("b")
    finally:
        await c.close()
        await c.close()  # idempotent
    assert c.models() == []
    with pytest.raises(ModelLoadError):
        await c.load_model("a", tiny_model_path, revision="r1")


# -- failures on the MLX thread ---------------------------------------------------------------

BOUND = 60  # seconds: a request that has not ended by then is hung (the thread died)


class _BrokenOnce:
    """Wraps a tokenizer: the first detokenizer handed out raises on its first token, as for a
    token id outside the vocabulary; later ones are the real thing."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._armed = True

    def __getattr__(self, name: str):
        return getattr(self._tok, name)

    @property
    def detokenizer(self):
        d = self._tok.detokenizer
        if self._armed:
            self._armed = False

            def add_token(token: int) -> None:
                raise IndexError(f"token id {token} outside the tokenizer's vocabulary")
            d.add_token = add_token
        return d


async def _two_models(path: Path) -> ServingCore:
    c = ServingCore(registry=CollectorRegistry())
    await c.start()
    await c.load_model("a", path, revision="r1", max_concurrent_sequences=4)
    await c.load_model("b", path, revision="r1", max_concurrent_sequences=4)
    return c


async def test_detokenizer_error_fails_only_that_request(tiny_model_path: Path) -> None:  # noqa: F811
    c = await _two_models(tiny_model_path)
    try:
        ref = await asyncio.wait_for(collect(await c.generate("b", prompt="Hi", max_tokens=6,
                                                              temperature=0)), BOUND)
        other = await c.generate("b", prompt="Hi", max_tokens=6, temperature=0)
        # on the MLX thread, like every other touch of model state
        res = c._engine.registry.get(("a", "r1"))
        await c._call(lambda: setattr(res, "tokenizer", _BrokenOnce(res.tokenizer)))
        bad = await c.generate("a", prompt="Hello", max_tokens=5, temperature=0)
        with pytest.raises(GenerationAborted, match="outside the tokenizer's vocabulary"):
            await asyncio.wait_for(collect(bad), BOUND)
        assert await asyncio.wait_for(collect(other), BOUND) == ref   # other model unaffected
        good = await c.generate("a", prompt="Hello", max_tokens=5, temperature=0)
        assert await asyncio.wait_for(collect(good), BOUND) is not None
        assert good.finish_reason == "length" and good.completion_tokens == 5
        assert c.healthy and c.failure is None and c.is_loaded("a")
        assert c.crashes("a", "r1") == 0             # one request failed, the batch went on
        await wait_for(lambda: c.inflight_requests() == 0 and c.active_sequences() == 0)
    finally:
        await c.close()


@pytest.mark.fault("a model that raises mid-generation",
                   holds="the requests of that model's batch fail with the error (GenerationAborted), "
                         "its batch is reset and it serves again; the other model on the same core "
                         "keeps decoding (the serving core in the test process)")
async def test_generator_error_resets_that_model_only(tiny_model_path: Path,  # noqa: F811
                                                      fault_record: FaultRecord) -> None:
    c = await _two_models(tiny_model_path)
    try:
        first = await c.generate("a", prompt="One", max_tokens=LONG, temperature=0)
        second = await c.generate("a", prompt="Two", max_tokens=LONG, temperature=0)
        in_b = await c.generate("b", prompt="Three", max_tokens=LONG, temperature=0)
        for g in (first, second, in_b):
            await asyncio.wait_for(g.__anext__(), BOUND)

        def broken_remove(uids, return_prompt_caches=False):
            raise RuntimeError("injected remove failure")
        res = c._engine.registry.get(("a", "r1"))
        await c._call(lambda: setattr(res.generator, "remove", broken_remove))
        first.cancel()                               # -> generator.remove raises on the thread
        with pytest.raises(GenerationAborted, match="injected remove failure"):
            await asyncio.wait_for(collect(second), BOUND)
        await asyncio.wait_for(in_b.__anext__(), BOUND)   # b keeps decoding
        assert in_b.finish_reason is None
        in_b.cancel()
        again = await c.generate("a", prompt="Four", max_tokens=3, temperature=0)
        await asyncio.wait_for(collect(again), BOUND)  # a fresh generator serves a again
        assert again.finish_reason == "length"
        assert c.healthy and c.is_loaded("a") and c.is_loaded("b")
        assert (c.crashes("a", "r1"), c.crashes("b", "r1")) == (1, 0)   # a's batch was reset
        fault_record.note("1 crash counted on the failing model, 0 on the other")
        await wait_for(lambda: c.inflight_requests() == 0 and c.active_sequences() == 0)
    finally:
        await c.close()


class _Fatal(BaseException):
    """Not an Exception: nothing on the MLX thread may swallow it."""


async def test_fatal_thread_error_fails_everything_at_once(tiny_model_path: Path) -> None:  # noqa: F811
    c = await _two_models(tiny_model_path)
    try:
        assert c.healthy and c.failure is None
        running = await c.generate("a", prompt="One", max_tokens=LONG, temperature=0)
        await asyncio.wait_for(running.__anext__(), BOUND)

        def fatal(loaded) -> None:
            raise _Fatal("the MLX thread is gone")
        c._engine.step = fatal                       # type: ignore[method-assign]
        with pytest.raises(GenerationAborted, match="the MLX thread is gone"):
            await asyncio.wait_for(collect(running), BOUND)
        assert not c.healthy and "the MLX thread is gone" in (c.failure or "")
        with pytest.raises(GenerationAborted):
            await asyncio.wait_for(c.generate("b", prompt="x", max_tokens=1), BOUND)
        with pytest.raises(ModelLoadError) as exc:
            await asyncio.wait_for(c.load_model("c", tiny_model_path, revision="r1"), BOUND)
        assert exc.value.reason == "CoreFailed"
        await wait_for(lambda: not c.models())
        assert not c.is_loaded("a") and c.inflight_requests() == 0
        # the failure hit every resident revision; their memory is gone
        assert (c.crashes("a", "r1"), c.crashes("b", "r1")) == (1, 1)
        assert c.memory_bytes("a", "r1") == 0
    finally:
        await asyncio.wait_for(c.close(), BOUND)
    assert not c.healthy


async def test_reload_with_new_limits_applies_them(tiny_model_path: Path) -> None:  # noqa: F811
    c = ServingCore(registry=CollectorRegistry())
    await c.start()
    try:
        first = await c.load_model("m", tiny_model_path, revision="r1",
                                   max_concurrent_sequences=4, max_context_tokens=4096)
        running = await c.generate("m", prompt="Kept", max_tokens=LONG, temperature=0)
        await running.__anext__()
        info = await c.load_model("m", tiny_model_path, revision="r1",
                                  max_concurrent_sequences=1, max_context_tokens=128)
        assert (info.max_concurrent_sequences, info.max_context_tokens) == (1, 128)
        assert c.model_info("m") == info and info.created_unix == first.created_unix
        # the sequence admitted under the old limits keeps running: nothing was reloaded
        await running.__anext__()
        assert running.finish_reason is None
        with pytest.raises(ContextLengthExceeded) as exc:
            await c.generate("m", prompt="hello", max_tokens=1000, temperature=0)
        assert exc.value.max_context_tokens == 128
        running.cancel()
        await wait_for(lambda: c.active_sequences("m") == 0)
        # two at once (one runs, one waits: with a batch of 1 and 128 tokens of context the
        # kv admission policy lets one batch's worth wait)
        gens = [await c.generate("m", prompt=f"n{i}", max_tokens=3, temperature=0)
                for i in range(2)]
        await asyncio.gather(*[collect(g) for g in gens])
        assert c.peak_active_sequences("m") == 1      # the new batch limit is enforced
        again = await c.load_model("m", tiny_model_path, revision="r1",
                                   max_concurrent_sequences=1, max_context_tokens=128)
        assert again is info                          # same limits: a no-op
    finally:
        await c.close()


async def test_failed_replacement_leaves_no_stale_model(tiny_model_path: Path, tmp_path: Path) -> None:  # noqa: F811
    registry = CollectorRegistry()
    c = ServingCore(registry=registry)
    await c.start()
    try:
        await c.load_model("m", tiny_model_path, revision="r1")
        await c.load_model("keep", tiny_model_path, revision="r1")
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
        # a new revision that fails to load leaves the loaded one serving
        with pytest.raises(ModelLoadError) as exc:
            await c.load_model("m", broken, revision="r2")
        assert exc.value.reason == "LoadFailed"
        assert c.is_loaded("m", "r1") and not c.is_loaded("m", "r2")
        assert [m.revision for m in c.revisions("m")] == ["r1"]
        assert registry.get_sample_value("mlxfleet_agent_model_loaded",
                                         {"model": "m", "revision": "r2"}) in (None, 0)
        await collect(await c.generate("m", prompt="x", max_tokens=2))
        # the same revision from another path replaces it: the old copy was dropped to make
        # room, so after the failure nothing may still claim that revision is served
        with pytest.raises(ModelLoadError) as exc:
            await c.load_model("m", broken, revision="r1")
        assert exc.value.reason == "LoadFailed"
        assert not c.is_loaded("m") and [m.model_id for m in c.models()] == ["keep"]
        for rev in ("r1", "r2"):
            assert registry.get_sample_value("mlxfleet_agent_model_loaded",
                                             {"model": "m", "revision": rev}) in (None, 0)
        with pytest.raises(ModelNotLoaded):
            await c.generate("m", prompt="x", max_tokens=1)
        await collect(await c.generate("keep", prompt="x", max_tokens=2))
        await c.load_model("m", tiny_model_path, revision="r3")  # and it can be loaded again
        assert c.is_loaded("m")
    finally:
        await c.close()


async def test_unseeded_requests_share_one_sampler(core: ServingCore, monkeypatch) -> None:
    import mlx_lm.sample_utils as su

    made: list[tuple] = []
    real = su.make_sampler

    def counting(*args, **kwargs):
        made.append((args, kwargs))
        return real(*args, **kwargs)
    monkeypatch.setattr(su, "make_sampler", counting)
    gens = [await core.generate("m", prompt=f"Shared {i}", max_tokens=3, temperature=0.55,
                                top_p=0.85) for i in range(3)]
    await asyncio.gather(*[collect(g) for g in gens])
    # one sampler object for equal (temperature, top_p): mlx-lm samples such a batch in one call
    assert len(made) <= 1


async def test_seed_does_not_touch_the_global_rng(core: ServingCore) -> None:
    import mlx.core as mx

    def reseed_and_draw() -> float:
        mx.random.seed(7)
        return mx.random.uniform().item()
    expected = await core._call(reseed_and_draw)
    await core._call(mx.random.seed, 7)
    # a seeded request alone in the batch: nothing else draws from the global RNG meanwhile
    await collect(await core.generate("m", prompt="Seeded", max_tokens=4, temperature=1.0,
                                      seed=99))
    assert await core._call(lambda: mx.random.uniform().item()) == expected


async def test_unloading_one_model_keeps_the_wired_limit_of_the_others(
        tiny_model_path: Path, monkeypatch) -> None:  # noqa: F811
    # This host reports no recommended working set (no Metal), so emulate one: mlx-lm's
    # BatchGenerator raises the wired limit to it on creation and restores what it saw in close().
    import mlx.core as mx
    import importlib

    mg = importlib.import_module("mlx_lm.generate")  # the module, not mlx_lm.generate()

    state = {"limit": "original"}

    def set_wired_limit(value):
        old, state["limit"] = state["limit"], value
        return old
    monkeypatch.setattr(mg, "maybe_set_recommended_wired_limit",
                        lambda: set_wired_limit("recommended"))
    monkeypatch.setattr(mx, "set_wired_limit", set_wired_limit)
    c = ServingCore(registry=CollectorRegistry())
    await c.start()
    try:
        await c.load_model("a", tiny_model_path, revision="r1")
        await c.load_model("b", tiny_model_path, revision="r1")
        assert state["limit"] == "recommended"
        await c.unload_model("a")
        assert state["limit"] == "recommended"        # b is still loaded
        await c.load_model("b", tiny_model_path, revision="r2")   # a second revision
        assert state["limit"] == "recommended"
        await c.unload_model("b")
        assert state["limit"] == "original"           # nothing loaded: restored
        await c.load_model("a", tiny_model_path, revision="r1")
        assert state["limit"] == "recommended"
    finally:
        await c.close()
    assert state["limit"] == "original"


# -- several revisions of one model -----------------------------------------------------------

async def _revisions(old: Path, new: Path, **limits) -> ServingCore:
    """A core with revision "old" (``old``'s weights) and then "new" of model "m" loaded."""
    c = ServingCore(registry=CollectorRegistry())
    await c.start()
    await c.load_model("m", old, revision="old", max_context_tokens=8192, **limits)
    await c.load_model("m", new, revision="new", max_context_tokens=8192, **limits)
    return c


async def test_two_revisions_are_resident_and_served_independently(
        tiny_model_path: Path, other_model_path: Path) -> None:  # noqa: F811
    c = await _revisions(tiny_model_path, other_model_path)
    try:
        assert [(i.model_id, i.revision) for i in c.models()] == [("m", "old"), ("m", "new")]
        assert [i.revision for i in c.revisions("m")] == ["old", "new"]
        assert c.revisions("other") == []
        assert c.model_info("m").revision == "new"          # the most recently loaded
        assert c.model_info("m", "old").path == str(tiny_model_path)
        assert c.is_loaded("m", "old") and c.is_loaded("m", "new") and c.is_loaded("m")
        assert not c.is_loaded("m", "r9")
        with pytest.raises(ModelNotLoaded) as exc:
            await c.generate("m", revision="r9", prompt="x", max_tokens=1)
        assert (exc.value.model_id, exc.value.revision) == ("m", "r9")

        async def run(revision: str | None) -> tuple[str, str]:
            g = await c.generate("m", revision=revision, prompt="Hello there", max_tokens=12,
                                 temperature=0)
            return g.revision, await collect(g)
        # alone, then both at once in their own batches: each revision gives its own text
        alone = {rev: await run(rev) for rev in ("old", "new")}
        together = await asyncio.gather(run("old"), run("new"), run(None))
        assert alone["old"][1] != alone["new"][1]          # other weights, other text
        assert together == [alone["old"], alone["new"], alone["new"]]
        # the two concurrent identical greedy requests for "new" (named, and by default) shared
        # one generation (request coalescing); "old" and "new" never share one
        for rev in ("old", "new"):
            assert sample(c, "mlxfleet_agent_generated_tokens_total", model="m",
                          revision=rev) == 12 * 2
            assert (sample(c, "mlxfleet_agent_coalesced_requests_total", model="m",
                           revision=rev) or 0) == (1 if rev == "new" else 0)
            assert sample(c, "mlxfleet_agent_model_loaded", model="m", revision=rev) == 1
            assert c.crashes("m", rev) == 0
    finally:
        await c.close()


async def test_unloading_one_revision_leaves_the_other_serving(
        tiny_model_path: Path, other_model_path: Path) -> None:  # noqa: F811
    c = await _revisions(tiny_model_path, other_model_path)
    try:
        ref = await collect(await c.generate("m", revision="old", prompt="Kept", max_tokens=16,
                                             temperature=0))
        kept = await c.generate("m", revision="old", prompt="Kept", max_tokens=16, temperature=0)
        first = await kept.__anext__()
        doomed = await c.generate("m", revision="new", prompt="Gone", max_tokens=LONG,
                                  temperature=0)
        await doomed.__anext__()
        await c.unload_model("m", "new")
        with pytest.raises(GenerationAborted):
            await collect(doomed)
        assert first.text + await collect(kept) == ref     # the other revision never noticed
        assert [i.revision for i in c.models()] == ["old"]
        assert c.model_info("m").revision == "old" and not c.is_loaded("m", "new")
        # only the unloaded revision's series went to 0
        assert sample(c, "mlxfleet_agent_model_loaded", model="m", revision="new") == 0
        assert sample(c, "mlxfleet_agent_model_loaded", model="m", revision="old") == 1
        assert sample(c, "mlxfleet_agent_batch_occupancy", model="m", revision="new") == 0
        assert c.memory_bytes("m", "new") == 0 and c.memory_bytes("m", "old") > 0
        g = await c.generate("m", prompt="Still here", max_tokens=3, temperature=0)
        await collect(g)
        assert (g.revision, g.finish_reason) == ("old", "length")
        await c.unload_model("m", "new")                    # not loaded: a no-op
        assert c.is_loaded("m", "old")
    finally:
        await c.close()


async def test_drain_lets_running_and_queued_requests_finish(
        tiny_model_path: Path, other_model_path: Path) -> None:  # noqa: F811
    # one sequence at a time, so that one request runs and one waits while the drain starts
    c = await _revisions(tiny_model_path, other_model_path, max_concurrent_sequences=1)
    try:
        # two prompts: identical concurrent requests would share one generation (coalescing)
        ref, ref_queued = [await collect(await c.generate("m", revision="old", prompt=p,
                                                          max_tokens=24, temperature=0))
                           for p in ("Drain me", "Drain me too")]
        running = await c.generate("m", revision="old", prompt="Drain me", max_tokens=24,
                                   temperature=0)
        queued = await c.generate("m", revision="old", prompt="Drain me too", max_tokens=24,
                                  temperature=0)
        first = await running.__anext__()
        assert c.queued_requests("m", "old") == 1

        unload = asyncio.create_task(c.unload_model("m", "old", drain_seconds=BOUND))
        await wait_for(lambda: not c.is_loaded("m", "old"))
        # draining: still resident, but admits nothing; unnamed requests go to "new"
        assert [i.revision for i in c.revisions("m")] == ["old", "new"]
        with pytest.raises(ModelNotLoaded):
            await c.generate("m", revision="old", prompt="late", max_tokens=1)
        with pytest.raises(ModelNotLoaded):
            c.model_info("m", "old")
        elsewhere = await c.generate("m", prompt="late", max_tokens=2, temperature=0)
        await collect(elsewhere)
        assert elsewhere.revision == "new"

        assert first.text + await collect(running) == ref
        assert running.finish_reason == "length" and running.completion_tokens == 24
        assert not unload.done()                             # the queued one is still going
        assert await collect(queued) == ref_queued and queued.finish_reason == "length"
        await asyncio.wait_for(unload, BOUND)                # returns once both are done
        assert [i.revision for i in c.models()] == ["new"]
        assert sample(c, "mlxfleet_agent_model_loaded", model="m", revision="old") == 0
        assert c.inflight_requests("m") == 0 and c.memory_bytes("m", "old") == 0

        # nothing in flight: the drain ends at once
        await asyncio.wait_for(c.unload_model("m", "new", drain_seconds=BOUND), BOUND / 2)
        assert c.models() == []
    finally:
        await c.close()


async def test_drain_timeout_aborts_what_is_left(tiny_model_path: Path) -> None:  # noqa: F811
    c = ServingCore(registry=CollectorRegistry())
    await c.start()
    try:
        await c.load_model("m", tiny_model_path, revision="r1", max_concurrent_sequences=1,
                           max_context_tokens=8192)
        running = await c.generate("m", prompt="Endless", max_tokens=8000, temperature=0)
        queued = await c.generate("m", prompt="Waiting", max_tokens=8000, temperature=0)
        await running.__anext__()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(c.unload_model("m", drain_seconds=0.3), BOUND)
        assert loop.time() - t0 >= 0.29                       # it waited for the drain
        for g in (running, queued):
            with pytest.raises(GenerationAborted):
                await asyncio.wait_for(collect(g), BOUND)
        assert not c.models() and c.inflight_requests() == 0
    finally:
        await c.close()


async def test_reloading_a_draining_revision_calls_the_drain_off(
        tiny_model_path: Path) -> None:  # noqa: F811
    c = ServingCore(registry=CollectorRegistry())
    await c.start()
    try:
        info = await c.load_model("m", tiny_model_path, revision="r1", max_context_tokens=8192)
        running = await c.generate("m", prompt="Stay", max_tokens=8000, temperature=0)
        await running.__anext__()
        unload = asyncio.create_task(c.unload_model("m", "r1", drain_seconds=BOUND))
        await wait_for(lambda: not c.is_loaded("m", "r1"))
        assert await c.load_model("m", tiny_model_path, revision="r1",
                                  max_context_tokens=8192) is info
        await asyncio.wait_for(unload, BOUND)                 # called off: returns at once
        assert c.is_loaded("m", "r1")
        await running.__anext__()                             # never aborted
        assert running.finish_reason is None

        # a drain whose caller is cancelled also leaves the revision serving
        unload = asyncio.create_task(c.unload_model("m", "r1", drain_seconds=BOUND))
        await wait_for(lambda: not c.is_loaded("m", "r1"))
        unload.cancel()
        with pytest.raises(asyncio.CancelledError):
            await unload
        assert c.is_loaded("m", "r1")
        await running.__anext__()
        running.cancel()
    finally:
        await c.close()


async def test_memory_bytes_counts_weights_and_prompt_cache(tiny_model_path: Path) -> None:  # noqa: F811
    c = ServingCore(registry=CollectorRegistry())
    await c.start()
    try:
        assert c.memory_bytes("m", "r1") == 0                 # not loaded
        await c.load_model("m", tiny_model_path, revision="r1")
        weights = safetensors_bytes(tiny_model_path)
        assert c.memory_bytes("m", "r1") == weights           # nothing cached yet
        await collect(await c.generate("m", prompt="Cache this prompt", max_tokens=8,
                                       temperature=0))
        assert c.memory_bytes("m", "r1") > weights            # + the finished prompt's KV cache
        await c.unload_model("m", "r1")
        assert c.memory_bytes("m", "r1") == 0
    finally:
        await c.close()
