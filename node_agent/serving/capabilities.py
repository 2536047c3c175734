"""What a loaded revision serves: its :class:`~mlx_fleet.capabilities.ModelCapabilities`,
computed from the loaded model.

Two steps: :func:`tokenizer_features` reads what the model itself brings, once per load, off
the MLX thread (mlx-lm's tool parser for the model family, from its ``TokenizerWrapper``;
whether llguidance can build a tokenizer for constrained decoding); :func:`model_capabilities`
combines those with what this build of the agent serves and the revision's limits. The result
goes into the revision's reports (``AssignmentReport.capabilities``, read by the fleet router),
onto its ``GET /v1/models`` card, and decides the agent's own 400 for a request the revision
cannot serve (:func:`mlx_fleet.capabilities.satisfies`).

**The switches below** (``TOOL_CALLING_SERVED``, ``STRUCTURED_OUTPUTS_SERVED``,
``LOGPROBS_SERVED`` with ``MAX_TOP_LOGPROBS``, ``EMBEDDINGS_SERVED``) say which of issue 20's
features this build serves; all are on. They are the one place a feature is claimed, so a test
stands in a Mac that lacks one (an older agent in a mixed fleet: tests/test_capabilities_e2e.py)
by turning its switch off, and the capabilities then claim only what is served — never a
feature the agent would accept and not apply. ``n``: the callers pass the agent's bound
(``--max-choices``, the core's ``max_choices``: the convergence's load, the ``/v1/models``
route, the completion route); a revision offers ``min(max_choices, max_concurrent_sequences)``
(its n sequences share one batch); :data:`MAX_N` (1) only where no bound is given.
"""

from __future__ import annotations

import logging
from typing import Any

from mlx_fleet.capabilities import (TASK_TEXT_EMBEDDING, TASK_TEXT_GENERATION, ModelCapabilities,
                                    Task)

from ..api_models import MAX_TOP_LOGPROBS as MAX_TOP_LOGPROBS_OPENAI
from .constrain import ll_tokenizer
from .grammar import envelope
from .types import ModelInfo, TokenizerFeatures

__all__ = ["TOOL_CALLING_SERVED", "STRUCTURED_OUTPUTS_SERVED", "LOGPROBS_SERVED",
           "MAX_TOP_LOGPROBS", "MAX_N", "EMBEDDINGS_SERVED", "tool_parser_name",
           "grammar_tokenizer_ok", "tokenizer_features", "model_capabilities", "served_tasks"]

log = logging.getLogger(__name__)

#: Served by this build of the agent (module docstring). ``MAX_N``: the ``n`` bound when the
#: caller passes none.
TOOL_CALLING_SERVED = True
STRUCTURED_OUTPUTS_SERVED = True
LOGPROBS_SERVED = True
MAX_TOP_LOGPROBS = MAX_TOP_LOGPROBS_OPENAI
MAX_N = 1
EMBEDDINGS_SERVED = True


def served_tasks() -> list[Task]:
    """The model tasks this build serves (``NodeRecord.tasks``, read by placement):
    ``TextGeneration`` always, ``TextEmbedding`` while :data:`EMBEDDINGS_SERVED`."""
    return [TASK_TEXT_GENERATION] + ([TASK_TEXT_EMBEDDING] if EMBEDDINGS_SERVED else [])


def tool_parser_name(tokenizer: Any) -> str | None:
    """mlx-lm's tool parser of a loaded ``TokenizerWrapper`` (the module name under
    ``mlx_lm.tool_parsers``, e.g. ``json_tools``), or None when it has none
    (``has_tool_calling`` false). mlx-lm's ``load_tokenizer`` chose it from the checkpoint's
    ``tokenizer_config.json`` (``tool_parser_type``) or inferred it from the chat template and
    vocabulary; it records the name in the tokenizer's ``init_kwargs``, else it is the parser
    function's module."""
    if not getattr(tokenizer, "has_tool_calling", False) or not getattr(
            tokenizer, "tool_call_start", None):
        return None  # no parser, or none whose calls can be found in the text (ServingCore.tool_format)
    inner = getattr(tokenizer, "_tokenizer", None)
    name = (getattr(inner, "init_kwargs", None) or {}).get("tool_parser_type")
    if isinstance(name, str) and name:
        return name
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    prefix = "mlx_lm.tool_parsers."
    return module[len(prefix):] if module.startswith(prefix) else None


def grammar_tokenizer_ok(tokenizer: Any) -> bool:
    """Whether llguidance builds its tokenizer from the model's Hugging Face tokenizer
    (``llguidance.hf.from_tokenizer``: fast tokenizers only; about a second for a large
    vocabulary, so it runs off the MLX thread, once per load). Never raises: a tokenizer it
    cannot take (a slow one, a broken ``tokenizer.json``) is False, logged."""
    try:
        ll_tokenizer(tokenizer)  # cached: the first constrained request finds it built
    except Exception as e:  # noqa: BLE001 - any failure means: no constrained decoding
        log.info("llguidance cannot build a tokenizer for this model (%s: %s): no structured "
                 "outputs", type(e).__name__, e)
        return False
    return True


def tokenizer_features(tokenizer: Any) -> TokenizerFeatures:
    """What the model's ``TokenizerWrapper`` brings: its tool parser, and whether llguidance
    takes it — checked only while :data:`STRUCTURED_OUTPUTS_SERVED` (else False, unchecked:
    the check costs up to a second per load for nothing). Pure Python; run it off the MLX
    thread."""
    return TokenizerFeatures(
        tool_parser=tool_parser_name(tokenizer),
        grammar=STRUCTURED_OUTPUTS_SERVED and grammar_tokenizer_ok(tokenizer))


def model_capabilities(info: ModelInfo, *,
                       max_choices: int | None = None) -> ModelCapabilities:
    """The capabilities of the loaded revision ``info`` (its ``task``, its ``features`` from
    :func:`tokenizer_features`, its limits) as this build serves them (module docstring).
    ``tool_choice_enforced``: a tool parser whose envelope constrained decoding writes
    (:func:`~node_agent.serving.grammar.envelope`) and structured outputs.
    ``max_choices``: the agent's bound on ``n`` (None: :data:`MAX_N`)."""
    if info.task == TASK_TEXT_EMBEDDING:
        return ModelCapabilities(task=TASK_TEXT_EMBEDDING, embeddings=EMBEDDINGS_SERVED,
                                 max_context_tokens=info.max_context_tokens)
    n = MAX_N if max_choices is None else max_choices
    parser = info.features.tool_parser if TOOL_CALLING_SERVED else None
    structured = STRUCTURED_OUTPUTS_SERVED and info.features.grammar
    return ModelCapabilities(
        task=TASK_TEXT_GENERATION,
        tool_calling=parser is not None,
        tool_parser=parser,
        # required / a named function: the call is written by constrained decoding, in an
        # envelope the grammar module knows for the parser (node_agent.api.structured)
        tool_choice_enforced=parser is not None and structured and envelope(parser) is not None,
        structured_outputs=structured,
        logprobs=LOGPROBS_SERVED,
        max_top_logprobs=MAX_TOP_LOGPROBS if LOGPROBS_SERVED else 0,
        max_n=max(1, min(n, info.max_concurrent_sequences)),
        embeddings=False,
        max_context_tokens=info.max_context_tokens)
