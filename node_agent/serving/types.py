"""Plain values the serving core hands out: a loaded revision's :class:`ModelInfo`, a
generation's :class:`Chunk`, a :class:`MemoryUsage` measurement and a load's
:class:`LoadProgress`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mlx_fleet.capabilities import TASK_TEXT_GENERATION, Task

from .embed_profile import EmbeddingProfile

__all__ = ["ModelKey", "TokenizerFeatures", "ModelInfo", "Chunk", "MemoryUsage",
           "LoadProgress", "ToolFormat"]

#: A resident revision's identity: ``(model_id, revision)``.
ModelKey = tuple[str, str]


@dataclass(frozen=True)
class TokenizerFeatures:
    """What a revision's tokenizer brings for the capabilities
    (:func:`node_agent.serving.capabilities.tokenizer_features`): ``tool_parser``, mlx-lm's
    tool parser for it (``mlx_lm.tool_parsers.<name>``; None: none); ``grammar``: llguidance
    builds a tokenizer from it (constrained decoding; False also when not checked)."""

    tool_parser: str | None = None
    grammar: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """A loaded model revision. ``created_unix``: load time, seconds since the epoch;
    ``max_context_tokens``: prompt + completion limit in tokens; ``kv_cache_bytes_per_token``:
    KV-cache bytes one token of one sequence holds
    (:func:`node_agent.memory_estimate.kv_cache_bytes_per_token` of its ``config.json``; 0 when
    that cannot be read: then no KV bound applies to it); ``features``: what its tokenizer
    brings for its capabilities
    (:func:`node_agent.serving.capabilities.model_capabilities`); ``task``: what it serves
    (:data:`mlx_fleet.capabilities.TASKS`: ``TextGeneration`` or ``TextEmbedding``);
    ``embedding``: how an embedding model pools (read from its directory at load), None for a
    generation model."""

    model_id: str
    revision: str
    path: str
    created_unix: int
    max_concurrent_sequences: int
    max_context_tokens: int
    kv_cache_bytes_per_token: int = 0
    features: TokenizerFeatures = TokenizerFeatures()
    task: Task = TASK_TEXT_GENERATION
    embedding: EmbeddingProfile | None = None

    @property
    def key(self) -> ModelKey:
        """``(model_id, revision)``: what identifies this revision in the core."""
        return (self.model_id, self.revision)


@dataclass(frozen=True)
class Chunk:
    """One piece of a generation: ``text`` (may be empty), ``tokens`` generated so far for the
    request, and ``finish_reason`` (``None`` until the last chunk, then ``"stop"`` or
    ``"length"``). ``index``: the choice it belongs to (0 .. n-1 of a request for ``n``
    choices); ``logprobs``: its token's log-probabilities when the request asked for them
    (a :class:`node_agent.serving.logprobs.TokenLogprob`; ``None`` otherwise, and for an
    end-of-sequence token, which is no part of the text)."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None
    index: int = 0
    logprobs: Any = None   # a logprobs.TokenLogprob (not imported: this module stays pure)


@dataclass(frozen=True)
class MemoryUsage:
    """The process's memory at one moment (:meth:`ServingCore.memory_usage`). ``active_bytes``:
    ``mlx.core.get_active_memory()`` (arrays alive now); ``cache_bytes``:
    ``mlx.core.get_cache_memory()`` (freed buffers MLX keeps for reuse); ``rss_bytes``: the
    process's resident set size (``psutil``; 0 when it cannot be read)."""

    active_bytes: int
    cache_bytes: int
    rss_bytes: int

    @property
    def mlx_bytes(self) -> int:
        """What MLX holds: active + cache bytes."""
        return self.active_bytes + self.cache_bytes


@dataclass(frozen=True)
class LoadProgress:
    """A load in progress (:meth:`ServingCore.loads`). ``state``: ``LoadingTokenizer`` (off the
    MLX thread), ``Queued`` (waiting for the MLX thread: one load reads weights at a time) or
    ``ReadingWeights``; ``done_bytes`` of ``total_bytes``: the parameters evaluated so far (both
    0 before ``ReadingWeights``); ``chunks``: in how many chunks (see
    :mod:`node_agent.serving.loading`)."""

    model_id: str
    revision: str
    state: str
    done_bytes: int
    total_bytes: int
    chunks: int


@dataclass(frozen=True)
class ToolFormat:
    """How a revision's model writes tool calls (:meth:`ServingCore.tool_format`), as mlx-lm's
    tokenizer loader inferred it from the chat template (``mlx_lm.tokenizer_utils.load``:
    ``tool_parser_type``, or its ``_infer_tool_parser``). ``parser``: the mlx-lm tool parser's
    name (``mlx_lm.tool_parsers.<parser>``); ``start`` / ``end``: the strings around one call in
    the output; ``parse(text, tools)``: that parser's ``parse_tool_call`` (a call's text between
    ``start`` and ``end`` → ``{"name", "arguments"}`` or a list of them; raises ``ValueError``
    for text it cannot read)."""

    parser: str
    start: str
    end: str
    parse: Callable[[str, Any], Any]
