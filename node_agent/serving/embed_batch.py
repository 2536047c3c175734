"""When the serving core runs a forward pass of an embedding model, and on which inputs: the
batching policy of ``POST /v1/embeddings`` (pure, table-tested in tests/test_embeddings.py).

Inputs of concurrent requests for one revision wait in one FIFO queue (loop side,
:mod:`node_agent.serving.embeddings`); :func:`decide` is asked whenever the queue changes, a
forward pass ends or a wait runs out. A batch is the longest head of the queue that fits
:class:`BatchPolicy` (``max_inputs`` inputs, ``max_tokens`` padded tokens: inputs × the longest
of them, since a batch is padded to its longest input). It runs at once when it is full (it
reached a bound, or more inputs wait than fit), else once its oldest input has waited
``window_s`` — so a lone request waits at most ``window_s`` for company, and a burst is cut
into full batches without waiting. One forward pass per revision at a time: while one runs
(``busy``), inputs only queue (the next batch forms meanwhile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["BatchPolicy", "Decision", "decide", "DEFAULT_WINDOW_SECONDS"]

#: How long the oldest waiting input waits for more before a partial batch runs (seconds):
#: 2 ms, about one decode step of a small model, against a forward pass of 10-100 ms.
DEFAULT_WINDOW_SECONDS = 0.002


@dataclass(frozen=True)
class BatchPolicy:
    """``max_inputs``: inputs per forward pass (the revision's ``max_concurrent_sequences``);
    ``max_tokens``: padded tokens per forward pass (default: ``max_inputs`` × its
    ``max_context_tokens``, the one batch the memory estimate reserves KV for);
    ``window_s``: :data:`DEFAULT_WINDOW_SECONDS`. Raises ``ValueError`` for a bound below 1 or a
    negative window."""

    max_inputs: int
    max_tokens: int
    window_s: float = DEFAULT_WINDOW_SECONDS

    def __post_init__(self) -> None:
        if self.max_inputs < 1 or self.max_tokens < 1 or self.window_s < 0:
            raise ValueError("max_inputs and max_tokens must be >= 1, window_s >= 0")


@dataclass(frozen=True)
class Decision:
    """``take``: inputs to run now from the head of the queue (0: none now); ``wait_s``: when
    ``take`` is 0, ask again after this many seconds (``None``: only when something changes)."""

    take: int
    wait_s: float | None = None


def fits(lengths: Sequence[int], policy: BatchPolicy) -> int:
    """How many inputs from the head of ``lengths`` (token counts, FIFO) one forward pass takes:
    the most that stay within ``max_inputs`` and ``max_tokens`` padded tokens; at least 1 (an
    input longer than ``max_tokens`` alone still runs alone)."""
    n, longest = 0, 0
    for length in lengths[:policy.max_inputs]:
        longest = max(longest, length)
        if n and (n + 1) * longest > policy.max_tokens:
            break
        n += 1
    return max(n, 1) if lengths else 0


def decide(lengths: Sequence[int], waited_s: float, busy: bool,
           policy: BatchPolicy) -> Decision:
    """What to do with the queue ``lengths`` (token counts of the waiting inputs, oldest first)
    whose oldest input has waited ``waited_s``; ``busy``: a forward pass of the revision is
    running (see the module docstring)."""
    if not lengths or busy:
        return Decision(0)
    n = fits(lengths, policy)
    full = n < len(lengths) or n == policy.max_inputs or (
        (n + 1) * max(lengths[:n]) > policy.max_tokens)
    if full or waited_s >= policy.window_s:
        return Decision(n)
    return Decision(0, policy.window_s - waited_s)
