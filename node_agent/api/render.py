"""Large JSON answers built without stalling the event loop.

An answer can be megabytes of JSON (``n`` choices × ``max_tokens`` token log-probabilities ×
``top_logprobs``: 8 × 2,000 × 20 is about 8 MB; 2,048 embedding vectors of 1,024 floats about
40 MB). Validating and encoding it at once on the event loop stalled every other request of the
agent for seconds (8 × 2,000 × 20 through pydantic: 1.5 to 7 s on the development CPU). So a
non-streamed completion's log-probabilities are encoded token by token as the tokens arrive
(:class:`~node_agent.logprobs_json.ChoiceLogprobsJson`, as a stream encodes them per event: no object graph of all the
entries is kept, which also spares the cyclic garbage collector), and :func:`json_answer` joins
the answer in the loop's default executor. Render functions run there encode in small calls (a
C ``json.dumps`` call holds the GIL until it returns, so one call over a whole large answer
would stall the loop from the executor thread just the same).

The bytes are ``json.dumps`` with ``separators=(",", ":")`` of the same document (ASCII only),
the shapes those of :mod:`node_agent.api_models`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from aiohttp import web

from ..logprobs_json import ChoiceLogprobsJson, dumps, obj

__all__ = ["completion_answer", "json_answer"]


def completion_answer(payload: dict[str, Any],
                      logprobs: list[ChoiceLogprobsJson] | None) -> bytes:
    """A non-streamed completion's JSON: ``payload`` is the answer's dict
    (:class:`~node_agent.api_responses.ChatCompletion` / ``TextCompletion`` ``model_dump()``, its
    choices' ``logprobs`` ``None``); ``logprobs``: per choice (by position in ``choices``) the
    ``logprobs`` object that replaces that ``None``, or ``None`` when the request asked for
    none. Equal, as a JSON document, to ``payload`` with those objects put in."""
    if logprobs is None:
        return dumps(payload)
    choices = [obj((k, lp.json() if k == "logprobs" else dumps(v)) for k, v in choice.items())
               for choice, lp in zip(payload["choices"], logprobs, strict=True)]
    return obj((k, b"[" + b",".join(choices) + b"]" if k == "choices" else dumps(v))
               for k, v in payload.items())


async def json_answer(render: Callable[..., bytes], *args: Any,
                      headers: dict[str, str] | None = None) -> web.Response:
    """A 200 ``application/json`` response whose body is ``render(*args)``, called in the
    running loop's default executor (never on the event loop)."""
    body = await asyncio.get_running_loop().run_in_executor(None, render, *args)
    return web.Response(body=body, content_type="application/json", headers=headers)
