"""The agent API's request bodies as pydantic models: what a request may hold (the responses:
:mod:`node_agent.api_responses`).

One source of truth for three uses: :mod:`node_agent.openai_api` validates request bodies with
the request models and builds its JSON responses through the response models, and
:mod:`node_agent.openapi` turns both into the ``GET /openapi.json`` document
(``model_json_schema``), so the published schema cannot drift from what the server does.

Request models follow OpenAI's Chat Completions, (legacy) Completions and Embeddings APIs.
A body's unknown top-level field is a 400 naming it, as OpenAI answers ("Unrecognized request
argument supplied"), and so is an unknown key of a request option object (``stream_options``,
``tools``, ``tool_choice``, ``response_format``); the keys of a message in ``messages`` that this
server does not render (OpenAI's ``refusal``, ``audio``, ...) are ignored: they are history,
not options. OpenAI's fields that this server does not apply are declared, typed and bounded,
and accepted only in the spelling that asks for nothing (:data:`mlx_fleet.openai_fields.
NOT_APPLIED`, checked by :func:`node_agent.api.parse.unsupported`); a few metadata fields are
accepted and change nothing (:data:`mlx_fleet.openai_fields.NO_EFFECT`).
Response models follow OpenAI's objects
(``chat.completion``, ``text_completion``, ``list`` of ``model`` or of ``embedding``) plus this
server's additions to a model card (``revision``, ``max_context_tokens``, ``status``,
``standby_reason``, ``capabilities``). Errors
have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` (:class:`ErrorResponse`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag,
                      WithJsonSchema, field_validator, model_validator)

from mlx_fleet.capabilities import OPENAI_MAX_LEGACY_LOGPROBS, OPENAI_MAX_TOP_LOGPROBS
from mlx_fleet.openai_errors import ErrorDetail, ErrorResponse
from mlx_fleet.routing.headers import SESSION_HEADER

__all__ = ["MAX_TOP_LOGPROBS", "MAX_LEGACY_LOGPROBS", "StreamOptions", "ContentPart", "ChatMessage",
           "SamplingRequest", "ChatCompletionRequest", "CompletionRequest", "ErrorDetail",
           "ErrorResponse", "REQUEST_MODELS", "Tool", "FunctionDefinition", "NamedToolChoice",
           "ResponseFormat", "JsonSchemaFormat", "ToolCallIn", "FunctionCallIn",
           "FUNCTION_NAME_PATTERN", "MAX_TOOLS", "EmbeddingRequest", "MAX_EMBEDDING_INPUTS",
           "MAX_TOKEN_ID"]

#: Largest whole number a JSON float represents exactly (2**53): ``4180.0`` is read as 4180
#: up to it (JSON Schema counts a number with a zero fraction as an integer), ``1e300`` is not.
MAX_EXACT_FLOAT_INT = 2**53


def _whole_number(v: Any) -> Any:
    if isinstance(v, float) and v.is_integer() and abs(v) <= MAX_EXACT_FLOAT_INT:
        return int(v)
    return v  # anything else goes to the strict check: strings, booleans, fractions refused


#: An integer field: a JSON integer, or a number with a zero fraction (``8.0``, as JSON Schema's
#: ``integer`` allows); not a string, a boolean or a fraction. (The constraints go before the
#: validator, so that the JSON schema shows them as ``minimum``.)
StrictInt = Annotated[int, Field(strict=True), BeforeValidator(_whole_number)]
#: :data:`StrictInt`, at least 1.
PositiveInt = Annotated[int, Field(strict=True, ge=1), BeforeValidator(_whole_number)]


def _number(v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be a number")
    return v


#: ``presence_penalty`` / ``frequency_penalty``: OpenAI's range, -2.0 to 2.0.
Penalty = Annotated[float, Field(ge=-2.0, le=2.0), BeforeValidator(_number)]
#: A ``logit_bias`` key: a token id as a string (OpenAI's shape); its value -100 to 100.
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0), BeforeValidator(_number)]
#: Most ``metadata`` pairs, and the longest key and value (OpenAI's bounds).
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
#: The longest ``safety_identifier`` (OpenAI's bound).
MAX_SAFETY_IDENTIFIER = 128


def _not_applied(off: str) -> str:
    """The description of an OpenAI field this server does not apply."""
    return (f"Not applied by this server: accepted only as {off} (asking for nothing); "
            "anything else is a 400 unsupported_parameter naming it.")


def _no_effect(what: str) -> str:
    """The description of an OpenAI metadata field accepted without effect on the output."""
    return f"Accepted{what}; changes nothing in the output (OpenAI-side metadata)."


#: Most ``top_logprobs`` a chat completion may ask for (OpenAI's bound, one source with the router).
MAX_TOP_LOGPROBS = OPENAI_MAX_TOP_LOGPROBS
#: Most ``logprobs`` a legacy completion may ask for (OpenAI's bound).
MAX_LEGACY_LOGPROBS = OPENAI_MAX_LEGACY_LOGPROBS


# ---------------------------------------------------------------------------------------------
# Requests (a body's unknown fields are a 400; a message's unknown keys are ignored)
# ---------------------------------------------------------------------------------------------


class _Request(BaseModel):
    """A part of the message history: keys it does not know are ignored (they are not
    rendered into the prompt; OpenAI's history may hold ``refusal``, ``audio``, ...)."""

    model_config = ConfigDict(extra="ignore")


class _Option(BaseModel):
    """A request body or one of its option objects: an unknown key is a 400 naming it
    (:func:`node_agent.api.parse.validation_error`, ``unsupported_parameter``)."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Option):
    """``stream_options``: ``include_usage`` adds a last event with the usage;
    ``include_obfuscation`` (OpenAI pads its events with an ``obfuscation`` field against
    size side channels) is not applied: only null or false."""

    include_usage: Annotated[bool, Field(strict=True)] = False
    include_obfuscation: Annotated[Annotated[bool, Field(strict=True)] | None, Field(
        description=_not_applied("null or false (events are not padded)"))] = None


class ContentPart(_Request):
    type: str
    text: str | None = None


#: A function's name, as OpenAI allows it (letters, digits, ``_`` and ``-``, at most 64).
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
#: Most tools one request may define (OpenAI's limit).
MAX_TOOLS = 128
FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]


class FunctionCallIn(_Request):
    """A function call of an earlier assistant message: ``arguments`` as a JSON string (or an
    object, as some clients send it)."""

    name: FunctionName
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Request):
    """One ``tool_calls`` entry of an earlier assistant message in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    """One message of the history. ``tool_calls``: an assistant message's calls;
    ``tool_call_id``: a ``tool`` message's answer to one of them (its ``content`` the result)."""

    role: Annotated[str, Field(min_length=1)]
    content: str | list[ContentPart] | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text: its string content, or its ``text`` parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


_OFF = ("Served only by a model whose capabilities (GET /v1/models `capabilities`) say so; "
        "the switched-off spellings (null, empty, false, 0, \"none\", or {\"type\": "
        "\"text\"} for response_format) are always accepted; otherwise a 400 "
        "unsupported_parameter (unsupported_value for a bound) naming it.")


class SamplingRequest(_Option):
    """The fields both request bodies share. ``temperature`` 0 is greedy; ``seed`` is honoured
    best-effort (see :mod:`node_agent.openai_api`)."""

    model: Annotated[str, Field(min_length=1, description=(
        "A served model name loaded (or on standby) on this node; else 404 model_not_found."))]
    max_tokens: Annotated[PositiveInt | None, Field(description=(
        "Most tokens to generate (default: up to the model's context); prompt plus "
        "max_tokens over the context is a 400 context_length_exceeded."))] = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, description="0 is greedy.")] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: Annotated[bool, Field(strict=True, description=(
        "Answer as server-sent events (text/event-stream)."))] = False
    stream_options: StreamOptions | None = Field(None, description=(
        "Only with stream: true (else 400)."))
    seed: StrictInt | None = Field(None, description=(
        "Honoured best-effort. With n > 1, choice 0 samples with seed and choice i > 0 with "
        "a seed derived from (seed, i), so the choices differ."))
    # the document's maximum is the app's --max-choices (openapi_document(max_choices=...))
    n: Annotated[PositiveInt, Field(description=(
        "Choices to generate: n sequences of the same prompt, prefilled once. At most the "
        "agent's --max-choices (default 8) and the model's max_concurrent_sequences (its "
        "capabilities' max_n); above that a 400 unsupported_value naming n. usage counts "
        "every choice's tokens."))] = 1
    user: str | None = Field(None, description=(
        f"Session key of a canary split when there is no {SESSION_HEADER} header."))
    # Accepted in their "off" spelling, otherwise only by a model whose capabilities serve them
    # (mlx_fleet.capabilities; functions/function_call: never, node_agent.api.parse.unsupported):
    # rejecting them is more honest than silently ignoring what the client asked for.
    tools: Any = Field(None, description=_OFF)
    tool_choice: Any = Field(None, description=_OFF)
    functions: Any = Field(None, description=_OFF)
    function_call: Any = Field(None, description=_OFF)
    response_format: Any = Field(None, description=_OFF)

    # OpenAI's fields that change the output and that no model here applies (yet): typed and
    # bounded, accepted only off (mlx_fleet.openai_fields.NOT_APPLIED), else a 400
    logit_bias: Annotated[dict[TokenIdKey, LogitBias] | None, Field(
        description=_not_applied("null or {}"))] = None
    presence_penalty: Annotated[Penalty | None, Field(
        description=_not_applied("null or 0"))] = None
    frequency_penalty: Annotated[Penalty | None, Field(
        description=_not_applied("null or 0"))] = None

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        return _number(v)


_LOGPROBS = ("Log-probabilities of the model's distribution at each position: after any "
             "logits processor, before temperature and top_p (so at temperature 0 the chosen "
             "token is the most likely).")
class FunctionDefinition(_Option):
    """A function the model may call: ``parameters`` is the JSON Schema of its arguments
    (absent: any JSON object); enforced by constrained decoding under ``tool_choice``
    ``required`` or a named function (then an unsupported keyword is a 400 naming ``tools``)."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Annotated[bool, Field(strict=True)] | None = None


class Tool(_Option):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Option):
    name: FunctionName


class NamedToolChoice(_Option):
    """``tool_choice`` naming one function: the answer is one call of it."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Option):
    """``response_format.json_schema``: ``schema`` (a JSON Schema object) is enforced by
    constrained decoding whatever ``strict`` says (a schema keyword the decoder cannot enforce
    is a 400 naming ``response_format.json_schema.schema``, never ignored)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    json_schema: Annotated[dict[str, Any], Field(alias="schema")]
    strict: Annotated[bool, Field(strict=True)] | None = None


class ResponseFormat(_Option):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (JSON valid against ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is json_schema")
        return self


_TOOL_CHOICE = ("none: no tool call (the tools are not shown to the model); auto (the default "
                "with tools): the model decides, its calls are parsed by mlx-lm's tool parser "
                "for its chat template (a model without one: 400 naming tools); required: one "
                "or more calls, enforced by constrained decoding; {type: function, function: "
                "{name}}: one call of that function, enforced likewise.")


def _tool_choice_kind(v: Any) -> str:
    """Which form of ``tool_choice`` ``v`` is meant to be (an object: a named function), so that
    a bad value's error is the one of that form (the tags have a ``-``: no part of ``param``)."""
    return "named-function" if isinstance(v, (dict, NamedToolChoice)) else "tool-choice-mode"


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions`` body. ``max_completion_tokens`` wins over ``max_tokens``.

    ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and ``response_format`` are served
    (issue 20); their semantics are in ``docs/node-agent.md`` (*Structured outputs and tool
    calls*). ``top_logprobs`` without ``logprobs: true`` is a 400 (as OpenAI answers)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS, description=(
        "Function tools, rendered into the prompt by the model's chat template."))] | None = None
    tool_choice: Annotated[
        Annotated[Literal["none", "auto", "required"], Tag("tool-choice-mode")]
        | Annotated[NamedToolChoice, Tag("named-function")],
        Discriminator(_tool_choice_kind)] | None = Field(None, description=_TOOL_CHOICE)
    parallel_tool_calls: Annotated[bool, Field(strict=True, description=(
        "With tool_choice required: up to 8 calls (else exactly one)."))] = True
    response_format: ResponseFormat | None = Field(None, description=(
        "text, json_object or json_schema, enforced by constrained decoding; an answer cut by "
        "max_tokens (finish_reason length) may be incomplete JSON."))
    logprobs: Annotated[bool | None, Field(strict=True, description=(
        "Return each token's log-probability in choices[].logprobs.content. " + _LOGPROBS))
    ] = None
    top_logprobs: Annotated[
        Annotated[int, Field(strict=True, ge=0, le=MAX_TOP_LOGPROBS),
                  BeforeValidator(_whole_number)] | None,
        Field(description="The most likely tokens listed at each position (needs "
                          "logprobs: true).")] = None
    # OpenAI's metadata: accepted, no effect on the output (NO_EFFECT)
    metadata: Annotated[
        Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA_KEY)],
                       Annotated[str, Field(max_length=MAX_METADATA_VALUE)]],
                  Field(max_length=MAX_METADATA_PAIRS)] | None,
        Field(description=_no_effect(f" (at most {MAX_METADATA_PAIRS} string pairs, keys of "
                                     f"at most {MAX_METADATA_KEY} characters, values "
                                     f"{MAX_METADATA_VALUE})"))] = None
    prompt_cache_key: Annotated[str | None, Field(description=_no_effect(
        " (the agent's prefix cache serves every request)"))] = None
    safety_identifier: Annotated[
        Annotated[str, Field(max_length=MAX_SAFETY_IDENTIFIER)] | None,
        Field(description=_no_effect(""))] = None
    # OpenAI's fields not applied here: accepted only off (mlx_fleet.openai_fields.NOT_APPLIED)
    store: Annotated[Annotated[bool, Field(strict=True)] | None, Field(
        description=_not_applied("null or false (nothing is stored)"))] = None
    service_tier: Annotated[str | None, Field(
        description=_not_applied('null, "auto" or "default" (one tier)'))] = None
    modalities: Annotated[list[str] | None, Field(
        description=_not_applied('null or ["text"]'))] = None
    audio: Annotated[dict[str, Any] | None, Field(description=_not_applied("null"))] = None
    prediction: Annotated[dict[str, Any] | None, Field(
        description=_not_applied("null"))] = None
    reasoning_effort: Annotated[str | None, Field(description=_not_applied("null"))] = None
    verbosity: Annotated[str | None, Field(description=_not_applied("null"))] = None
    web_search_options: Annotated[dict[str, Any] | None, Field(
        description=_not_applied("null"))] = None
    moderation: Annotated[dict[str, Any] | None, Field(
        description=_not_applied("null"))] = None
    prompt_cache_retention: Annotated[str | None, Field(
        description=_not_applied("null"))] = None
    prompt_cache_options: Annotated[dict[str, Any] | None, Field(
        description=_not_applied("null"))] = None


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions`` body; ``prompt`` is one string."""

    prompt: str
    logprobs: Annotated[
        Annotated[int, Field(strict=True, ge=0, le=MAX_LEGACY_LOGPROBS),
                  BeforeValidator(_whole_number)] | None,
        Field(description=(
            "Return the chosen token's log-probability and this many most likely tokens at "
            "each position (choices[].logprobs: tokens, token_logprobs, top_logprobs, "
            "text_offset). " + _LOGPROBS))] = None
    # not a field of OpenAI's legacy API (its `logprobs` says how many): refused unless off
    top_logprobs: Any = Field(None, description=(
        "Not a field of the legacy API (logprobs says how many): anything but null or 0 is a "
        "400 unsupported_parameter."))
    # OpenAI legacy fields not applied here: accepted only off (openai_fields.NOT_APPLIED)
    echo: Annotated[Annotated[bool, Field(strict=True)] | None, Field(
        description=_not_applied("null or false (the prompt is never echoed, nor its "
                                 "logprobs)"))] = None
    best_of: Annotated[PositiveInt | None, Field(
        description=_not_applied("null or equal to n (less than n: 400 invalid_value)"))] = None
    suffix: Annotated[str | None, Field(description=_not_applied('null or ""'))] = None


#: Most inputs one ``POST /v1/embeddings`` request may hold (OpenAI's limit: 2048).
MAX_EMBEDDING_INPUTS = 2048
#: Largest token id a request may send (int32; the model's vocabulary bounds it further).
MAX_TOKEN_ID = 2**31 - 1

_EMBEDDING_INPUT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1, "description": "One text."},
    {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS,
     "items": {"type": "string", "minLength": 1}, "description": "Texts."},
    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                "maximum": MAX_TOKEN_ID},
     "description": "One input as token ids."},
    {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS, "items": {
        "type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                  "maximum": MAX_TOKEN_ID}},
     "description": "Inputs as token ids."}],
    "description": (f"What to embed (OpenAI's shapes): at most {MAX_EMBEDDING_INPUTS} inputs, "
                    "none empty; each within the model's context (else 400 "
                    "context_length_exceeded); token ids within its vocabulary.")}


def _token_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TOKEN_ID


def _embedding_input(v: Any) -> list[str] | list[list[int]]:
    """OpenAI's ``input`` shapes normalised to a list of texts or a list of token lists."""
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v:
        raise ValueError("must be a non-empty string, a non-empty array of strings, an array "
                         "of token ids or an array of arrays of token ids")
    if all(isinstance(x, str) for x in v):
        shape: list = v
    elif all(_token_id(x) for x in v):
        shape = [v]
    elif all(isinstance(x, list) and x and all(_token_id(t) for t in x) for x in v):
        shape = v
    else:
        raise ValueError("must be a string, an array of strings, an array of token ids (integers "
                         f"from 0 to {MAX_TOKEN_ID}) or an array of non-empty arrays of token "
                         "ids, not a mix")
    if len(shape) > MAX_EMBEDDING_INPUTS:
        raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(shape)}")
    empty = next((i for i, x in enumerate(shape) if isinstance(x, str) and not x), None)
    if empty is not None:
        raise ValueError(f"input {empty} is an empty string")
    return shape


class EmbeddingRequest(_Option):
    """``POST /v1/embeddings`` body (OpenAI's Embeddings API). ``input`` is normalised to a list
    of texts or a list of token-id lists, in input order."""

    model: Annotated[str, Field(min_length=1, description=(
        "A served model name with spec.model.task TextEmbedding, loaded (or on standby) on this "
        "node; else 404 model_not_found, or 400 wrong_model_task for a generation model."))]
    input: Annotated[list[str] | list[list[int]], BeforeValidator(_embedding_input),
                     WithJsonSchema(_EMBEDDING_INPUT_SCHEMA)]
    encoding_format: Literal["float", "base64"] = Field("float", description=(
        "float: arrays of numbers; base64: each vector's little-endian float32 bytes in "
        "base64 (OpenAI's)."))
    dimensions: PositiveInt | None = Field(None, description=(
        "Truncate each vector to this many dimensions and renormalise (Matryoshka); only for a "
        "model trained for it (config.json is_matryoshka or matryoshka_dimensions), else 400 "
        "naming dimensions."))
    user: str | None = Field(None, description=(
        f"Session key of a canary split when there is no {SESSION_HEADER} header."))


REQUEST_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest,
                                               EmbeddingRequest)
