"""OpenAI request fields this fleet does not apply, and when a request's value asks for nothing.

Pure data and predicates (no I/O), shared by the node agent's request parsing
(``node_agent.api.parse``) and, where it answers the same, the fleet router. The rule (issue 20:
"never accept a feature and quietly not apply it"): a field of OpenAI's Chat Completions or
legacy Completions API that changes the output — or promises an action — and that no model here
applies is accepted only in the spelling that asks for nothing (:data:`NOT_APPLIED`, checked by
:func:`is_off`), otherwise answered 400 ``invalid_request_error`` ``unsupported_parameter``
naming it; OpenAI's pure metadata fields are accepted and change nothing (:data:`NO_EFFECT`);
a field OpenAI does not have is a 400 too (:data:`UNRECOGNIZED`, OpenAI's own wording).

Field list: the ``openai`` Python client's ``CompletionCreateParams`` of ``chat`` and of the
legacy ``completions`` (openai 3.57).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

__all__ = ["LEGACY_REFUSED", "LEGACY_REFUSAL", "UNRECOGNIZED", "NOT_APPLIED", "NO_EFFECT",
           "is_off", "not_applied"]

#: Options served on chat completions that OpenAI's legacy ``/v1/completions`` does not have:
#: refused there unless off (:func:`is_off`: null, ``tools: []``, ``tool_choice: "none"``,
#: ``response_format: {"type": "text"}``), never ignored.
LEGACY_REFUSED = ("tools", "tool_choice", "response_format")
#: The message of that refusal (``.format(param=...)``), ``code`` ``unsupported_parameter``.
LEGACY_REFUSAL = ("{param}: {param} is not supported on /v1/completions (OpenAI's legacy "
                  "endpoint has none: use /v1/chat/completions)")
#: The message of a body's field OpenAI's API does not have (OpenAI answers "Unrecognized
#: request argument supplied: X"), ``code`` ``unsupported_parameter``.
UNRECOGNIZED = "{param}: Unrecognized request argument supplied: {param}"
#: The message of a :data:`NOT_APPLIED` field that is not off (``param``, ``spelling``).
NOT_APPLIED_MESSAGE = ("{param}: {param} is not supported by this server (accepted only as "
                       "{spelling})")


#: Fields off only when null: an object there asks for something even when empty (OpenAI runs
#: a web search for ``web_search_options: {}``).
_NULL_ONLY = frozenset({"audio", "prediction", "reasoning_effort", "verbosity",
                        "web_search_options", "moderation", "prompt_cache_retention",
                        "prompt_cache_options"})


def is_off(param: str, value: Any) -> bool:
    """Whether ``value`` (parsed JSON, or the validated request's attribute) of the OpenAI field
    ``param`` asks for nothing: null, ``false``, ``0``, ``""``, ``[]`` or ``{}``; and per field
    ``tool_choice`` / ``function_call`` ``"none"``, ``response_format`` whose ``type`` is
    ``"text"`` or null (an object or a parsed model; other keys are not looked at: a validated
    request's dump has ``"json_schema": None``), ``modalities`` ``["text"]``, ``service_tier``
    ``"auto"`` or
    ``"default"``; only null for the fields of ``_NULL_ONLY`` (``audio``, ``prediction``,
    ``web_search_options``, ...)."""
    if param in ("tool_choice", "function_call"):
        return value is None or value == "none"
    if param == "response_format":
        if value is None:
            return True
        if isinstance(value, Mapping):
            return value.get("type") in (None, "text")
        return hasattr(value, "type") and value.type in (None, "text")
    if param in _NULL_ONLY:
        return value is None
    if param == "modalities":
        return value is None or value == ["text"]
    if param == "service_tier":
        return value in (None, "auto", "default")
    if value is None or value is False:
        return True
    return not isinstance(value, bool) and value in (0, "", [], {})  # 0 == 0.0


def _off(param: str) -> Callable[[Any, int], bool]:
    return lambda value, _n: is_off(param, value)


#: OpenAI's fields that no model here applies: field → (whether ``(value, n)`` asks for
#: nothing, the spellings that do, for the message). In checking order; a field absent from an
#: endpoint's body model is not checked there.
NOT_APPLIED: dict[str, tuple[Callable[[Any, int], bool], str]] = {
    **{param: (_off(param), spelling) for param, spelling in (
        ("functions", "null or []: use tools"),
        ("function_call", 'null or "none": use tool_choice'),
        ("logit_bias", "null or {}"),
        ("presence_penalty", "null or 0"),
        ("frequency_penalty", "null or 0"),
        ("echo", "null or false"),
        ("suffix", 'null or ""'),
        ("store", "null or false: nothing is stored"),
        ("service_tier", 'null, "auto" or "default": there is one tier'),
        ("modalities", 'null or ["text"]'),
        ("audio", "null"),
        ("prediction", "null"),
        ("reasoning_effort", "null"),
        ("verbosity", "null"),
        ("web_search_options", "null"),
        ("moderation", "null"),
        ("prompt_cache_retention", "null"),
        ("prompt_cache_options", "null"),
        ("stream_options.include_obfuscation", "null or false: events are not padded"))},
    # best_of = n generates n and returns them: what no best_of does (below n: invalid)
    "best_of": (lambda value, n: value is None or value == n, "null or equal to n"),
}

#: OpenAI's metadata fields, accepted and changing nothing in the output: ``metadata``
#: (OpenAI keeps it with a stored completion; nothing is stored here), ``prompt_cache_key``
#: (a cache-routing hint: the agent's prefix cache serves every request), ``safety_identifier``
#: (OpenAI's abuse monitoring).
NO_EFFECT = ("metadata", "prompt_cache_key", "safety_identifier")


def not_applied(fields: dict[str, Any], n: int = 1) -> tuple[str, str] | None:
    """The first :data:`NOT_APPLIED` field of ``fields`` (a body's field → value; absent ones
    left out or None) that is not off, with its 400 message; None when all are off. ``n``: the
    request's choices (``best_of`` may equal it)."""
    for param, (off, spelling) in NOT_APPLIED.items():
        if param in fields and not off(fields[param], n):
            return param, NOT_APPLIED_MESSAGE.format(param=param, spelling=spelling)
    return None
