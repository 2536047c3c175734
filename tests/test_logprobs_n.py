"""Log-probabilities (chat ``logprobs``/``top_logprobs``, legacy ``logprobs``) and ``n`` choices
(issue 20 §3): over a real ServingCore and the generated random-weight model, through raw HTTP
and the official ``openai`` client; the top-k gather and the request fields' bounds as units."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from node_agent.api.parse import unsupported
from node_agent.api.render import completion_answer
from node_agent.api_models import (MAX_LEGACY_LOGPROBS, MAX_TOP_LOGPROBS, ChatCompletionRequest,
                                   CompletionRequest)
from node_agent.api_responses import (ChoiceLogprobs, CompletionLogprobs, chat_logprobs,
                                      completion_logprobs)
from node_agent.logprobs_json import ChoiceLogprobsJson
from node_agent.serving import ServingCore, TooManyChoices
from node_agent.serving.logprobs import MIN_LOGPROB, TokenLogprob, TopLogprob, gather
from node_agent.serving.sampling import choice_seed
from serving_fixtures import (MODEL_ID, Agent, agent, mlx_thread_held,  # noqa: F401
                              tiny_model_path, wait_for)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "Tell me about the sea"}]


@pytest_asyncio.fixture(scope="module")
async def client(agent: Agent) -> AsyncIterator[openai.AsyncOpenAI]:  # noqa: F811
    c = openai.AsyncOpenAI(base_url=agent.base_url, api_key="x", max_retries=0)
    yield c
    await c.close()


async def post(agent: Agent, path: str, body: dict) -> Any:  # noqa: F811
    resp = await agent.client.post(path, json={"model": MODEL_ID, **body})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def stream_events(agent: Agent, path: str, body: dict) -> list[dict]:  # noqa: F811
    resp = await agent.client.post(path, json={"model": MODEL_ID, "stream": True, **body})
    assert resp.status == 200, await resp.text()
    raw = (await resp.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    return [json.loads(e.removeprefix("data: ")) for e in raw.split("\n\n")[:-2]]


async def error_param(agent: Agent, path: str, body: dict) -> str:  # noqa: F811
    resp = await agent.client.post(path, json={"model": MODEL_ID, **body})
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["type"] == "invalid_request_error"
    return err["param"]


def tokens_of(choice: dict) -> int:
    """Generated tokens of a chat choice with logprobs: its entries, plus the end-of-sequence
    token (which has none) when it stopped on one."""
    return len(choice["logprobs"]["content"]) + (choice["finish_reason"] == "stop")


def check_entries(content: list[dict], k: int, greedy: bool) -> None:
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["logprob"] <= 0.0
        tops = e["top_logprobs"]
        assert len(tops) == k
        values = [t["logprob"] for t in tops]
        assert values == sorted(values, reverse=True)
        assert all(set(t) == {"token", "logprob", "bytes"} for t in tops)
        if greedy and k:
            # the sampled token is the most likely one, with the very same value
            assert e["logprob"] == tops[0]["logprob"]
            assert (e["token"], e["bytes"]) == (tops[0]["token"], tops[0]["bytes"])
    assert sum(e["logprob"] for e in content) <= 0.0


# -- chat ------------------------------------------------------------------------------------


async def test_greedy_chosen_token_has_the_top_logprob(agent: Agent) -> None:  # noqa: F811
    body = await post(agent, CHAT, {"messages": MSGS, "max_tokens": 12, "temperature": 0,
                                    "logprobs": True, "top_logprobs": 5})
    (choice,) = body["choices"]
    content = choice["logprobs"]["content"]
    assert content and tokens_of(choice) == body["usage"]["completion_tokens"]
    check_entries(content, 5, greedy=True)
    # the tokens' own bytes rebuild the text (byte-level BPE: partial characters too; the
    # detokenizer drops a leading space of the first token)
    raw = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", "replace")
    assert raw.removeprefix(" ") == choice["message"]["content"]


async def test_top_logprobs_zero_lists_only_the_chosen_token(agent: Agent) -> None:  # noqa: F811
    body = await post(agent, CHAT, {"messages": MSGS, "max_tokens": 4, "temperature": 0.8,
                                    "logprobs": True})
    content = body["choices"][0]["logprobs"]["content"]
    check_entries(content, 0, greedy=False)


async def test_without_logprobs_the_field_is_null(agent: Agent) -> None:  # noqa: F811
    body = await post(agent, CHAT, {"messages": MSGS, "max_tokens": 3, "logprobs": False})
    assert body["choices"][0]["logprobs"] is None
    events = await stream_events(agent, CHAT, {"messages": MSGS, "max_tokens": 3})
    assert all(e["choices"][0]["logprobs"] is None for e in events)


async def test_streamed_logprobs_equal_the_non_streamed(agent: Agent) -> None:  # noqa: F811
    req = {"messages": MSGS, "max_tokens": 10, "temperature": 0, "logprobs": True,
           "top_logprobs": 3}
    whole = (await post(agent, CHAT, req))["choices"][0]
    events = await stream_events(agent, CHAT, req)
    streamed = [e for ev in events for c in ev["choices"] if c["logprobs"]
                for e in c["logprobs"]["content"]]
    text = "".join(c["delta"]["content"] for ev in events for c in ev["choices"])
    assert text == whole["message"]["content"]
    want = whole["logprobs"]["content"]
    assert [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]])
            for e in streamed] == [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]])
                                   for e in want]
    # the second request's prefill may come from the prompt cache: same values to rounding
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in want],
                                                             rel=1e-4, abs=1e-5)


# -- legacy completions ----------------------------------------------------------------------


async def test_legacy_completion_logprobs_shape(agent: Agent) -> None:  # noqa: F811
    req = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "logprobs": 3}
    body = await post(agent, COMPLETIONS, req)
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    n = len(lp["tokens"])
    assert n == body["usage"]["completion_tokens"] - (choice["finish_reason"] == "stop") > 0
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    offset = 0
    for token, value, top, at in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                      lp["text_offset"]):
        assert at == offset
        offset += len(token)
        assert value <= 0.0
        # the 3 likeliest and the chosen (tokens of one text share a key)
        assert 1 <= len(top) <= 4 and top[token] == value
        assert value == max(top.values())                   # greedy
    # streamed: the same tokens, values and offsets, spread over the events
    events = await stream_events(agent, COMPLETIONS, req)
    parts = [c["logprobs"] for ev in events for c in ev["choices"] if c["logprobs"]]
    joined = {k: [x for p in parts for x in p[k]] for k in lp}
    assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
    assert joined["token_logprobs"] == pytest.approx(lp["token_logprobs"], rel=1e-4, abs=1e-5)


async def test_openai_client_parses_legacy_logprobs(client: openai.AsyncOpenAI) -> None:
    r = await client.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=5,
                                        temperature=0, logprobs=2, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.logprobs is not None and len(c.logprobs.tokens) == len(c.logprobs.text_offset)
        assert all(1 <= len(top) <= 3 for top in c.logprobs.top_logprobs)
    assert r.choices[0].logprobs == r.choices[1].logprobs


# -- large answers ---------------------------------------------------------------------------


async def test_a_large_logprobs_answer_does_not_stall_the_event_loop(
        agent: Agent) -> None:  # noqa: F811
    """n = 8 choices of up to 1,000 tokens with 20 top log-probabilities each (megabytes of
    JSON; validated and encoded at once on the loop this stalled it for 1.5 s and more): a
    ticker task on the agent's loop sees no gap near the request's own time."""
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    start = time.perf_counter()
    resp = await agent.client.post(CHAT, json={
        "model": MODEL_ID, "messages": MSGS, "n": 8, "max_tokens": 1000, "temperature": 1,
        "seed": 1, "logprobs": True, "top_logprobs": 20})
    raw = await resp.read()
    elapsed = time.perf_counter() - start
    task.cancel()
    assert resp.status == 200, raw[:500]
    body = json.loads(raw)
    assert len(raw) > 1_000_000          # large enough that encoding it at once takes ~1 s
    assert sum(tokens_of(c) for c in body["choices"]) == body["usage"]["completion_tokens"]
    worst = max(gaps)
    assert worst < 0.25 and worst < elapsed / 4, (worst, elapsed)


def _entries(count: int, k: int) -> list[TokenLogprob]:
    texts = ["a", " é", "\ufffd", "b", 'q"', "\n"]
    return [TokenLogprob(token_id=i, text=texts[i % len(texts)],
                         bytes=tuple(texts[i % len(texts)].encode()), logprob=-0.5 * i,
                         top=tuple(TopLogprob(text=texts[(i + j) % len(texts)],
                                              bytes=tuple(texts[(i + j) % len(texts)].encode()),
                                              logprob=MIN_LOGPROB if j == 3 else -0.25 * j)
                                   for j in range(k)))
            for i in range(count)]


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("count,k", [(0, 0), (1, 0), (7, 3), (30, 5)])
def test_encoded_logprobs_equal_the_models_dump(kind: str, count: int, k: int) -> None:
    """Token-by-token encoding gives the document pydantic's models give."""
    entries = _entries(count, k)
    lp = ChoiceLogprobsJson(kind)
    for e in entries:
        lp.add(e)
    choice = ({"index": 0, "message": {"role": "assistant", "content": "x"}, "logprobs": None,
               "finish_reason": "length"} if kind == "chat"
              else {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"})
    payload = {"id": "i", "object": "o", "created": 1, "model": "m", "choices": [choice],
               "usage": {"prompt_tokens": 1}}
    got = json.loads(completion_answer(payload, [lp]))
    want = (ChoiceLogprobs.model_validate(chat_logprobs(entries)) if kind == "chat"
            else CompletionLogprobs.model_validate(completion_logprobs(entries))).model_dump()
    assert got == {**payload, "choices": [{**choice, "logprobs": want}]}
    assert list(got["choices"][0]) == list(choice)     # key order kept
    assert json.loads(completion_answer(payload, None)) == payload


# -- n ---------------------------------------------------------------------------------------


async def test_openai_client_n_with_logprobs(client: openai.AsyncOpenAI) -> None:
    one = await client.chat.completions.create(model=MODEL_ID, messages=MSGS, max_tokens=6,
                                               temperature=0)
    r = await client.chat.completions.create(model=MODEL_ID, messages=MSGS, max_tokens=6,
                                             temperature=0, logprobs=True, top_logprobs=5, n=4)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    # greedy: four equal choices, equal to the lone request's answer
    assert {c.message.content for c in r.choices} == {one.choices[0].message.content}
    tokens = []
    for c in r.choices:
        assert c.logprobs is not None and c.logprobs.content
        assert [t.token for t in c.logprobs.content] == [
            t.token for t in r.choices[0].logprobs.content]
        for t in c.logprobs.content:
            assert len(t.top_logprobs) == 5 and t.logprob == t.top_logprobs[0].logprob
        tokens.append(len(c.logprobs.content) + (c.finish_reason == "stop"))
    assert r.usage.completion_tokens == sum(tokens) == 4 * one.usage.completion_tokens
    assert r.usage.prompt_tokens == one.usage.prompt_tokens          # the prompt counts once
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


async def test_openai_client_parses_streamed_n_with_logprobs(
        client: openai.AsyncOpenAI) -> None:
    kw = dict(model=MODEL_ID, messages=MSGS, max_tokens=5, temperature=0, logprobs=True,
              top_logprobs=2, n=2)
    whole = await client.chat.completions.create(**kw)
    stream = await client.chat.completions.create(**kw, stream=True,
                                                  stream_options={"include_usage": True})
    text, tokens, usage = {0: "", 1: ""}, {0: [], 1: []}, None
    async for ev in stream:
        usage = ev.usage or usage
        for c in ev.choices:
            text[c.index] += c.delta.content or ""
            if c.logprobs is not None:
                tokens[c.index] += [t.token for t in c.logprobs.content or []]
    for c in whole.choices:
        assert text[c.index] == c.message.content
        assert tokens[c.index] == [t.token for t in c.logprobs.content]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


async def test_streamed_n_choices_carry_their_index(agent: Agent) -> None:  # noqa: F811
    req = {"messages": MSGS, "max_tokens": 6, "temperature": 0, "n": 3, "logprobs": True,
           "top_logprobs": 2, "stream_options": {"include_usage": True}}
    events = await stream_events(agent, CHAT, req)
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == []
    roles = [c["index"] for ev in events for c in ev["choices"] if "role" in c["delta"]]
    assert roles == [0, 1, 2]
    text: dict[int, str] = {0: "", 1: "", 2: ""}
    finished: dict[int, list[str]] = {0: [], 1: [], 2: []}
    entries: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    for ev in events[:-1]:
        (c,) = ev["choices"]
        text[c["index"]] += c["delta"]["content"]
        if c["finish_reason"]:
            finished[c["index"]].append(c["finish_reason"])
        if c["logprobs"]:
            entries[c["index"]] += c["logprobs"]["content"]
    assert all(len(f) == 1 for f in finished.values())
    whole = await post(agent, CHAT, {**req, "stream_options": None})
    for c in whole["choices"]:
        assert text[c["index"]] == c["message"]["content"]
        assert [e["token"] for e in entries[c["index"]]] == [
            e["token"] for e in c["logprobs"]["content"]]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == sum(
        tokens_of(c) for c in whole["choices"])
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]


async def test_seeded_choices_are_distinct_draws(agent: Agent) -> None:  # noqa: F811
    body = await post(agent, CHAT, {"messages": MSGS, "max_tokens": 12, "temperature": 1.0,
                                    "seed": 7, "n": 4})
    texts = [c["message"]["content"] for c in body["choices"]]
    assert len(set(texts)) == 4
    assert body["usage"]["completion_tokens"] <= 4 * 12


def test_choice_seeds() -> None:
    assert choice_seed(None, 3) is None
    assert choice_seed(5, 0) == 5
    seeds = [choice_seed(5, i) for i in range(8)]
    assert len(set(seeds)) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [choice_seed(5, i) for i in range(8)]          # derived, not random
    assert choice_seed(6, 1) != choice_seed(5, 1)


async def test_n_sequences_share_one_prefill_and_count_in_admission(
        tiny_model_path, monkeypatch) -> None:  # noqa: F811
    import node_agent.serving.engine as engine_module

    prefills: list[int] = []
    real = engine_module.fastpath.prefill

    def counted(model: Any, tokens: Any, cache: Any, *a: Any) -> None:
        prefills.append(len(tokens))
        real(model, tokens, cache, *a)

    monkeypatch.setattr(engine_module.fastpath, "prefill", counted)
    core = ServingCore(registry=CollectorRegistry(), max_choices=6)
    await core.start()
    try:
        await core.load_model("m", tiny_model_path, revision="r1", max_concurrent_sequences=4,
                              max_context_tokens=4096)
        async with mlx_thread_held(core, 30):
            task = asyncio.create_task(core.generate(
                "m", prompt="the same prompt for all", max_tokens=3, temperature=0, n=3))
            await wait_for(lambda: core.inflight_requests("m") == 3)   # n sequences admitted
        gen = await task
        chunks = [c async for c in gen]
        # one prefill of the prompt but its last token, for all three sequences
        assert prefills == [gen.prompt_tokens - 1]
        assert sorted({c.index for c in chunks}) == [0, 1, 2]
        assert gen.completion_tokens == 9 and gen.finish_reasons == ["length"] * 3
        assert [c.text for c in chunks if c.index == 0] == [c.text for c in chunks
                                                             if c.index == 2]
        assert core.inflight_requests("m") == 0
        # bounds: the model's batch (4), the core's max_choices (6)
        with pytest.raises(TooManyChoices) as e:
            await core.generate("m", prompt="x", max_tokens=1, n=5)
        assert e.value.limit == 4
        with pytest.raises(TooManyChoices) as e:
            await core.generate("m", prompt="x", max_tokens=1, n=7)
        assert e.value.limit == 6
        assert core.inflight_requests("m") == 0
    finally:
        await core.close()


@pytest.mark.parametrize(("body", "param"), [
    ({"n": 0}, "n"),
    ({"n": 9}, "n"),                          # above --max-choices (8)
    ({"n": 1.5}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),    # without logprobs: OpenAI answers 400 too
    ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": 1}, "logprobs"),
])
async def test_chat_field_errors_name_the_field(agent: Agent, body: dict,  # noqa: F811
                                                param: str) -> None:
    assert await error_param(agent, CHAT, {"messages": MSGS, "max_tokens": 1, **body}) == param


@pytest.mark.parametrize(("body", "param"), [
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),    # not a legacy field: unsupported
    ({"n": 9}, "n"),
])
async def test_legacy_field_errors_name_the_field(agent: Agent, body: dict,  # noqa: F811
                                                  param: str) -> None:
    assert await error_param(agent, COMPLETIONS, {"prompt": "x", "max_tokens": 1,
                                                  **body}) == param


# -- property tests of the request models ----------------------------------------------------


def _verdict(cls: type, body: dict) -> str | None:
    """``None`` when the body is accepted, else the ``param`` its 400 names."""
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        return ".".join(str(p) for p in e.errors()[0]["loc"][:1])
    refused = unsupported(req)
    return None if refused is None else json.loads(refused.body)["error"]["param"]


_values = st.one_of(st.none(), st.booleans(), st.integers(-5, 30), st.floats(-5, 30),
                    st.sampled_from([1.5, 2.0**60, "1", "true", [1], {}]))


@settings(max_examples=300, deadline=None)
@given(logprobs=_values, top=_values, n=_values)
def test_chat_logprobs_fields_property(logprobs: Any, top: Any, n: Any) -> None:
    body: dict[str, Any] = {"model": "m", "messages": MSGS}
    for key, value in (("logprobs", logprobs), ("top_logprobs", top), ("n", n)):
        if value is not None:
            body[key] = value

    def whole(v: Any) -> int | None:
        if isinstance(v, bool):
            return None
        if isinstance(v, int):
            return v
        if isinstance(v, float) and v.is_integer() and abs(v) <= 2**53:   # exact in JSON
            return int(v)
        return None

    verdict = _verdict(ChatCompletionRequest, body)
    lp_ok = logprobs is None or isinstance(logprobs, bool)
    top_ok = top is None or (whole(top) is not None and 0 <= whole(top) <= MAX_TOP_LOGPROBS)
    n_ok = n is None or (whole(n) is not None and whole(n) >= 1)
    # pydantic reports the first invalid field in declaration order: n (shared), logprobs,
    # top_logprobs
    if not n_ok:
        assert verdict == "n"
    elif not lp_ok:
        assert verdict == "logprobs"
    elif not top_ok:
        assert verdict == "top_logprobs"
    elif top is not None and logprobs is not True:
        assert verdict == "top_logprobs"
    else:
        assert verdict is None


@settings(max_examples=200, deadline=None)
@given(logprobs=_values)
def test_legacy_logprobs_field_property(logprobs: Any) -> None:
    body: dict[str, Any] = {"model": "m", "prompt": "x"}
    if logprobs is not None:
        body["logprobs"] = logprobs
    verdict = _verdict(CompletionRequest, body)
    ok = logprobs is None or (
        not isinstance(logprobs, bool) and isinstance(logprobs, (int, float))
        and float(logprobs).is_integer() and 0 <= logprobs <= MAX_LEGACY_LOGPROBS)
    assert verdict == (None if ok else "logprobs")


# -- the top-k gather ------------------------------------------------------------------------


def test_gather_sorts_breaks_ties_by_id_and_floors_minus_infinity() -> None:
    import mlx.core as mx

    row = mx.log(mx.array([0.1, 0.4, 0.2, 0.2, 0.1, 0.0]))
    (chosen, top), (c2, top2), (c3, top3) = gather([(row, 2, 3), (row, 5, 0), (row, 0, 6)])
    assert chosen == pytest.approx(math.log(0.2))
    assert [i for i, _ in top] == [1, 2, 3]                  # 0.4, then the tie 0.2 by id
    assert [v for _, v in top] == pytest.approx([math.log(0.4), math.log(0.2), math.log(0.2)])
    assert c2 == MIN_LOGPROB and top2 == []                   # -inf (masked) → -9999.0
    assert [i for i, _ in top3] == [1, 2, 3, 0, 4, 5] and top3[-1][1] == MIN_LOGPROB
    assert gather([]) == []


async def test_requests_without_logprobs_add_no_gather(agent: Agent,  # noqa: F811
                                                      monkeypatch) -> None:
    import node_agent.serving.logprobs as logprobs_module

    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("gather called for a request that did not ask")

    monkeypatch.setattr(logprobs_module, "gather", boom)
    body = await post(agent, CHAT, {"messages": MSGS, "max_tokens": 4, "n": 2})
    assert body["usage"]["completion_tokens"] >= 2


# -- admission counts a request's n sequences ------------------------------------------------

A = ("a", "r1")


@pytest.mark.parametrize(("inflight", "limit", "max_queued", "n", "refused_at"), [
    (0, 4, 0, 4, None),        # all four fit the batch
    (1, 4, 0, 4, 0),           # one of them would wait, none may
    (1, 4, 1, 4, None),        # one may wait
    (5, 4, 2, 2, 1),           # 1 waits already, 2 more would: 3 > 2
    (5, 4, 3, 2, None),
    (3, 4, 1, 1, None),        # n = 1: the old rule (a free slot)
    (4, 4, 0, 1, 0),
])
def test_admission_counts_n_sequences(inflight: int, limit: int, max_queued: int, n: int,
                                      refused_at: int | None) -> None:
    from node_agent.serving.admission import admit

    refused = admit(A, {A: inflight}, {A: limit}, max_queued, n)
    if refused_at is None:
        assert refused is None
    else:
        assert refused is not None and (refused.bound, refused.waiting) == ("count", refused_at)


async def test_a_request_for_n_waits_for_n_slots_and_counts_n_in_the_queue(
        tiny_model_path) -> None:  # noqa: F811
    from node_agent.serving import Overloaded

    c = ServingCore(registry=CollectorRegistry(), max_queued_requests=1)
    await c.start()
    try:
        await c.load_model("m", tiny_model_path, revision="r1", max_concurrent_sequences=2,
                           max_context_tokens=4096)
        running = await c.generate("m", prompt="a", max_tokens=3000, temperature=0)
        await running.__anext__()
        # 1 running + 2: one of the two must wait, and one may
        pair = await c.generate("m", prompt="b", max_tokens=2, temperature=0, n=2)
        assert c.inflight_requests("m") == 3
        with pytest.raises(Overloaded):                     # a second waiter: over the bound
            await c.generate("m", prompt="c", max_tokens=2, temperature=0)
        # a slot is free beside `running`, but the pair needs two: it waits whole
        assert c.queued_requests("m") == 2 and c.active_sequences("m") == 1
        running.cancel()
        got = [ch async for ch in pair]
        assert sorted({ch.index for ch in got}) == [0, 1] and pair.completion_tokens == 4
        await wait_for(lambda: c.active_sequences() == 0 and c.inflight_requests() == 0)
    finally:
        await c.close()


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 3000), k=st.integers(1, 25),
       seed=st.integers(0, 2**31), masked=st.floats(0.0, 1.0), ties=st.booleans())
def test_top_k_ids_picks_the_k_largest(rows: int, vocab: int, k: int, seed: int,
                                       masked: float, ties: bool) -> None:
    """The blocked two-stage top-k gives the same values as one argpartition (random rows,
    vocabularies not a multiple of the block, masked -inf entries, many ties)."""
    import mlx.core as mx

    from node_agent.serving.logprobs import top_k_ids

    k = min(k, vocab)
    key = mx.random.key(seed)
    m = mx.random.normal((rows, vocab), key=key)
    if ties:
        m = mx.round(m * 2) / 2
    m = mx.where(mx.random.uniform(shape=(rows, vocab), key=mx.random.split(key)[0]) < masked,
                 -mx.inf, m)
    ids = top_k_ids(m, k, block=16)
    assert ids.shape == (rows, k)
    got = mx.sort(mx.take_along_axis(m, ids, axis=-1), axis=-1)
    want = mx.sort(m, axis=-1)[:, vocab - k:]
    assert mx.array_equal(got, want).item()
    for r in ids.tolist():
        assert len(set(r)) == k and all(0 <= i < vocab for i in r)


# -- n and logprobs with constrained decoding and tools ------------------------------------


async def test_n_constrained_choices_each_follow_the_schema_with_logprobs(
        client: openai.AsyncOpenAI) -> None:
    """Each of n sampled sequences follows the JSON schema with a grammar matcher of its own
    (one shared matcher would be fed every choice's tokens), and its logprobs come from the
    masked distribution: the chosen token is never a masked one."""
    import jsonschema
    from test_structured_outputs import MAX, MSGS as JSON_MSGS, SCHEMAS

    schema = SCHEMAS["nested"]
    r = await client.chat.completions.create(
        model=MODEL_ID, messages=JSON_MSGS, temperature=1.0, seed=11, n=3, max_tokens=MAX,
        logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1          # distinct draws
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)
        assert c.logprobs is not None and c.logprobs.content
        assert all(t.logprob > -9999.0 for t in c.logprobs.content)


async def test_streamed_n_tool_calls_are_parsed_per_choice(client: openai.AsyncOpenAI) -> None:
    import jsonschema
    from test_structured_outputs import MAX, PARAMS, TOOLS

    stream = await client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=TOOLS, tool_choice="required", temperature=1.0, seed=4, n=2, max_tokens=MAX,
        stream=True)
    calls: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    reasons: dict[int, list] = {0: [], 1: []}
    async for ev in stream:
        for c in ev.choices:
            for tc in c.delta.tool_calls or ():
                call = calls[c.index].setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                reasons[c.index].append(c.finish_reason)
    assert reasons == {0: ["tool_calls"], 1: ["tool_calls"]}
    for index in (0, 1):
        assert calls[index]
        for call in calls[index].values():
            jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
