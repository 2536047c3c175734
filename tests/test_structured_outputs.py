"""Structured outputs and tool calls (issue 20) through the official ``openai`` client against
a real agent app over a real ServingCore with the generated random-weight test model: it emits
valid JSON, and schema-valid tool calls, only because constrained decoding allows nothing else.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
import pytest_asyncio
from prometheus_client import generate_latest

from mlx_fleet.testmodel import make_test_model
from node_agent.serving import InvalidConstraint
from node_agent.serving.grammar import json_object_grammar, json_schema_grammar
from serving_fixtures import (MODEL_ID, REVISION, Agent, agent,  # noqa: F401
                              tiny_model_path)

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Give me JSON."}]
MAX = 300   # enough for every schema below to finish ("stop") on the test model

#: Schemas covering what OpenAI's structured outputs use: nested objects, enums, arrays with
#: bounds, anyOf, required, numbers with bounds, string patterns, $defs/$ref, const.
SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "address": {"type": "object", "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"], "additionalProperties": False}},
            "required": ["id", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"], "additionalProperties": False},
    "array-bounds": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                 "minItems": 2, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False},
    "anyOf": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
                            {"type": "boolean"}, {"type": "null"}]}},
        "required": ["value"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}},
        "required": ["x", "n"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"], "additionalProperties": False},
    "refs": {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"},
                       "kind": {"const": "segment"}},
        "required": ["a", "b", "kind"], "additionalProperties": False},
    "top-level-array": {"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                        "maxItems": 3},
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest_asyncio.fixture(scope="module")
async def client(agent: Agent) -> AsyncIterator[openai.AsyncOpenAI]:  # noqa: F811
    c = openai.AsyncOpenAI(base_url=agent.base_url, api_key="x", max_retries=0)
    yield c
    await c.close()


def json_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}


async def streamed(client: openai.AsyncOpenAI, **kw: Any) -> tuple[str, list[dict], str]:
    """A streamed chat answer reassembled: content, tool calls (by index), finish reason."""
    stream = await client.chat.completions.create(model=MODEL_ID, stream=True, **kw)
    content, calls, reason = "", {}, None
    async for chunk in stream:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += tc.id or ""
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


# -- structured outputs ------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SCHEMAS))
async def test_json_schema_outputs_validate(client: openai.AsyncOpenAI, name: str) -> None:
    schema = SCHEMAS[name]
    r = await client.chat.completions.create(model=MODEL_ID, messages=MSGS, temperature=0,
                                             max_tokens=MAX, response_format=json_format(schema))
    (choice,) = r.choices
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)
    # streamed: the same answer (greedy, same prompt), also valid
    content, calls, reason = await streamed(client, messages=MSGS, temperature=0,
                                            max_tokens=MAX, response_format=json_format(schema))
    assert (content, calls, reason) == (choice.message.content, [], "stop")


class Step(pydantic.BaseModel):
    n: int = pydantic.Field(ge=0, le=9)
    kind: Literal["add", "sub"]


class Plan(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=12)
    steps: list[Step] = pydantic.Field(min_length=1, max_length=3)


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    unit: Literal["celsius", "fahrenheit"]


async def test_openai_parse_helpers(client: openai.AsyncOpenAI) -> None:
    """The client's own structured-output helpers: ``chat.completions.parse`` with a pydantic
    model (strict JSON schema with ``$defs``) and ``pydantic_function_tool`` (a strict tool):
    the answers parse into the models."""
    r = await client.chat.completions.parse(model=MODEL_ID, messages=MSGS, response_format=Plan,
                                            temperature=0, max_tokens=MAX)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Plan)
    r = await client.chat.completions.parse(
        model=MODEL_ID, messages=MSGS, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", temperature=0, max_tokens=MAX)
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


async def test_sampled_json_schema_outputs_validate(client: openai.AsyncOpenAI) -> None:
    """Sampling (temperature 1, several seeds) explores other paths: every one valid."""
    schema = SCHEMAS["nested"]
    for seed in range(4):
        r = await client.chat.completions.create(model=MODEL_ID, messages=MSGS, seed=seed,
                                                 temperature=1.0, max_tokens=MAX,
                                                 response_format=json_format(schema))
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


async def test_unconstrained_output_is_not_json(client: openai.AsyncOpenAI) -> None:
    """The control: without a response format the test model's output is not JSON at all, so
    the outputs above are the constraint's doing."""
    r = await client.chat.completions.create(model=MODEL_ID, messages=MSGS, temperature=0,
                                             max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


async def test_json_object(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(model=MODEL_ID, messages=MSGS, temperature=0,
                                             max_tokens=MAX,
                                             response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


async def test_max_tokens_cuts_json_with_finish_reason_length(
        client: openai.AsyncOpenAI) -> None:
    """As with OpenAI: an answer cut by max_tokens says ``length`` and may not parse."""
    schema = SCHEMAS["refs"]
    full = await client.chat.completions.create(model=MODEL_ID, messages=MSGS, temperature=0,
                                                max_tokens=MAX,
                                                response_format=json_format(schema))
    cut = await client.chat.completions.create(model=MODEL_ID, messages=MSGS, temperature=0,
                                               max_tokens=3,
                                               response_format=json_format(schema))
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    assert full.choices[0].message.content.startswith(cut.choices[0].message.content)
    with pytest.raises(ValueError):
        json.loads(cut.choices[0].message.content)


@pytest.mark.parametrize(("schema", "fragment"), [
    ({"type": "object", "if": {"required": ["a"]}, "then": {}}, "if"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)x"}}},
     "look-around"),
])
async def test_unsupported_schema_feature_is_a_400_naming_it(agent: Agent, schema: dict,  # noqa: F811
                                                             fragment: str) -> None:
    resp = await agent.client.post(CHAT, json={"model": MODEL_ID, "messages": MSGS,
                                               "response_format": json_format(schema)})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_schema"
    assert err["param"] == "response_format.json_schema.schema"
    assert fragment in err["message"]


def test_unknown_keywords_are_ignored_unimplemented_ones_refused(
        tiny_model_path: Path) -> None:  # noqa: F811
    """What node_agent/serving/grammar.py and docs/node-agent.md say: a keyword llguidance does
    not know (a typo'd ``maxlength``) is ignored, as JSON Schema allows, even with ``strict``;
    one it knows but does not implement is refused naming it."""
    from mlx_lm.utils import load_tokenizer

    from node_agent.serving.constrain import compile_grammar

    tokenizer = load_tokenizer(tiny_model_path)
    typo = {"type": "object", "properties": {"a": {"type": "string", "maxlength": 3}},
            "required": ["a"], "additionalProperties": False}
    assert compile_grammar(tokenizer, json_schema_grammar(typo), "p").error() is None
    with pytest.raises(InvalidConstraint, match="dependentSchemas"):
        compile_grammar(tokenizer, json_schema_grammar(
            {"type": "object", "dependentSchemas": {"a": {}}}), "p")


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b",
                                                                 "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "a b"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "not": {"type": "object"}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
async def test_bad_tools_and_formats_are_400_naming_the_field(agent: Agent, body: dict,  # noqa: F811
                                                              param: str) -> None:
    resp = await agent.client.post(CHAT, json={"model": MODEL_ID, "messages": MSGS,
                                               "max_tokens": 4, **body})
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert (await agent.client.get("/health")).status == 200


async def test_legacy_completions_still_refuse_response_format(agent: Agent) -> None:  # noqa: F811
    """OpenAI's legacy completions have no response_format or tools: refused, not ignored."""
    for field, value in (("response_format", {"type": "json_object"}),
                         ("tools", [WEATHER])):
        resp = await agent.client.post("/v1/completions", json={
            "model": MODEL_ID, "prompt": "x", "max_tokens": 2, field: value})
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert err["param"] == field and err["code"] == "unsupported_parameter"


# -- tool calls --------------------------------------------------------------------------------

def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


async def test_required_tool_choice_gives_schema_valid_calls(
        client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=TOOLS, tool_choice="required", temperature=0, max_tokens=MAX)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == len(ids)


async def test_single_call_without_parallel_tool_calls(client: openai.AsyncOpenAI) -> None:
    for seed in range(3):
        r = await client.chat.completions.create(
            model=MODEL_ID, messages=MSGS, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=MAX)
        assert r.choices[0].finish_reason == "tool_calls"
        assert len(r.choices[0].message.tool_calls) == 1
        check_calls(r.choices[0].message.tool_calls, set(PARAMS))


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
async def test_named_tool_choice_calls_that_function(client: openai.AsyncOpenAI,
                                                     name: str) -> None:
    r = await client.chat.completions.create(
        model=MODEL_ID, messages=MSGS, tools=TOOLS, temperature=0, max_tokens=MAX,
        tool_choice={"type": "function", "function": {"name": name}})
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    check_calls([call], {name})


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_time"}}])
async def test_streamed_tool_calls_equal_the_non_streamed(client: openai.AsyncOpenAI,
                                                          choice: Any) -> None:
    kw = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
          "tool_choice": choice, "temperature": 0, "max_tokens": MAX}
    whole = await client.chat.completions.create(model=MODEL_ID, **kw)
    content, calls, reason = await streamed(client, **kw)
    assert reason == whole.choices[0].finish_reason == "tool_calls"
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls)


async def test_tool_loop(client: openai.AsyncOpenAI) -> None:
    """call → the tool's result in a ``tool`` message → an answer: the history (assistant
    tool_calls, tool result) is rendered by the model's chat template."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    first = await client.chat.completions.create(model=MODEL_ID, messages=messages,
                                                 tools=TOOLS, tool_choice="required",
                                                 temperature=0, max_tokens=MAX)
    calls = first.choices[0].message.tool_calls
    check_calls(calls, set(PARAMS))
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"temperature": 12})})
    answer = await client.chat.completions.create(model=MODEL_ID, messages=messages,
                                                  tools=TOOLS, temperature=0, max_tokens=12)
    (choice,) = answer.choices
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.message.content
    # the call and its result are in the prompt: more prompt tokens than the first turn had
    # plus the call's own tokens
    assert answer.usage.prompt_tokens > (first.usage.prompt_tokens
                                         + first.usage.completion_tokens)


async def test_tool_choice_none_renders_no_tools(client: openai.AsyncOpenAI) -> None:
    plain = await client.chat.completions.create(model=MODEL_ID, messages=MSGS,
                                                 temperature=0, max_tokens=4)
    none = await client.chat.completions.create(model=MODEL_ID, messages=MSGS, tools=TOOLS,
                                                tool_choice="none", temperature=0,
                                                max_tokens=4)
    auto = await client.chat.completions.create(model=MODEL_ID, messages=MSGS, tools=TOOLS,
                                                temperature=0, max_tokens=4)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens   # the tools are rendered


@pytest.fixture(scope="module")
def toolless_model_path(tiny_model_path: Path,  # noqa: F811
                        tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test model with a chat template mlx-lm infers no tool parser from."""
    dest = tmp_path_factory.mktemp("models") / "toolless"
    shutil.copytree(tiny_model_path, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                               "{% endfor %}assistant:")
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


async def test_tools_on_a_model_without_a_tool_parser_are_a_400(
        agent: Agent, toolless_model_path: Path) -> None:  # noqa: F811
    await agent.core.load_model("toolless", toolless_model_path, revision=REVISION,
                                max_concurrent_sequences=2, max_context_tokens=2048)
    try:
        assert agent.core.tool_format("toolless", REVISION) is None
        assert agent.core.tool_format(MODEL_ID, REVISION).parser == "json_tools"
        for choice in ("auto", "required"):
            resp = await agent.client.post(CHAT, json={
                "model": "toolless", "messages": MSGS, "tools": [WEATHER],
                "tool_choice": choice, "max_tokens": 2})
            assert resp.status == 400
            err = (await resp.json())["error"]
            assert err["param"] == "tools" and err["code"] == "unsupported_parameter"
        # tool_choice none asks for no call: served
        resp = await agent.client.post(CHAT, json={
            "model": "toolless", "messages": MSGS, "tools": [WEATHER], "tool_choice": "none",
            "max_tokens": 2})
        assert resp.status == 200
    finally:
        await agent.core.unload_model("toolless", revision=REVISION)


# -- the serving core: per-sequence constraint, coalescing -------------------------------------

async def collect(gen: Any) -> str:
    async with gen:
        return "".join([c.text async for c in gen])


async def test_constraint_applies_to_its_sequence_only(agent: Agent) -> None:  # noqa: F811
    """An unconstrained greedy request batched with constrained ones generates what it does
    alone: the mask is applied to the constrained rows only."""
    core = agent.core
    kw = {"messages": MSGS, "max_tokens": 24, "temperature": 0.0}
    alone = await collect(await core.generate(MODEL_ID, **kw))
    schema = SCHEMAS["nested"]
    gens = await asyncio.gather(
        core.generate(MODEL_ID, grammar=json_schema_grammar(schema), **{**kw, "max_tokens": MAX}),
        core.generate(MODEL_ID, **kw),
        core.generate(MODEL_ID, grammar=json_object_grammar(), **{**kw, "max_tokens": MAX}))
    constrained, plain, obj = await asyncio.gather(*(collect(g) for g in gens))
    assert plain == alone
    jsonschema.validate(json.loads(constrained), schema)
    assert isinstance(json.loads(obj), dict)


def coalesced(agent: Agent) -> float:  # noqa: F811
    for line in generate_latest(agent.registry).decode().splitlines():
        if line.startswith("mlxfleet_agent_coalesced_requests_total{") and MODEL_ID in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_coalescing_never_merges_constrained_with_unconstrained(
        agent: Agent) -> None:  # noqa: F811
    core = agent.core
    grammar = json_schema_grammar(SCHEMAS["flat"])
    kw = {"messages": [{"role": "user", "content": "coalesce me"}], "max_tokens": MAX,
          "temperature": 0.0}
    before = coalesced(agent)
    gens = await asyncio.gather(core.generate(MODEL_ID, grammar=grammar, **kw),
                                core.generate(MODEL_ID, **kw))
    constrained, plain = await asyncio.gather(*(collect(g) for g in gens))
    assert coalesced(agent) == before
    jsonschema.validate(json.loads(constrained), SCHEMAS["flat"])
    assert constrained != plain
    # two identical constrained requests do share one generation
    gens = await asyncio.gather(core.generate(MODEL_ID, grammar=grammar, **kw),
                                core.generate(MODEL_ID, grammar=grammar, **kw))
    a, b = await asyncio.gather(*(collect(g) for g in gens))
    assert coalesced(agent) == before + 1 and a == b == constrained
    # and the same grammar with other tools in the template does not
    tools = [WEATHER]
    gens = await asyncio.gather(core.generate(MODEL_ID, grammar=grammar, tools=tools, **kw),
                                core.generate(MODEL_ID, grammar=grammar, **kw))
    await asyncio.gather(*(collect(g) for g in gens))
    assert coalesced(agent) == before + 1


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["alone", "coalescable"])
async def test_core_refuses_an_uncompilable_grammar(agent: Agent,  # noqa: F811
                                                    temperature: float) -> None:
    """Refused before it reaches the MLX thread, whether it leads a shareable generation
    (greedy: identical requests would join it) or not; nothing stays in flight."""
    grammar = json_schema_grammar({"type": "object", "if": {}})
    calls = [agent.core.generate(MODEL_ID, messages=MSGS, max_tokens=4, grammar=grammar,
                                 temperature=temperature,
                                 grammar_param="response_format.json_schema.schema")
             for _ in range(2)]
    for result in await asyncio.gather(*calls, return_exceptions=True):
        assert isinstance(result, InvalidConstraint)
        assert result.param == "response_format.json_schema.schema"
    assert agent.core.inflight_requests() == 0


class RecordingRouter:
    """A traffic manager stand-in routing every request to ``revision`` here, as under a
    canary split, and keeping what it is told to :meth:`record` (the per-revision statistics
    the canary analysis and the local guard read): ``(revision, failed)``."""

    def __init__(self, revision: str) -> None:
        self.revision = revision
        self.recorded: list[tuple[str, bool]] = []

    def route(self, model: str, **_: Any) -> Any:
        from types import SimpleNamespace as NS
        return NS(route=NS(forward=False, revision=self.revision, canary=True),
                  standby=False, deployment=("ns", "dep"))

    def touch(self, model: str, revision: str) -> None:
        pass

    def record(self, routed: Any, **kw: Any) -> None:
        self.recorded.append((routed.route.revision, kw["failed"]))


async def test_a_matcher_error_is_the_requests_fault(agent: Agent,  # noqa: F811
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar the matcher can no longer follow (here: put in its error state by a token it
    refuses, as a parser limit would) ends the request — a 400 ``invalid_schema`` naming the
    grammar's field (an error event once a stream's 200 is out), never output that may not
    match the schema — and is not counted as a failure of the revision (a 503 was, and could
    roll a canary back for a client's grammar); the batch goes on."""
    from aiohttp.test_utils import TestClient, TestServer

    from node_agent.openai_api import build_app
    from node_agent.serving import constrain, core as core_module

    def broken(tokenizer: Any, grammar: str, param: str) -> Any:
        c = constrain.compile_grammar(tokenizer, grammar, param)
        c.matcher.consume_token(tokenizer.encode("}", add_special_tokens=False)[0])
        assert c.error() is not None
        return c

    router = RecordingRouter(agent.core.model_info(MODEL_ID).revision)
    client = TestClient(TestServer(build_app(agent.core, health=lambda: (True, {}),
                                             registry=agent.registry, router=lambda: router),
                                   host="127.0.0.1"))
    await client.start_server()
    try:
        monkeypatch.setattr(core_module, "compile_grammar", broken)
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        for response_format, param in (
                ({"type": "json_object"}, "response_format"),
                ({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                 "response_format.json_schema.schema")):
            resp = await client.post(CHAT, json={"model": MODEL_ID, "messages": MSGS,
                                                 "max_tokens": 8,
                                                 "response_format": response_format})
            assert resp.status == 400
            err = (await resp.json())["error"]
            assert (err["type"], err["code"], err["param"]) == (
                "invalid_request_error", "invalid_schema", param), err
            assert "constrained decoding could not follow the grammar" in err["message"]
        stream = await client.post(CHAT, json={"model": MODEL_ID, "messages": MSGS,
                                               "max_tokens": 8, "stream": True,
                                               "response_format": {"type": "json_object"}})
        assert stream.status == 200
        events = (await stream.read()).decode().split("\n\n")
        last = json.loads(events[-2].removeprefix("data: "))["error"]
        assert (last["type"], last["code"], last["param"]) == (
            "invalid_request_error", "invalid_schema", "response_format")
        assert "data: [DONE]" not in events
        # the revision's statistics did not move
        assert router.recorded == []
        monkeypatch.undo()
        ok = await client.post(CHAT, json={"model": MODEL_ID, "messages": MSGS,
                                           "max_tokens": MAX, "temperature": 0,
                                           "response_format": {"type": "json_object"}})
        assert ok.status == 200
        (choice,) = (await ok.json())["choices"]
        # a request served is recorded (as not failed): the statistics are there to move
        assert router.recorded == [(router.revision, False)]
    finally:
        await client.close()
    # greedy: the answer finishes within MAX (sampled, a random model may run a string on
    # until max_tokens cuts it: finish_reason "length")
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)
