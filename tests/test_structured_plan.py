"""The pure parts of structured outputs and tool calls (issue 20), without a model: the request
models' new fields (property tests of their bounds and errors), the output plan
(:mod:`node_agent.api.structured`), the grammars (:mod:`node_agent.serving.grammar`, compiled
with llguidance against a byte-level tokenizer) and the tool-call reader
(:mod:`node_agent.api.tool_calls`, with mlx-lm's own ``json_tools`` parser)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mlx_lm.tool_parsers import json_tools
from node_agent.api.structured import SCHEMA_PARAM, PlanError, plan_output, template_messages
from node_agent.api.tool_calls import ToolCallReader, finish_reason, openai_calls
from node_agent.api_models import (FUNCTION_NAME_PATTERN, MAX_TOOLS, ChatCompletionRequest,
                                   CompletionRequest)
from node_agent.serving.constrain import public_grammar_error
from node_agent.serving.grammar import (MAX_PARALLEL_CALLS, json_object_grammar,
                                        json_schema_grammar, tool_call_grammar)
from node_agent.serving.types import ToolFormat

JSON_TOOLS = ToolFormat(parser="json_tools", start=json_tools.tool_call_start,
                        end=json_tools.tool_call_end, parse=json_tools.parse_tool_call)
OTHER = ToolFormat(parser="pythonic", start="[", end="]", parse=lambda text, tools: {})
MSGS = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS, **fields})


# -- request models: every new field's bounds and errors ---------------------------------------

names = st.from_regex(FUNCTION_NAME_PATTERN, fullmatch=True)


@settings(max_examples=80, deadline=None)
@given(name=st.text(max_size=70))
def test_function_names_follow_openais_pattern(name: str) -> None:
    ok = re.fullmatch(FUNCTION_NAME_PATTERN, name) is not None
    body = {"tools": [{"type": "function", "function": {"name": name}}]}
    if ok:
        assert chat(**body).tools[0].function.name == name
    else:
        with pytest.raises(ValidationError) as e:
            chat(**body)
        assert e.value.errors()[0]["loc"][:4] == ("tools", 0, "function", "name")


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, MAX_TOOLS + 5))
def test_tools_are_bounded(n: int) -> None:
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]
    if n <= MAX_TOOLS:
        assert len(chat(tools=tools).tools or []) == n
    else:
        with pytest.raises(ValidationError) as e:
            chat(tools=tools)
        assert e.value.errors()[0]["loc"][0] == "tools"


@settings(max_examples=60, deadline=None)
@given(choice=st.one_of(st.text(max_size=10), st.integers(), st.none(),
                        st.sampled_from(["none", "auto", "required"]),
                        st.fixed_dictionaries({"type": st.sampled_from(["function", "tool"]),
                                               "function": st.fixed_dictionaries(
                                                   {"name": names | st.text(max_size=3)})})))
def test_tool_choice_values(choice: Any) -> None:
    valid = choice is None or choice in ("none", "auto", "required") or (
        isinstance(choice, dict) and choice["type"] == "function"
        and re.fullmatch(FUNCTION_NAME_PATTERN, choice["function"]["name"]) is not None)
    if valid:
        chat(tool_choice=choice)
    else:
        with pytest.raises(ValidationError) as e:
            chat(tool_choice=choice)
        assert e.value.errors()[0]["loc"][0] == "tool_choice"


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["text", "json_object", "json_schema", "xml", ""]),
       schema=st.one_of(st.none(), st.just({"type": "object"}), st.integers(), st.text()),
       name=st.one_of(names, st.text(max_size=3)),
       strict=st.one_of(st.none(), st.booleans(), st.just("yes")))
def test_response_format_values(kind: str, schema: Any, name: str, strict: Any) -> None:
    rf: dict[str, Any] = {"type": kind}
    if schema is not None:
        rf["json_schema"] = {"name": name, "schema": schema, "strict": strict}
    valid = kind in ("text", "json_object", "json_schema") and (
        schema is None and kind != "json_schema"
        or isinstance(schema, dict) and re.fullmatch(FUNCTION_NAME_PATTERN, name) is not None
        and not isinstance(strict, str))
    if valid:
        got = chat(response_format=rf).response_format
        assert got is not None and got.type == kind
    else:
        with pytest.raises(ValidationError) as e:
            chat(response_format=rf)
        assert e.value.errors()[0]["loc"][0] == "response_format"


def test_parallel_tool_calls_is_a_strict_boolean() -> None:
    assert chat().parallel_tool_calls is True
    assert chat(parallel_tool_calls=False).parallel_tool_calls is False
    for bad in ("false", 0, None):
        with pytest.raises(ValidationError):
            chat(parallel_tool_calls=bad)


def test_history_tool_calls_and_tool_messages() -> None:
    req = chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12C"}])
    assert template_messages(req.messages) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "content": "12C", "tool_call_id": "call_1"}]


def test_legacy_completions_keep_the_untyped_off_switches() -> None:
    """OpenAI's legacy completions have no tools or response_format: they stay "off only"
    (refused by api.parse.unsupported), whatever their shape."""
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x",
                                            "response_format": {"type": "json_object"}})
    assert req.response_format == {"type": "json_object"}


# -- the plan ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "fmt", "param"), [
    ({"tool_choice": "auto"}, JSON_TOOLS, "tool_choice"),
    ({"tool_choice": "required"}, JSON_TOOLS, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, JSON_TOOLS, "tools"),
    ({"tools": [WEATHER]}, None, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required"}, None, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     JSON_TOOLS, "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "required"}, OTHER, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, JSON_TOOLS,
     "response_format"),
])
def test_plan_refusals_name_the_field(fields: dict, fmt: ToolFormat | None, param: str) -> None:
    with pytest.raises(PlanError) as e:
        plan_output(chat(**fields), fmt)
    assert e.value.param == param and str(e.value).startswith(param + ": ")


def test_plans() -> None:
    assert plan_output(chat(), None).grammar is None
    assert plan_output(chat(response_format={"type": "text"}), None).grammar is None
    # tool_choice none: tools neither rendered nor parsed; a response format still applies
    none = plan_output(chat(tools=[WEATHER], tool_choice="none",
                            response_format={"type": "json_object"}), None)
    assert none.tools is None and none.tool_format is None
    assert none.grammar == json_object_grammar() and none.grammar_param == "response_format"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    js = plan_output(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}}), JSON_TOOLS)
    assert js.grammar == json_schema_grammar(schema) and js.grammar_param == SCHEMA_PARAM
    auto = plan_output(chat(tools=[WEATHER]), JSON_TOOLS)
    assert auto.grammar is None and auto.tool_format is JSON_TOOLS
    assert auto.tools == [WEATHER]
    req = plan_output(chat(tools=[WEATHER, NOARGS], tool_choice="required"), JSON_TOOLS)
    assert req.grammar == tool_call_grammar([WEATHER, NOARGS], "json_tools", parallel=True)
    assert req.grammar_param == "tools"
    one = plan_output(chat(tools=[WEATHER, NOARGS], tool_choice="required",
                           parallel_tool_calls=False), JSON_TOOLS)
    assert one.grammar == tool_call_grammar([WEATHER, NOARGS], "json_tools")
    named = plan_output(chat(tools=[WEATHER, NOARGS],
                             tool_choice={"type": "function", "function": {"name": "ping"}}),
                        JSON_TOOLS)
    assert named.grammar == tool_call_grammar([WEATHER, NOARGS], "json_tools", name="ping")


# -- grammars, compiled ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ll_tokenizer() -> Any:
    """A byte-level llguidance tokenizer (every byte a token): what matches is exactly what
    the grammar allows, whatever a model's vocabulary."""
    import llguidance
    from llguidance import LLTokenizer

    del llguidance
    vocab = {chr(0x100 + b) if b < 0x21 or 0x7e < b < 0xa1 or b == 0xad else chr(b): b
             for b in range(256)}
    vocab["<eos>"] = 256
    tok = {"version": "1.0", "model": {"type": "BPE", "vocab": vocab, "merges": []},
           "added_tokens": [{"id": 256, "content": "<eos>", "special": True, "single_word":
                             False, "lstrip": False, "rstrip": False, "normalized": False}],
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                             "trim_offsets": False, "use_regex": False},
           "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                       "use_regex": False}}
    return LLTokenizer(json.dumps(tok), eos_token=256)


def accepts(tok: Any, grammar: str, text: str) -> bool:
    from llguidance import LLMatcher

    m = LLMatcher(tok, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    ok = m.consume_tokens(list(text.encode()))
    return ok and m.is_accepting()


def test_tool_call_grammar_is_the_envelope_and_the_schema(ll_tokenizer: Any) -> None:
    g = tool_call_grammar([WEATHER, NOARGS], "json_tools", parallel=True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call>'
    ping = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    assert accepts(ll_tokenizer, g, call)
    assert accepts(ll_tokenizer, g, call + "\n" + ping)
    assert accepts(ll_tokenizer, g, "\n".join([ping] * MAX_PARALLEL_CALLS))
    assert not accepts(ll_tokenizer, g, "\n".join([ping] * (MAX_PARALLEL_CALLS + 1)))
    assert not accepts(ll_tokenizer, g, call.replace('"Oslo"', "3"))         # schema
    assert not accepts(ll_tokenizer, g, call.replace("get_weather", "rm"))    # unknown name
    assert not accepts(ll_tokenizer, g, "sure! " + call)                      # no free text
    single = tool_call_grammar([WEATHER, NOARGS], "json_tools")
    assert accepts(ll_tokenizer, single, ping)
    assert not accepts(ll_tokenizer, single, ping + "\n" + ping)
    named = tool_call_grammar([WEATHER, NOARGS], "json_tools", name="get_weather")
    assert accepts(ll_tokenizer, named, call) and not accepts(ll_tokenizer, named, ping)
    with pytest.raises(KeyError):
        tool_call_grammar([WEATHER], "json_tools", name="nope")
    # the grammar's text is exactly what mlx-lm's parser reads back
    (parsed,) = openai_calls(JSON_TOOLS, call[len("<tool_call>"):-len("</tool_call>")], None)
    assert parsed["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_json_grammars_are_compact(ll_tokenizer: Any) -> None:
    assert accepts(ll_tokenizer, json_object_grammar(), '{"a":[1,2]}')
    assert not accepts(ll_tokenizer, json_object_grammar(), '{"a": [1, 2]}')   # whitespace
    assert not accepts(ll_tokenizer, json_object_grammar(), "[1]")            # not an object


@pytest.mark.parametrize(("schema", "fragment"), [
    ({"type": "object", "if": {"type": "object"}}, 'Unimplemented keys: ["if"]'),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
])
def test_unsupported_schema_features_are_reported(ll_tokenizer: Any, schema: dict,
                                                  fragment: str) -> None:
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(json_schema_grammar(schema), ll_tokenizer)
    assert error
    public = public_grammar_error(error)
    assert fragment in public and "x-guidance" not in public and "\n" not in public


# -- the tool-call reader ----------------------------------------------------------------------

ANSWER = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call> done <tool')


def ids() -> Any:
    n = iter(range(100))
    return lambda: f"call_{next(n)}"


def read(pieces: list[str]) -> tuple[str, list[dict], list[int]]:
    reader = ToolCallReader(JSON_TOOLS, None, ids())
    out = [p for piece in pieces for p in reader.feed(piece)] + reader.finish()
    content = "".join(v for k, v in out if k == "content")
    firsts = [v[0] for k, v in out if k == "call"]
    assert [c for k, v in out if k == "call" for c in v[1]] == reader.calls
    return content, reader.calls, firsts


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, len(ANSWER)), max_size=12))
def test_streamed_reading_equals_whole_reading(cuts: list[int]) -> None:
    bounds = sorted(set(cuts))
    pieces = [ANSWER[a:b] for a, b in zip([0, *bounds], [*bounds, len(ANSWER)])]
    assert read(pieces) == read([ANSWER])


def test_reader_splits_content_and_calls() -> None:
    content, calls, firsts = read([ANSWER])
    assert content == "Let me check. \n done <tool"
    assert calls == [
        {"id": "call_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]
    assert firsts == [0, 1]


def test_unreadable_or_cut_calls_stay_content() -> None:
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert read([bad]) == (bad, [], [])
    cut = 'x <tool_call>\n{"name": "ping", "argu'
    assert read([cut]) == (cut, [], [])
    assert read(['<tool_call>\n{"arguments": {}}\n</tool_call>'])[1] == []   # no name


def test_finish_reason() -> None:
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("stop", False) == "stop"
    assert finish_reason("length", True) == "length"


# -- the stream's tool-call event --------------------------------------------------------------

@pytest.mark.parametrize("include_usage", [False, True])
def test_tool_calls_event_is_the_json_of_openais_chunk(include_usage: bool) -> None:
    from node_agent.api_responses import ChatCompletionChunk
    from node_agent.sse import StreamEncoder

    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]
    event = StreamEncoder("chat", "chatcmpl-1", 7, "m", include_usage).tool_calls(calls, 2)
    want = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 2, **calls[0]}]},
                         "logprobs": None, "finish_reason": None}]}
    if include_usage:
        want["usage"] = None
    assert event == b"data: " + json.dumps(want, separators=(",", ":")).encode() + b"\n\n"
    ChatCompletionChunk.model_validate_json(event[len(b"data: "):])   # the documented shape
