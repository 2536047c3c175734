"""Generated tokens → emitted text: streaming detokenization and stop strings.

:func:`apply_stops` and :func:`next_text` are pure: they take the text held back so far and
return what to emit, what to hold back and whether a stop string ended the generation. Text that
may be the beginning of a stop string is held back until the next segment decides it.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["apply_stops", "next_text", "feed"]


def apply_stops(stops: Sequence[str], held: str, segment: str) -> tuple[str, str, str | None]:
    """``segment`` decoded after ``held`` → ``(text to emit, text now held back, reason)``.

    ``reason`` is ``"stop"`` when a stop string occurs in ``held + segment`` (the text is then
    cut before its first occurrence, whichever stop string that is, and nothing is held);
    otherwise ``None``, and the longest tail that is a proper prefix of some stop string is held
    back. Empty stop strings never match (callers drop them)."""
    if not stops:
        return segment, held, None
    buf = held + segment
    first = -1
    for s in stops:
        i = buf.find(s)
        if i >= 0 and (first < 0 or i < first):
            first = i
    if first >= 0:
        return buf[:first], "", "stop"
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(buf)), 0, -1):
            if buf.endswith(s[:k]):
                keep = max(keep, k)
                break
    return buf[:len(buf) - keep], (buf[len(buf) - keep:] if keep else ""), None


def next_text(stops: Sequence[str], held: str, segment: str,
              finish_reason: str | None) -> tuple[str, str, str | None]:
    """Like :func:`apply_stops` for a segment that may be the generation's last:
    ``finish_reason`` (``None``, ``"stop"`` for EOS, ``"length"``) is mlx-lm's verdict on the
    token. A stop string wins; otherwise when the generation ends, held-back text is emitted
    after all and the reason is ``finish_reason``."""
    text, held, reason = apply_stops(stops, held, segment)
    if reason is None and finish_reason is not None:
        return text + held, "", finish_reason
    return text, held, reason


def feed(detokenizer: Any, token: int, finish_reason: str | None) -> str:
    """Add one generated token to mlx-lm's streaming ``detokenizer``; returns the newly decoded
    segment. An EOS (``finish_reason == "stop"``) is not part of the text; the last token
    flushes the detokenizer."""
    if finish_reason == "stop":
        detokenizer.finalize()
    else:
        detokenizer.add_token(token)
        if finish_reason is not None:
            detokenizer.finalize()
    return detokenizer.last_segment
