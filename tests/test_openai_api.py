"""The OpenAI-compatible API over a real ServingCore and a real generated model, through the
official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mlx_fleet.contract import Keys, NodeCapacity, Role, TrafficSplit
from mlx_fleet.memstore import MemoryStore
from mlx_fleet.routing.headers import PIN_HEADER, REVISION_HEADER, SESSION_HEADER
from mlx_fleet.routing.split import bucket
from mlx_fleet.store import Store
from mlx_fleet.testmodel import Fault, make_test_model
from node_agent.controller import ServedModel
from node_agent.openai_api import build_app
from node_agent.registration import Registration
from node_agent.serving import GenerationAborted, ServingCore
from node_agent.traffic import TrafficManager
from serving_fixtures import (MODEL_ID, REVISION, Agent, agent, close_agent,  # noqa: F401
                              make_agent, other_model_path, tiny_model_path, wait_for)

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
    ({"messages": msgs(), "max_tokens": 2.5}, "max_tokens"),
    ({"messages": msgs(), "max_tokens": True}, "max_tokens"),
    ({"messages": msgs(), "max_tokens": "3"}, "max_tokens"),
    ({"messages": msgs(), "max_tokens": 2.0**60}, "max_tokens"),   # not exact as a float
    ({"messages": msgs(), "seed": 1.5}, "seed"),
    ({"messages": msgs(), "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": msgs(), "temperature": "hot"}, "temperature"),
    ({"messages": msgs(), "temperature": 3}, "temperature"),
    ({"messages": msgs(), "top_p": 0}, "top_p"),
    ({"messages": msgs(), "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": msgs(), "stream": "yes"}, "stream"),
    ({"messages": msgs(), "n": 0}, "n"),
    ({"messages": msgs(), "n": 9}, "n"),      # above --max-choices (default 8)
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
    # chat's tools, tool_choice and response_format are served (tests/test_structured_outputs.py),
    # and so are n and logprobs (tests/test_logprobs_n.py); the legacy endpoint has none of the
    # first three nor a top_logprobs (its logprobs says how many), nor does chat serve the
    # deprecated functions
    (COMPLETIONS, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (COMPLETIONS, {"tool_choice": "auto"}, "tool_choice"),
    (COMPLETIONS, {"response_format": {"type": "json_object"}}, "response_format"),
    (COMPLETIONS, {"top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
])
async def test_unsupported_options_are_400_naming_them(agent: Agent, path: str, body: dict,  # noqa: F811
                                                       param: str) -> None:
    base = {"model": MODEL_ID, "max_tokens": 1,
            **({"messages": msgs()} if path == CHAT else {"prompt": "x"})}
    resp = await agent.client.post(path, json={**base, **body})
    assert resp.status == 400
    err = await error_of(resp)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert param in err["message"]
    if param != "stream_options":
        assert "not supported" in err["message"]


async def test_whole_floats_are_integers(agent: Agent) -> None:  # noqa: F811
    """JSON Schema's ``integer`` counts ``3.0`` (schemathesis sent ``"n": 4180.0`` and
    ``"max_tokens": 3511.0``, valid by the published document, and got a 400)."""
    resp = await agent.client.post(CHAT, json={
        "model": MODEL_ID, "messages": msgs(), "max_tokens": 3.0, "n": 1.0, "seed": 7.0,
        "temperature": 0})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["usage"]["completion_tokens"] == 3


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


async def test_unknown_fields_are_refused_and_off_spellings_accepted(
        agent: Agent) -> None:  # noqa: F811
    # a field OpenAI's API does not have: 400 naming it, as OpenAI answers (it used to be
    # ignored, issue 20: never accept and quietly not apply)
    resp = await agent.client.post(COMPLETIONS, json={
        "model": MODEL_ID, "prompt": "Hi", "max_tokens": 1, "logit_bias": {}, "whatever": [1]})
    assert resp.status == 400
    err = await error_of(resp)
    assert (err["param"], err["code"]) == ("whatever", "unsupported_parameter")
    assert err["message"] == "whatever: Unrecognized request argument supplied: whatever"
    # OpenAI's fields in the spelling that asks for nothing: served
    resp = await agent.client.post(COMPLETIONS, json={
        "model": MODEL_ID, "prompt": "Hi", "max_tokens": 1, "logit_bias": {}})
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

    def body(path: str, model: str) -> dict:   # each endpoint's own fields (others: 400)
        return ({"model": model, "prompt": "x"} if path == COMPLETIONS
                else {"model": model, "messages": msgs()})

    for path in (CHAT, COMPLETIONS):
        await agent.client.post(path, json=body(path, "warm-up"))
    await agent.client.post(CHAT, data=b"{bad json", headers={"Content-Type": "application/json"})
    before = series()
    for i in range(40):
        path = COMPLETIONS if i % 2 else CHAT
        resp = await agent.client.post(path, json=body(path, uuid.uuid4().hex * 4))
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


@pytest.mark.parametrize(("path", "body", "status", "fragment"), [
    (CHAT, b"[" * 50_000 + b"]" * 50_000, 400, "recursion limit"),            # deep nesting
    (CHAT, b'{"model":' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, "recursion limit"),
    (COMPLETIONS, b'{"model":"m","prompt":"\xff\xfe"}', 400, "malformed JSON"),  # bad UTF-8
    (COMPLETIONS, b'{"model":"m","prompt":"' + b"a" * (2 * 2**20) + b'"}', 413, ""),  # > 1 MiB
    (CHAT, json.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}] * 100_000}
                      ).encode(), 413, ""),                                   # too many messages
    (COMPLETIONS, b'{"model":"m","prompt":"a","max_tokens":1e300}', 400, "max_tokens"),
], ids=["nested-array", "nested-value", "invalid-utf8", "oversized", "many-messages",
        "absurd-max-tokens"])
async def test_hostile_bodies_get_a_4xx_in_openai_shape(agent: Agent, path: str, body: bytes,  # noqa: F811
                                                       status: int, fragment: str) -> None:
    """Bodies built to hurt a JSON server are refused before anything is parsed into memory
    or generated (aiohttp's 1 MiB body limit; pydantic's bounded-depth JSON parser)."""
    resp = await agent.client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert resp.status == status
    err = await error_of(resp)
    assert fragment in err["message"]
    assert (await agent.client.get("/health")).status == 200


# -- revisions: the X-Model-Revision header, the canary split, forwarding ---------------------

CANARY_MODEL = "canary-tiny"
NS, DEP = "default", "canary"
FAULT_AFTER = 2  # the faulty revision fails every generation after this many tokens


@pytest.fixture(scope="module")
def faulty_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_model(tmp_path_factory.mktemp("models") / "faulty",
                           fault=Fault("raise", after_tokens=FAULT_AFTER))


@pytest_asyncio.fixture(scope="module")
async def canary_core(tiny_model_path: Path, other_model_path: Path,  # noqa: F811
                      faulty_model_path: Path) -> AsyncIterator[ServingCore]:
    """One core holding three revisions of CANARY_MODEL: r1, r2 (other weights), bad (faulty).
    Each test node below serves the subset its ``served`` says (as the controller would)."""
    core = ServingCore(registry=CollectorRegistry())
    await core.start()
    for rev, path in (("r1", tiny_model_path), ("r2", other_model_path),
                      ("bad", faulty_model_path)):
        await core.load_model(CANARY_MODEL, path, revision=rev, max_context_tokens=8192)
    yield core
    await core.close()


async def _capacity() -> NodeCapacity:
    return NodeCapacity(memory_total_bytes=64 * 2**30, memory_available_bytes=48 * 2**30,
                        chip="Apple M3 Max", chip_generation=3, simulated=True)


@dataclasses.dataclass
class Recorded:
    revision: str
    failed: bool


@dataclasses.dataclass
class Node:
    """One agent's HTTP side: the real app over ``canary_core``, routed by a real
    TrafficManager following ``keys``' traffic splits in the store. ``recorded``: the outcomes the
    app reported to the traffic manager (``record`` is spied on, then does its real work)."""

    tm: TrafficManager
    client: TestClient
    recorded: list[Recorded]

    @property
    def url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")


NodeFactory = Callable[..., Awaitable[Node]]


@pytest.fixture
def store(memory_store: MemoryStore) -> MemoryStore:
    """The store the nodes' traffic managers follow: the in-memory one (nothing here is about
    etcd)."""
    return memory_store


@pytest_asyncio.fixture
async def start_node(store: Store, canary_core: ServingCore) -> AsyncIterator[NodeFactory]:
    started: list[tuple[Registration, TrafficManager, TestClient]] = []

    async def start(keys: Keys, name: str, served: dict[str, Role]) -> Node:
        reg = Registration(store, keys, node_name=name, address="http://unused", ttl=5,
                           capacity=_capacity)
        await reg.start()
        tm = TrafficManager(store, keys, node_name=name, registration=reg,
                            served=lambda: {CANARY_MODEL: ServedModel(NS, DEP, dict(served))},
                            crashes=canary_core.crashes, memory_bytes=canary_core.memory_bytes)
        recorded: list[Recorded] = []
        real_record = tm.record

        def record(routed, **kw) -> None:
            recorded.append(Recorded(routed.route.revision, kw["failed"]))
            real_record(routed, **kw)

        tm.record = record  # type: ignore[method-assign]
        await tm.start()
        await asyncio.wait_for(tm.synced.wait(), 30)  # the splits written so far are in
        app = build_app(canary_core, health=lambda: (True, {}),
                        registry=canary_core.registry, router=lambda: tm)
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        started.append((reg, tm, client))
        return Node(tm, client, recorded)

    yield start
    for reg, tm, client in reversed(started):
        await client.close()
        await tm.stop()
        await reg.stop()


def canary_split(weight: int, candidate: str = "r2", endpoints: tuple[str, ...] = ()
                 ) -> TrafficSplit:
    return TrafficSplit(namespace=NS, name=DEP, served_model_name=CANARY_MODEL,
                        stable_revision="r1", candidate_revision=candidate, weight=weight,
                        canary="c", canary_uid="uid-1", candidate_endpoints=list(endpoints))


async def put_split(store: Store, keys: Keys, split: TrafficSplit) -> None:
    await store.put(keys.traffic(NS, DEP), split.to_json())


def sessions(side: str, weight: int, n: int) -> list[str]:
    """``n`` session keys whose bucket is on ``side`` ("stable"/"candidate") at ``weight``."""
    out = [k for k in (f"session-{i}" for i in range(10_000))
           if (bucket(f"{NS}/{DEP}", k) < weight * 100) == (side == "candidate")]
    assert len(out) >= n
    return out[:n]


async def test_every_response_names_the_revision_that_served_it(
        agent: Agent, store: Store, keys: Keys, start_node: NodeFactory,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    # without a router: the model's only revision
    for path, body in ((CHAT, {"messages": msgs()}), (COMPLETIONS, {"prompt": "Hi"})):
        for stream in (False, True):
            async with agent.client.post(path, json={"model": MODEL_ID, "max_tokens": 2,
                                                     "stream": stream, **body}) as resp:
                assert resp.status == 200
                assert resp.headers[REVISION_HEADER] == REVISION, (path, stream)
                await (sse_events(resp) if stream else resp.json())

    # the MLX thread ends between routing and admission (GenerationAborted): 503, naming it
    async def aborted(*args, **kwargs):
        raise GenerationAborted("the serving core closed")

    with monkeypatch.context() as m:
        m.setattr(agent.core, "generate", aborted)
        resp = await agent.client.post(CHAT, json={"model": MODEL_ID, "messages": msgs()})
        assert resp.status == 503 and resp.headers[REVISION_HEADER] == REVISION
        assert (await error_of(resp))["code"] == "unavailable"

    # a revision that fails mid-generation (GenerationAborted): 503, still naming it
    node = await start_node(keys, "n1", {"bad": Role.STABLE})
    resp = await node.client.post(COMPLETIONS, json={
        "model": CANARY_MODEL, "prompt": "Hi", "max_tokens": FAULT_AFTER + 4})
    assert resp.status == 503 and resp.headers[REVISION_HEADER] == "bad"
    err = await error_of(resp)
    assert (err["type"], err["code"]) == ("server_error", "unavailable")
    async with node.client.post(CHAT, json={"model": CANARY_MODEL, "messages": msgs(),
                                            "max_tokens": FAULT_AFTER + 4,
                                            "stream": True}) as resp:
        assert resp.status == 200 and resp.headers[REVISION_HEADER] == "bad"
        last = (await resp.read()).decode().split("\n\n")[-2]
    assert json.loads(last.removeprefix("data: "))["error"]["code"] == "unavailable"
    # both outcomes went to the router as server-side failures of that revision
    assert node.recorded == [Recorded("bad", True), Recorded("bad", True)]


async def test_sessions_go_to_the_revision_their_bucket_says(
        store: Store, keys: Keys, start_node: NodeFactory) -> None:
    await put_split(store, keys, canary_split(30))
    node = await start_node(keys, "n1", {"r1": Role.STABLE, "r2": Role.CANDIDATE})
    assert node.tm.splits[(NS, DEP)].weight == 30  # a node started mid-canary has the split
    want = {k: "r2" for k in sessions("candidate", 30, 4)}
    want |= {k: "r1" for k in sessions("stable", 30, 4)}

    async def served_by(headers: dict[str, str], **body) -> str:
        resp = await node.client.post(CHAT, headers=headers, json={
            "model": CANARY_MODEL, "messages": msgs(), "max_tokens": 1, **body})
        assert resp.status == 200, await resp.text()
        await resp.json()
        return resp.headers[REVISION_HEADER]

    for key, rev in want.items():
        assert await served_by({SESSION_HEADER: key}) == rev, key
        assert await served_by({SESSION_HEADER: key}) == rev, key  # sticky
        assert await served_by({}, user=key) == rev, key            # the fallback key
    cand, stable = sessions("candidate", 30, 1)[0], sessions("stable", 30, 1)[0]
    assert await served_by({SESSION_HEADER: cand}, user=stable) == "r2"  # the header wins
    assert await served_by({SESSION_HEADER: stable}, user=cand) == "r1"
    # every one of them was counted for the split, on the revision that served it
    assert len(node.recorded) == 3 * len(want) + 2
    assert not any(r.failed for r in node.recorded)
    assert sum(r.revision == "r2" for r in node.recorded) == 3 * 4 + 1


async def test_candidate_held_elsewhere_is_forwarded_streaming_pinned(
        store: Store, keys: Keys, start_node: NodeFactory,
        canary_core: ServingCore) -> None:
    # the node that holds the candidate follows no split of its own (another key root): it
    # serves r2 only when the forwarded request pins it
    back = await start_node(Keys(keys.root + "-back"), "holder",
                            {"r1": Role.STABLE, "r2": Role.CANDIDATE})
    await put_split(store, keys, canary_split(100, endpoints=(back.url,)))
    front = await start_node(keys, "front", {"r1": Role.STABLE})
    body = {"model": CANARY_MODEL, "prompt": "Once upon a time", "max_tokens": 6,
            "temperature": 0}

    direct = await back.client.post(COMPLETIONS, json=body)
    assert direct.headers[REVISION_HEADER] == "r1"  # unpinned: its stable revision
    pinned = await back.client.post(COMPLETIONS, json=body, headers={PIN_HEADER: "r2"})
    assert pinned.headers[REVISION_HEADER] == "r2"
    want = (await pinned.json())["choices"][0]["text"]
    assert want != (await direct.json())["choices"][0]["text"]  # two different models

    # forwarded, JSON and SSE: served by r2 on the back node, the answer relayed as is
    resp = await front.client.post(COMPLETIONS, json=body)
    assert resp.status == 200 and resp.headers[REVISION_HEADER] == "r2"
    assert (await resp.json())["choices"][0]["text"] == want
    async with front.client.post(COMPLETIONS, json={**body, "stream": True}) as resp:
        assert resp.status == 200 and resp.headers[REVISION_HEADER] == "r2"
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(resp)
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == want
    # the serving node counts what it served (once: the forwarding node does not count it again)
    assert back.recorded == [Recorded("r1", False)] + [Recorded("r2", False)] * 3
    assert front.recorded == []

    def hung_up() -> float:  # forwarded requests carry no model label on the forwarding node
        return canary_core.registry.get_sample_value("mlxfleet_agent_requests_total", {
            "model": "unknown", "revision": "unknown", "endpoint": COMPLETIONS,
            "code": "499"}) or 0

    # streaming is preserved: events arrive while the back node is still generating
    before = hung_up()
    resp = await front.client.post(COMPLETIONS, json={**body, "max_tokens": LONG,
                                                      "stream": True})
    try:
        assert resp.status == 200
        for _ in range(3):
            await resp.content.readuntil(b"\n\n")
        assert canary_core.active_sequences(CANARY_MODEL, "r2") == 1
    finally:
        resp.close()  # the client hangs up: the forward is dropped, the back node stops
    await wait_for(lambda: canary_core.inflight_requests(CANARY_MODEL) == 0)
    await wait_for(lambda: hung_up() == before + 1)  # the forwarding handler has ended
    # a hang-up is not a failure of the candidate (and is not counted at all)
    assert front.recorded == []


async def test_a_forward_to_a_node_that_dropped_the_candidate_is_served_by_stable_here(
        store: Store, keys: Keys, start_node: NodeFactory) -> None:
    """A canary ends: its split goes before its candidate unloads, but a node may see the
    unload elsewhere before the split's removal. The node it forwards to answers 404 (it no
    longer holds the pinned revision); nothing has gone to the client yet, so the request is
    served here by the stable revision — never a 404 for a model this node serves."""
    back = await start_node(Keys(keys.root + "-back"), "dropped", {"r1": Role.STABLE})
    await put_split(store, keys, canary_split(100, endpoints=(back.url,)))
    front = await start_node(keys, "front", {"r1": Role.STABLE})
    for stream in (False, True):
        resp = await front.client.post(CHAT, json={"model": CANARY_MODEL, "messages": msgs(),
                                                   "max_tokens": 2, "stream": stream})
        assert resp.status == 200, await resp.text()
        assert resp.headers[REVISION_HEADER] == "r1"
        await resp.read()
    assert front.recorded == [Recorded("r1", False)] * 2  # the stable side served them
    assert back.recorded == []  # its 404 served nothing


async def test_unreachable_forward_target_is_a_503(store: Store, keys: Keys,
                                                   start_node: NodeFactory) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    await put_split(store, keys, canary_split(100, endpoints=(f"http://127.0.0.1:{port}",)))
    front = await start_node(keys, "front", {"r1": Role.STABLE})
    for stream in (False, True):
        resp = await front.client.post(CHAT, json={"model": CANARY_MODEL, "messages": msgs(),
                                                   "max_tokens": 2, "stream": stream})
        assert resp.status == 503
        err = await error_of(resp)
        assert (err["type"], err["code"]) == ("server_error", "unavailable")
        assert "r2" in err["message"]
    # the client saw a server error: a failure of the candidate
    assert front.recorded == [Recorded("r2", True)] * 2
