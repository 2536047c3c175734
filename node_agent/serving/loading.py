"""Loading a model in chunks, interleaved with the other models' decode steps.

``mlx_lm.load`` reads every weight in one ``mx.eval`` on the MLX thread; every other resident
model then stops decoding for the whole load. Instead the serving core loads a revision in
stages (see :mod:`node_agent.serving.core`):

1. the tokenizer (``mlx_lm.utils.load_tokenizer``: pure Python / ``tokenizers``, no MLX) on a
   worker thread of the event loop, before anything happens on the MLX thread;
2. on the MLX thread, ``mlx_lm.utils.load_model(path, lazy=True)``: builds the modules and
   attaches *lazy* weights (``mx.load`` reads nothing until evaluated) — milliseconds;
3. :class:`Materialization`: the parameters' leaf arrays (``mlx.utils.tree_flatten`` of
   ``model.parameters()``) evaluated a chunk at a time, one chunk per iteration of the MLX
   thread's loop, *after* that iteration's decode step of every revision with work.

How big a chunk is (:func:`chunk_budget_bytes`, pure): while other revisions decode, the chunk's
read time should stay at or below ``LoadPacing.step_fraction`` of the last decode step's time,
so an inter-token gap grows by at most that fraction (0.5: at most 1.5 × the gap without a
load; the goal of issue 6 is 2 ×). The bytes that fit in that time come from the read rate
measured on the previous chunks (:func:`update_rate`). While nothing else decodes there is no
one to stall, so a chunk is ``LoadPacing.max_chunk_bytes`` and a lone load runs about as fast as
one ``mx.eval`` of everything. :func:`next_chunk` cuts the arrays into chunks (pure); an array
is never split, so one array larger than the budget is a chunk of its own (a known limit: e.g. a
large embedding matrix stalls the others for its own read time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["LoadPacing", "chunk_budget_bytes", "next_chunk", "update_rate", "load_tokenizer",
           "Materialization"]

#: Weight of the newest measurement in the read-rate average (:func:`update_rate`).
RATE_WEIGHT = 0.5


@dataclass(frozen=True)
class LoadPacing:
    """How the serving core sizes load chunks (see the module docstring).

    ``step_fraction``: a chunk read while other revisions decode takes at most this fraction of
    the last decode step's time (default 0.5: the inter-token gap grows to at most 1.5 × during
    a load, within issue 6's goal of 2 ×). ``max_chunk_bytes``: the ceiling of any chunk, and
    the chunk size while nothing else decodes (default 512 MiB: a 4-bit 70B model is ~80
    chunks, each far longer than the per-``mx.eval`` overhead). ``probe_chunk_bytes``: the first
    chunk while others decode, before a read rate is measured (default 4 MiB: ~1 ms from an
    SSD). Raises ``ValueError`` for a fraction outside (0, 10] or sizes below 1 byte.
    """

    step_fraction: float = 0.5
    max_chunk_bytes: int = 512 * 2**20
    probe_chunk_bytes: int = 4 * 2**20

    def __post_init__(self) -> None:
        if not 0 < self.step_fraction <= 10:
            raise ValueError(f"step_fraction must be in (0, 10], got {self.step_fraction!r}")
        if self.max_chunk_bytes < 1 or self.probe_chunk_bytes < 1:
            raise ValueError("max_chunk_bytes and probe_chunk_bytes must be at least 1 byte")


def chunk_budget_bytes(pacing: LoadPacing, *, decode_step_seconds: float | None,
                       bytes_per_second: float | None) -> int:
    """The bytes the next chunk may hold.

    ``decode_step_seconds``: the duration of the MLX thread's last round of decode steps (every
    revision with work), or ``None`` when no revision is decoding; ``bytes_per_second``: the
    measured read rate of this load's earlier chunks, ``None`` before the first. Nothing
    decoding: ``max_chunk_bytes``. Decoding but no rate yet: ``probe_chunk_bytes`` (capped by
    the ceiling). Otherwise ``step_fraction × decode_step_seconds × bytes_per_second`` within
    ``[1, max_chunk_bytes]``.
    """
    if decode_step_seconds is None:
        return pacing.max_chunk_bytes
    if bytes_per_second is None or bytes_per_second <= 0:
        return min(pacing.probe_chunk_bytes, pacing.max_chunk_bytes)
    budget = int(pacing.step_fraction * max(decode_step_seconds, 0.0) * bytes_per_second)
    return max(1, min(budget, pacing.max_chunk_bytes))


def next_chunk(sizes: Sequence[int], start: int, budget_bytes: int) -> int:
    """The end (exclusive) of the chunk of ``sizes[start:]`` (bytes per array) to evaluate next:
    the longest run whose total is at most ``budget_bytes``, but at least one array (an array
    larger than the budget is a chunk of its own). ``start == len(sizes)``: returns ``start``."""
    end, total = start, 0
    while end < len(sizes) and (end == start or total + sizes[end] <= budget_bytes):
        total += sizes[end]
        end += 1
    return end


def update_rate(rate: float | None, nbytes: int, seconds: float,
                weight: float = RATE_WEIGHT) -> float | None:
    """The read rate (bytes/s) after a chunk of ``nbytes`` took ``seconds``: an exponential
    average with ``weight`` on the new measurement (the first one is taken as is). A chunk
    too short to time (``seconds`` <= 0) or empty leaves ``rate`` unchanged."""
    if nbytes <= 0 or seconds <= 0:
        return rate
    measured = nbytes / seconds
    return measured if rate is None else weight * measured + (1 - weight) * rate


def load_tokenizer(path: str | Path) -> Any:
    """The mlx-lm ``TokenizerWrapper`` of the model directory ``path``, with the EOS ids of its
    ``config.json`` (as ``mlx_lm.load`` does). Pure Python (no MLX): runs off the MLX thread.
    Raises whatever mlx-lm / transformers raise for a bad directory."""
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    p = Path(path)
    return mlx_load_tokenizer(p, eos_token_ids=load_config(p).get("eos_token_id"))


class Materialization:
    """A lazily loaded model's parameters, evaluated chunk by chunk (MLX thread only).

    ``total_bytes``: the parameters' bytes; ``done_bytes`` / ``chunks``: what is evaluated so far
    and in how many chunks (plain ints, safe to read from any thread). ``bytes_per_second``:
    the measured read rate (``None`` before the first chunk).
    """

    def __init__(self, model: Any, pacing: LoadPacing) -> None:
        from mlx.utils import tree_flatten

        self.pacing = pacing
        self._arrays = [v for _, v in tree_flatten(model.parameters()) if hasattr(v, "nbytes")]
        self._sizes = [int(v.nbytes) for v in self._arrays]
        self._next = 0
        self.total_bytes = sum(self._sizes)
        self.done_bytes = 0
        self.chunks = 0
        self.bytes_per_second: float | None = None

    @property
    def done(self) -> bool:
        return self._next >= len(self._arrays)

    def step(self, decode_step_seconds: float | None) -> int:
        """Evaluate the next chunk, sized for ``decode_step_seconds`` (see
        :func:`chunk_budget_bytes`); returns its bytes. Raises what ``mx.eval`` raises (a read
        error of the weight files)."""
        budget = chunk_budget_bytes(self.pacing, decode_step_seconds=decode_step_seconds,
                                    bytes_per_second=self.bytes_per_second)
        end = next_chunk(self._sizes, self._next, budget)
        nbytes = sum(self._sizes[self._next:end])
        t0 = time.perf_counter()
        self.eval_arrays(self._arrays[self._next:end])
        self.bytes_per_second = update_rate(self.bytes_per_second, nbytes,
                                            time.perf_counter() - t0)
        for i in range(self._next, end):
            self._arrays[i] = None  # the model holds them; keep no second reference
        self._next = end
        self.done_bytes += nbytes
        self.chunks += 1
        return nbytes

    def release(self) -> None:
        """Drop every reference to the model's arrays (the counters stay)."""
        self._arrays = []
        self._next = len(self._sizes)

    @staticmethod
    def eval_arrays(arrays: list[Any]) -> None:
        """``mx.eval`` of one chunk (a seam for tests that inject a read failure)."""
        import mlx.core as mx

        mx.eval(arrays)
