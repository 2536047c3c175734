"""Loading a model in chunks, overlapped with the other models' decode steps.

``mlx_lm.load`` reads every weight in one ``mx.eval`` on the MLX thread; every other resident
model then stops decoding for the whole load. Instead the serving core loads a revision in
stages (see :mod:`node_agent.serving.core`):

1. the tokenizer (``mlx_lm.utils.load_tokenizer``: pure Python / ``tokenizers``, no MLX) on a
   worker thread of the event loop, before anything happens on the MLX thread;
2. on the MLX thread, ``mlx_lm.utils.load_model(path, lazy=True)`` under the core's *load
   stream* (a CPU stream of its own): builds the modules and attaches *lazy* weights
   (``mx.load`` reads nothing until evaluated) — milliseconds;
3. :class:`Materialization`: the parameters' leaf arrays (``mlx.utils.tree_flatten`` of
   ``model.parameters()``) evaluated a chunk at a time, advanced once per iteration of the MLX
   thread's loop, *after* that iteration's decode step of every revision with work.

Why overlapped, not merely chunked (measured on the H100, ``benchmarks/results/
load_stall-probe-h100.json``): the decode loop is bound by its host thread — BatchGenerator's
next step is built only after the previous one's tokens are read — so *any* time the MLX thread
spends blocked adds to an inter-token gap one for one (a 2 ms ``time.sleep`` per step: p50 gap
7.1 → 9.9 ms; a synchronous ``mx.eval`` of one weight array per step: 13.6 ms; the same arrays
handed to ``mx.async_eval`` on a separate CPU stream and not waited for: 6.5 ms, no worse than
idle). So while other revisions decode, a chunk is *submitted* (``mx.async_eval``: the load
stream's own thread reads it) and *confirmed* (``mx.eval``, by then a no-op) only once its read
should be over, with a margin (:func:`due_time`); then the next is submitted. The read rate comes
from the confirmations themselves (:func:`rate_after_confirm`): one that had to wait measured
the read exactly; one that did not proves a lower bound, and the estimate creeps up until a
confirmation waits again — so a confirmation waits rarely and briefly, never a whole read.
While nothing else decodes there is no one to stall: a chunk of ``LoadPacing.max_chunk_bytes`` is
read synchronously and a lone load runs about as fast as one ``mx.eval`` of everything.
``LoadPacing(overlap=False)`` restores synchronous chunks while others decode (the A/B of
``benchmarks/load_stall.py``). :func:`next_chunk` cuts the arrays into chunks (pure); an array is
never split.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["LoadPacing", "chunk_budget_bytes", "next_chunk", "update_rate", "due_time",
           "rate_after_confirm", "load_tokenizer", "Materialization"]

#: Weight of the newest measurement in the read-rate average (:func:`update_rate`).
RATE_WEIGHT = 0.5
#: A confirmation that blocked for longer than this (seconds) measured the read's end exactly.
BLOCKED_SECONDS = 0.0005
#: A confirmation that did not block: the chunk was done before it was looked at, so the rate is
#: at least what it implies, and the estimate grows by this factor (:func:`rate_after_confirm`).
RATE_GROWTH = 1.1


@dataclass(frozen=True)
class LoadPacing:
    """How the serving core sizes and schedules load chunks (see the module docstring).

    ``overlap``: while other revisions decode, chunks are read on the load stream without the
    MLX thread waiting (default ``True``); ``False``: each chunk is an ``mx.eval`` on the MLX
    thread, which stalls the others for its read time. ``chunk_seconds``: while others decode,
    a chunk holds about this much reading at the estimated rate (default 0.04 s: per-chunk
    overhead small, progress and cancellation prompt, a wait on an overestimated rate short).
    ``confirm_margin``: a chunk is confirmed after this multiple of its expected read time
    (default 1.25: a read up to 20 % slower than estimated costs no wait; the reader idles
    ~20 % of a load, so a load while others decode takes ~1.3 × a lone one).
    ``max_chunk_bytes``: the ceiling of any chunk, and the chunk size while nothing else
    decodes (default 512 MiB: a 4-bit 70B model is ~80 chunks). ``probe_chunk_bytes``: the
    first chunk while others decode, before a rate is measured (default 4 MiB: ~1 ms from an
    SSD). Raises ``ValueError`` for ``chunk_seconds`` outside (0, 60], ``confirm_margin`` < 1
    or sizes below 1 byte.
    """

    overlap: bool = True
    chunk_seconds: float = 0.04
    confirm_margin: float = 1.25
    max_chunk_bytes: int = 512 * 2**20
    probe_chunk_bytes: int = 4 * 2**20

    def __post_init__(self) -> None:
        if not 0 < self.chunk_seconds <= 60:
            raise ValueError(f"chunk_seconds must be in (0, 60], got {self.chunk_seconds!r}")
        if not self.confirm_margin >= 1:
            raise ValueError(f"confirm_margin must be at least 1, got {self.confirm_margin!r}")
        if self.max_chunk_bytes < 1 or self.probe_chunk_bytes < 1:
            raise ValueError("max_chunk_bytes and probe_chunk_bytes must be at least 1 byte")


def chunk_budget_bytes(pacing: LoadPacing, *, decoding: bool,
                       bytes_per_second: float | None) -> int:
    """The bytes the next chunk may hold.

    ``decoding``: another revision decoded in this iteration of the MLX thread's loop;
    ``bytes_per_second``: the read rate measured on this load's earlier chunks, ``None``
    before the first. Nothing decoding: ``max_chunk_bytes``. Decoding but no usable rate yet:
    ``probe_chunk_bytes`` (capped by the ceiling). Otherwise ``chunk_seconds ×
    bytes_per_second`` within ``[1, max_chunk_bytes]``.
    """
    if not decoding:
        return pacing.max_chunk_bytes
    if bytes_per_second is None or bytes_per_second <= 0:
        return min(pacing.probe_chunk_bytes, pacing.max_chunk_bytes)
    budget = int(pacing.chunk_seconds * bytes_per_second)
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


def due_time(submitted: float, nbytes: int, bytes_per_second: float | None,
             margin: float) -> float:
    """When to confirm a chunk of ``nbytes`` submitted at ``submitted`` (seconds, that clock) to
    an idle load stream: after ``margin`` × its expected read time ``nbytes / rate``. No usable
    rate yet: at once (that confirmation then measures the rate)."""
    if bytes_per_second is None or bytes_per_second <= 0:
        return submitted
    return submitted + margin * nbytes / bytes_per_second


def rate_after_confirm(rate: float | None, nbytes: int, submitted: float, confirmed: float,
                       blocked_seconds: float) -> float | None:
    """The read-rate estimate (bytes/s) after confirming a chunk of ``nbytes`` that was
    submitted to an idle load stream at ``submitted`` and confirmed at ``confirmed`` (seconds,
    one clock) after waiting ``blocked_seconds``. The read took at most ``confirmed -
    submitted``. Waited (more than :data:`BLOCKED_SECONDS`): it ended at ``confirmed``, so that
    is its duration — the new estimate, as measured. Did not wait: the rate is at least
    ``nbytes / (confirmed - submitted)``, and the old estimate (× :data:`RATE_GROWTH`) was not
    too high, so the estimate is the larger of the two. Nothing to time: unchanged."""
    seconds = confirmed - submitted
    if nbytes <= 0 or seconds <= 0:
        return rate
    measured = nbytes / seconds
    if blocked_seconds > BLOCKED_SECONDS or rate is None:
        return measured
    return max(measured, rate * RATE_GROWTH)


def load_tokenizer(path: str | Path) -> Any:
    """The mlx-lm ``TokenizerWrapper`` of the model directory ``path``, with the EOS ids of its
    ``config.json`` (as ``mlx_lm.load`` does). Pure Python (no MLX): runs off the MLX thread.
    Raises whatever mlx-lm / transformers raise for a bad directory."""
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    p = Path(path)
    # never run a model directory's code (node_agent.model_dir refuses *.py and auto_map too)
    return mlx_load_tokenizer(p, {"trust_remote_code": False},
                              eos_token_ids=load_config(p).get("eos_token_id"))


@dataclass
class _Chunk:
    arrays: list[Any]
    nbytes: int
    submitted: float
    due: float


class Materialization:
    """A lazily loaded model's parameters, evaluated chunk by chunk (MLX thread only).

    ``total_bytes``: the parameters' bytes; ``done_bytes`` / ``chunks``: what is confirmed read so
    far and in how many chunks (plain ints, safe to read from any thread).
    ``bytes_per_second``: the estimated read rate (``None`` before the first chunk).
    """

    def __init__(self, model: Any, pacing: LoadPacing) -> None:
        from mlx.utils import tree_flatten

        self.pacing = pacing
        self._arrays = [v for _, v in tree_flatten(model.parameters()) if hasattr(v, "nbytes")]
        self._sizes = [int(v.nbytes) for v in self._arrays]
        self._next = 0
        self._inflight: _Chunk | None = None
        self.total_bytes = sum(self._sizes)
        self.done_bytes = 0
        self.chunks = 0
        self.bytes_per_second: float | None = None

    @property
    def done(self) -> bool:
        return self._next >= len(self._arrays) and self._inflight is None

    def step(self, decoding: bool) -> int:
        """Advance the read by one iteration of the MLX thread's loop; returns the bytes
        confirmed read by this call. ``decoding``: another revision decoded in this iteration.
        Overlapping (``pacing.overlap`` and ``decoding``): if the chunk in flight is due,
        confirm it; if none is in flight then, submit the next — never waits for a read that is
        not due. Otherwise: confirm the chunk in flight (waiting) and read one chunk
        synchronously. Raises what ``mx.eval`` raises (a read error of the weight files)."""
        overlapped = self.pacing.overlap and decoding
        confirmed = 0
        if self._inflight is not None:
            if overlapped and time.perf_counter() < self._inflight.due:
                return 0
            confirmed += self._confirm()
        if self._next >= len(self._arrays):
            return confirmed
        chunk = self._take(chunk_budget_bytes(self.pacing, decoding=decoding,
                                              bytes_per_second=self.bytes_per_second))
        if overlapped:
            self.submit_arrays(chunk.arrays)
            chunk.due = due_time(chunk.submitted, chunk.nbytes, self.bytes_per_second,
                                 self.pacing.confirm_margin)
            self._inflight = chunk
        else:
            self.eval_arrays(chunk.arrays)
            self.bytes_per_second = update_rate(self.bytes_per_second, chunk.nbytes,
                                                time.perf_counter() - chunk.submitted)
            confirmed += self._count(chunk)
        return confirmed

    def _take(self, budget_bytes: int) -> _Chunk:
        end = next_chunk(self._sizes, self._next, budget_bytes)
        arrays = self._arrays[self._next:end]
        for i in range(self._next, end):
            self._arrays[i] = None  # the model holds them; keep no second reference
        nbytes = sum(self._sizes[self._next:end])
        self._next = end
        now = time.perf_counter()
        return _Chunk(arrays, nbytes, now, now)

    def _confirm(self) -> int:
        chunk, self._inflight = self._inflight, None
        assert chunk is not None
        t0 = time.perf_counter()
        self.eval_arrays(chunk.arrays)
        now = time.perf_counter()
        self.bytes_per_second = rate_after_confirm(self.bytes_per_second, chunk.nbytes,
                                                   chunk.submitted, now, now - t0)
        return self._count(chunk)

    def _count(self, chunk: _Chunk) -> int:
        chunk.arrays = []
        self.done_bytes += chunk.nbytes
        self.chunks += 1
        return chunk.nbytes

    def release(self) -> None:
        """Drop every reference to the model's arrays (the counters stay). A chunk still being
        read is waited for first, so that its memory can be returned (a read error there is
        ignored: the load is being dropped)."""
        chunk, self._inflight = self._inflight, None
        if chunk is not None:
            try:
                self.eval_arrays(chunk.arrays)
            except Exception:  # noqa: BLE001 - dropping the load anyway
                pass
        self._arrays = []
        self._next = len(self._sizes)

    @staticmethod
    def eval_arrays(arrays: list[Any]) -> None:
        """``mx.eval`` of one chunk: reads it, or confirms a submitted one (a seam for tests
        that inject a read failure)."""
        import mlx.core as mx

        mx.eval(arrays)

    @staticmethod
    def submit_arrays(arrays: list[Any]) -> None:
        """``mx.async_eval`` of one chunk: its read is scheduled on the streams of its arrays
        (the core's load stream) and this returns at once."""
        import mlx.core as mx

        mx.async_eval(arrays)
