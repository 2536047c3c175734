"""A loaded revision's capabilities (node_agent.serving.capabilities): what its tokenizer brings
(mlx-lm's tool parser, llguidance's tokenizer), what this build serves (the switches each
issue-20 feature flips), and the agent's own 400 through mlx_fleet.capabilities.satisfies."""

from __future__ import annotations

import dataclasses

import json
import shutil
from pathlib import Path

import pytest

from mlx_fleet.capabilities import (CHAT_PATH, ModelCapabilities, required_capabilities,
                                    satisfies)
from node_agent.serving import ModelInfo
from node_agent.serving import capabilities as caps_mod
from node_agent.serving.capabilities import (grammar_tokenizer_ok, model_capabilities,
                                             tokenizer_features, tool_parser_name)
from node_agent.serving.loading import load_tokenizer
from node_agent.serving.types import TokenizerFeatures
from serving_fixtures import MODEL_ID, Agent, agent, tiny_model_path  # noqa: F401


@pytest.fixture(scope="module")
def tool_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The tiny model's tokenizer with mlx-lm's ``json_tools`` parser named in its
    ``tokenizer_config.json`` (as a checkpoint of a tool-calling family names it)."""
    dest = tmp_path_factory.mktemp("tools") / "tiny-tools"
    shutil.copytree(tiny_model_path, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config["tool_parser_type"] = "json_tools"
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture
def plain_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The tiny model with a chat template that knows no tools (mlx-lm infers no parser)."""
    dest = tmp_path_factory.mktemp("plain") / "tiny-plain"
    shutil.copytree(tiny_model_path, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}"
                               "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def test_tool_parser_from_mlx_lms_tokenizer_wrapper(plain_model_path: Path,
                                                   tool_model_path: Path) -> None:
    plain = load_tokenizer(plain_model_path)
    assert not plain.has_tool_calling and tool_parser_name(plain) is None
    tools = load_tokenizer(tool_model_path)
    assert tools.has_tool_calling and tool_parser_name(tools) == "json_tools"


def test_llguidance_builds_the_test_models_tokenizer(tiny_model_path: Path) -> None:  # noqa: F811
    assert grammar_tokenizer_ok(load_tokenizer(tiny_model_path))
    assert not grammar_tokenizer_ok(object())  # not a fast tokenizer: False, never raises


def test_the_grammar_check_runs_only_while_structured_outputs_are_served(
        tool_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []

    def check(tok: object) -> bool:
        calls.append(tok)
        return True

    monkeypatch.setattr(caps_mod, "grammar_tokenizer_ok", check)
    tok = load_tokenizer(tool_model_path)
    monkeypatch.setattr(caps_mod, "STRUCTURED_OUTPUTS_SERVED", False)
    assert tokenizer_features(tok) == TokenizerFeatures("json_tools", False) and calls == []
    monkeypatch.setattr(caps_mod, "STRUCTURED_OUTPUTS_SERVED", True)
    assert tokenizer_features(tok) == TokenizerFeatures("json_tools", True) and calls == [tok]


INFO = ModelInfo("m", "r1", "/models/m", 1, 8, 4096,
                 features=TokenizerFeatures(tool_parser="qwen3_coder", grammar=True))
NO_PARSER = ModelInfo("m", "r1", "/models/m", 1, 2, 2048,
                      features=TokenizerFeatures(tool_parser=None, grammar=False))
JSON_TOOLS = dataclasses.replace(INFO, features=TokenizerFeatures("json_tools", True))
ALL_ON = {"TOOL_CALLING_SERVED": True, "STRUCTURED_OUTPUTS_SERVED": True,
          "LOGPROBS_SERVED": True, "MAX_TOP_LOGPROBS": 20, "MAX_N": 4,
          "EMBEDDINGS_SERVED": True}
ALL_OFF = {"TOOL_CALLING_SERVED": False, "STRUCTURED_OUTPUTS_SERVED": False,
           "LOGPROBS_SERVED": False, "MAX_TOP_LOGPROBS": 0, "MAX_N": 1,
           "EMBEDDINGS_SERVED": False}


@pytest.mark.parametrize(("switches", "info", "task", "expected"), [
    # what this build serves with nothing switched on: text generation, n = 1
    (ALL_OFF, INFO, "TextGeneration", ModelCapabilities(max_context_tokens=4096)),
    # every feature on: the tokenizer's parser and grammar decide, n within the batch
    (ALL_ON, INFO, "TextGeneration", ModelCapabilities(
        tool_calling=True, tool_parser="qwen3_coder", structured_outputs=True, logprobs=True,
        max_top_logprobs=20, max_n=4, max_context_tokens=4096)),
    # a parser whose envelope constrained decoding writes: required / named enforced
    (ALL_ON, JSON_TOOLS, "TextGeneration", ModelCapabilities(
        tool_calling=True, tool_parser="json_tools", tool_choice_enforced=True,
        structured_outputs=True, logprobs=True, max_top_logprobs=20, max_n=4,
        max_context_tokens=4096)),
    # ... but not without a grammar (llguidance cannot take the tokenizer: p6)
    (ALL_ON, dataclasses.replace(JSON_TOOLS, features=TokenizerFeatures("json_tools", False)),
     "TextGeneration", ModelCapabilities(
         tool_calling=True, tool_parser="json_tools", logprobs=True, max_top_logprobs=20,
         max_n=4, max_context_tokens=4096)),
    (ALL_ON, NO_PARSER, "TextGeneration", ModelCapabilities(
        logprobs=True, max_top_logprobs=20, max_n=2, max_context_tokens=2048)),
    # an embedding model serves embeddings only
    (ALL_ON, INFO, "TextEmbedding", ModelCapabilities(task="TextEmbedding", embeddings=True,
                                                      max_context_tokens=4096)),
    (ALL_OFF, INFO, "TextEmbedding", ModelCapabilities(task="TextEmbedding",
                                                       max_context_tokens=4096)),
])
def test_model_capabilities(switches: dict, info: ModelInfo, task: str,
                            expected: ModelCapabilities,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in switches.items():
        monkeypatch.setattr(caps_mod, name, value)
    # the revision's task is its ModelInfo's (the assignment's spec.model.task)
    info = dataclasses.replace(info, task=task)  # type: ignore[arg-type]
    assert model_capabilities(info) == expected


@pytest.mark.parametrize(("max_choices", "batch", "max_n"), [
    (None, 8, min(caps_mod.MAX_N, 8)), (6, 8, 6), (6, 4, 4), (1, 8, 1)])
def test_the_n_bound_is_the_agents_within_the_batch(max_choices, batch: int,
                                                    max_n: int) -> None:
    info = ModelInfo("m", "r1", "/models/m", 1, batch, 4096)
    assert model_capabilities(info, max_choices=max_choices).max_n == max_n


async def test_the_agent_refuses_by_its_revisions_capabilities(
        agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The 400 comes from the loaded revision's capabilities (here with an n bound of 2: the
    agent's --max-choices), in the words of mlx_fleet.capabilities — the fleet router's own
    answer."""
    monkeypatch.setattr(agent.core, "max_choices", 2)
    listed = await (await agent.client.get("/v1/models")).json()
    card = next(m for m in listed["data"] if m["id"] == MODEL_ID)
    assert card["capabilities"]["max_n"] == 2 and card["capabilities"]["tool_parser"] == "json_tools"
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "n": 3}
    resp = await agent.client.post(CHAT_PATH, json=body)
    assert resp.status == 400
    err = (await resp.json())["error"]
    want = satisfies(ModelCapabilities.model_validate(card["capabilities"]),
                     required_capabilities(CHAT_PATH, body))
    assert want is not None
    assert err == {"message": want.message(MODEL_ID), "type": "invalid_request_error",
                   "param": "n", "code": "unsupported_value"}
    assert "(at most 2)" in err["message"]
    assert resp.headers["X-Model-Revision"] == card["revision"]


async def test_a_model_whose_tokenizer_llguidance_cannot_take(
        tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """p6: llguidance cannot adapt the tokenizer. The card claims tool calling but neither
    structured outputs nor an enforced tool choice; tool_choice required / named is a 400 in
    the capabilities' words (never a 500), auto and the off spellings are served; a grammar
    compiled anyway is a 400-able InvalidConstraint."""
    import llguidance.hf

    from node_agent.serving.constrain import compile_grammar
    from node_agent.serving.errors import InvalidConstraint
    from node_agent.serving.grammar import json_object_grammar
    from serving_fixtures import close_agent, make_agent

    def refuse(*_a: object, **_k: object) -> None:
        raise ValueError("slow tokenizer not supported")

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", refuse)
    a = await make_agent(tiny_model_path)
    try:
        card = (await (await a.client.get("/v1/models")).json())["data"][0]["capabilities"]
        assert (card["tool_calling"], card["structured_outputs"],
                card["tool_choice_enforced"]) == (True, False, False)
        caps = ModelCapabilities.model_validate(card)
        tools = [{"type": "function", "function": {"name": "get",
                                                     "parameters": {"type": "object"}}}]
        msgs = [{"role": "user", "content": "x"}]
        for choice in ("required", {"type": "function", "function": {"name": "get"}}):
            body = {"model": MODEL_ID, "messages": msgs, "max_tokens": 3, "tools": tools,
                    "tool_choice": choice}
            resp = await a.client.post(CHAT_PATH, json=body)
            assert resp.status == 400, await resp.text()
            want = satisfies(caps, required_capabilities(CHAT_PATH, body))
            assert want is not None
            assert (await resp.json())["error"] == {
                "message": want.message(MODEL_ID), "type": "invalid_request_error",
                "param": "tool_choice", "code": "unsupported_parameter"}
        for extra in ({"tools": tools, "tool_choice": "auto"},
                      {"response_format": {"type": "text"}}):
            resp = await a.client.post(CHAT_PATH, json={"model": MODEL_ID, "messages": msgs,
                                                        "max_tokens": 2, **extra})
            assert resp.status == 200, await resp.text()
        with pytest.raises(InvalidConstraint) as e:
            compile_grammar(load_tokenizer(tiny_model_path), json_object_grammar(),
                            "response_format")
        assert e.value.param == "response_format" and "not available" in str(e.value)
    finally:
        await close_agent(a)


@pytest.mark.parametrize(("embeddings", "tasks"), [
    (True, ["TextGeneration", "TextEmbedding"]), (False, ["TextGeneration"])])
def test_the_agent_advertises_the_tasks_it_serves(embeddings: bool, tasks: list[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(caps_mod, "EMBEDDINGS_SERVED", embeddings)
    assert caps_mod.served_tasks() == tasks
