"""The OpenAI-compatible API over a real ServingCore and a real generated model, through the
official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from node_agent.openai_api import build_app
from serving_fixtures import (MODEL_ID, REVISION, Agent, agent, close_agent,  # noqa: F401
                              make_agent, tiny_model_path, wait_for)

LONG = 4000
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def msgs(text: str = "Hello") -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest_asyncio.fixture(scope="module")
async def client(agent: Agent) -> AsyncIterator[openai.AsyncOpenAI]:  # noqa: F811
    c = openai.AsyncOpenAI(base_url=agent.base_url, api_key="x", max_retries=0)
    yield c
    await c.close()


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text → {(sample name, sorted label items): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def error_of(resp) -> dict:
    body = await resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def sse_events(resp) -> list[str]:
    raw = (await resp.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    return [e.removeprefix("data: ") for e in events[:-1]]


# -- happy paths ------------------------------------------------------------------------------


async def test_chat_completion_with_openai_client(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(model=MODEL_ID, messages=msgs(), max_tokens=8,
                                             temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == MODEL_ID and isinstance(r.created, int)
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8 and r.usage.prompt_tokens > 3
    # max_completion_tokens wins over max_tokens
    r2 = await client.chat.completions.create(model=MODEL_ID, messages=msgs(), max_tokens=8,
                                              max_completion_tokens=3, temperature=0)
    assert r2.usage.completion_tokens == 3
    assert r.choices[0].message.content.startswith(r2.choices[0].message.content[:1])


async def test_text_completion_with_openai_client(client: openai.AsyncOpenAI) -> None:
    r = await client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=6,
                                        temperature=0, seed=3)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert r.usage.completion_tokens == 6


async def test_stop_sequence(client: openai.AsyncOpenAI) -> None:
    full = (await client.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=20,
                                            temperature=0)).choices[0].text
    candidates = [full[i:i + 2] for i in range(1, len(full) - 2)
                  if full[i:i + 2].isprintable() and full[i:i + 2].strip() == full[i:i + 2]]
    assert candidates, full
    stop = candidates[0]
    r = await client.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=20,
                                        temperature=0, stop=stop)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]


async def test_chat_streaming_with_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL_ID, messages=msgs(), max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = await client.chat.completions.create(model=MODEL_ID, messages=msgs(),
                                                 max_tokens=6, temperature=0)
    assert text == plain.choices[0].message.content


async def test_raw_sse_framing(agent: Agent) -> None:  # noqa: F811
    async with agent.client.post(COMPLETIONS, json={
            "model": MODEL_ID, "prompt": "Hi", "max_tokens": 4, "temperature": 0,
            "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    bodies = [json.loads(e) for e in events[:-1]]
    assert all(b["object"] == "text_completion" and "usage" not in b for b in bodies)
    assert bodies[-1]["choices"][0]["finish_reason"] == "length"
    assert all(b["choices"][0]["finish_reason"] is None for b in bodies[:-1])


# -- batching and disconnects -----------------------------------------------------------------


async def test_concurrent_streams_share_one_batch(agent: Agent) -> None:  # noqa: F811
    core = agent.core
    body = {"model": MODEL_ID, "max_tokens": LONG, "temperature": 0, "stream": True}
    first = await agent.client.post(CHAT, json={**body, "messages": msgs("first")})
    try:
        assert first.status == 200
        await first.content.readuntil(b"\n\n")
        await first.content.readuntil(b"\n\n")        # a generated token: first is decoding
        second = await agent.client.post(CHAT, json={**body, "messages": msgs("second")})
        try:
            assert second.status == 200
            await second.content.readuntil(b"\n\n")
            await wait_for(lambda: core.active_sequences(MODEL_ID) == 2)
            assert not first.content.at_eof()
            samples = parse_metrics(await (await agent.client.get("/metrics")).text())
            assert samples[("mlxfleet_agent_batch_occupancy",
                            (("model", MODEL_ID), ("revision", REVISION)))] == 2
        finally:
            second.close()
    finally:
        first.close()
    await wait_for(lambda: core.active_sequences() == 0 and core.inflight_requests() == 0)


async def test_client_disconnect_stops_generation(agent: Agent) -> None:  # noqa: F811
    core = agent.core
    before = agent.registry.get_sample_value(
        "mlxfleet_agent_generated_tokens_total", {"model": MODEL_ID, "revision": REVISION}) or 0
    resp = await agent.client.post(COMPLETIONS, json={
        "model": MODEL_ID, "prompt": "Hello", "max_tokens": LONG, "temperature": 0,
        "stream": True})
    assert resp.status == 200
    for _ in range(3):
        await resp.content.readuntil(b"\n\n")
    assert core.active_sequences(MODEL_ID) == 1
    resp.close()                                     # drop the connection
    await wait_for(lambda: core.active_sequences() == 0 and core.inflight_requests() == 0)
    after = agent.registry.get_sample_value(
        "mlxfleet_agent_generated_tokens_total", {"model": MODEL_ID, "revision": REVISION})
    assert after - before < LONG


async def test_non_streaming_disconnect_stops_generation(agent: Agent) -> None:  # noqa: F811
    core = agent.core
    task = asyncio.create_task(agent.client.post(CHAT, json={
        "model": MODEL_ID, "messages": msgs(), "max_tokens": LONG, "temperature": 0}))
    await wait_for(lambda: core.active_sequences(MODEL_ID) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: core.active_sequences() == 0 and core.inflight_requests() == 0)


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_malformed_json_is_400(agent: Agent, path: str) -> None:  # noqa: F811
    resp = await agent.client.post(path, data=b"{not json",
                                   headers={"Content-Type": "application/json"})
    assert resp.status == 400
    err = await error_of(resp)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": msgs(), "max_tokens": "ten"}, "max_tokens"),
    ({"messages": msgs(), "max_tokens": 0}, "max_tokens"),
    ({"messages": msgs(), "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": msgs(), "temperature": "hot"}, "temperature"),
    ({"messages": msgs(), "temperature": 3}, "temperature"),
    ({"messages": msgs(), "top_p": 0}, "top_p"),
    ({"messages": msgs(), "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": msgs(), "stream": "yes"}, "stream"),
    ({"messages": msgs(), "n": 2}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({}, "messages"),
])
async def test_invalid_field_is_400_naming_it(agent: Agent, body: dict, param: str) -> None:  # noqa: F811
    resp = await agent.client.post(CHAT, json={"model": MODEL_ID, **body})
    assert resp.status == 400
    err = await error_of(resp)
    assert err["type"] == "invalid_request_error" and err["param"] == param


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETIONS, {"stream": False, "stream_options": {"include_usage": False}},
     "stream_options"),
    (CHAT, {"n": 2}, "n"),
    (COMPLETIONS, {"n": 3}, "n"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"logprobs": True}, "logprobs"),
    (COMPLETIONS, {"logprobs": 2}, "logprobs"),
])
async def test_unsupported_options_are_400_naming_them(agent: Agent, path: str, body: dict,  # noqa: F811
                                                       param: str) -> None:
    base = {"model": MODEL_ID, "max_tokens": 1, "messages": msgs(), "prompt": "x"}
    resp = await agent.client.post(path, json={**base, **body})
    assert resp.status == 400
    err = await error_of(resp)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert param in err["message"]
    if param != "stream_options":
        assert "not supported" in err["message"]


async def test_supported_spellings_of_those_options_pass(agent: Agent) -> None:  # noqa: F811
    resp = await agent.client.post(CHAT, json={
        "model": MODEL_ID, "messages": msgs(), "max_tokens": 1, "n": 1, "tools": [],
        "tool_choice": "none", "response_format": {"type": "text"}, "logprobs": False,
        "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status == 200
    await resp.read()


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "non-streaming"])
@pytest.mark.parametrize("cancellation", [True, False], ids=["cancel", "no-cancel"])
async def test_hangup_counts_499_and_logs_one_info_line(agent: Agent, caplog,  # noqa: F811
                                                        streaming: bool,
                                                        cancellation: bool) -> None:
    # handler_cancellation=True is the production setting (node_agent.main): a disconnect
    # cancels the handler, unless the handler notices it first (a write to the closed stream).
    # Without it the handler always notices it itself (ConnectionResetError). Either way: 499.
    app = build_app(agent.core, health=lambda: (True, {}), registry=agent.registry)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=cancellation)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    path = COMPLETIONS if streaming else CHAT
    labels = {"model": MODEL_ID, "revision": REVISION, "endpoint": path}

    def count(code: str) -> float:
        return agent.registry.get_sample_value("mlxfleet_agent_requests_total",
                                               {**labels, "code": code}) or 0

    before_499, before_200 = count("499"), count("200")
    try:
        with caplog.at_level(logging.INFO, logger="node_agent.openai_api"):
            async with aiohttp.ClientSession() as session:
                if streaming:
                    resp = await session.post(f"http://127.0.0.1:{port}{path}", json={
                        "model": MODEL_ID, "prompt": "Hello", "max_tokens": LONG,
                        "temperature": 0, "stream": True})
                    assert resp.status == 200
                    for _ in range(3):
                        await resp.content.readuntil(b"\n\n")   # decoding has started
                    resp.close()                                # the client hangs up
                else:
                    task = asyncio.create_task(session.post(
                        f"http://127.0.0.1:{port}{path}",
                        json={"model": MODEL_ID, "messages": msgs(), "max_tokens": LONG,
                              "temperature": 0}))
                    await wait_for(lambda: agent.core.active_sequences(MODEL_ID) == 1)
                    task.cancel()                               # the client hangs up
                    with pytest.raises(asyncio.CancelledError):
                        await task
            # counted (and logged just before) when the handler ends
            await wait_for(lambda: count("499") == before_499 + 1)
            await wait_for(lambda: agent.core.inflight_requests() == 0)
    finally:
        await runner.cleanup()
    assert count("200") == before_200
    ours = [r for r in caplog.records if r.name == "node_agent.openai_api"]
    assert [(r.levelno, r.getMessage()) for r in ours] == [
        (logging.INFO, f"client disconnected during POST {path}")]
    assert all(r.exc_info is None for r in ours)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_unknown_fields_are_ignored(agent: Agent) -> None:  # noqa: F811
    resp = await agent.client.post(COMPLETIONS, json={
        "model": MODEL_ID, "prompt": "Hi", "max_tokens": 1, "logit_bias": {}, "whatever": [1]})
    assert resp.status == 200


async def test_context_overflow_is_400(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL_ID, messages=msgs(), max_tokens=8192)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL_ID, prompt="word " * 9000, max_tokens=1)


async def test_unknown_model_is_404(client: openai.AsyncOpenAI, agent: Agent) -> None:  # noqa: F811
    with pytest.raises(openai.NotFoundError) as exc:
        await client.chat.completions.create(model="nope", messages=msgs(), max_tokens=1)
    assert exc.value.code == "model_not_found"
    resp = await agent.client.post(COMPLETIONS, json={"model": "nope", "prompt": "x"})
    assert resp.status == 404 and (await error_of(resp))["param"] == "model"


async def test_unknown_models_add_no_metric_series(agent: Agent) -> None:  # noqa: F811
    def series() -> set[tuple]:
        text = generate_latest(agent.registry).decode()
        return {labels for (name, labels) in parse_metrics(text)
                if name == "mlxfleet_agent_requests_total"}

    for path in (CHAT, COMPLETIONS):
        await agent.client.post(path, json={"model": "warm-up", "prompt": "x",
                                            "messages": msgs()})
    await agent.client.post(CHAT, data=b"{bad json", headers={"Content-Type": "application/json"})
    before = series()
    for i in range(40):
        resp = await agent.client.post(COMPLETIONS if i % 2 else CHAT, json={
            "model": uuid.uuid4().hex * 4, "prompt": "x", "messages": msgs()})
        assert resp.status == 404
    after = series()
    assert after == before
    models = {dict(labels)["model"] for labels in after}
    assert models <= {MODEL_ID, "unknown"} and "" not in models


async def test_wrong_method_and_path(agent: Agent) -> None:  # noqa: F811
    resp = await agent.client.get(CHAT)
    assert resp.status == 405
    assert (await error_of(resp))["code"] == "method_not_allowed"
    resp = await agent.client.post("/v1/models")
    assert resp.status == 405
    resp = await agent.client.get("/v1/nothing")
    assert resp.status == 404
    await error_of(resp)


async def test_saturated_agent_answers_429(tiny_model_path: Path) -> None:  # noqa: F811
    a = await make_agent(tiny_model_path, max_queued_requests=0, max_concurrent_sequences=1)
    try:
        running = await a.client.post(COMPLETIONS, json={
            "model": MODEL_ID, "prompt": "Hello", "max_tokens": LONG, "stream": True,
            "temperature": 0})  # greedy: sampling could draw EOS and end it early
        try:
            await running.content.readuntil(b"\n\n")
            resp = await a.client.post(CHAT, json={"model": MODEL_ID, "messages": msgs(),
                                                   "max_tokens": 1})
            assert resp.status == 429
            assert int(resp.headers["Retry-After"]) >= 1
            assert (await error_of(resp))["type"] == "rate_limit_error"
            c = openai.AsyncOpenAI(base_url=a.base_url, api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                await c.completions.create(model=MODEL_ID, prompt="x", max_tokens=1)
            await c.close()
        finally:
            running.close()
        await wait_for(lambda: a.core.inflight_requests() == 0)
        resp = await a.client.post(COMPLETIONS, json={"model": MODEL_ID, "prompt": "x",
                                                      "max_tokens": 1})
        assert resp.status == 200
        count = a.registry.get_sample_value("mlxfleet_agent_requests_total", {
            "model": MODEL_ID, "revision": REVISION, "endpoint": CHAT, "code": "429"})
        assert count == 1
    finally:
        await close_agent(a)


# -- models, health, metrics ------------------------------------------------------------------


async def test_models_list(client: openai.AsyncOpenAI, agent: Agent) -> None:  # noqa: F811
    page = await client.models.list()
    (m,) = page.data
    assert (m.id, m.object, m.owned_by) == (MODEL_ID, "model", "mlx-fleet")
    body = await (await agent.client.get("/v1/models")).json()
    assert body["object"] == "list" and body["data"][0]["created"] == m.created


async def test_health(agent: Agent) -> None:  # noqa: F811
    resp = await agent.client.get("/health")
    assert resp.status == 200 and await resp.json() == {"node": "test"}
    agent.health["ok"] = False
    try:
        resp = await agent.client.get("/health")
        assert resp.status == 503 and await resp.json() == {"node": "test"}
    finally:
        agent.health["ok"] = True


async def test_metrics_exposition(client: openai.AsyncOpenAI, agent: Agent) -> None:  # noqa: F811
    await client.completions.create(model=MODEL_ID, prompt="Metrics", max_tokens=3)
    resp = await agent.client.get("/metrics")
    assert resp.status == 200 and resp.content_type == "text/plain"
    samples = parse_metrics(await resp.text())
    ml = {"model": MODEL_ID, "revision": REVISION}
    key = lambda name, **extra: (name, tuple(sorted({**ml, **extra}.items())))  # noqa: E731
    assert samples[key("mlxfleet_agent_requests_total", endpoint=COMPLETIONS, code="200")] >= 1
    assert samples[key("mlxfleet_agent_time_to_first_token_seconds_count")] >= 1
    assert samples[key("mlxfleet_agent_inter_token_latency_seconds_count")] >= 2
    assert samples[key("mlxfleet_agent_generated_tokens_total")] >= 3
    assert samples[key("mlxfleet_agent_prompt_tokens_total")] >= 1
    assert samples[key("mlxfleet_agent_queue_depth")] == 0
    assert samples[key("mlxfleet_agent_batch_occupancy")] == 0
    assert samples[key("mlxfleet_agent_model_loaded")] == 1
    assert samples[key("mlxfleet_agent_model_load_seconds_count")] == 1


# -- fuzz -------------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10) | st.floats(allow_nan=False, width=32)
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                              max_size=3),
    max_leaves=8)
_bodies = st.one_of(
    _json,
    st.fixed_dictionaries({
        "model": st.sampled_from([MODEL_ID, "nope", ""]) | _json,
        "max_tokens": st.integers(-1, 3) | _json,
    }, optional={
        "messages": st.lists(st.fixed_dictionaries({"role": st.text(max_size=5) | _json,
                                                    "content": st.text(max_size=20) | _json}),
                             max_size=3) | _json,
        "prompt": st.text(max_size=30) | _json,
        "temperature": st.floats(-1, 3, allow_nan=False) | _json,
        "top_p": st.floats(-1, 2, allow_nan=False) | _json,
        "stop": st.lists(st.text(max_size=3), max_size=5) | _json,
        "stream": st.booleans() | _json,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _json,
        "seed": st.integers() | _json,
    }),
)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from([CHAT, COMPLETIONS]), body=_bodies)
async def test_fuzzed_bodies_never_crash_the_agent(agent: Agent, path: str, body: object) -> None:  # noqa: F811
    resp = await agent.client.post(path, data=json.dumps(body).encode(),
                                   headers={"Content-Type": "application/json"})
    raw = await resp.read()
    assert resp.status in {200, 400, 404}, raw
    if resp.status != 200:
        await error_of(resp)
    assert (await agent.client.get("/health")).status == 200
