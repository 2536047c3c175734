"""Issue 20's API through the fleet router, with the official ``openai`` client: the real router
app in front of a real agent app (the generated random-weight model), the router's table from the
Ready report carrying the capabilities the agent computed (tests/router_fixtures.py). What the
client gets through the router equals what it gets from the agent directly: a tool loop, forced
calls valid against their schema, streamed tool-call deltas equal to the non-streamed call, and
JSON-schema outputs that validate, n choices with logprobs. (The same features against the agent alone, in depth:
tests/test_structured_outputs.py.)"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest
import pytest_asyncio

from mlx_fleet.memstore import MemoryStore
from node_agent.serving.capabilities import model_capabilities
from router_fixtures import publish, router_url  # noqa: F401
from serving_fixtures import MODEL_ID, REVISION, Agent, agent, tiny_model_path  # noqa: F401
from test_structured_outputs import (MAX, MSGS, PARAMS, SCHEMAS, TOOLS, check_calls,
                                     json_format, streamed)


@pytest_asyncio.fixture
async def clients(agent: Agent, memory_store: MemoryStore,  # noqa: F811
                  router_url) -> AsyncIterator[tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]]:  # noqa: F811
    """``(direct, routed)``: the official client against the agent and against the router."""
    follower, url = router_url
    endpoint = str(agent.client.make_url("")).rstrip("/")
    # what the agent reports for its loaded revision (convergence/load.py)
    caps = model_capabilities(agent.core.model_info(MODEL_ID),
                              max_choices=agent.core.max_choices)
    assert caps.tool_calling and caps.structured_outputs  # what the router routes by
    await publish(memory_store, endpoint, MODEL_ID, REVISION, caps)
    await follower.wait_until(lambda t: MODEL_ID in t.models and t.models[MODEL_ID].replicas)
    direct = openai.AsyncOpenAI(base_url=agent.base_url, api_key="x", max_retries=0)
    routed = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
    yield direct, routed
    await direct.close()
    await routed.close()


async def test_tool_loop_through_the_router(clients: Any) -> None:
    """call (forced, schema-valid) → the tool's result → an answer, each turn through the
    router, each equal to the agent's own answer (greedy)."""
    direct, routed = clients
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    kw: dict[str, Any] = {"model": MODEL_ID, "tools": TOOLS, "temperature": 0}
    first = await routed.chat.completions.create(messages=messages, tool_choice="required",
                                                 max_tokens=MAX, **kw)
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, set(PARAMS))
    alone = await direct.chat.completions.create(messages=messages, tool_choice="required",
                                                 max_tokens=MAX, **kw)
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in alone.choices[0].message.tool_calls]
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in choice.message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"temperature": 12})})
    answer = await routed.chat.completions.create(messages=messages, max_tokens=12, **kw)
    assert answer.choices[0].message.tool_calls is None
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_time"}}])
async def test_streamed_tool_call_deltas_through_the_router(clients: Any, choice: Any) -> None:
    _, routed = clients
    kw = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
          "tool_choice": choice, "temperature": 0, "max_tokens": MAX}
    whole = await routed.chat.completions.create(model=MODEL_ID, **kw)
    content, calls, reason = await streamed(routed, **kw)
    assert reason == whole.choices[0].finish_reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])


@pytest.mark.parametrize("name", ["nested", "enum", "array-bounds", "anyOf", "refs"])
async def test_json_schema_outputs_through_the_router(clients: Any, name: str) -> None:
    direct, routed = clients
    kw = {"model": MODEL_ID, "messages": MSGS, "temperature": 0, "max_tokens": MAX,
          "response_format": json_format(SCHEMAS[name])}
    r = await routed.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])
    assert r.choices[0].message.content == (
        await direct.chat.completions.create(**kw)).choices[0].message.content


async def test_logprobs_and_n_through_the_router(clients: Any) -> None:
    """n = 4 greedy choices with top_logprobs through the router: four indexed choices, usage
    counting all of them, each token the top of its own list, equal to the agent's answer."""
    direct, routed = clients
    kw = {"model": MODEL_ID, "messages": MSGS, "temperature": 0, "max_tokens": 6, "n": 4,
          "logprobs": True, "top_logprobs": 3}
    r = await routed.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    for c in r.choices:
        for t in c.logprobs.content:
            assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob
    alone = await direct.chat.completions.create(**kw)
    assert [c.message.content for c in r.choices] == [c.message.content for c in alone.choices]
    # streamed through the router: the same tokens and logprobs per choice
    stream = await routed.chat.completions.create(stream=True, **kw)
    tokens: dict[int, list[tuple[str, float]]] = {}
    async for chunk in stream:
        for c in chunk.choices:
            for t in (c.logprobs.content if c.logprobs and c.logprobs.content else ()):
                tokens.setdefault(c.index, []).append((t.token, t.logprob))
    assert tokens == {c.index: [(t.token, t.logprob) for t in c.logprobs.content]
                      for c in r.choices}
