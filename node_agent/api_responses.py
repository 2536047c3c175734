"""The agent API's response bodies as pydantic models (exactly these fields): OpenAI's objects
(``chat.completion``, ``text_completion``, their stream chunks, ``list`` of ``model`` or of
``embedding``) plus this server's additions to a model card (``revision``,
``max_context_tokens``, ``status``, ``standby_reason``, ``capabilities``). The request bodies
are :mod:`node_agent.api_models`; :mod:`node_agent.openapi` publishes both
(:data:`RESPONSE_MODELS`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from mlx_fleet.capabilities import ModelCapabilities
from mlx_fleet.openai_errors import ErrorResponse

__all__ = ["chat_logprobs", "completion_logprobs", "AssistantMessage", "ChatChoice", "ChatChunkChoice",
           "ChatCompletion", "ChatCompletionChunk", "ChatTokenLogprob", "ChoiceLogprobs", "ChunkDelta",
           "CompletionLogprobs", "Embedding", "EmbeddingList", "EmbeddingUsage", "FunctionCall",
           "ModelCard", "ModelList", "PromptTokensDetails", "TextChoice", "TextChunkChoice",
           "TextCompletion", "TextCompletionChunk", "ToolCall", "ToolCallDelta", "TopLogprob",
           "Usage", "FinishReason", "RESPONSE_MODELS"]

#: Why a generation ended: ``stop`` (end-of-sequence token or a stop sequence), ``length``
#: (``max_tokens`` or the context reached), ``tool_calls`` (a chat answer that ended with tool
#: calls).
FinishReason = Literal["stop", "length", "tool_calls"]

# ---------------------------------------------------------------------------------------------
# Responses (exactly these fields)
# ---------------------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    """What the prompt's tokens cost: ``cached_tokens`` were served from the prompt cache."""

    cached_tokens: int


class Usage(_Response):
    """Token counts of one request (tokens of the model's tokenizer)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class FunctionCall(_Response):
    """A call's function: ``arguments`` is a JSON string (OpenAI's shape)."""

    name: str
    arguments: str


class ToolCall(_Response):
    """One tool call of an answer: ``id`` ``call_…``."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Response):
    """The answer: ``content`` (null when the answer is only tool calls) and ``tool_calls``
    (present only when there are some)."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(_Response):
    """A likely token at one position: ``token`` (its text decoded alone), ``logprob``
    (natural log; ``-9999.0`` for a token a logits processor masked), ``bytes`` (the token's
    bytes: those of a partial UTF-8 character too, so that the bytes of consecutive tokens
    rebuild the text)."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    """The chosen token at one position, and the ``top_logprobs`` most likely tokens there
    (most likely first)."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Response):
    """A chat choice's ``logprobs``: one entry per generated token (not the end-of-sequence
    token)."""

    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(_Response):
    """A legacy completion choice's ``logprobs``, one element per generated token:
    ``tokens`` (texts), ``token_logprobs``, ``top_logprobs`` (``{token text: logprob}`` of the
    ``logprobs`` most likely tokens and the chosen one; tokens of the same text, such as parts
    of multi-byte characters, share one key: the chosen token's value, else the likeliest's)
    and ``text_offset`` (each token's character offset in the concatenated token texts, from
    0)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


def chat_logprobs(entries: Any) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object (``{"content": [...]}``, the shape of
    :class:`ChoiceLogprobs`) of token entries (``node_agent.serving.logprobs.TokenLogprob``:
    ``text``, ``bytes``, ``logprob``, ``top`` of ``text``, ``bytes``, ``logprob``)."""
    return {"content": [
        {"token": e.text, "logprob": e.logprob, "bytes": list(e.bytes),
         "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.bytes)}
                          for t in e.top]}
        for e in entries]}


def completion_logprobs(entries: Any, offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` object (the shape of :class:`CompletionLogprobs`) of token
    entries (as :func:`chat_logprobs`); ``offset``: the first token's ``text_offset`` (the
    length of the token texts before it, for a stream's later chunks)."""
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
        tokens.append(e.text)
        values.append(e.logprob)
        # keyed by text: of tokens with the same text (partial characters) the likeliest is
        # kept, and the chosen token's own value for its text
        top: dict[str, float] = {}
        for t in e.top:
            top.setdefault(t.text, e.logprob if t.text == e.text else t.logprob)
        top.setdefault(e.text, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(_Response):
    """A non-streamed ``POST /v1/chat/completions`` answer (``object``: ``chat.completion``)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class TextCompletion(_Response):
    """A non-streamed ``POST /v1/completions`` answer (``object``: ``text_completion``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class ToolCallDelta(_Response):
    """A tool call in a stream: each call comes whole in one event (``index``: its position
    among the answer's calls; ``id``, ``type``, the function's name and complete arguments)."""

    index: int
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChunkDelta(_Response):
    """The new text of one chat stream event (``role`` on the first event only), or the
    answer's tool calls (``tool_calls``, then without ``content``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Response):
    """One server-sent event of a streamed chat completion. ``usage`` is there (null, then the
    counts on a last event with no choices) only with ``stream_options.include_usage``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TextChunkChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class TextCompletionChunk(_Response):
    """One server-sent event of a streamed text completion (``usage`` as for
    :class:`ChatCompletionChunk`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    """One revision in ``GET /v1/models``: ``status`` ``loaded`` (resident) or ``standby``
    (assigned here but not resident; ``standby_reason`` ``IdleUnloaded``, ``Evicted`` or
    ``AwaitingRequest``; a request for it loads it first). ``created``: load time, Unix
    seconds; ``max_context_tokens``: prompt plus completion tokens a request may use.
    ``capabilities``: what the revision serves (:class:`mlx_fleet.capabilities.
    ModelCapabilities`: task, tool calling and its parser, structured outputs, logprobs, ``n``,
    embeddings); on every loaded card, on a standby card when the revision was loaded here
    before (absent when unknown)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    revision: str
    max_context_tokens: int
    status: Literal["loaded", "standby"]
    standby_reason: str | None = None
    capabilities: ModelCapabilities | None = None


class ModelList(_Response):
    """``GET /v1/models``."""

    object: Literal["list"]
    data: list[ModelCard]


class Embedding(_Response):
    """One input's vector: ``index`` its position in the request's ``input``; ``embedding`` the
    numbers (``encoding_format`` float) or their little-endian float32 bytes in base64."""

    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(_Response):
    """Tokens of the inputs (``total_tokens`` equals ``prompt_tokens``: nothing is generated)."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Response):
    """A ``POST /v1/embeddings`` answer (``object``: ``list``), vectors in input order."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


#: Models whose JSON schema the OpenAPI document holds, validation side (requests) and
#: serialization side (responses).


RESPONSE_MODELS: tuple[type[BaseModel], ...] = (ErrorResponse, ChatCompletion, TextCompletion,
                                                ChatCompletionChunk, TextCompletionChunk,
                                                ModelList, EmbeddingList)
