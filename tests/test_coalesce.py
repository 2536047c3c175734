"""Request coalescing (N→1): the pure key (which requests may share a generation), the fan-out
class, and the serving core and HTTP API on the tiny generated model — identical concurrent
greedy or seeded requests share one generation (asserted with the core's counters), late
subscribers get the whole stream, one subscriber leaving does not stop the others, different
parameters or revisions never share, and with the flag off nothing is shared."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from mlx_fleet.routing.headers import REVISION_HEADER
from node_agent.cli import build_parser
from node_agent.serving import (Chunk, GenerationAborted, ModelInfo, ServingCore,
                                ServingOptions, StreamBufferOverflow)
from node_agent.serving.coalesce import Coalescer, coalesce_key
from serving_fixtures import (MODEL_ID, REVISION, Agent, close_agent,  # noqa: F401
                              make_agent, tiny_model_path)

BOUND = 60.0  # seconds: longer than any step here takes; a wait that long means a hang
PROMPT = "Once upon a time"
N_TOKENS = 16
CHAT = "/v1/chat/completions"

# -- the key: which requests may share a generation ------------------------------------------

INFO = ModelInfo("m", "r1", "/models/m", 1, 8, 4096)
GREEDY = {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "stop": [], "seed": None}


def key(params: dict | None = None, *, info: ModelInfo = INFO, prompt: str | None = "Hi",
        messages: list | None = None) -> Any:
    return coalesce_key(info, None if messages is not None else prompt, messages,
                        {**GREEDY, **(params or {})})


@pytest.mark.parametrize(("a", "b", "shared"), [
    # the same greedy request: one generation
    ({}, {}, True),
    ({"temperature": 0}, {"temperature": 0.0}, True),            # the same number
    # a seeded sampling request is deterministic too
    ({"temperature": 0.8, "seed": 7}, {"temperature": 0.8, "seed": 7}, True),
    ({"temperature": 0.8, "seed": 7, "top_p": 0.9}, {"temperature": 0.8, "seed": 7,
                                                      "top_p": 0.9}, True),
    # any parameter that differs: never shared
    ({"temperature": 0.0}, {"temperature": 0.5, "seed": 1}, False),
    ({"temperature": 0.8, "seed": 7}, {"temperature": 0.8, "seed": 8}, False),
    ({"temperature": 0.8, "seed": 7}, {"temperature": 0.9, "seed": 7}, False),
    ({"temperature": 0.8, "seed": 7, "top_p": 0.9}, {"temperature": 0.8, "seed": 7}, False),
    ({"max_tokens": 16}, {"max_tokens": 17}, False),
    ({"max_tokens": 16}, {"max_tokens": None}, False),
    ({"stop": ["\n"]}, {"stop": []}, False),
    ({"stop": ["a", "b"]}, {"stop": ["b", "a"]}, False),           # not second-guessed
    ({"seed": 1}, {"seed": None}, False),                        # even where greedy ignores it
    ({"top_p": 0.5}, {"top_p": 1.0}, False),
    ({"frequency_penalty": 0.5}, {"frequency_penalty": 0.0}, False),  # any parameter given
    ({"logit_bias": {"1": 5}}, {"logit_bias": {"1": 6}}, False),
    ({"logit_bias": {"1": 5, "2": 1}}, {"logit_bias": {"2": 1, "1": 5}}, True),
])
def test_params_that_make_requests_shareable(a: dict, b: dict, shared: bool) -> None:
    ka, kb = key(a), key(b)
    assert ka is not None and kb is not None
    assert (ka == kb) is shared
    if shared:
        assert hash(ka) == hash(kb)


@pytest.mark.parametrize("params", [
    {"temperature": 0.8},                           # sampling without a seed: its own draw
    {"temperature": 1.0, "seed": None},
    {"temperature": 0.0, "stop": [{"a", "b"}]},     # cannot be compared (a set): not shared
    {"temperature": None},
    {"temperature": "0"},
])
def test_not_shareable(params: dict) -> None:
    assert key(params) is None


def test_prompt_and_revision_are_part_of_the_key() -> None:
    assert key(prompt="Hi") != key(prompt="Hi!")
    other_revision = ModelInfo("m", "r2", "/models/m2", 1, 8, 4096)
    assert key(info=other_revision) != key()
    other_limits = ModelInfo("m", "r1", "/models/m", 1, 8, 2048)  # limits changed: new info
    assert key(info=other_limits) != key()
    msgs = [{"role": "user", "content": "Hi"}]
    assert key(messages=msgs) == key(messages=[{"content": "Hi", "role": "user"}])
    assert key(messages=msgs) != key(prompt="Hi")
    assert key(messages=msgs) != key(messages=[{"role": "system", "content": "Hi"}])
    # a chat template renders 1, 1.0 and True differently: the prompt's scalars keep their type
    assert key(messages=[{"role": "user", "content": 1}]) != key(
        messages=[{"role": "user", "content": True}])
    assert key(messages=[{"role": "user", "content": 1}]) != key(
        messages=[{"role": "user", "content": 1.0}])
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert key(messages=parts) == key(messages=[{"role": "user",
                                                 "content": [{"text": "Hi", "type": "text"}]}])
    assert key(messages=[{"role": "user", "content": {"a", "b"}}]) is None  # not comparable


# -- the fan-out, without a model ------------------------------------------------------------


def test_fan_out_replays_to_late_subscribers_and_cancels_when_the_last_leaves() -> None:
    cancelled: list[bool] = []
    co = Coalescer()
    shared = co.lead("k", lambda: cancelled.append(True))
    assert co.get("k") is shared and co.get(None) is None
    a = shared.subscribe()
    shared.put_nowait(Chunk("x", 1))
    b = shared.subscribe()                            # late: gets the chunk so far, then live
    shared.put_nowait(Chunk("y", 2))
    assert [a.get_nowait().text for _ in range(2)] == ["x", "y"]
    assert [b.get_nowait().text for _ in range(2)] == ["x", "y"]
    shared.leave(a)
    shared.leave(a)                                   # idempotent
    assert not cancelled and co.get("k") is shared    # b still listens
    shared.leave(b)
    assert cancelled == [True] and co.get("k") is None and len(co) == 0
    shared.put_nowait(Chunk("z", 3))                  # events after that are dropped
    assert b.empty()


def test_a_slow_subscriber_overflows_alone() -> None:
    cancelled: list[bool] = []
    overflows: list[bool] = []
    shared = Coalescer().lead("k", lambda: cancelled.append(True), buffer_limit=2,
                              overflowed=lambda: overflows.append(True))
    slow, fast = shared.subscribe(), shared.subscribe()
    for i in range(3):
        shared.put_nowait(Chunk(str(i), i + 1))
        assert fast.get_nowait().text == str(i)     # fast drains as it goes
    got = [slow.get_nowait() for _ in range(slow.qsize())]
    assert [c.text for c in got[:2]] == ["0", "1"]
    assert isinstance(got[2], StreamBufferOverflow) and overflows == [True]
    shared.put_nowait(Chunk("3", 4, "length"))      # the generation went on for fast
    assert fast.get_nowait().finish_reason == "length" and slow.empty()
    assert not cancelled and shared.qsize() == 0


def test_fan_out_ends_with_the_final_event() -> None:
    cancelled: list[bool] = []
    co = Coalescer()
    shared = co.lead("k", lambda: cancelled.append(True))
    a = shared.subscribe()
    shared.put_nowait(Chunk("x", 1, "length"))
    assert co.get("k") is None                        # no longer joinable
    again = co.lead("k", lambda: None)                # an identical request starts anew
    assert co.get("k") is again
    shared.leave(a)
    assert not cancelled                              # it had ended: nothing to cancel
    b = co.lead("e", lambda: None)
    q = b.subscribe()
    err = GenerationAborted("unloaded")
    b.put_nowait(err)
    assert q.get_nowait() is err and co.get("e") is None


async def test_a_refused_submission_ends_the_sharing() -> None:
    cancelled: list[bool] = []
    co = Coalescer()
    shared = co.lead("k", lambda: cancelled.append(True))
    fut = asyncio.get_running_loop().create_future()
    shared.watch(fut)
    fut.set_exception(ValueError("refused"))
    await asyncio.wait([fut])
    assert cancelled == [True] and co.get("k") is None


# -- the serving core on the tiny model -------------------------------------------------------


async def _core(path: Path, coalesce: bool) -> ServingCore:
    c = ServingCore(registry=CollectorRegistry(),
                    options=ServingOptions(request_coalescing=coalesce))
    await c.start()
    await c.load_model("m", path, revision="r1", max_concurrent_sequences=8,
                       max_context_tokens=8192)
    return c


@pytest_asyncio.fixture(scope="module")
async def core(tiny_model_path: Path) -> AsyncIterator[ServingCore]:  # noqa: F811
    c = await _core(tiny_model_path, True)
    yield c
    await c.close()


@pytest_asyncio.fixture(scope="module")
async def core_off(tiny_model_path: Path) -> AsyncIterator[ServingCore]:  # noqa: F811
    c = await _core(tiny_model_path, False)
    yield c
    await c.close()


def counters(c: ServingCore, revision: str = "r1", model: str = "m") -> dict[str, float]:
    labels = {"model": model, "revision": revision}
    return {name: c.registry.get_sample_value(f"mlxfleet_agent_{name}_total", labels) or 0.0
            for name in ("coalesced_requests", "prompt_tokens", "generated_tokens")}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


async def chunks(gen: Any) -> list[Chunk]:
    return [c async for c in gen]


async def collect(gen: Any) -> str:
    return "".join(c.text for c in await chunks(gen))


async def reference(core_off: ServingCore, **params: Any) -> str:
    """The text of the request alone, on a core that never coalesces."""
    return await collect(await core_off.generate("m", **{"prompt": PROMPT, "temperature": 0,
                                                         "max_tokens": N_TOKENS, **params}))


class StepGate:
    """While closed, the core's MLX thread stops after the first batch step that generated a
    token (until :meth:`open`, or ``BOUND`` seconds): a generation stays mid-stream, so that
    what joins or leaves meanwhile is deterministic. Opened and removed on exit."""

    def __init__(self, core: ServingCore) -> None:
        self._engine = core._engine
        self._step = core._engine.step
        self._open = threading.Event()

    def _gated(self, res: Any) -> None:
        self._step(res)
        if any(r.n_generated for r in res.active.values()):
            self._open.wait(BOUND)

    def open(self) -> None:
        self._open.set()

    def __enter__(self) -> "StepGate":
        self._engine.step = self._gated
        return self

    def __exit__(self, *exc: object) -> None:
        self._open.set()
        del self._engine.step


async def test_20_identical_greedy_requests_share_one_generation(
        core: ServingCore, core_off: ServingCore) -> None:
    want = await reference(core_off)
    before = counters(core)
    gens = await asyncio.gather(*(core.generate("m", prompt=PROMPT, max_tokens=N_TOKENS,
                                                temperature=0) for _ in range(20)))
    texts = await asyncio.gather(*(collect(g) for g in gens))
    d = delta(counters(core), before)
    # one generation: one prompt submitted, its tokens generated once, 19 subscribers joined
    assert d == {"coalesced_requests": 19, "prompt_tokens": gens[0].prompt_tokens,
                 "generated_tokens": N_TOKENS}
    assert texts == [want] * 20
    assert len({g.id for g in gens}) == 20                 # each its own handle
    assert {(g.prompt_tokens, g.completion_tokens, g.finish_reason) for g in gens} == {
        (gens[0].prompt_tokens, N_TOKENS, "length")}
    assert core.inflight_requests() == 0 and len(core._coalescer) == 0


async def test_identical_seeded_requests_share_unseeded_ones_do_not(core: ServingCore) -> None:
    before = counters(core)
    seeded = await asyncio.gather(*(core.generate("m", prompt=PROMPT, max_tokens=8,
                                                  temperature=0.9, seed=42) for _ in range(3)))
    texts = {await collect(g) for g in seeded}
    assert len(texts) == 1
    assert delta(counters(core), before)["coalesced_requests"] == 2
    before = counters(core)
    unseeded = await asyncio.gather(*(core.generate("m", prompt=PROMPT, max_tokens=8,
                                                    temperature=0.9) for _ in range(3)))
    await asyncio.gather(*(collect(g) for g in unseeded))
    d = delta(counters(core), before)
    assert d["coalesced_requests"] == 0 and d["prompt_tokens"] == 3 * unseeded[0].prompt_tokens


@pytest.mark.parametrize("other", [
    {"temperature": 0.7, "seed": 1},
    {"seed": 3, "temperature": 0.7},
    {"max_tokens": N_TOKENS - 1},
    {"stop": ["zzz"]},
    {"top_p": 0.5},
    {"prompt": PROMPT + "!"},
    {"messages": [{"role": "user", "content": PROMPT}]},
    {"logprobs": 0},
])
async def test_different_parameters_are_not_shared(core: ServingCore, core_off: ServingCore,
                                                    other: dict) -> None:
    second = {"prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0, **other}
    if "messages" in other:
        del second["prompt"]
    want = [await reference(core_off), await collect(await core_off.generate("m", **second))]
    before = counters(core)
    # started together: the second is decided while the first is in flight
    gens = await asyncio.gather(core.generate("m", prompt=PROMPT, max_tokens=N_TOKENS,
                                              temperature=0),
                                core.generate("m", **second))
    texts = [await collect(g) for g in gens]
    d = delta(counters(core), before)
    assert d["coalesced_requests"] == 0
    assert d["prompt_tokens"] == gens[0].prompt_tokens + gens[1].prompt_tokens
    if "temperature" not in other or other.get("seed") is not None:
        assert texts == want


async def test_identical_logprobs_requests_share_the_very_same_values(
        core: ServingCore, core_off: ServingCore) -> None:
    """Coalescing stays exact with logprobs: ``logprobs`` (how many top entries) is part of
    the key, so only requests asking the same share, and each gets the leader's entries — the
    values a lone request computes (same prompt, same greedy steps)."""
    alone = await chunks(await core_off.generate("m", prompt=PROMPT, max_tokens=N_TOKENS,
                                                 temperature=0, logprobs=3))
    before = counters(core)
    gens = await asyncio.gather(*(core.generate("m", prompt=PROMPT, max_tokens=N_TOKENS,
                                                temperature=0, logprobs=3) for _ in range(3)),
                                core.generate("m", prompt=PROMPT, max_tokens=N_TOKENS,
                                              temperature=0, logprobs=2))
    got = [await chunks(g) for g in gens]
    d = delta(counters(core), before)
    assert d["coalesced_requests"] == 2                      # the k=2 one ran on its own
    assert d["prompt_tokens"] == 2 * gens[0].prompt_tokens
    assert got[0] == got[1] == got[2]                          # the very same chunks
    assert [c.logprobs.token_id for c in got[0] if c.logprobs] == [
        c.logprobs.token_id for c in alone if c.logprobs]
    assert [c.logprobs.logprob for c in got[0] if c.logprobs] == pytest.approx(
        [c.logprobs.logprob for c in alone if c.logprobs], rel=1e-4, abs=1e-5)
    assert all(len(c.logprobs.top) == 2 for c in got[3] if c.logprobs)


async def test_requests_for_n_choices_are_never_shared(core: ServingCore) -> None:
    """A request for n > 1 choices is n sequences under one handle: it never coalesces (the
    fan-out shares one sequence), not even with an identical greedy one."""
    before = counters(core)
    gens = await asyncio.gather(*(core.generate("m", prompt=PROMPT, max_tokens=4,
                                                temperature=0, n=2) for _ in range(2)))
    got = [await chunks(g) for g in gens]
    d = delta(counters(core), before)
    assert d["coalesced_requests"] == 0
    assert d["prompt_tokens"] == 2 * gens[0].prompt_tokens and d["generated_tokens"] == 16
    assert [sorted({c.index for c in g}) for g in got] == [[0, 1], [0, 1]]


async def test_a_late_subscriber_gets_the_whole_stream(core: ServingCore,
                                                       core_off: ServingCore) -> None:
    want = await reference(core_off)
    before = counters(core)
    with StepGate(core) as gate:
        leader = await core.generate("m", prompt=PROMPT, max_tokens=N_TOKENS, temperature=0)
        first = await leader.__anext__()        # the thread now waits: leader is mid-stream
        assert first.finish_reason is None
        late = await core.generate("m", prompt=PROMPT, max_tokens=N_TOKENS, temperature=0)
        assert delta(counters(core), before)["coalesced_requests"] == 1
        gate.open()
        texts = [first.text + await collect(leader), await collect(late)]
    assert texts == [want, want]
    assert late.completion_tokens == leader.completion_tokens == N_TOKENS
    assert delta(counters(core), before)["generated_tokens"] == N_TOKENS


async def test_one_subscriber_leaving_does_not_stop_the_others(core: ServingCore,
                                                               core_off: ServingCore) -> None:
    # chunk by chunk (text, tokens so far, finish reason) as a request alone gets them
    alone = await core_off.generate("m", prompt=PROMPT, max_tokens=N_TOKENS, temperature=0)
    want = await chunks(alone)
    before = counters(core)
    with StepGate(core) as gate:
        gens = await asyncio.gather(*(core.generate("m", prompt=PROMPT, max_tokens=N_TOKENS,
                                                    temperature=0) for _ in range(20)))
        firsts = [await g.__anext__() for g in gens]   # all 20 are mid-stream
        assert firsts[0].finish_reason is None
        gens[0].cancel()                               # one client disconnects
        gate.open()
        rest = await asyncio.gather(*(chunks(g) for g in gens[1:]))
    assert [[f, *r] for f, r in zip(firsts[1:], rest)] == [want] * 19
    assert await chunks(gens[0]) == [] and gens[0].finish_reason is None
    d = delta(counters(core), before)
    assert d["coalesced_requests"] == 19 and d["generated_tokens"] == N_TOKENS


async def test_the_last_subscriber_leaving_cancels_the_generation(core: ServingCore) -> None:
    before = counters(core)
    with StepGate(core) as gate:
        gens = await asyncio.gather(*(core.generate("m", prompt=PROMPT, max_tokens=4000,
                                                    temperature=0) for _ in range(3)))
        for g in gens:
            await g.__anext__()

        async def consume(g: Any, started: asyncio.Event) -> str:
            started.set()
            return await collect(g)          # waits: the thread is held mid-stream
        started = [asyncio.Event() for _ in gens]
        tasks = [asyncio.create_task(consume(g, e)) for g, e in zip(gens, started)]
        for e in started:
            await e.wait()
        for t in tasks:                      # each consumer goes away (a client disconnects)
            t.cancel()
        await asyncio.wait(tasks)
        assert core.inflight_requests() == 0 and len(core._coalescer) == 0
        gate.open()
    await core._call(lambda: None)   # the MLX thread has run the cancel (commands are FIFO)
    assert core.active_sequences() == 0
    assert delta(counters(core), before)["generated_tokens"] < 4000
    # an identical request now starts a generation of its own
    g = await core.generate("m", prompt=PROMPT, max_tokens=2, temperature=0)
    await collect(g)
    assert g.finish_reason == "length"


async def test_a_refused_request_fails_every_subscriber(core: ServingCore) -> None:
    before = counters(core)
    results = await asyncio.gather(*(core.generate("m", prompt=PROMPT, max_tokens=9000,
                                                   temperature=0) for _ in range(3)),
                                   return_exceptions=True)
    assert all(type(r).__name__ == "ContextLengthExceeded" for r in results)
    assert core.inflight_requests() == 0 and len(core._coalescer) == 0
    assert delta(counters(core), before)["coalesced_requests"] == 2


async def test_flag_off_shares_nothing(core_off: ServingCore) -> None:
    want = await reference(core_off)
    before = counters(core_off)
    gens = await asyncio.gather(*(core_off.generate("m", prompt=PROMPT, max_tokens=N_TOKENS,
                                                    temperature=0) for _ in range(20)))
    texts = await asyncio.gather(*(collect(g) for g in gens))
    d = delta(counters(core_off), before)
    assert d == {"coalesced_requests": 0, "prompt_tokens": 20 * gens[0].prompt_tokens,
                 "generated_tokens": 20 * N_TOKENS}
    assert texts == [want] * 20


def test_agent_flag() -> None:
    p = build_parser()
    assert p.parse_args([]).coalesce_requests is True
    assert p.parse_args(["--no-coalesce-requests"]).coalesce_requests is False
    assert p.parse_args(["--coalesce-requests"]).coalesce_requests is True


# -- through the HTTP API ---------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module")
async def http_agent(tiny_model_path: Path) -> AsyncIterator[Agent]:  # noqa: F811
    a = await make_agent(tiny_model_path)
    yield a
    await close_agent(a)


async def _events(resp: Any) -> list[dict]:
    out = []
    while True:
        raw = (await resp.content.readuntil(b"\n\n")).strip()
        data = raw[len(b"data: "):]
        if data == b"[DONE]":
            return out
        out.append(json.loads(data))


async def test_20_identical_streams_over_http_each_with_its_own_id_and_usage(
        http_agent: Agent) -> None:
    core, client = http_agent.core, http_agent.client
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": N_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    before = counters(core, REVISION, MODEL_ID)
    resps: list[Any] = []
    firsts: list[dict] = []
    try:
        with StepGate(core) as gate:
            for _ in range(20):
                # each stream's first event (the role) is sent once its handler has its
                # generation; the leader's stays mid-stream until the gate opens
                resps.append(await client.post(CHAT, json=body))
                assert resps[-1].status == 200
                firsts.append(json.loads((await resps[-1].content.readuntil(b"\n\n"))[6:]))
            gate.open()
            streams = [[f] + await _events(r) for f, r in zip(firsts, resps)]
    finally:
        for r in resps:
            r.close()
    assert delta(counters(core, REVISION, MODEL_ID), before)["coalesced_requests"] == 19
    texts, ids, usages = [], set(), []
    for r, events in zip(resps, streams):
        assert r.headers[REVISION_HEADER] == REVISION
        assert len({e["id"] for e in events}) == 1     # one id per response...
        ids.add(events[0]["id"])
        texts.append("".join(c["delta"].get("content") or "" for e in events
                             for c in e["choices"]))
        usages.append(events[-1]["usage"])
    assert len(ids) == 20                              # ...and each response its own
    assert texts == [texts[0]] * 20 and texts[0]
    assert usages == [usages[0]] * 20 and usages[0]["completion_tokens"] == N_TOKENS
