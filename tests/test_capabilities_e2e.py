"""Capabilities end to end with the official ``openai`` client: a real agent (ServingCore over
the generated model, its real app) behind the real router app, the router's table followed from
a MemoryStore holding the agent's report with the capabilities the agent computes for its loaded
revision. A request the model can't serve gets the same 400 from the router (which tries no
Mac) as from the agent directly; a Mac whose capabilities are unknown is tried and its agent
gives that 400 itself; a plain request passes."""

from __future__ import annotations

import openai
import pytest

from mlx_fleet.memstore import MemoryStore
from node_agent.serving import capabilities as caps_mod
from node_agent.serving.capabilities import model_capabilities
from router_fixtures import publish, router_url  # noqa: F401
from serving_fixtures import MODEL_ID, REVISION, Agent, agent, tiny_model_path  # noqa: F401

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


async def _error(client: openai.AsyncOpenAI, *, legacy: bool = False, **extra) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        if legacy:
            await client.completions.create(model=MODEL_ID, prompt="x", max_tokens=2,
                                            **extra)
        else:
            await client.chat.completions.create(model=MODEL_ID,  # type: ignore
                                                 messages=MESSAGES, max_tokens=2, **extra)
    assert e.value.status_code == 400
    body = e.value.body
    assert isinstance(body, dict)
    return body


@pytest.mark.parametrize("known", [True, False], ids=["reported", "unknown"])
async def test_the_router_and_the_agent_refuse_alike(agent: Agent,  # noqa: F811
                                                     memory_store: MemoryStore,
                                                     router_url,  # noqa: F811
                                                     known: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    follower, url = router_url
    endpoint = str(agent.client.make_url("")).rstrip("/")
    # logprobs and n > 1 are served: this agent is made one that serves
    # no logprobs and at most 2 choices, to see both refuse them alike
    monkeypatch.setattr(caps_mod, "LOGPROBS_SERVED", False)
    monkeypatch.setattr(agent.core, "max_choices", 2)
    # and one without constrained decoding: tool calls (auto) but no enforced tool choice
    monkeypatch.setattr(caps_mod, "STRUCTURED_OUTPUTS_SERVED", False)
    caps = (model_capabilities(agent.core.model_info(MODEL_ID),
                               max_choices=agent.core.max_choices) if known else None)
    await publish(memory_store, endpoint, MODEL_ID, REVISION, caps)
    await follower.wait_until(lambda t: MODEL_ID in t.models and t.models[MODEL_ID].replicas
                              and t.models[MODEL_ID].replicas[0].capabilities == caps)
    def refused_by_agent() -> float:
        return agent.registry.get_sample_value("mlxfleet_agent_requests_total", {
            "model": MODEL_ID, "revision": REVISION, "endpoint": "/v1/chat/completions",
            "code": "400"}) or 0.0

    before = refused_by_agent()
    direct = openai.AsyncOpenAI(base_url=agent.base_url, api_key="x", max_retries=0)
    routed = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
    try:
        cases = (({"logprobs": True, "top_logprobs": 2}, "logprobs"), ({"n": 3}, "n"),
                 ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
                 ({"tools": TOOLS, "tool_choice": {"type": "function",
                                                   "function": {"name": "get_weather"}}},
                  "tool_choice"))
        for extra, param in cases:
            by_agent = await _error(direct, **extra)
            by_router = await _error(routed, **extra)
            assert by_router == by_agent
            assert by_agent["param"] == param
            assert by_agent["code"] in ("unsupported_parameter", "unsupported_value")
        # reported: the router answered itself (the agent saw only the direct requests);
        # unknown: the router tried the Mac and relayed its agent's answer
        assert refused_by_agent() - before == len(cases) * (1 if known else 2)
        # refused whatever the model (OpenAI's bounds, the legacy endpoint's fields): the
        # router answers them itself, in the agent's words
        for legacy, extra, param, code in (
                (False, {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
                 "invalid_value"),
                (True, {"logprobs": 6}, "logprobs", "invalid_value"),
                (True, {"extra_body": {"tools": TOOLS}}, "tools", "unsupported_parameter"),
                (True, {"extra_body": {"tool_choice": "required"}}, "tool_choice",
                 "unsupported_parameter"),
                (True, {"extra_body": {"response_format": {"type": "json_object"}}},
                 "response_format", "unsupported_parameter")):
            by_agent = await _error(direct, legacy=legacy, **extra)
            by_router = await _error(routed, legacy=legacy, **extra)
            assert by_router == by_agent
            assert (by_agent["param"], by_agent["code"]) == (param, code)
        # what the model serves passes through the router, the off spellings included
        done = await routed.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=2, n=1,  # type: ignore
            logprobs=False, response_format={"type": "text"})
        assert done.choices[0].message.content is not None
        called = await routed.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=2, tools=TOOLS,  # type: ignore
            tool_choice="auto")
        assert called.choices[0].finish_reason in ("stop", "length", "tool_calls")
    finally:
        await direct.close()
        await routed.close()
