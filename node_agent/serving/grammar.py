"""What a constrained request's output must match, as an llguidance grammar (a string): pure.

Three sources (issue 20), each a function from plain request data to the grammar text that
:mod:`node_agent.serving.constrain` compiles against a revision's tokenizer:

* :func:`json_object_grammar` — OpenAI's ``response_format: {"type": "json_object"}``: any JSON
  object.
* :func:`json_schema_grammar` — ``response_format: {"type": "json_schema", "json_schema":
  {"schema": ...}}``: JSON valid against the schema (llguidance's JSON-schema compiler; its
  supported keywords: https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md).
* :func:`tool_call_grammar` — ``tool_choice: "required"`` or a named function: one (or, with
  ``parallel``, up to :data:`MAX_PARALLEL_CALLS`) tool calls in the model's tool-call envelope
  (:data:`ENVELOPES`, by mlx-lm tool-parser name), each ``{"name": <a tool>, "arguments":
  <JSON valid against that tool's parameters schema>}``.

JSON is compact (llguidance ``whitespace_flexible: false``: no whitespace between tokens): a
small or random-weight model would otherwise spend its tokens on whitespace. Keywords llguidance
knows but does not implement (``if``/``then``/``else``, ``not``, ``dependentSchemas``, …) are
refused (``lenient: false``), so none is silently unenforced. Keywords it does not know (a
typo'd ``maxlength``, a vendor ``x-…`` key) are ignored, as JSON Schema allows (its 2020-12
Core treats unknown keywords as annotations, not errors). Unlike OpenAI's ``strict: true``,
they are not refused: llguidance (1.9) has no option to refuse them (its
``JsonCompileOptions``: ``lenient`` only turns the refusal of unimplemented keywords off), and
telling a misspelt keyword from a vendor extension or an annotation needs a schema walker of
our own. Compiling (and so finding an
unimplemented keyword) happens in :mod:`~node_agent.serving.constrain`; here nothing is validated
but the shapes.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

__all__ = ["JSON_OPTIONS", "ENVELOPES", "MAX_PARALLEL_CALLS", "json_object_grammar",
           "json_schema_grammar", "tool_call_grammar", "envelope"]

#: llguidance JSON compile options forced on every schema (``x-guidance``; they override the
#: schema's own): compact JSON, keywords llguidance does not implement refused (unknown ones are
#: ignored: see the module docstring).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "lenient": False}

#: The tool-call envelopes constrained decoding can write, by mlx-lm tool parser
#: (``mlx_lm.tool_parsers.<name>``): ``(before the call's JSON, after it, between two calls)``.
#: ``json_tools`` is the Qwen/Hermes ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
#: form (its parser ``json.loads`` what lies between the start and end strings). Other parsers'
#: formats are not JSON-enveloped: ``required`` / a named function is refused for them.
ENVELOPES: dict[str, tuple[str, str, str]] = {
    "json_tools": ("<tool_call>\n", "\n</tool_call>", "\n"),
}

#: Most calls one ``tool_choice: "required"`` answer holds with ``parallel_tool_calls`` (a bound,
#: so that a model that never chooses to stop still ends).
MAX_PARALLEL_CALLS = 8


def _lark_string(s: str) -> str:
    return json.dumps(s)  # llguidance's Lark reads JSON-style string literals


def _with_options(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": dict(JSON_OPTIONS)}


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    """The grammar of JSON valid against ``schema`` (a JSON Schema object)."""
    if not isinstance(schema, Mapping):
        raise TypeError("a JSON schema is an object")
    return "start: %json " + json.dumps(_with_options(schema))


def json_object_grammar() -> str:
    """The grammar of any JSON object (OpenAI's ``json_object`` response format)."""
    return json_schema_grammar({"type": "object"})


def envelope(parser: str | None) -> tuple[str, str, str] | None:
    """The tool-call envelope of mlx-lm tool parser ``parser`` (:data:`ENVELOPES`), or None
    when constrained decoding cannot write that format."""
    return ENVELOPES.get(parser or "")


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], parser: str, *,
                      name: str | None = None, parallel: bool = False) -> str:
    """The grammar of tool calls in ``parser``'s envelope (:data:`ENVELOPES`).

    ``tools``: OpenAI function tools (``{"type": "function", "function": {"name",
    "parameters"?}}``; no ``parameters``: any JSON object); ``name``: only that function (a named
    ``tool_choice``), else any of them (``required``); ``parallel``: 1 to
    :data:`MAX_PARALLEL_CALLS` calls, else exactly one. Raises ``KeyError`` for a parser without
    an envelope or a ``name`` that is not among ``tools``."""
    before, after, between = ENVELOPES[parser]
    functions = [t["function"] for t in tools]
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise KeyError(name)
    rules = []
    alternatives = []
    for i, f in enumerate(functions):
        params = f.get("parameters") or {"type": "object"}
        head = '{"name": ' + json.dumps(f["name"]) + ', "arguments": '
        rules.append(f"call_{i}: {_lark_string(before + head)} args_{i} "
                     f"{_lark_string('}' + after)}")
        rules.append(f"args_{i}: %json {json.dumps(_with_options(params))}")
        alternatives.append(f"call_{i}")
    rules.append("call: " + " | ".join(alternatives))
    if parallel:
        more = f"({_lark_string(between)} call){{0,{MAX_PARALLEL_CALLS - 1}}}"
        start = f"start: call {more}"
    else:
        start = "start: call"
    return "\n".join(["%llguidance {}", start, *rules])
