"""Tool calls read out of a chat answer's text, whole or as it streams: pure.

A model writes a call between its format's start and end strings (mlx-lm's tool parser for
its chat template: :class:`~node_agent.serving.types.ToolFormat`, e.g. ``<tool_call>`` …
``</tool_call>``). :class:`ToolCallReader` splits the text it is fed into content and the raw
text of each call (holding back a tail that may begin a start string, as a stop string is held
back), and :func:`openai_calls` turns a call's text into OpenAI's ``tool_calls`` entries with
the parser itself (mlx-lm's ``parse_tool_call``: reused, not rewritten).

A call the parser cannot read (e.g. cut by ``max_tokens``) is not dropped: its text, markers
included, stays in the answer's ``content``. The non-streamed and the streamed answer come from
the same reader, so a stream's ``delta.tool_calls`` reassemble to the non-streamed
``message.tool_calls`` (ids aside: each answer has its own).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable

from ..serving.types import ToolFormat

__all__ = ["ToolCallReader", "openai_calls", "new_call_id", "finish_reason", "Piece"]

#: What the reader yields: ``("content", text)`` or ``("call", (index of its first call among
#: the answer's calls, [OpenAI tool call, ...]))``.
Piece = tuple[str, Any]


def new_call_id() -> str:
    """A tool call id in OpenAI's form ``call_<24 hex digits>``."""
    return "call_" + uuid.uuid4().hex[:24]


def openai_calls(fmt: ToolFormat, text: str, tools: list[dict[str, Any]] | None,
                 new_id: Callable[[], str] = new_call_id) -> list[dict[str, Any]] | None:
    """OpenAI ``tool_calls`` entries (``{"id", "type": "function", "function": {"name",
    "arguments": <JSON string>}}``) of one call's text, parsed by ``fmt.parse``; ``None`` when
    the parser cannot read it (or reads no function name)."""
    try:
        parsed = fmt.parse(text, tools)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None
    out = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", {})
        out.append({"id": new_id(), "type": "function",
                    "function": {"name": call["name"],
                                 "arguments": args if isinstance(args, str)
                                 else json.dumps(args, ensure_ascii=False)}})
    return out


class ToolCallReader:
    """Feed an answer's text in pieces (:meth:`feed`), then :meth:`finish`; each returns the
    pieces complete so far, in order: content text and parsed calls. ``calls``: every call
    read so far (the ``tool_calls`` of the answer)."""

    def __init__(self, fmt: ToolFormat, tools: list[dict[str, Any]] | None,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self.tools = tools
        self.new_id = new_id
        self.calls: list[dict[str, Any]] = []
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[Piece]:
        """The pieces complete after ``text`` (content up to any possible start of a call)."""
        self._buf += text
        out: list[Piece] = []
        start, end = self.fmt.start, self.fmt.end
        while True:
            if self._in_call:
                i = self._buf.find(end) if end else -1
                if i < 0:
                    return out
                raw, self._buf = self._buf[:i], self._buf[i + len(end):]
                self._in_call = False
                out.append(self._call(raw))
            else:
                i = self._buf.find(start)
                if i < 0:
                    keep = _partial_suffix(self._buf, start)
                    text_out = self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    if text_out:
                        out.append(("content", text_out))
                    return out
                if i:
                    out.append(("content", self._buf[:i]))
                self._buf = self._buf[i + len(start):]
                self._in_call = True

    def finish(self) -> list[Piece]:
        """The rest at the end of the answer: held-back text, or an unfinished call — parsed if
        the parser can read it (a format without end string), else its text as content."""
        rest, self._buf = self._buf, ""
        if not self._in_call:
            return [("content", rest)] if rest else []
        self._in_call = False
        calls = openai_calls(self.fmt, rest, self.tools, self.new_id) if not self.fmt.end \
            else None
        if calls:
            first = len(self.calls)
            self.calls.extend(calls)
            return [("call", (first, calls))]
        return [("content", self.fmt.start + rest)]

    def _call(self, raw: str) -> Piece:
        calls = openai_calls(self.fmt, raw, self.tools, self.new_id)
        if not calls:
            return ("content", self.fmt.start + raw + self.fmt.end)
        first = len(self.calls)
        self.calls.extend(calls)
        return ("call", (first, calls))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish reason of a chat answer: ``tool_calls`` when it ended (``stop``) after
    tool calls; else the generation's own."""
    return "tool_calls" if has_calls and reason == "stop" else reason
