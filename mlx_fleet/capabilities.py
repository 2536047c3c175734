"""What a served model can do, what an OpenAI request needs, and whether the one satisfies the
other: the one definition the node agent (which refuses) and the fleet router (which routes)
share, so that both answer with the same message and code.

* :class:`ModelCapabilities`: per loaded revision, written by its agent into its
  :class:`~mlx_fleet.contract.AssignmentReport` (``capabilities``) and shown on its
  ``GET /v1/models`` card. The agent computes it from the loaded model
  (``node_agent.serving.capabilities.model_capabilities``).
* :func:`required_capabilities`: an OpenAI request body (chat, legacy completions, embeddings)
  → the :class:`Need` s it makes.
* :func:`satisfies`: capabilities and needs → the first :class:`Missing` one, or None; an agent
  answers it as a 400 (:meth:`Missing.message`, :attr:`Missing.code`, ``param``).
* :func:`missing_everywhere`: the router's question over a model's replicas: is there one that
  may serve the request? (A replica whose capabilities are unknown may.)

Compatibility: every field has a default that claims nothing (no tools, no structured outputs,
no logprobs, ``n`` 1), so a record written by an older agent, or a capability added later that
an older agent does not write, never promises what the agent does not do. A report with no
``capabilities`` at all (an agent older than them, or a standby revision never loaded here)
is *unknown*: the router still sends it requests, and that agent refuses what it cannot do.

Codes (OpenAI's own, as its API answers a parameter a model does not support):
``unsupported_parameter`` when the model lacks the capability (or the endpoint lacks the field:
``tools`` / ``tool_choice`` / ``response_format`` on legacy ``/v1/completions``,
:func:`legacy_refused_message`), ``invalid_value`` for a value above OpenAI's own bound
(``top_logprobs`` > 20, legacy ``logprobs`` > 5: the agent's request validation, word for word), ``unsupported_value`` when it has
it with a smaller bound (``n``, ``top_logprobs``); ``wrong_model_task`` (``param`` ``model``)
when the model is served for another task than the endpoint's (a chat request to a
``TextEmbedding`` model, embeddings from a ``TextGeneration`` one). ``type`` is always
``invalid_request_error``, status 400.

Pure: standard library and pydantic.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .openai_fields import LEGACY_REFUSAL, LEGACY_REFUSED, is_off

__all__ = ["Task", "TASK_TEXT_GENERATION", "TASK_TEXT_EMBEDDING", "TASKS", "Capability", "Need",
           "Missing", "WRONG_MODEL_TASK",
           "ModelCapabilities", "CHAT_PATH", "COMPLETIONS_PATH", "EMBEDDINGS_PATH",
           "UNSUPPORTED_PARAMETER", "UNSUPPORTED_VALUE", "INVALID_VALUE", "REQUEST_FIELDS",
           "OPENAI_MAX_TOP_LOGPROBS", "OPENAI_MAX_LEGACY_LOGPROBS", "LEGACY_REFUSED",
           "legacy_refused_message",
           "required_capabilities", "satisfies", "missing_everywhere", "may_serve",
           "beyond_task", "FieldRule", "FIELD_RULES",
           "rules_markdown"]

#: What a model is served for (the ModelDeployment's task): text generation (chat,
#: completions) or embeddings. The names are KubeAI's model ``features``, CamelCase as Kubernetes
#: enum values are; one task per model, as vLLM's ``--task`` (``generate`` / ``embed``).
Task = Literal["TextGeneration", "TextEmbedding"]
TASK_TEXT_GENERATION: Task = "TextGeneration"
TASK_TEXT_EMBEDDING: Task = "TextEmbedding"
TASKS: tuple[Task, ...] = (TASK_TEXT_GENERATION, TASK_TEXT_EMBEDDING)

#: The OpenAI endpoints whose bodies :func:`required_capabilities` reads.
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"

#: Error codes (module docstring).
UNSUPPORTED_PARAMETER = "unsupported_parameter"
UNSUPPORTED_VALUE = "unsupported_value"
WRONG_MODEL_TASK = "wrong_model_task"
INVALID_VALUE = "invalid_value"

#: OpenAI's bounds on the number of top logprobs: chat's ``top_logprobs`` and legacy
#: completions' ``logprobs`` (API reference). Above them a request is invalid whatever the
#: model (400 ``invalid_value``, :func:`required_capabilities`).
OPENAI_MAX_TOP_LOGPROBS = 20
OPENAI_MAX_LEGACY_LOGPROBS = 5

def legacy_refused_message(param: str) -> str:
    """The 400's message (code ``unsupported_parameter``) for
    :data:`~mlx_fleet.openai_fields.LEGACY_REFUSED` field ``param`` sent to ``/v1/completions``
    (:data:`~mlx_fleet.openai_fields.LEGACY_REFUSAL`, the agent's own words)."""
    return LEGACY_REFUSAL.format(param=param)


def _above_bound_message(param: str, bound: int) -> str:
    """The agent's request validation's message for ``param`` above ``bound`` (pydantic's
    ``less_than_equal`` text, as ``node_agent.api.parse.validation_error`` answers it)."""
    return f"{param}: Input should be less than or equal to {bound}"

#: The endpoints that serve each task (named in a ``wrong_model_task`` message).
_ENDPOINTS = {TASK_TEXT_GENERATION: f"POST {CHAT_PATH} or {COMPLETIONS_PATH}",
              TASK_TEXT_EMBEDDING: f"POST {EMBEDDINGS_PATH}"}

#: The request fields :func:`required_capabilities` reads besides the path (an agent that has
#: parsed the body into a model passes ``model.model_dump(include=REQUEST_FIELDS)``).
REQUEST_FIELDS = frozenset({"tools", "tool_choice", "response_format", "logprobs",
                            "top_logprobs", "n"})


class Capability(str, enum.Enum):
    """One thing a request may need. The order of the members is the order in which
    :func:`satisfies` reports missing ones (the endpoint first)."""

    GENERATE = "generate"                      # chat / completions: a generate model
    EMBEDDINGS = "embeddings"                  # /v1/embeddings
    TOOL_CALLING = "tool_calling"              # tools with tool_choice other than "none"
    TOOL_CHOICE = "tool_choice"                # tool_choice required / a named function
    STRUCTURED_OUTPUTS = "structured_outputs"  # response_format json_object / json_schema
    LOGPROBS = "logprobs"                      # logprobs / top_logprobs (amount: top k)
    N = "n"                                    # n > 1 (amount: n)


_RANK = {c: i for i, c in enumerate(Capability)}

#: How a missing capability is named in messages.
_WHAT = {Capability.GENERATE: "text generation (chat and completions)",
         Capability.EMBEDDINGS: "embeddings",
         Capability.TOOL_CALLING: "tool calling",
         Capability.TOOL_CHOICE: "an enforced tool choice (required or a named function; "
                                 "use auto)",
         Capability.STRUCTURED_OUTPUTS: "structured outputs (response_format json_object / "
                                        "json_schema)",
         Capability.LOGPROBS: "logprobs",
         Capability.N: "n > 1"}


@dataclass(frozen=True, slots=True)
class Need:
    """A capability a request needs: ``capability``, the request field that asks for it
    (``param``: ``model``, ``tools``, ``tool_choice``, ``response_format``, ``logprobs``,
    ``top_logprobs``, ``n``) and, for bounded ones, the ``amount`` asked (``n``; the number of
    top logprobs, 0 for the chosen token's only).

    ``refused`` / ``refused_code``: a request no model serves (a field the endpoint lacks, a
    value above OpenAI's bound): the 400's message and code, answered before any capability
    (as the agent validates the request before it looks at the model)."""

    capability: Capability
    param: str
    amount: int = 0
    refused: str = ""
    refused_code: str = ""

    def sort_key(self) -> tuple[int, int, str, int]:
        return (0 if self.refused else 1, _RANK[self.capability], self.param, self.amount)


class ModelCapabilities(BaseModel):
    """What one loaded revision serves (all fields default to claiming nothing).

    ``task``: ``TextGeneration`` (chat and completions) or ``TextEmbedding``
    (``/v1/embeddings``), the deployment's task. ``tool_calling``: ``tools`` are rendered into the prompt and the model's
    tool calls parsed into ``tool_calls``; ``tool_parser``: mlx-lm's parser for it
    (``mlx_lm.tool_parsers.<name>``, e.g. ``json_tools``, ``qwen3_coder``; null without tool
    calling). ``tool_choice_enforced``: ``tool_choice`` ``required`` / a named function served
    (the call constrained to the tools' schemas: needs a tool-call envelope constrained decoding
    can write for the parser, and structured outputs). ``structured_outputs``: ``response_format`` ``json_object`` / ``json_schema`` by
    constrained decoding. ``logprobs``: ``logprobs`` answered; ``max_top_logprobs``: the most
    ``top_logprobs`` (chat) or ``logprobs`` (legacy completions) it answers (OpenAI's bound is
    20). ``max_n``: the most choices per request (``n``). ``embeddings``: ``/v1/embeddings``
    answered. ``max_context_tokens``: prompt plus completion tokens a request may use (0:
    unknown)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    task: Task = TASK_TEXT_GENERATION
    tool_calling: bool = False
    tool_parser: str | None = None
    tool_choice_enforced: bool = False
    structured_outputs: bool = False
    logprobs: bool = False
    max_top_logprobs: Annotated[int, Field(ge=0)] = 0
    max_n: Annotated[int, Field(ge=1)] = 1
    embeddings: bool = False
    max_context_tokens: Annotated[int, Field(ge=0)] = 0

    def limit(self, capability: Capability) -> int | None:
        """The most a bounded ``capability`` offers here (``n``: :attr:`max_n`; logprobs:
        :attr:`max_top_logprobs` when :attr:`logprobs`), None for the others and for logprobs
        when not offered."""
        if capability is Capability.N:
            return self.max_n
        if capability is Capability.LOGPROBS:
            return self.max_top_logprobs if self.logprobs else None
        return None

    def supports(self, need: Need) -> bool:
        """Whether this revision serves ``need``."""
        c = need.capability
        if c is Capability.GENERATE:
            return self.task == TASK_TEXT_GENERATION
        if c is Capability.EMBEDDINGS:
            return self.task == TASK_TEXT_EMBEDDING and self.embeddings
        if need.refused:
            return False
        if c is Capability.TOOL_CALLING:
            return self.tool_calling
        if c is Capability.TOOL_CHOICE:
            return self.tool_calling and self.structured_outputs and self.tool_choice_enforced
        if c is Capability.STRUCTURED_OUTPUTS:
            return self.structured_outputs
        if c is Capability.LOGPROBS:
            return self.logprobs and need.amount <= self.max_top_logprobs
        return need.amount <= self.max_n


@dataclass(frozen=True, slots=True)
class Missing:
    """The need a model (or, at the router, every replica of it) does not serve, with the most
    it offers of a bounded capability (``limit``; None when it does not offer it at all) and
    the model's ``task`` (what it is served for: named when that is the reason)."""

    need: Need
    limit: int | None = None
    task: Task = TASK_TEXT_GENERATION

    @property
    def wrong_task(self) -> bool:
        """The model is served for another task than the request's endpoint."""
        c = self.need.capability
        return not self.need.refused and ((c is Capability.GENERATE and self.task != TASK_TEXT_GENERATION)
                or (c is Capability.EMBEDDINGS and self.task != TASK_TEXT_EMBEDDING))

    @property
    def param(self) -> str:
        """The request field at fault (OpenAI's ``param``)."""
        return self.need.param

    @property
    def code(self) -> str:
        """``wrong_model_task`` when the model is served for another task,
        ``unsupported_value`` for a bound exceeded, else ``unsupported_parameter`` (module
        docstring); a :attr:`Need.refused` need's own code."""
        if self.need.refused:
            return self.need.refused_code
        if self.wrong_task:
            return WRONG_MODEL_TASK
        bounded = self.limit is not None and self.need.capability in (Capability.N,
                                                                       Capability.LOGPROBS)
        if bounded and not (self.need.capability is Capability.N and self.limit == 1):
            return UNSUPPORTED_VALUE
        return UNSUPPORTED_PARAMETER

    def message(self, model: str) -> str:
        """The 400's message for a request to ``model`` (the served name), naming the field."""
        need = self.need
        p = need.param
        if need.refused:
            return need.refused
        if self.wrong_task:
            return (f"model: the model '{model}' is served for {self.task}: use "
                    f"{_ENDPOINTS[self.task]}")
        if need.capability is Capability.EMBEDDINGS:
            return f"model: embeddings are not supported by the model '{model}'"
        if self.limit is not None and need.capability is Capability.N:
            return (f"n: n = {need.amount} is not supported by the model '{model}' "
                    f"(at most {self.limit})")
        if self.limit is not None and need.capability is Capability.LOGPROBS:
            return (f"{p}: {need.amount} top logprobs are not supported by the model "
                    f"'{model}' (at most {self.limit})")
        return f"{p}: {_WHAT[need.capability]} is not supported by the model '{model}'"


def _whole(v: Any) -> int | None:
    """``v`` as an int when it is a JSON integer or a number with a zero fraction (not a
    boolean), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def required_capabilities(path: str, body: Mapping[str, Any]) -> frozenset[Need]:
    """What the OpenAI request ``body`` (a parsed JSON object, not validated) sent to ``path``
    needs. Never raises: a malformed field is the agent's validation to refuse (400
    ``invalid_value``), not a need.

    * ``/v1/embeddings`` → :attr:`Capability.EMBEDDINGS` (param ``model``); nothing else.
    * ``/v1/chat/completions``, ``/v1/completions`` → :attr:`Capability.GENERATE` (``model``),
      plus:

      - ``tools`` non-empty and ``tool_choice`` other than ``"none"`` → tool calling
        (``tools``); ``tool_choice`` other than ``"none"`` without tools → tool calling
        (``tool_choice``); with tools, ``tool_choice`` ``"required"`` or a named function
        (an object) → also :attr:`Capability.TOOL_CHOICE` (``tool_choice``);
      - ``response_format`` whose ``type`` is other than absent/null/``"text"`` → structured
        outputs (a dumped ``{"type": "text", "json_schema": None}`` is off too);
      - ``logprobs`` other than absent/null/false/0 → logprobs (``logprobs``; ``amount``: its
        value when it is a number — legacy completions' top-k — else 0); ``top_logprobs`` other
        than absent/null/0 → logprobs (``top_logprobs``, ``amount`` its value);

      "off" is :func:`mlx_fleet.openai_fields.is_off`, the rule the agent refuses by;
      - ``n`` a whole number > 1 → :attr:`Capability.N` (``amount`` n).

    Refused whatever the model (:attr:`Need.refused`, answered first): on
    ``/v1/completions``, a :data:`LEGACY_REFUSED` field in another than its off spelling
    (``unsupported_parameter``, :func:`legacy_refused_message`) instead of its capability
    need; a whole ``top_logprobs`` above :data:`OPENAI_MAX_TOP_LOGPROBS` (chat) or legacy
    ``logprobs`` above :data:`OPENAI_MAX_LEGACY_LOGPROBS` (``invalid_value``, the agent's
    validation message).

    * any other path → nothing.

    The "off" spellings are those the agent has always accepted (``tools: []``, ``tool_choice:
    "none"``, ``response_format: {"type": "text"}``, ``logprobs: false``, ``n: 1``).
    """
    if path == EMBEDDINGS_PATH:
        return frozenset({Need(Capability.EMBEDDINGS, "model")})
    if path not in (CHAT_PATH, COMPLETIONS_PATH):
        return frozenset()
    legacy = path == COMPLETIONS_PATH
    needs = {Need(Capability.GENERATE, "model")}
    tools, choice = body.get("tools"), body.get("tool_choice")
    choice_on = not is_off("tool_choice", choice)
    field_needs: list[Need] = []
    if not is_off("tools", tools) and choice != "none":  # absent tool_choice: "auto"
        field_needs.append(Need(Capability.TOOL_CALLING, "tools"))
        if choice == "required" or isinstance(choice, Mapping):
            field_needs.append(Need(Capability.TOOL_CHOICE, "tool_choice"))
    elif choice_on:
        field_needs.append(Need(Capability.TOOL_CALLING, "tool_choice"))
    if not is_off("response_format", body.get("response_format")):
        field_needs.append(Need(Capability.STRUCTURED_OUTPUTS, "response_format"))
    if legacy:
        field_needs = [Need(n.capability, n.param, refused=legacy_refused_message(n.param),
                            refused_code=UNSUPPORTED_PARAMETER)
                       for n in field_needs if n.capability is not Capability.TOOL_CHOICE]
    needs.update(field_needs)
    logprobs = body.get("logprobs")
    if not is_off("logprobs", logprobs):
        amount = max(_whole(logprobs) or 0, 0)
        needs.add(_logprobs_need("logprobs", amount, OPENAI_MAX_LEGACY_LOGPROBS if legacy
                                 else None))
    top = body.get("top_logprobs")
    if not is_off("top_logprobs", top):
        needs.add(_logprobs_need("top_logprobs", max(_whole(top) or 0, 0),
                                 None if legacy else OPENAI_MAX_TOP_LOGPROBS))
    n = _whole(body.get("n"))
    if n is not None and n > 1:
        needs.add(Need(Capability.N, "n", n))
    return frozenset(needs)


def _logprobs_need(param: str, amount: int, openai_bound: int | None) -> Need:
    """The logprobs need of ``param`` asking ``amount``; refused (``invalid_value``) above
    ``openai_bound`` (None: no bound of OpenAI's applies to the field here)."""
    if openai_bound is not None and amount > openai_bound:
        return Need(Capability.LOGPROBS, param, amount,
                    refused=_above_bound_message(param, openai_bound),
                    refused_code=INVALID_VALUE)
    return Need(Capability.LOGPROBS, param, amount)


def _ordered(needs: Iterable[Need]) -> list[Need]:
    return sorted(needs, key=Need.sort_key)


def satisfies(caps: ModelCapabilities, needs: Iterable[Need]) -> Missing | None:
    """The first of ``needs`` (in :class:`Capability` order) that ``caps`` does not serve, as a
    :class:`Missing` with ``caps``' bound for it; None when it serves them all."""
    for need in _ordered(needs):
        if not caps.supports(need):
            return Missing(need, caps.limit(need.capability), caps.task)
    return None


_TASK_CAPABILITIES = (Capability.GENERATE, Capability.EMBEDDINGS)


def beyond_task(needs: Iterable[Need]) -> bool:
    """``needs`` ask more than the endpoint's task (plain generate / embeddings): a capability
    that only a replica's reported capabilities can promise."""
    return any(n.capability not in _TASK_CAPABILITIES or n.refused for n in needs)


def may_serve(caps: ModelCapabilities | None, needs: Iterable[Need],
              task: Task | None = None) -> bool:
    """Whether a replica may serve ``needs``: its capabilities :func:`satisfies` them; when they
    are unknown (None: an agent older than them, a standby never loaded), whether its ``task``
    (the assignment's; None: unknown too) fits the endpoint — the rest its agent decides. A
    :attr:`Need.refused` need is served by none."""
    needs = list(needs)
    if caps is not None:
        return satisfies(caps, needs) is None
    if any(n.refused for n in needs):
        return False
    if task is None:
        return True
    return satisfies(_task_view(task),
                     [n for n in needs if n.capability in _TASK_CAPABILITIES]) is None


def _task_view(task: Task) -> ModelCapabilities:
    """What a replica of ``task`` whose capabilities are unknown is known to serve: its task's
    endpoint (nothing else is claimed)."""
    return ModelCapabilities(task=task, embeddings=task == TASK_TEXT_EMBEDDING)


def missing_everywhere(replicas: Iterable[ModelCapabilities | Task | None],
                       needs: Iterable[Need]) -> Missing | None:
    """The router's check over one model's replicas (a :data:`Task` name: a replica whose
    capabilities are unknown but whose assignment's task is that; ``None``: one of which
    nothing is known). None when some replica may serve ``needs`` (:func:`may_serve`: one that
    :func:`satisfies` them, or an unknown one of the endpoint's task), or when there are no
    replicas (then nothing is known: 503, not 400).
    Otherwise the :class:`Missing` to answer: the first need (in :class:`Capability` order)
    that no replica serves, with the largest bound any replica offers for it; when each need
    is served by some replica but no replica serves them all, the first replica's (in the given
    order) first missing need. A :attr:`Need.refused` need is answered first, whatever the
    replicas (no model serves it)."""
    ordered = _ordered(needs)
    if ordered and ordered[0].refused:
        return Missing(ordered[0])
    known: list[ModelCapabilities] = []
    for caps in replicas:
        if caps is None:
            return None
        if isinstance(caps, str):  # unknown capabilities of a known task
            if may_serve(None, ordered, caps):
                return None
            caps = _task_view(caps)  # refuses on the task: the message names it
        known.append(caps)
    if not known or any(satisfies(c, ordered) is None for c in known):
        return None
    for need in ordered:
        if not any(c.supports(need) for c in known):
            limits = [x for c in known if (x := c.limit(need.capability)) is not None]
            return Missing(need, max(limits) if limits else None, known[0].task)
    return satisfies(known[0], ordered)


@dataclass(frozen=True, slots=True)
class FieldRule:
    """One row of the capability table (documentation: the agent's OpenAPI document, the
    docs): request field ``param``, ``when`` it needs ``capability`` (in words), the
    :class:`ModelCapabilities` fields that decide, and an ``example`` body on ``path``
    (``tests/test_capabilities.py`` checks that :func:`required_capabilities` of each example
    makes that need, so the table cannot drift from the rule)."""

    param: str
    when: str
    capability: Capability
    decided_by: str
    path: str
    example: Mapping[str, Any]


FIELD_RULES: tuple[FieldRule, ...] = (
    FieldRule("model", "any chat or completions request", Capability.GENERATE,
              "`task` = `TextGeneration`", CHAT_PATH, {}),
    FieldRule("model", "any embeddings request", Capability.EMBEDDINGS,
              "`task` = `TextEmbedding` and `embeddings`", EMBEDDINGS_PATH, {"input": "x"}),
    FieldRule("tools", "non-empty, `tool_choice` not `\"none\"`", Capability.TOOL_CALLING,
              "`tool_calling` (`tool_parser`)", CHAT_PATH,
              {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    FieldRule("tool_choice", "not `\"none\"` without `tools`", Capability.TOOL_CALLING,
              "`tool_calling`", CHAT_PATH, {"tool_choice": "auto"}),
    FieldRule("tool_choice", "`\"required\"` or a named function, with `tools`",
              Capability.TOOL_CHOICE,
              "`tool_choice_enforced` (with `tool_calling`, `structured_outputs`)", CHAT_PATH,
              {"tools": [{"type": "function", "function": {"name": "f"}}],
               "tool_choice": "required"}),
    FieldRule("response_format", "`json_object` or `json_schema` (anything but `text`)",
              Capability.STRUCTURED_OUTPUTS, "`structured_outputs`", CHAT_PATH,
              {"response_format": {"type": "json_object"}}),
    FieldRule("logprobs", "true (chat) or k > 0 (completions: top k)", Capability.LOGPROBS,
              "`logprobs`, k ≤ `max_top_logprobs`", COMPLETIONS_PATH, {"logprobs": 2}),
    FieldRule("top_logprobs", "k > 0", Capability.LOGPROBS, "`logprobs`, k ≤ `max_top_logprobs`",
              CHAT_PATH, {"logprobs": True, "top_logprobs": 3}),
    FieldRule("n", "> 1", Capability.N, "n ≤ `max_n`", CHAT_PATH, {"n": 2}),
)


def rules_markdown() -> str:
    """:data:`FIELD_RULES` as a Markdown table (field, when, needs, decided by)."""
    rows = ["| field | when | needs | decided by (`capabilities`) |",
            "|---|---|---|---|"]
    rows += [f"| `{r.param}` | {r.when} | {r.capability.value} | {r.decided_by} |"
             for r in FIELD_RULES]
    return "\n".join(rows)
