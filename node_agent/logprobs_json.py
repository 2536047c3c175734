"""OpenAI's ``logprobs`` objects encoded to JSON token by token, and JSON assembled from
already encoded parts: pure, no I/O.

A choice's log-probabilities can be megabytes of JSON (``max_tokens`` × ``top_logprobs``); built
as one dict and encoded in one ``json.dumps`` call they cost the caller (the event loop) the
whole document at once, a C call that holds the GIL until it returns. :class:`ChoiceLogprobsJson`
encodes each token's entry as it arrives instead (the shapes of
:func:`~node_agent.api_responses.chat_logprobs` / :func:`~node_agent.api_responses.completion_logprobs`,
called per token), and :func:`obj` splices the parts into the answer or event. The bytes are
``json.dumps`` with ``separators=(",", ":")`` of the same document (ASCII only).
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from .api_responses import chat_logprobs, completion_logprobs

__all__ = ["ChoiceLogprobsJson", "dumps", "obj"]


def dumps(value: Any) -> bytes:
    """``value``'s compact JSON (``json.dumps``, ``separators=(",", ":")``), as bytes."""
    return json.dumps(value, separators=(",", ":")).encode()


def obj(members: Iterable[tuple[str, bytes]]) -> bytes:
    """The JSON object of ``(key, already encoded value)`` pairs, in their order."""
    return b"{" + b",".join(dumps(k) + b":" + v for k, v in members) + b"}"


class ChoiceLogprobsJson:
    """One choice's ``logprobs`` object (of a non-streamed answer, or of one stream event),
    encoded token by token as the tokens arrive (:meth:`add`), so that no object graph of every
    token's entries is kept and no single call encodes them all: chat ``{"content": [...]}``
    (:func:`~node_agent.api_responses.chat_logprobs`), legacy ``{"tokens", "token_logprobs",
    "top_logprobs", "text_offset"}`` (:func:`~node_agent.api_responses.completion_logprobs`;
    ``offset``: the first token's ``text_offset``, then the next one's)."""

    def __init__(self, kind: str, offset: int = 0) -> None:
        self.kind = kind
        self._columns: dict[str, list[bytes]] = {}
        self.offset = offset     # legacy: the next token's text_offset

    def add(self, entry: Any) -> None:
        """Encode one token's entry (:class:`node_agent.serving.logprobs.TokenLogprob`)."""
        if self.kind == "chat":
            value = chat_logprobs((entry,))
        else:
            value = completion_logprobs((entry,), self.offset)
            self.offset += len(entry.text)
        for key, column in value.items():
            self._columns.setdefault(key, []).extend(dumps(x) for x in column)

    def json(self) -> bytes:
        """The ``logprobs`` object's JSON (every key, its lists empty for no token)."""
        keys = (chat_logprobs(()) if self.kind == "chat" else completion_logprobs(()))
        return obj((k, b"[" + b",".join(self._columns.get(k, ())) + b"]") for k in keys)
