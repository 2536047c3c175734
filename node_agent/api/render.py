"""Large JSON answers built without stalling the event loop.

An answer can be megabytes of JSON (``n`` choices × ``max_tokens`` token log-probabilities ×
``top_logprobs``: 8 × 2,000 × 20 is about 8 MB; 2,048 embedding vectors of 1,024 floats about
40 MB). Validating and encoding it at once on the event loop stalled every other request of the
agent for seconds (8 × 2,000 × 20 through pydantic: 1.5 to 7 s on the development CPU). So a
non-streamed completion's log-probabilities are encoded token by token as the tokens arrive
(:class:`ChoiceLogprobsJson`, as a stream encodes them per event: no object graph of all the
entries is kept, which also spares the cyclic garbage collector), and :func:`json_answer` joins
the answer in the loop's default executor. Render functions run there encode in small calls (a
C ``json.dumps`` call holds the GIL until it returns, so one call over a whole large answer
would stall the loop from the executor thread just the same).

The bytes are ``json.dumps`` with ``separators=(",", ":")`` of the same document (ASCII only),
the shapes those of :mod:`node_agent.api_models`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Iterable

from aiohttp import web

from ..api_models import chat_logprobs, completion_logprobs

__all__ = ["ChoiceLogprobsJson", "completion_answer", "dumps", "json_answer", "obj"]


def dumps(value: Any) -> bytes:
    """``value``'s compact JSON (``json.dumps``, ``separators=(",", ":")``), as bytes."""
    return json.dumps(value, separators=(",", ":")).encode()


def obj(members: Iterable[tuple[str, bytes]]) -> bytes:
    """The JSON object of ``(key, already encoded value)`` pairs, in their order."""
    return b"{" + b",".join(dumps(k) + b":" + v for k, v in members) + b"}"


class ChoiceLogprobsJson:
    """One choice's ``logprobs`` object of a non-streamed answer, encoded token by token as the
    tokens arrive (:meth:`add`), so that no object graph of every token's entries is kept and
    no single call encodes them all: chat ``{"content": [...]}``
    (:func:`~node_agent.api_models.chat_logprobs`), legacy ``{"tokens", "token_logprobs",
    "top_logprobs", "text_offset"}`` (:func:`~node_agent.api_models.completion_logprobs`)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._columns: dict[str, list[bytes]] = {}
        self._offset = 0     # legacy text_offset of the next token

    def add(self, entry: Any) -> None:
        """Encode one token's entry (:class:`node_agent.serving.logprobs.TokenLogprob`)."""
        if self.kind == "chat":
            value = chat_logprobs((entry,))
        else:
            value = completion_logprobs((entry,), self._offset)
            self._offset += len(entry.text)
        for key, column in value.items():
            self._columns.setdefault(key, []).extend(dumps(x) for x in column)

    def json(self) -> bytes:
        """The ``logprobs`` object's JSON (every key, its lists empty for no token)."""
        keys = (chat_logprobs(()) if self.kind == "chat" else completion_logprobs(()))
        return obj((k, b"[" + b",".join(self._columns.get(k, ())) + b"]") for k in keys)


def completion_answer(payload: dict[str, Any],
                      logprobs: list[ChoiceLogprobsJson] | None) -> bytes:
    """A non-streamed completion's JSON: ``payload`` is the answer's dict
    (:class:`~node_agent.api_models.ChatCompletion` / ``TextCompletion`` ``model_dump()``, its
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
