"""Plain values the serving core hands out: a loaded revision's :class:`ModelInfo` and a
generation's :class:`Chunk`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelKey", "ModelInfo", "Chunk"]

#: A resident revision's identity: ``(model_id, revision)``.
ModelKey = tuple[str, str]


@dataclass(frozen=True)
class ModelInfo:
    """A loaded model revision. ``created_unix``: load time, seconds since the epoch;
    ``max_context_tokens``: prompt + completion limit in tokens."""

    model_id: str
    revision: str
    path: str
    created_unix: int
    max_concurrent_sequences: int
    max_context_tokens: int

    @property
    def key(self) -> ModelKey:
        """``(model_id, revision)``: what identifies this revision in the core."""
        return (self.model_id, self.revision)


@dataclass(frozen=True)
class Chunk:
    """One piece of a generation: ``text`` (may be empty), ``tokens`` generated so far for the
    request, and ``finish_reason`` (``None`` until the last chunk, then ``"stop"`` or
    ``"length"``)."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None
