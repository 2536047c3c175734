"""What a chat request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` /
``response_format`` ask of the serving core, for the revision's tool-call format: pure.

:func:`plan_output` turns them into an :class:`OutputPlan` — the tools the chat template
renders, the grammar constrained decoding enforces (:mod:`node_agent.serving.grammar`), and
whether the answer's tool calls are parsed — or a :class:`PlanError` (a 400 naming the field),
never a silently ignored option:

================================  ==========================================================
``tool_choice`` (with ``tools``)  what happens
================================  ==========================================================
``none``                          tools not shown to the model; plain text answer
``auto`` (default)                tools rendered; calls parsed by the model's mlx-lm tool
                                  parser (none known for the model: 400 naming ``tools``)
``required``                      tools rendered; output constrained to 1 call (up to
                                  :data:`~node_agent.serving.grammar.MAX_PARALLEL_CALLS`
                                  with ``parallel_tool_calls``) in the model's envelope,
                                  arguments valid against the function's ``parameters``
named function                    likewise, exactly one call of that function
================================  ==========================================================

``tool_choice`` other than ``none`` without tools, a named function not among the tools, two
tools of one name, ``required`` / named for a tool-call format constrained decoding cannot
write (in the capabilities' words: ``tool_choice_enforced`` is false there, so the agent's
capability check answers it first), and ``response_format`` JSON together with tool calls are 400s.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from mlx_fleet.capabilities import Capability, Missing, Need

from ..api_models import ChatCompletionRequest, ChatMessage, NamedToolChoice
from ..serving.grammar import (envelope, json_object_grammar, json_schema_grammar,
                               tool_call_grammar)
from ..serving.types import ToolFormat

__all__ = ["OutputPlan", "PlanError", "plan_output", "template_messages", "SCHEMA_PARAM"]

#: The field a response-format schema error names.
SCHEMA_PARAM = "response_format.json_schema.schema"


class PlanError(ValueError):
    """A 400 ``invalid_request_error``: ``param`` names the field, ``code`` is OpenAI's
    ``invalid_value`` or ``unsupported_parameter``."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.code = code


@dataclasses.dataclass(frozen=True)
class OutputPlan:
    """``tools``: OpenAI tools for the chat template (None: none rendered); ``grammar`` /
    ``grammar_param``: the output constraint and the field it came from (None: unconstrained);
    ``tool_format``: parse tool calls out of the answer with it (None: the answer is text)."""

    tools: list[dict[str, Any]] | None = None
    grammar: str | None = None
    grammar_param: str = "grammar"
    tool_format: ToolFormat | None = None


def plan_output(req: ChatCompletionRequest, tool_format: ToolFormat | None) -> OutputPlan:
    """The plan for ``req`` on a revision whose model writes tool calls as ``tool_format``
    (None: mlx-lm knows no tool parser for it). Raises :class:`PlanError`."""
    choice = req.tool_choice
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    rf = req.response_format
    json_format = rf is not None and rf.type != "text"
    if not tools:
        if choice not in (None, "none"):
            raise PlanError("tool_choice", "only allowed when tools are given")
        return _format_plan(req)
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise PlanError("tools", "two tools have the same function name")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return _format_plan(req)
    if json_format:
        raise PlanError("response_format", "a JSON response format cannot be combined with "
                        "tool calls (use tool_choice none, or no response_format)",
                        code="unsupported_parameter")
    if tool_format is None:
        raise PlanError("tools", "this model has no tool-call format that mlx-lm can parse "
                        "(no tool parser for its chat template), so it cannot call tools",
                        code="unsupported_parameter")
    if choice == "auto":
        return OutputPlan(tools=tools, tool_format=tool_format)
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if name is not None and name not in names:
        raise PlanError("tool_choice.function.name", f"no tool is named {name!r}")
    if envelope(tool_format.parser) is None:
        # the capabilities (tool_choice_enforced false) refuse this first; the same words
        missing = Missing(Need(Capability.TOOL_CHOICE, "tool_choice"))
        raise PlanError(missing.param, missing.message(req.model).removeprefix(
            f"{missing.param}: "), code=missing.code)
    grammar = tool_call_grammar(tools, tool_format.parser, name=name,
                                parallel=name is None and req.parallel_tool_calls)
    return OutputPlan(tools=tools, grammar=grammar, grammar_param="tools",
                      tool_format=tool_format)


def _format_plan(req: ChatCompletionRequest) -> OutputPlan:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return OutputPlan()
    if rf.type == "json_object":
        return OutputPlan(grammar=json_object_grammar(), grammar_param="response_format")
    assert rf.json_schema is not None  # the model's validator
    return OutputPlan(grammar=json_schema_grammar(rf.json_schema.json_schema),
                      grammar_param=SCHEMA_PARAM)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The history as the chat template reads it: ``{"role", "content"}`` (text), plus an
    assistant's ``tool_calls`` (``arguments`` decoded from its JSON string to an object when it
    is one, as mlx-lm's server does: templates write ``arguments | tojson``) and a tool
    message's ``tool_call_id`` / ``name``."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [_call(c.id, c.function.name, c.function.arguments)
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _call(call_id: str, name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass   # kept as the string the client sent
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}
