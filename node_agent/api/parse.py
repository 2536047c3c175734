"""Request bodies validated into :mod:`node_agent.api_models`, or OpenAI's 400.

400 ``invalid_request_error``: malformed JSON (``code`` ``invalid_json``), an invalid field
(``param`` names it, ``code`` ``invalid_value``), an unknown field (``unsupported_parameter``,
"Unrecognized request argument supplied", as OpenAI answers), ``stream_options`` without
``stream: true``, and OpenAI's fields that no model here applies unless switched off
(:data:`mlx_fleet.openai_fields.NOT_APPLIED`: penalties, ``logit_bias``, ``echo``,
``best_of``, ``suffix``, ``store``, ..., and the legacy ``functions`` / ``function_call``;
``code`` ``unsupported_parameter``, :func:`unsupported`). Nothing is accepted and then ignored
but OpenAI's metadata fields (:data:`mlx_fleet.openai_fields.NO_EFFECT`), which change no
output. What depends on the model (tools, structured outputs, logprobs, ``n``) is decided
once the serving revision is known, by its capabilities (:mod:`.completions`); a chat
``top_logprobs`` without ``logprobs: true`` is a 400 here (``invalid_value``, as OpenAI
answers), and so is a legacy ``top_logprobs`` (not a field of OpenAI's legacy API, whose
``logprobs`` says how many: ``unsupported_parameter``).
"""

from __future__ import annotations

from aiohttp import web
from pydantic import ValidationError

from mlx_fleet.http_errors import error_response as _error
from mlx_fleet.openai_fields import (LEGACY_REFUSAL, LEGACY_REFUSED, UNRECOGNIZED, is_off,
                                     not_applied)

from ..api_models import ChatCompletionRequest, CompletionRequest, SamplingRequest

__all__ = ["parse", "unsupported", "validation_error", "LEGACY_REFUSED"]


def validation_error(e: ValidationError) -> web.Response:
    """The 400 for pydantic's first error, naming the field (``param``: its dotted path)."""
    err = e.errors(include_url=False)[0]
    if err.get("type") == "json_invalid":
        return _error(400, f"malformed JSON body: {err.get('msg')}", code="invalid_json")
    loc = [str(p) for p in err.get("loc", ()) if not _is_type_tag(p)]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden" and param:
        return _error(400, UNRECOGNIZED.format(param=param), param=param,
                      code="unsupported_parameter")
    msg = err.get("msg", "invalid value")
    if param is None and err.get("type") == "model_type":
        msg = "the request body must be a JSON object"
    return _error(400, f"{param + ': ' if param else ''}{msg}", param=param,
                  code="invalid_value")


def unsupported(req: SamplingRequest) -> web.Response | None:
    """400 for options this server honours for no model, naming the first such parameter:
    ``stream_options`` without ``stream``, :data:`~mlx_fleet.openai_fields.NOT_APPLIED` not
    off (among them the legacy ``functions`` / ``function_call``: use ``tools`` /
    ``tool_choice``), a legacy ``best_of`` below ``n`` (``invalid_value``), a message's
    content part other than ``text`` (``param`` ``messages.i.content.j.type``), and
    :data:`~mlx_fleet.openai_fields.LEGACY_REFUSED` not off on ``/v1/completions``
    (:data:`~mlx_fleet.openai_fields.LEGACY_REFUSAL`). The
    model-dependent ones are the revision's capabilities'
    (:func:`mlx_fleet.capabilities.satisfies`)."""
    if req.stream_options is not None and not req.stream:
        return _error(400, "stream_options: only allowed when stream is true",
                      param="stream_options", code="invalid_value")
    if (isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None
            and req.logprobs is not True):
        return _error(400, "top_logprobs: only allowed when logprobs is true",
                      param="top_logprobs", code="invalid_value")
    if isinstance(req, CompletionRequest) and req.top_logprobs not in (None, 0):
        return _error(400, "top_logprobs: top_logprobs is not supported on /v1/completions "
                      "(its logprobs says how many)", param="top_logprobs",
                      code="unsupported_parameter")
    if isinstance(req, CompletionRequest) and req.best_of is not None and req.best_of < req.n:
        return _error(400, f"best_of: must be at least n ({req.n}), got {req.best_of}",
                      param="best_of", code="invalid_value")
    if not isinstance(req, ChatCompletionRequest):
        for param in LEGACY_REFUSED:
            if not is_off(param, getattr(req, param)):
                return _error(400, LEGACY_REFUSAL.format(param=param), param=param,
                              code="unsupported_parameter")
    if isinstance(req, ChatCompletionRequest):
        for i, m in enumerate(req.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                if part.type != "text":   # an image, audio, file or refusal part
                    param = f"messages.{i}.content.{j}.type"
                    return _error(400, f"{param}: a content part of type {part.type!r} is not "
                                  "supported by this server (text parts only)", param=param,
                                  code="unsupported_parameter")
    fields = {f: getattr(req, f) for f in type(req).model_fields}
    if req.stream_options is not None:
        fields["stream_options.include_obfuscation"] = req.stream_options.include_obfuscation
    refused = not_applied(fields, req.n)
    if refused is not None:
        return _error(400, refused[1], param=refused[0], code="unsupported_parameter")
    return None


def _is_type_tag(part: object) -> bool:
    """pydantic puts union-member names (``str``, ``list[str]`` ...) into error locations."""
    if isinstance(part, int):
        return False
    p = str(part)
    return ("[" in p or "-" in p or p in {"str", "int", "float", "bool", "none",
                                          "ContentPart", "ChatMessage"})


async def parse(request: web.Request, cls: type[SamplingRequest]) -> SamplingRequest | web.Response:
    """The request's body as ``cls``, or the 400 that says what is wrong with it."""
    body = await request.read()
    try:
        req = cls.model_validate_json(body)
    except ValidationError as e:
        return validation_error(e)
    return unsupported(req) or req
