"""The capability contract (mlx_fleet.capabilities): what a request needs, what a model serves,
and the 400 both the agent and the router answer (pure, table tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mlx_fleet.capabilities import (CHAT_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH, FIELD_RULES,
                                    rules_markdown, INVALID_VALUE, legacy_refused_message,
                                    UNSUPPORTED_PARAMETER, UNSUPPORTED_VALUE, WRONG_MODEL_TASK,
                                    Capability,
                                    ModelCapabilities, Need, missing_everywhere,
                                    required_capabilities, satisfies, may_serve, beyond_task)
from mlx_fleet.contract import AssignmentReport, AssignmentState

C = Capability
GEN = Need(C.GENERATE, "model")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("path", "body", "extra"), [
    (CHAT_PATH, {}, set()),
    (COMPLETIONS_PATH, {"prompt": "x"}, set()),
    # the "off" spellings the agent always accepted need nothing
    (CHAT_PATH, {"tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                 "logprobs": False, "top_logprobs": 0, "n": 1}, set()),
    (CHAT_PATH, {"tools": None, "tool_choice": None, "response_format": None,
                 "logprobs": None, "top_logprobs": None, "n": None}, set()),
    (CHAT_PATH, {"tools": [TOOL], "tool_choice": "none"}, set()),
    (CHAT_PATH, {"tools": [TOOL]}, {Need(C.TOOL_CALLING, "tools")}),
    (CHAT_PATH, {"tools": [TOOL], "tool_choice": "auto"}, {Need(C.TOOL_CALLING, "tools")}),
    # required / named: enforced by constrained decoding, a capability of its own
    (CHAT_PATH, {"tools": [TOOL], "tool_choice": "required"},
     {Need(C.TOOL_CALLING, "tools"), Need(C.TOOL_CHOICE, "tool_choice")}),
    (CHAT_PATH, {"tools": [TOOL], "tool_choice": {"type": "function",
                                                   "function": {"name": "f"}}},
     {Need(C.TOOL_CALLING, "tools"), Need(C.TOOL_CHOICE, "tool_choice")}),
    (CHAT_PATH, {"tool_choice": "required"}, {Need(C.TOOL_CALLING, "tool_choice")}),
    (CHAT_PATH, {"tool_choice": "auto"}, {Need(C.TOOL_CALLING, "tool_choice")}),
    (CHAT_PATH, {"response_format": {"type": "json_object"}},
     {Need(C.STRUCTURED_OUTPUTS, "response_format")}),
    (CHAT_PATH, {"response_format": {"type": "json_schema",
                                     "json_schema": {"name": "x", "schema": {}}}},
     {Need(C.STRUCTURED_OUTPUTS, "response_format")}),
    # the off spelling as a parsed request dumps it (pydantic: json_schema None) needs nothing
    (CHAT_PATH, {"response_format": {"type": "text", "json_schema": None}}, set()),
    (CHAT_PATH, {"response_format": {"type": None}}, set()),
    (CHAT_PATH, {"response_format": "json"}, {Need(C.STRUCTURED_OUTPUTS, "response_format")}),
    # legacy completions have no tools / response_format: refused whatever the model
    (COMPLETIONS_PATH, {"response_format": {"type": "json_object"}},
     {Need(C.STRUCTURED_OUTPUTS, "response_format", refused=legacy_refused_message(
         "response_format"), refused_code=UNSUPPORTED_PARAMETER)}),
    (COMPLETIONS_PATH, {"tools": [TOOL], "tool_choice": "required"},
     {Need(C.TOOL_CALLING, "tools", refused=legacy_refused_message("tools"),
           refused_code=UNSUPPORTED_PARAMETER)}),
    (COMPLETIONS_PATH, {"tool_choice": "auto"},
     {Need(C.TOOL_CALLING, "tool_choice", refused=legacy_refused_message("tool_choice"),
           refused_code=UNSUPPORTED_PARAMETER)}),
    (COMPLETIONS_PATH, {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}},
     set()),
    # above OpenAI's own bounds: invalid whatever the model (the agent's validation answer)
    (CHAT_PATH, {"logprobs": True, "top_logprobs": 21},
     {Need(C.LOGPROBS, "logprobs", 0), Need(C.LOGPROBS, "top_logprobs", 21, refused=(
         "top_logprobs: Input should be less than or equal to 20"), refused_code=INVALID_VALUE)}),
    (CHAT_PATH, {"logprobs": True, "top_logprobs": 20},
     {Need(C.LOGPROBS, "logprobs", 0), Need(C.LOGPROBS, "top_logprobs", 20)}),
    (COMPLETIONS_PATH, {"logprobs": 6}, {Need(C.LOGPROBS, "logprobs", 6, refused=(
        "logprobs: Input should be less than or equal to 5"), refused_code=INVALID_VALUE)}),
    (COMPLETIONS_PATH, {"logprobs": 5}, {Need(C.LOGPROBS, "logprobs", 5)}),
    (CHAT_PATH, {"logprobs": True}, {Need(C.LOGPROBS, "logprobs", 0)}),
    (CHAT_PATH, {"logprobs": True, "top_logprobs": 5},
     {Need(C.LOGPROBS, "logprobs", 0), Need(C.LOGPROBS, "top_logprobs", 5)}),
    (CHAT_PATH, {"top_logprobs": 3}, {Need(C.LOGPROBS, "top_logprobs", 3)}),
    (COMPLETIONS_PATH, {"logprobs": 2}, {Need(C.LOGPROBS, "logprobs", 2)}),
    (COMPLETIONS_PATH, {"logprobs": 0}, set()),
    (CHAT_PATH, {"n": 4}, {Need(C.N, "n", 4)}),
    (CHAT_PATH, {"n": 4.0}, {Need(C.N, "n", 4)}),
    (COMPLETIONS_PATH, {"n": 2}, {Need(C.N, "n", 2)}),
    # malformed values are the agent's validation to refuse, never an exception here
    (CHAT_PATH, {"n": "4", "tools": "x", "logprobs": "yes"},
     {Need(C.TOOL_CALLING, "tools"), Need(C.LOGPROBS, "logprobs", 0)}),
    (CHAT_PATH, {"n": True}, set()),
])
def test_required_capabilities_of_generation_requests(path: str, body: dict,
                                                      extra: set[Need]) -> None:
    assert required_capabilities(path, body) == {GEN} | extra


@pytest.mark.parametrize(("path", "body", "needs"), [
    (EMBEDDINGS_PATH, {"input": "x"}, {Need(C.EMBEDDINGS, "model")}),
    # fields of generation requests mean nothing on /v1/embeddings
    (EMBEDDINGS_PATH, {"input": ["a"], "n": 3, "tools": [TOOL]}, {Need(C.EMBEDDINGS, "model")}),
    ("/v1/models", {"n": 3}, set()),
    ("/v1/unknown", {}, set()),
])
def test_required_capabilities_of_other_paths(path: str, body: dict, needs: set[Need]) -> None:
    assert required_capabilities(path, body) == needs


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                     | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["tools", "tool_choice", "response_format", "logprobs",
                                        "top_logprobs", "n", "model"]), _json),
       st.sampled_from([CHAT_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH, "/x"]))
def test_required_capabilities_never_raises(body: dict, path: str) -> None:
    needs = required_capabilities(path, body)
    assert all(n.amount >= 0 for n in needs)
    # and every answer is decidable against any capabilities
    satisfies(ModelCapabilities(), needs)


BASE = ModelCapabilities(max_context_tokens=4096)
TOOLS_ONLY = ModelCapabilities(tool_calling=True, tool_parser="json_tools")
FULL = ModelCapabilities(tool_calling=True, tool_parser="json_tools", tool_choice_enforced=True,
                         structured_outputs=True,
                         logprobs=True, max_top_logprobs=20, max_n=8, max_context_tokens=4096)
EMBED = ModelCapabilities(task="TextEmbedding", embeddings=True, max_context_tokens=512)


@pytest.mark.parametrize(("caps", "body", "param", "code", "words"), [
    (BASE, {}, None, None, None),
    (BASE, {"tools": [TOOL]}, "tools", UNSUPPORTED_PARAMETER, "tool calling is not supported"),
    (BASE, {"tool_choice": "required"}, "tool_choice", UNSUPPORTED_PARAMETER,
     "tool calling is not supported"),
    (BASE, {"response_format": {"type": "json_object"}}, "response_format",
     UNSUPPORTED_PARAMETER, "structured outputs"),
    (BASE, {"logprobs": True}, "logprobs", UNSUPPORTED_PARAMETER, "logprobs is not supported"),
    (BASE, {"top_logprobs": 2}, "top_logprobs", UNSUPPORTED_PARAMETER, "not supported"),
    # n beyond a model that serves only 1: the parameter itself (the agent's old answer)
    (BASE, {"n": 2}, "n", UNSUPPORTED_PARAMETER, "n = 2 is not supported by the model 'm' "
                                                  "(at most 1)"),
    (FULL, {"tools": [TOOL], "response_format": {"type": "json_object"}, "logprobs": True,
            "top_logprobs": 20, "n": 8}, None, None, None),
    # a capability with a smaller bound: the value
    (FULL, {"n": 9}, "n", UNSUPPORTED_VALUE, "(at most 8)"),
    (ModelCapabilities(logprobs=True, max_top_logprobs=5), {"logprobs": True, "top_logprobs": 6},
     "top_logprobs", UNSUPPORTED_VALUE,
     "6 top logprobs are not supported by the model 'm' (at most 5)"),
    # above OpenAI's own bound: invalid whatever the model, first (the agent's validation)
    (FULL, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", INVALID_VALUE,
     "top_logprobs: Input should be less than or equal to 20"),
    (EMBED, {"logprobs": True, "top_logprobs": 21, "tools": [TOOL]}, "top_logprobs",
     INVALID_VALUE, "less than or equal to 20"),
    # tool_choice required / named: only where the call can be enforced
    (FULL, {"tools": [TOOL], "tool_choice": "required"}, None, None, None),
    (TOOLS_ONLY, {"tools": [TOOL], "tool_choice": "auto"}, None, None, None),
    (TOOLS_ONLY, {"tools": [TOOL], "tool_choice": "required"}, "tool_choice",
     UNSUPPORTED_PARAMETER, "tool_choice: an enforced tool choice (required or a named "
                            "function; use auto) is not supported by the model 'm'"),
    (TOOLS_ONLY, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", UNSUPPORTED_PARAMETER, "an enforced tool choice"),
    # the flag alone claims nothing without tool calling and structured outputs (p6: llguidance
    # cannot take the tokenizer)
    (ModelCapabilities(tool_calling=True, tool_parser="json_tools", tool_choice_enforced=True),
     {"tools": [TOOL], "tool_choice": "required"}, "tool_choice", UNSUPPORTED_PARAMETER,
     "an enforced tool choice"),
    # the first missing one in capability order: tools before response_format before n
    (BASE, {"n": 3, "response_format": {"type": "json_object"}, "tools": [TOOL]}, "tools",
     UNSUPPORTED_PARAMETER, "tool calling"),
    (BASE, {"n": 3, "logprobs": True}, "logprobs", UNSUPPORTED_PARAMETER, "logprobs"),
    # the endpoint against the model's task
    (EMBED, {}, "model", WRONG_MODEL_TASK,
     "model: the model 'm' is served for TextEmbedding: use POST /v1/embeddings"),
    (EMBED, {"tools": [TOOL]}, "model", WRONG_MODEL_TASK, "use POST /v1/embeddings"),
])
def test_satisfies(caps: ModelCapabilities, body: dict, param: str | None, code: str | None,
                   words: str | None) -> None:
    missing = satisfies(caps, required_capabilities(CHAT_PATH, body))
    if param is None:
        assert missing is None
        return
    assert missing is not None
    assert (missing.param, missing.code) == (param, code)
    message = missing.message("m")
    assert message.startswith(f"{param}: ") and words in message


@pytest.mark.parametrize(("caps", "missing"), [
    (BASE, ("model", WRONG_MODEL_TASK,
            "model: the model 'm' is served for TextGeneration: use POST /v1/chat/completions "
            "or /v1/completions")),
    (FULL, ("model", WRONG_MODEL_TASK, "served for TextGeneration")),
    (EMBED, None),
    # an embedding model whose agent does not serve embeddings (yet)
    (ModelCapabilities(task="TextEmbedding"), ("model", UNSUPPORTED_PARAMETER,
                                               "model: embeddings are not supported by the "
                                               "model 'm'")),
])
def test_embeddings_need_an_embedding_model(caps: ModelCapabilities, missing) -> None:
    got = satisfies(caps, required_capabilities(EMBEDDINGS_PATH, {"input": "x"}))
    assert (None if got is None else (got.param, got.code)) == (missing and missing[:2])
    if got is not None:
        assert missing[2] in got.message("m")


N4 = ModelCapabilities(max_n=4)
N2 = ModelCapabilities(max_n=2)


@pytest.mark.parametrize(("replicas", "body", "missing"), [
    ([], {"tools": [TOOL]}, None),                       # no replica: nothing known (503)
    ([BASE], {}, None),
    ([BASE], {"tools": [TOOL]}, ("tools", None)),
    ([BASE, TOOLS_ONLY], {"tools": [TOOL]}, None),        # one has it
    ([BASE, None], {"tools": [TOOL]}, None),              # an unknown one may have it
    ([None], {"n": 64}, None),
    # the largest bound offered is the one the message names
    ([N2, N4], {"n": 5}, ("n", 4)),
    ([N2, BASE], {"n": 5}, ("n", 2)),
    # each need is served somewhere but no replica serves both: the first replica's first
    ([TOOLS_ONLY, N4], {"tools": [TOOL], "n": 3}, ("n", 1)),
    ([N4, TOOLS_ONLY], {"tools": [TOOL], "n": 3}, ("tools", None)),
    # required: the replica that can enforce it serves it; none can: named
    ([TOOLS_ONLY, FULL], {"tools": [TOOL], "tool_choice": "required"}, None),
    ([TOOLS_ONLY], {"tools": [TOOL], "tool_choice": "required"}, ("tool_choice", None)),
    # refused whatever the model, even with unknown replicas or none
    ([None, FULL], {"logprobs": True, "top_logprobs": 21}, ("top_logprobs", None)),
    ([], {"logprobs": True, "top_logprobs": 21}, ("top_logprobs", None)),
])
def test_missing_everywhere(replicas, body: dict, missing) -> None:
    got = missing_everywhere(replicas, required_capabilities(CHAT_PATH, body))
    assert (None if got is None else (got.param, got.limit)) == missing


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [TOOL]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}},
     "response_format"),
    ({"tools": [TOOL], "response_format": {"type": "json_object"}}, "tools"),
])
def test_legacy_completions_refuse_chat_only_fields_whatever_the_model(body: dict,
                                                                       param: str) -> None:
    needs = required_capabilities(COMPLETIONS_PATH, body)
    for replicas in ([FULL], [None], [], [EMBED]):
        got = missing_everywhere(replicas, needs)
        assert got is not None and (got.param, got.code) == (param, UNSUPPORTED_PARAMETER)
        assert got.message("m") == legacy_refused_message(param) == (
            f"{param}: {param} is not supported on /v1/completions (OpenAI's legacy endpoint "
            "has none: use /v1/chat/completions)")
    assert satisfies(FULL, needs) is not None


def test_a_dumped_off_response_format_needs_nothing() -> None:
    """The agent passes its parsed request's dump: ``{"type": "text", "json_schema": None}``
    must need what the raw body (the router's view) needs: nothing."""
    from node_agent.api_models import ChatCompletionRequest
    from mlx_fleet.capabilities import REQUEST_FIELDS
    raw = {"model": "m", "messages": [{"role": "user", "content": "x"}],
           "response_format": {"type": "text"}}
    dumped = ChatCompletionRequest.model_validate(raw).model_dump(include=set(REQUEST_FIELDS))
    assert required_capabilities(CHAT_PATH, dumped) == required_capabilities(CHAT_PATH, raw) \
        == {GEN}
    assert satisfies(ModelCapabilities(), required_capabilities(CHAT_PATH, dumped)) is None


def test_defaults_claim_nothing_and_old_reports_parse() -> None:
    caps = ModelCapabilities()
    assert (caps.task, caps.tool_calling, caps.tool_parser, caps.structured_outputs,
            caps.logprobs, caps.max_top_logprobs, caps.max_n, caps.embeddings) == (
        "TextGeneration", False, None, False, False, 0, 1, False)
    # a report written before the field: capabilities unknown
    old = b'{"node": "a", "namespace": "ns", "name": "m", "state": "Ready"}'
    assert AssignmentReport.from_json(old).capabilities is None
    # a newer agent's capability this reader does not know is ignored; the known ones kept
    new = AssignmentReport(node="a", namespace="ns", name="m", state=AssignmentState.READY,
                           capabilities=FULL)
    raw = new.to_json().replace(b'"max_n":8', b'"max_n":8,"rerank":true')
    assert AssignmentReport.from_json(raw).capabilities == FULL
    # only the known fields, partially written: the rest default to nothing
    partial = (b'{"node": "a", "namespace": "ns", "name": "m", "state": "Ready", '
               b'"capabilities": {"tool_calling": true, "tool_parser": "json_tools"}}')
    got = AssignmentReport.from_json(partial).capabilities
    assert got == TOOLS_ONLY


@pytest.mark.parametrize("bad", [{"max_n": 0}, {"max_top_logprobs": -1}, {"task": "rerank"},
                                 {"max_context_tokens": -5}])
def test_invalid_capabilities_are_refused(bad: dict) -> None:
    with pytest.raises(ValidationError):
        ModelCapabilities(**bad)


@pytest.mark.parametrize("rule", FIELD_RULES, ids=lambda r: f"{r.param}-{r.capability.value}")
def test_the_documented_table_is_the_rule(rule) -> None:
    needs = required_capabilities(rule.path, rule.example)
    assert any(n.capability is rule.capability and n.param == rule.param for n in needs)
    # and a model with nothing but the defaults lacks it (except plain generation)
    missing = satisfies(ModelCapabilities(), needs)
    assert (missing is None) == (rule.capability is C.GENERATE)


def test_the_agents_docs_and_openapi_document_show_that_table() -> None:
    from node_agent.openapi import openapi_document

    doc = (Path(__file__).resolve().parents[1] / "docs" / "node-agent.md").read_text()
    assert rules_markdown() in doc
    assert rules_markdown() in openapi_document()["info"]["description"]


@pytest.mark.parametrize(("caps", "task", "path", "body", "ok"), [
    # known capabilities decide
    (FULL, None, CHAT_PATH, {"tools": [TOOL]}, True),
    (BASE, None, CHAT_PATH, {"tools": [TOOL]}, False),
    # unknown: the agent decides, but only for the endpoint of its task
    (None, None, CHAT_PATH, {"tools": [TOOL]}, True),
    (None, "TextGeneration", CHAT_PATH, {"tools": [TOOL], "n": 8}, True),
    (None, "TextEmbedding", CHAT_PATH, {}, False),
    (None, "TextEmbedding", EMBEDDINGS_PATH, {"input": "x"}, True),
    (None, "TextGeneration", EMBEDDINGS_PATH, {"input": "x"}, False),
    # refused whatever the model: even an unknown one
    (None, None, CHAT_PATH, {"logprobs": True, "top_logprobs": 21}, False),
])
def test_may_serve(caps, task, path: str, body: dict, ok: bool) -> None:
    assert may_serve(caps, required_capabilities(path, body), task) is ok


@pytest.mark.parametrize(("path", "body", "beyond"), [
    (CHAT_PATH, {}, False), (EMBEDDINGS_PATH, {"input": "x"}, False),
    (CHAT_PATH, {"response_format": {"type": "text"}}, False),
    (CHAT_PATH, {"tools": [TOOL]}, True), (CHAT_PATH, {"n": 2}, True),
    (CHAT_PATH, {"logprobs": True}, True),
])
def test_beyond_task(path: str, body: dict, beyond: bool) -> None:
    assert beyond_task(required_capabilities(path, body)) is beyond


@pytest.mark.parametrize(("replicas", "path", "body", "missing"), [
    (["TextGeneration"], CHAT_PATH, {"tools": [TOOL]}, None),
    (["TextEmbedding"], CHAT_PATH, {}, ("model", WRONG_MODEL_TASK)),
    (["TextEmbedding", BASE], CHAT_PATH, {"tools": [TOOL]}, ("tools", UNSUPPORTED_PARAMETER)),
    (["TextEmbedding", TOOLS_ONLY], CHAT_PATH, {"tools": [TOOL]}, None),
    (["TextGeneration"], EMBEDDINGS_PATH, {"input": "x"}, ("model", WRONG_MODEL_TASK)),
])
def test_missing_everywhere_with_unknown_replicas_of_a_known_task(replicas, path: str,
                                                                   body: dict, missing) -> None:
    got = missing_everywhere(replicas, required_capabilities(path, body))
    assert (None if got is None else (got.param, got.code)) == missing
