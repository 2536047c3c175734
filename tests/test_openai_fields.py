"""OpenAI fields the agent does not apply are refused unless off, unknown fields are refused,
metadata fields change nothing (issue 20: never accept a feature and quietly not apply it).

Pure: ``mlx_fleet.openai_fields`` table-tested, property tests of the request models' new
fields (bounds, types, off spellings) through ``node_agent.api.parse``. Live, on the tiny
generated model: the review's probes (``echo`` with ``logprobs``, ``best_of``, ``suffix``,
``logit_bias``, penalties answered 200 and ignored; the legacy endpoint's off spellings of
``tools`` / ``tool_choice`` / ``response_format`` refused) and the official ``openai`` client.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mlx_fleet.openai_fields import (LEGACY_REFUSAL, LEGACY_REFUSED, NO_EFFECT, NOT_APPLIED,
                                     is_off, not_applied)
from node_agent.api.parse import unsupported, validation_error
from node_agent.api_models import (ChatCompletionRequest, CompletionRequest, EmbeddingRequest,
                                   StreamOptions)
from serving_fixtures import MODEL_ID, Agent, agent, tiny_model_path  # noqa: F401

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "Hello"}]


# -- the table ------------------------------------------------------------------------------


@pytest.mark.parametrize(("param", "value", "off"), [
    ("logit_bias", None, True), ("logit_bias", {}, True), ("logit_bias", {"5": 1.0}, False),
    ("presence_penalty", 0, True), ("presence_penalty", 0.0, True),
    ("presence_penalty", 0.5, False), ("frequency_penalty", -2.0, False),
    ("echo", False, True), ("echo", True, False), ("suffix", "", True), ("suffix", "x", False),
    ("store", False, True), ("store", True, False),
    ("service_tier", "auto", True), ("service_tier", "default", True),
    ("service_tier", "flex", False), ("service_tier", "priority", False),
    ("modalities", ["text"], True), ("modalities", ["text", "audio"], False),
    ("modalities", [], False), ("modalities", None, True), ("audio", {"voice": "x"}, False),
    ("prediction", {}, False), ("web_search_options", {}, False),   # {} searches at OpenAI
    ("web_search_options", None, True), ("verbosity", "", False),
    ("reasoning_effort", "low", False), ("reasoning_effort", None, True),
    ("tools", [], True), ("tools", [{"type": "function"}], False),
    ("tool_choice", "none", True), ("tool_choice", "auto", False),
    ("tool_choice", "required", False),
    ("response_format", {"type": "text"}, True),
    ("response_format", {"type": "text", "json_schema": None}, True),  # a validated dump
    ("response_format", {"type": None}, True), ("response_format", "text", False),
    ("response_format", {"type": "json_schema", "json_schema": {}}, False),
    ("response_format", {"type": "json_object"}, False),
    ("function_call", "none", True), ("function_call", "auto", False),
    ("functions", [], True), ("functions", [{"name": "f"}], False),
])
def test_is_off_table(param: str, value: Any, off: bool) -> None:
    assert is_off(param, value) is off


def test_not_applied_names_the_first_field_on_and_best_of_may_equal_n() -> None:
    assert not_applied({"echo": False, "best_of": 2}, n=2) is None
    assert not_applied({"best_of": 3}, n=2) == (
        "best_of", "best_of: best_of is not supported by this server (accepted only as null or "
                   "equal to n)")
    # table order: presence before frequency
    assert not_applied({"frequency_penalty": 1.0, "presence_penalty": 1.0})[0] == (
        "presence_penalty")
    assert not_applied({"metadata": {"a": "b"}, "prompt_cache_key": "k"}) is None
    assert not set(NO_EFFECT) & set(NOT_APPLIED)


def test_every_openai_field_is_declared() -> None:
    """The ``openai`` client's own request fields are all declared (served, no effect, or
    refused unless off): none is unknown, so none reaches the "unrecognized" 400 by accident."""
    from openai.types import completion_create_params as legacy
    from openai.types import embedding_create_params as embeddings
    from openai.types.chat import completion_create_params as chat
    from openai.types.chat.chat_completion_stream_options_param import (
        ChatCompletionStreamOptionsParam)

    assert set(ChatCompletionStreamOptionsParam.__annotations__) <= set(
        StreamOptions.model_fields)

    for params, model in ((chat.CompletionCreateParamsBase, ChatCompletionRequest),
                          (legacy.CompletionCreateParamsBase, CompletionRequest)):
        assert set(params.__annotations__) - set(model.model_fields) == set()
    assert set(embeddings.EmbeddingCreateParams.__annotations__) == set(
        EmbeddingRequest.model_fields)
    for field in NOT_APPLIED:
        assert field.startswith("stream_options.") or (
            field in ChatCompletionRequest.model_fields
            or field in CompletionRequest.model_fields)


# -- property tests of the request models ----------------------------------------------------


def _verdict(cls: type, body: dict) -> tuple[str, str] | None:
    """``None`` when the body is accepted, else the 400's ``(param, code)``."""
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        refused = validation_error(e)
    else:
        refused = unsupported(req)
    if refused is None:
        return None
    err = json.loads(refused.body)["error"]
    return err["param"], err["code"]


_numbers = st.one_of(st.none(), st.booleans(), st.integers(-5, 5),
                     st.floats(-5, 5, allow_nan=False), st.sampled_from(["1", [0], {}]))


@settings(max_examples=200, deadline=None)
@given(param=st.sampled_from(["presence_penalty", "frequency_penalty"]), value=_numbers,
       chat=st.booleans())
def test_penalty_property(param: str, value: Any, chat: bool) -> None:
    cls = ChatCompletionRequest if chat else CompletionRequest
    body = {"model": "m", **({"messages": MSGS} if chat else {"prompt": "x"}), param: value}
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if value is None or (number and value == 0):
        assert _verdict(cls, body) is None
    elif not number or not -2 <= value <= 2:
        assert _verdict(cls, body) == (param, "invalid_value")
    else:
        assert _verdict(cls, body) == (param, "unsupported_parameter")


@settings(max_examples=200, deadline=None)
@given(bias=st.one_of(st.none(), st.dictionaries(
    st.one_of(st.from_regex(r"\A[0-9]{1,6}\Z"), st.sampled_from(["a", "-1", ""])),
    st.one_of(st.floats(-150, 150, allow_nan=False), st.sampled_from(["1", True])),
    max_size=3), st.sampled_from([[1], "x"])))
def test_logit_bias_property(bias: Any) -> None:
    body = {"model": "m", "messages": MSGS, "logit_bias": bias}
    valid = bias is None or (isinstance(bias, dict) and all(
        k.isdigit() and not isinstance(v, (bool, str)) and -100 <= v <= 100
        for k, v in bias.items()))
    if not valid:
        assert _verdict(ChatCompletionRequest, body)[1] == "invalid_value"
    elif bias:
        assert _verdict(ChatCompletionRequest, body) == ("logit_bias", "unsupported_parameter")
    else:
        assert _verdict(ChatCompletionRequest, body) is None


@settings(max_examples=200, deadline=None)
@given(best_of=st.one_of(st.none(), st.integers(-1, 6), st.sampled_from([2.0, 1.5, "2", True])),
       n=st.integers(1, 4))
def test_best_of_property(best_of: Any, n: int) -> None:
    verdict = _verdict(CompletionRequest, {"model": "m", "prompt": "x", "n": n,
                                           "best_of": best_of})
    whole = (None if isinstance(best_of, bool) or not isinstance(best_of, (int, float))
             or not float(best_of).is_integer() else int(best_of))
    if best_of is None or whole == n:
        assert verdict is None
    elif whole is None or whole < 1 or whole < n:
        assert verdict == ("best_of", "invalid_value")
    else:
        assert verdict == ("best_of", "unsupported_parameter")


@settings(max_examples=100, deadline=None)
@given(echo=st.one_of(st.none(), st.booleans(), st.sampled_from([0, 1, "false"])),
       suffix=st.one_of(st.none(), st.text(max_size=3), st.sampled_from([0, ["x"]])))
def test_echo_and_suffix_property(echo: Any, suffix: Any) -> None:
    verdict = _verdict(CompletionRequest, {"model": "m", "prompt": "x", "echo": echo,
                                           "suffix": suffix})
    # declaration order: echo, then suffix; then the NOT_APPLIED order (echo, suffix)
    if echo is not None and not isinstance(echo, bool):
        assert verdict == ("echo", "invalid_value")
    elif suffix is not None and not isinstance(suffix, str):
        assert verdict == ("suffix", "invalid_value")
    elif echo:
        assert verdict == ("echo", "unsupported_parameter")
    elif suffix:
        assert verdict == ("suffix", "unsupported_parameter")
    else:
        assert verdict is None


@settings(max_examples=100, deadline=None)
@given(name=st.from_regex(r"\A[a-z_]{1,20}\Z"), chat=st.booleans())
def test_unknown_field_property(name: str, chat: bool) -> None:
    cls = ChatCompletionRequest if chat else CompletionRequest
    body = {"model": "m", **({"messages": MSGS} if chat else {"prompt": "x"}), name: 1}
    verdict = _verdict(cls, body)
    if name in cls.model_fields:
        assert verdict is None or verdict[0] == name       # declared: its own rule
    else:
        assert verdict == (name, "unsupported_parameter")


def test_metadata_bounds() -> None:
    ok = {"model": "m", "messages": MSGS, "metadata": {f"k{i}": "v" for i in range(16)},
          "safety_identifier": "s" * 128, "prompt_cache_key": "k"}
    assert _verdict(ChatCompletionRequest, ok) is None
    for bad in ({"metadata": {f"k{i}": "v" for i in range(17)}},
                {"metadata": {"k" * 65: "v"}}, {"metadata": {"k": "v" * 513}},
                {"metadata": {"k": 1}}, {"safety_identifier": "s" * 129}):
        verdict = _verdict(ChatCompletionRequest, {**ok, **bad})
        assert verdict is not None and verdict[1] == "invalid_value"
        assert verdict[0].split(".")[0] == next(iter(bad))


def test_option_objects_refuse_unknown_keys_messages_ignore_them() -> None:
    base = {"model": "m", "messages": MSGS}
    assert _verdict(ChatCompletionRequest, {**base, "response_format": {
        "type": "json_object", "strict": True}}) == ("response_format.strict",
                                                     "unsupported_parameter")
    assert _verdict(ChatCompletionRequest, {**base, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}) == (
        "stream_options.continuous_usage_stats", "unsupported_parameter")
    # OpenAI's own: off accepted, on (padded events) refused
    assert _verdict(ChatCompletionRequest, {**base, "stream": True, "stream_options": {
        "include_usage": True, "include_obfuscation": False}}) is None
    assert _verdict(CompletionRequest, {"model": "m", "prompt": "x", "stream": True,
                                        "stream_options": {"include_obfuscation": True}}) == (
        "stream_options.include_obfuscation", "unsupported_parameter")
    assert _verdict(ChatCompletionRequest, {**base, "tools": [{"type": "function", "function": {
        "name": "f", "parameter": {}}}]}) == ("tools.0.function.parameter",
                                              "unsupported_parameter")
    # history: OpenAI's own assistant keys this server does not render
    assert _verdict(ChatCompletionRequest, {**base, "messages": [
        {"role": "assistant", "content": "x", "refusal": None, "annotations": []},
        *MSGS]}) is None
    # but a non-text content part (it would be dropped from the prompt) is refused
    assert _verdict(ChatCompletionRequest, {**base, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is"}, {
            "type": "image_url", "image_url": {"url": "https://mac.example/a.png"}}]}]}) == (
        "messages.0.content.1.type", "unsupported_parameter")


def test_embeddings_refuse_unknown_fields() -> None:
    with pytest.raises(ValidationError) as e:
        EmbeddingRequest.model_validate({"model": "e", "input": "x", "truncate": True})
    err = json.loads(validation_error(e.value).body)["error"]
    assert (err["param"], err["code"]) == ("truncate", "unsupported_parameter")


# -- live, on the tiny model ----------------------------------------------------------------


async def _post(agent: Agent, path: str, body: dict) -> tuple[int, dict]:  # noqa: F811
    base = {"model": MODEL_ID, "max_tokens": 3, "temperature": 0,
            **({"messages": MSGS} if path == CHAT else {"prompt": "Hello"})}
    resp = await agent.client.post(path, json={**base, **body})
    return resp.status, await resp.json()


@pytest.mark.parametrize(("path", "body", "param"), [
    # the review's probes (/tmp/review20/p2.py): each answered 200 and ignored before
    (COMPLETIONS, {"echo": True, "logprobs": 5}, "echo"),
    (COMPLETIONS, {"echo": True}, "echo"),
    (COMPLETIONS, {"best_of": 3}, "best_of"),
    (COMPLETIONS, {"suffix": "zzz"}, "suffix"),
    (COMPLETIONS, {"logit_bias": {"5": 100}}, "logit_bias"),
    (CHAT, {"logit_bias": {"5": 100}}, "logit_bias"),
    (CHAT, {"frequency_penalty": 2, "presence_penalty": 2}, "presence_penalty"),
    (CHAT, {"frequency_penalty": 0.5}, "frequency_penalty"),
    (COMPLETIONS, {"presence_penalty": -1}, "presence_penalty"),
    (CHAT, {"store": True}, "store"),
    (CHAT, {"service_tier": "flex"}, "service_tier"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"reasoning_effort": "low"}, "reasoning_effort"),
    (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    # not OpenAI's: unrecognized
    (CHAT, {"min_p": 0.1}, "min_p"),
    (CHAT, {"top_k": 5}, "top_k"),
    (COMPLETIONS, {"repetition_penalty": 1.1}, "repetition_penalty"),
    (COMPLETIONS, {"max_completion_tokens": 3}, "max_completion_tokens"),
])
async def test_not_applied_fields_are_400_naming_them(agent: Agent, path: str,  # noqa: F811
                                                      body: dict, param: str) -> None:
    status, out = await _post(agent, path, body)
    assert status == 400, out
    assert out["error"]["type"] == "invalid_request_error"
    assert (out["error"]["param"], out["error"]["code"]) == (param, "unsupported_parameter")
    assert out["error"]["message"].startswith(f"{param}: ")


@pytest.mark.parametrize("body", [
    # the review's p5 probes: the legacy endpoint's off spellings, refused before
    {"response_format": {"type": "text"}}, {"tools": []}, {"tool_choice": "none"},
    {"tools": None, "tool_choice": None, "response_format": None},
    {"echo": False, "best_of": 1, "suffix": "", "logit_bias": {}, "presence_penalty": 0,
     "frequency_penalty": 0.0, "functions": [], "function_call": "none"},
])
async def test_legacy_off_spellings_are_served(agent: Agent, body: dict) -> None:  # noqa: F811
    status, out = await _post(agent, COMPLETIONS, body)
    assert status == 200, out
    assert out["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("param", LEGACY_REFUSED)
async def test_legacy_refusal_keeps_its_wording(agent: Agent, param: str) -> None:  # noqa: F811
    value = {"tools": [{"type": "function", "function": {"name": "f"}}],
             "tool_choice": "auto", "response_format": {"type": "json_object"}}[param]
    status, out = await _post(agent, COMPLETIONS, {param: value})
    assert status == 400
    assert out["error"]["message"] == (
        f"{param}: {param} is not supported on /v1/completions (OpenAI's legacy endpoint has "
        "none: use /v1/chat/completions)") == LEGACY_REFUSAL.format(param=param)


async def test_no_effect_fields_change_nothing(agent: Agent) -> None:  # noqa: F811
    plain = await _post(agent, CHAT, {"max_tokens": 6})
    tagged = await _post(agent, CHAT, {
        "max_tokens": 6, "metadata": {"team": "a"}, "prompt_cache_key": "k",
        "safety_identifier": "u1", "store": False, "service_tier": "auto",
        "modalities": ["text"], "user": "u"})
    assert plain[0] == tagged[0] == 200
    assert tagged[1]["choices"] == plain[1]["choices"]
    assert tagged[1]["usage"]["completion_tokens"] == 6


@pytest_asyncio.fixture
async def client(agent: Agent) -> AsyncIterator[openai.AsyncOpenAI]:  # noqa: F811
    c = openai.AsyncOpenAI(base_url=agent.base_url, api_key="x", max_retries=0)
    yield c
    await c.close()


async def test_official_client_sees_echo_refused(client: openai.AsyncOpenAI) -> None:
    """lm-eval-harness scores a prompt with ``echo`` and ``logprobs``: it must not get only the
    generated tokens' logprobs as if they were the prompt's."""
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=1,
                                        echo=True, logprobs=5)
    assert exc.value.code == "unsupported_parameter" and exc.value.param == "echo"
    # and what the client sends by default passes
    out = await client.chat.completions.create(model=MODEL_ID, messages=MSGS, max_tokens=2,
                                               temperature=0, stream_options=None)
    assert out.choices[0].finish_reason == "length"
