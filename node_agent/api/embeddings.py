"""``POST /v1/embeddings`` (OpenAI's Embeddings API) over a ``TextEmbedding`` revision of the
:class:`~node_agent.serving.ServingCore` (:meth:`~node_agent.serving.ServingCore.embed`:
tokenized off the MLX thread, inputs of concurrent requests batched into shared forward passes).

The revision is chosen as for the chat routes (:func:`.routing.serve_on`: canary split, pin,
standby reload, forward; ``X-Model-Revision`` on every answer; the request's outcome in the
per-revision statistics under a split). The answer is ``{"object": "list", "data": [{"object":
"embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}``;
``encoding_format: base64`` gives each vector as its little-endian float32 bytes in base64, as
OpenAI does (the ``openai`` Python client asks for that by default and decodes it).

Statuses beyond :mod:`.routing`'s: 400 (``param`` ``input``) ``context_length_exceeded`` (an
input over the model's ``max_context_tokens``), ``prompt_too_large`` (the texts over
``--max-prompt-bytes``), ``invalid_prompt`` (a token id outside the vocabulary); 400
``invalid_value`` (``param`` ``dimensions``) for a width the model does not allow; 400
``wrong_model_task`` (``param`` ``model``) for a ``TextGeneration`` model; 429; 503.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Callable

from aiohttp import web
from pydantic import ValidationError

from mlx_fleet.http_errors import error_response as _error

from ..api_models import EmbeddingRequest

from ..api_responses import Embedding, EmbeddingUsage
from ..serving import (DimensionsNotSupported, GenerationAborted, InputTooLong, InvalidPrompt,
                       ModelNotLoaded, Overloaded, PromptTooLarge, ServingCore, WrongTask)
from .forward import Forwarder
from .parse import validation_error
from .render import json_answer
from .routing import Outcome, Served, not_found, refusal, serve_on, wrong_task

__all__ = ["EmbeddingsRoute", "encode"]


def encode(vector: Any, encoding_format: str) -> list[float] | str:
    """One vector (numpy float32) as OpenAI sends it: a list of numbers, or for ``base64`` its
    little-endian float32 bytes in base64."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def render(vectors: Any, prompt_tokens: int, model: str, encoding_format: str) -> bytes:
    """The :class:`~node_agent.api_responses.EmbeddingList` JSON of ``vectors`` (numpy ``(n, d)``).
    Written one vector at a time, so a thread writing a large answer holds the GIL only briefly
    at a time and the event loop keeps running."""
    rows = b",".join(Embedding.model_construct(object="embedding", index=i,
                                               embedding=encode(v, encoding_format)
                                               ).model_dump_json().encode()
                     for i, v in enumerate(vectors))
    usage = EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
    return (b'{"object":"list","data":[' + rows + b'],"model":' + json.dumps(model).encode()
            + b',"usage":' + usage.model_dump_json().encode() + b"}")


class EmbeddingsRoute:
    """The embeddings route over ``core``; ``router`` and ``forward`` as for
    :class:`~node_agent.api.completions.Completions`."""

    def __init__(self, core: ServingCore, *, router: Callable[[], Any],
                 forward: Forwarder) -> None:
        self.core = core
        self.router = router
        self.forward = forward

    async def create(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/embeddings``."""
        try:
            req = EmbeddingRequest.model_validate_json(await request.read())
        except ValidationError as e:
            return validation_error(e)
        served = await serve_on(request, self.core, self.router, self.forward, req.model,
                                req.user)
        if not isinstance(served, Served):
            return served
        headers = served.headers
        refused = refusal(served.info, request.path, {}, req.model, headers)
        if refused is not None:   # a TextGeneration model: wrong_model_task, as the router says
            return refused
        outcome = Outcome(served.tm, served.routed)
        texts = req.input if req.input and isinstance(req.input[0], str) else None
        try:
            result = await self.core.embed(
                req.model, revision=served.info.revision, dimensions=req.dimensions,
                texts=texts, token_ids=None if texts is not None else req.input)
        except ModelNotLoaded:
            return not_found(req.model)
        except WrongTask as e:
            return wrong_task(e, headers)
        except DimensionsNotSupported as e:
            return _error(400, f"dimensions: {e}", param="dimensions", code="invalid_value",
                          headers=headers)
        except Overloaded as e:
            return _error(429, f"Too many requests: {e}", type_="rate_limit_error",
                          code="overloaded",
                          headers={"Retry-After": str(e.retry_after_seconds), **headers})
        except InputTooLong as e:
            return _error(400, str(e), param="input", code="context_length_exceeded",
                          headers=headers)
        except PromptTooLarge as e:
            return _error(400, str(e), param="input", code="prompt_too_large",
                          headers=headers)
        except InvalidPrompt as e:
            return _error(400, str(e), param="input", code="invalid_prompt", headers=headers)
        except GenerationAborted as e:
            outcome.done(failed=True)
            message = ("this node's serving core failed" if self.core.failure is not None
                       else e.public)
            return _error(503, message, type_="server_error", code="unavailable",
                          headers=headers)
        outcome.done(failed=False)
        # off the event loop: 2048 vectors of 1024 floats are ~40 MB of JSON (~0.5 s to write)
        return await json_answer(render, result.vectors, result.prompt_tokens, req.model,
                                 req.encoding_format, headers=headers)
