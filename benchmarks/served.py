"""Whether a server applied a workload's feature, judged from its responses (plain data, no I/O):
``benchmarks/serving.py``'s ``json``, ``tools``, ``embeddings`` and ``logprobs`` workloads count a
response only when it shows the feature was applied, and a server that refuses or ignores it is
reported as **not served** for that workload — never counted as a fast server, never hidden
among errors (the failure ollama#17013 describes: a JSON schema silently ignored).

Each response gets a *check*:

* ``None`` — nothing to check (the unconstrained workloads);
* ``"valid"`` — the feature shows: the content validates against the workload's JSON schema
  (``jsonschema``, Draft 2020-12), a tool call names an offered function and its arguments
  validate against that function's ``parameters``, the embeddings are one vector per input;
* ``"ignored: …"`` — a complete answer without the feature (text that is not JSON or does not
  validate, no tool call, a body without vectors);
* ``"invalid: …"`` — the feature was attempted but its output is wrong (a tool call to an
  unknown function or with arguments that do not validate, the wrong number of vectors);
* ``"truncated"`` — the answer stopped at ``max_tokens`` (``finish_reason: length``) inside
  what began as JSON or a tool call (content starting with ``{``, ``[`` or ``<tool_call>``):
  nothing can be judged. Text that never began as one is ``ignored`` however it ended.

:func:`classify` turns a round's outcomes into ``not_served`` (a reason, or ``None``) and the
error count.
"""

from __future__ import annotations

import base64
import json
from typing import Any

#: The ``json`` workload's schema: bounded (at most about 110 characters compact, so an answer
#: that follows it ends well within the workload's ``max_tokens``), with a string bound, an
#: integer range, an enum array with a size bound and a boolean — what a constrained decoder
#: must enforce.
JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}

#: The ``tools`` workload's one function (OpenAI's ``tools`` entry).
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}

#: HTTP statuses that mean "this server does not take this request" (a refusal of the feature
#: or the route), as opposed to a failure while serving it (5xx).
REFUSAL_STATUSES = frozenset({400, 404, 405, 415, 422, 501})


def _validation_error(instance: Any, schema: dict[str, Any]) -> str | None:
    """``None`` if ``instance`` validates against ``schema``, else jsonschema's best message."""
    import jsonschema

    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(instance))
    return None if error is None else error.message[:120]


def check_json(content: str, finish_reason: str | None,
               schema: dict[str, Any] = JSON_SCHEMA) -> str:
    """The check of a structured-output answer: its ``content`` must parse as JSON and validate
    against ``schema``."""
    try:
        value = json.loads(content)
    except ValueError:
        if finish_reason == "length" and _begins_structured(content):
            return "truncated"
        return f"ignored: content is not JSON ({content[:40]!r})"
    error = _validation_error(value, schema)
    if error is None:
        return "valid"
    return f"ignored: content does not validate against the schema ({error})"


def _begins_structured(content: str) -> bool:
    return content.lstrip().startswith(("{", "[", "<tool_call>"))


def check_tool_calls(tool_calls: list[dict[str, Any]], finish_reason: str | None,
                     content: str = "",
                     tools: list[dict[str, Any]] = (TOOL,)) -> str:  # type: ignore[assignment]
    """The check of an answer to ``tool_choice: required``: at least one call, each naming a
    function of ``tools`` with ``arguments`` (a JSON string, OpenAI's shape) that validate
    against its ``parameters``; ``content``: the answer's text, which tells a call cut off by
    ``max_tokens`` from none at all."""
    if not tool_calls:
        if finish_reason == "length" and _begins_structured(content):
            return "truncated"
        return f"ignored: no tool call ({content[:40]!r})"
    functions = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    for call in tool_calls:
        fn = call.get("function") or {}
        name = fn.get("name")
        if name not in functions:
            return f"invalid: a call to {name!r}, not an offered function"
        try:
            args = json.loads(fn.get("arguments") or "")
        except ValueError:
            if finish_reason == "length":
                return "truncated"
            return f"invalid: arguments are not JSON ({(fn.get('arguments') or '')[:40]!r})"
        error = _validation_error(args, functions[name])
        if error is not None:
            return f"invalid: arguments do not validate ({error})"
    return "valid"


def check_embeddings(body: Any, inputs: int) -> str:
    """The check of a ``/v1/embeddings`` answer to ``inputs`` inputs: ``data`` holds one
    non-empty vector (a float list, or base64 of little-endian float32) per input."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not data:
        return "ignored: no embeddings in the answer"
    if len(data) != inputs:
        return f"invalid: {len(data)} vectors for {inputs} inputs"
    for item in data:
        vector = item.get("embedding") if isinstance(item, dict) else None
        if isinstance(vector, str):
            size = len(base64.b64decode(vector)) // 4
        elif isinstance(vector, list):
            size = len(vector)
        else:
            return "invalid: an embedding is neither a list nor base64"
        if size == 0:
            return "invalid: an empty vector"
    return "valid"


def check_logprobs(entries: int) -> str:
    """The check of a ``logprobs`` answer: ``"valid"`` when its events carried token entries
    (``choices[].logprobs.content``), else ``"ignored: no logprobs"``."""
    return "valid" if entries > 0 else "ignored: no logprobs in the answer"


def classify(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """A round's verdict from its per-request outcomes (``{"status": HTTP status or None,
    "error": "" or a message, "check": see the module}``).

    Returns ``{"not_served": reason or None, "errors": int, "error_samples": [...]}``:

    * every request refused with a 4xx of :data:`REFUSAL_STATUSES` → not served, ``refused``;
    * no response ``valid`` and at least one ``ignored`` → not served, ``ignored``;
    * else served, and ``errors`` counts every request without a ``valid`` (or unchecked)
      answer: failures, 5xx, ``invalid``, ``truncated`` and the ``ignored`` among valid ones.
    """
    def bad(o: dict[str, Any]) -> str | None:
        if o.get("error"):
            return o["error"]
        check = o.get("check")
        return None if check in (None, "valid") else check

    samples = sorted({b for o in outcomes if (b := bad(o))})[:3]
    out: dict[str, Any] = {"not_served": None, "errors": sum(bad(o) is not None
                                                             for o in outcomes),
                           "error_samples": samples}
    if outcomes and all(o.get("status") in REFUSAL_STATUSES for o in outcomes):
        out["not_served"] = f"refused: {outcomes[0].get('error') or outcomes[0]['status']}"[:240]
    elif (not any(o.get("check") == "valid" for o in outcomes)
          and any(str(o.get("check")).startswith("ignored") for o in outcomes)):
        first = next(o["check"] for o in outcomes if str(o.get("check")).startswith("ignored"))
        out["not_served"] = first[:240]
    return out
