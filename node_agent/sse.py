"""Server-sent events of OpenAI's streaming completions, encoded without a dict per token.

A streamed completion sends one event per chunk, ``data: <json>\\n\\n``, whose JSON object is
``{"id", "object", "created", "model", "choices": [<choice>]}`` plus ``"usage": null`` when the
client asked for ``stream_options.include_usage`` (OpenAI's chunk shapes: ``chat.completion.chunk``
with ``choices[0].delta``, ``text_completion`` with ``choices[0].text``). The head of that object
is the same for every event of a stream, and the ``choices`` part depends only on the chunk: so
:class:`StreamEncoder` encodes the head once per stream, :func:`choice_part` encodes the rest once
per distinct chunk (memoised: the subscribers of one coalesced generation,
:mod:`node_agent.serving.coalesce`, receive the very same chunk objects), and an event costs one
bytes concatenation per subscriber.

A chunk of a request for ``n`` choices (its ``index``) or with log-probabilities is encoded
without the memo (:func:`choice_event`): its ``choices`` entry carries its ``index`` and
``logprobs`` (chat: ``{"content": [...]}``, legacy: ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}``, :mod:`node_agent.api_models`). A token whose text is held back
(it may begin a stop string) sends no event; its log-probabilities go out with the next event of
its choice, so every token's entry is sent once, in order; each entry is encoded when it is
noted (:class:`~node_agent.logprobs_json.ChoiceLogprobsJson`), so an event after many held
tokens (a tool call's, up to ``max_tokens``) costs a join, not one encoding of them all.

The bytes are exactly ``json.dumps(event, separators=(",", ":"))`` of the event's dict (ASCII
only: non-ASCII text is ``\\uXXXX``-escaped, as ``json.dumps`` does by default). Pure: no I/O.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Literal

from .logprobs_json import ChoiceLogprobsJson, dumps, obj

__all__ = ["StreamEncoder", "choice_part", "choice_event", "DONE", "data_event"]

#: The event that ends a successful stream.
DONE = b"data: [DONE]\n\n"
#: How many distinct chunks :func:`choice_part` remembers: several times the chunks in flight at
#: once (one per running sequence per step; a coalesced generation's subscribers read the same
#: chunk within a few steps of each other).
CHOICE_CACHE_SIZE = 4096

Kind = Literal["chat", "text"]


def data_event(body: bytes) -> bytes:
    """``body`` (one JSON document) as one server-sent event."""
    return b"data: " + body + b"\n\n"



@functools.lru_cache(maxsize=CHOICE_CACHE_SIZE)
def choice_part(kind: Kind, include_usage: bool, text: str, finish_reason: str | None,
                role: bool = False) -> bytes:
    """The end of one chunk's event, from ``"choices"`` to the event's final newlines:
    ``"choices":[{"index":0,"delta":{"content":text},"logprobs":null,"finish_reason":...}]``
    (``kind`` ``"chat"``; with ``role``: ``"delta":{"role":"assistant","content":text}``, the
    first chunk) or ``"choices":[{"index":0,"text":text,...}]`` (``"text"``), then
    ``,"usage":null`` when ``include_usage``, ``}`` and ``\\n\\n``: :func:`choice_event` of
    choice 0 without log-probabilities, memoised (:data:`CHOICE_CACHE_SIZE` entries): equal
    arguments give the same bytes object."""
    return choice_event(kind, include_usage, 0, text, finish_reason, None, role)


def _tail(include_usage: bool) -> bytes:
    """What ends an event after its ``choices``: ``,"usage":null`` with ``include_usage``."""
    return b',"usage":null}\n\n' if include_usage else b"}\n\n"


def choice_event(kind: Kind, include_usage: bool, index: int, text: str,
                 finish_reason: str | None, logprobs: bytes | None,
                 role: bool = False) -> bytes:
    """:func:`choice_part` for any choice ``index`` and with ``logprobs`` (the JSON of OpenAI's
    ``logprobs`` object of the event's tokens, :class:`~node_agent.logprobs_json.
    ChoiceLogprobsJson`, or ``None``); not memoised."""
    if kind == "chat":
        delta: dict[str, Any] = ({"role": "assistant", "content": text} if role
                                 else {"content": text})
        body: list[tuple[str, bytes]] = [("index", dumps(index)), ("delta", dumps(delta))]
    else:
        body = [("index", dumps(index)), ("text", dumps(text))]
    body += [("logprobs", b"null" if logprobs is None else logprobs),
             ("finish_reason", dumps(finish_reason))]
    return b'"choices":[' + obj(body) + b"]" + _tail(include_usage)


class StreamEncoder:
    """The events of one streamed completion.

    ``kind``: ``"chat"`` (``object`` ``chat.completion.chunk``) or ``"text"``
    (``text_completion``); ``rid``, ``created`` (Unix seconds) and ``model``: the stream's
    ``id``, ``created`` and ``model``; ``include_usage``: the client's
    ``stream_options.include_usage`` (every chunk then carries ``"usage": null`` and
    :meth:`usage` gives the final usage event); ``logprobs``: the request asked for
    log-probabilities (chunks then carry them, see the module docstring); ``n``: its choices
    (:meth:`first` then starts each)."""

    def __init__(self, kind: Kind, rid: str, created: int, model: str,
                 include_usage: bool, *, logprobs: bool = False, n: int = 1) -> None:
        if kind not in ("chat", "text"):
            raise ValueError(f"kind must be 'chat' or 'text', not {kind!r}")
        self.kind: Kind = kind
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.n = n
        # per choice: the token entries not yet sent, encoded as they were noted
        self._held: dict[int, ChoiceLogprobsJson] = {}
        self._offset: dict[int, int] = {}        # per choice: legacy text_offset so far
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        # `{"id":…,"object":…,"created":…,"model":…,` — everything before "choices"
        self._head = b"data: " + dumps({"id": rid, "object": obj, "created": created,
                                         "model": model})[:-1] + b","

    def first(self) -> bytes:
        """The chat stream's first event: ``delta`` ``{"role": "assistant", "content": ""}``
        (one such event per choice when ``n`` > 1)."""
        if self.n == 1:
            return self._head + choice_part(self.kind, self.include_usage, "", None, True)
        return b"".join(self._head + choice_event(self.kind, self.include_usage, i, "", None,
                                                  None, True) for i in range(self.n))

    def chunk(self, text: str, finish_reason: str | None, index: int = 0) -> bytes:
        """One chunk's event: ``text`` (may be empty) and its ``finish_reason`` (``None`` but
        for the last chunk), of choice ``index``, with the token entries :meth:`note` d for
        that choice since its last event (when the request asked for log-probabilities)."""
        if index == 0 and not self.logprobs and self.n == 1:
            return self._head + choice_part(self.kind, self.include_usage, text, finish_reason)
        return self._head + choice_event(self.kind, self.include_usage, index, text,
                                         finish_reason, self._logprobs(index))

    def note(self, chunk: Any) -> None:
        """Hold ``chunk``'s token entry (its ``logprobs``, when it has one) for the next event
        of its choice (:meth:`chunk`): for callers that send other text than the chunks'
        (tool-call parsing)."""
        entry = getattr(chunk, "logprobs", None)
        if entry is not None:
            index = getattr(chunk, "index", 0)
            held = self._held.get(index)
            if held is None:
                held = self._held[index] = ChoiceLogprobsJson(self.kind,
                                                              self._offset.get(index, 0))
            held.add(entry)

    def chunks(self, chunks: Iterable[Any]) -> bytes:
        """The events of several chunks (objects with ``text`` and ``finish_reason``, e.g.
        :class:`~node_agent.serving.types.Chunk`) back to back, leaving out those with neither
        text nor a finish reason (a token whose text is held back: nothing to send); ``b""``
        when none is left."""
        head, kind, usage = self._head, self.kind, self.include_usage
        if not self.logprobs and self.n == 1:
            return b"".join(head + choice_part(kind, usage, c.text, c.finish_reason)
                            for c in chunks if c.text or c.finish_reason is not None)
        out = []
        for c in chunks:
            self.note(c)
            if not c.text and c.finish_reason is None:
                continue
            out.append(self.chunk(c.text, c.finish_reason, getattr(c, "index", 0)))
        return b"".join(out)

    def _logprobs(self, index: int) -> bytes | None:
        """The held token entries of choice ``index`` as OpenAI's ``logprobs`` object's JSON
        (then sent: forgotten), or ``None`` when there are none. Each entry was encoded when
        it was noted: an event after many held tokens (a tool call's) costs a join, not one
        encoding of them all."""
        held = self._held.pop(index, None)
        if held is None:
            return None
        self._offset[index] = held.offset
        return held.json()

    def tool_calls(self, calls: list[dict[str, Any]], first_index: int,
                   choice_index: int = 0) -> bytes:
        """One chat event whose ``delta`` is ``{"tool_calls": [...]}``: each of ``calls``
        (OpenAI ``tool_calls`` entries, complete) with its ``index`` among the answer's calls,
        counted from ``first_index``, in choice ``choice_index`` (its token entries go with
        the choice's next :meth:`chunk`)."""
        delta = {"tool_calls": [{"index": first_index + i, **c} for i, c in enumerate(calls)]}
        choice = {"index": choice_index, "delta": delta, "logprobs": None,
                  "finish_reason": None}
        return self._head + b'"choices":[' + dumps(choice) + b"]" + _tail(self.include_usage)

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The final usage event (only with ``include_usage``): ``choices`` ``[]`` and
        ``usage`` (OpenAI's ``usage`` object as a dict)."""
        return self._head + b'"choices":[],"usage":' + dumps(usage) + b"}\n\n"
