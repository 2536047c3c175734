"""Embeddings: the event loop's side of :class:`ServingCore` for ``TextEmbedding`` revisions.

:meth:`_Embeddings.embed` admits a request like a generation (it counts in the revision's
in-flight requests, so queue limits, ``Retry-After`` and drains apply), tokenizes its texts on
the core's tokenizer pool (never on the MLX thread nor the event loop;
:func:`~node_agent.serving.tokenize.tokenize_inputs`), checks every input against the context
limit, and queues its inputs in the revision's batch queue. The queue is cut into forward
passes by :func:`~node_agent.serving.embed_batch.decide` (inputs of concurrent requests share a
pass: at most ``max_concurrent_sequences`` inputs and that many times ``max_context_tokens``
padded tokens; a partial batch waits at most
:data:`~node_agent.serving.embed_batch.DEFAULT_WINDOW_SECONDS`), each pass one call on the MLX
thread (:meth:`~node_agent.serving.engine.Engine.embed`), one pass per revision at a time. A
request's vectors come back in its input order; ``dimensions`` truncates them (Matryoshka) and
renormalises. :class:`_Embeddings` is one part of
:class:`~node_agent.serving.core.ServingCore` (a mixin; ``ServingCore.__init__`` sets up
``_embed_queues``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from mlx_fleet.capabilities import TASK_TEXT_EMBEDDING, Capability

from .embed_batch import BatchPolicy, decide
from .embed_profile import check_dimensions
from .errors import (ContextLengthExceeded, GenerationAborted, InvalidPrompt, ModelNotLoaded,
                     WrongTask)
from .tokenize import PromptTooLarge, prompt_bytes, tokenize_inputs
from .types import ModelInfo, ModelKey

__all__ = ["Embeddings", "InputTooLong", "DimensionsNotSupported"]


class InputTooLong(ContextLengthExceeded):
    """An embedding input has more tokens than the model's ``max_context_tokens``. ``index``:
    which input (0-based); ``tokens``: its length."""

    def __init__(self, index: int, tokens: int, max_context_tokens: int) -> None:
        ValueError.__init__(self, f"input {index} has {tokens} tokens; this model's maximum "
                                  f"context length is {max_context_tokens} tokens")
        self.prompt_tokens, self.max_tokens = tokens, 0
        self.max_context_tokens = max_context_tokens
        self.index, self.tokens = index, tokens


class DimensionsNotSupported(ValueError):
    """The request's ``dimensions`` cannot be served by the model (the message says why)."""


@dataclass(frozen=True)
class Embeddings:
    """The answer of :meth:`_Embeddings.embed`: ``vectors``, a float32 numpy array
    ``(inputs, dimensions)`` in input order; ``prompt_tokens``: the inputs' tokens together;
    ``info``: the revision that served them."""

    vectors: Any
    prompt_tokens: int
    info: ModelInfo


@dataclass
class _Item:
    ids: list[int]
    fut: asyncio.Future
    queued_at: float


@dataclass
class _Queue:
    items: collections.deque[_Item] = field(default_factory=collections.deque)
    busy: bool = False
    timer: asyncio.TimerHandle | None = None


@dataclass
class _Call:
    """An embeddings request as admission counts it (``_admit`` / ``_release``)."""

    key: ModelKey
    finished: bool = False


def truncate(vectors: Any, dimensions: int | None, normalize: bool) -> Any:
    """``vectors`` (numpy ``(n, d)``) cut to their first ``dimensions`` features and, when
    ``normalize``, L2-renormalised (Matryoshka truncation: Kusupati et al. 2022; what
    sentence-transformers' ``truncate_dim`` does before its Normalize module). ``None``:
    unchanged."""
    import numpy as np

    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    out = np.ascontiguousarray(vectors[:, :dimensions], dtype=np.float32)
    if normalize:
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


class _Embeddings:
    """The embeddings part of :class:`~node_agent.serving.core.ServingCore` (see the module
    docstring)."""

    async def embed(self, model_id: str, *, revision: str | None = None,
                    texts: Sequence[str] | None = None,
                    token_ids: Sequence[Sequence[int]] | None = None,
                    dimensions: int | None = None) -> Embeddings:
        """Embed exactly one of ``texts`` (strings, tokenized with the model's tokenizer and
        its special tokens) or ``token_ids`` (token lists, as they are) with revision
        ``revision`` of ``model_id`` (None: as :meth:`generate` picks), a ``TextEmbedding``
        model. ``dimensions``: truncate to that many features and renormalise, only where the
        model allows (:func:`~node_agent.serving.embed_profile.check_dimensions`).

        Raises :class:`ModelNotLoaded`, :class:`WrongTask` (a ``TextGeneration`` model),
        :class:`DimensionsNotSupported`, :class:`PromptTooLarge` (the texts are larger than
        ``max_prompt_bytes`` together), :class:`InvalidPrompt` (a token id outside the
        vocabulary, an input that cannot be tokenized; the message names the input),
        :class:`InputTooLong` (an input longer than ``max_context_tokens``),
        :class:`Overloaded`, ``ValueError`` for bad arguments (no inputs, both kinds),
        :class:`GenerationAborted` when the core is not running, has failed or the revision
        was unloaded meanwhile.
        """
        if (texts is None) == (token_ids is None):
            raise ValueError("give exactly one of texts or token_ids")
        n_inputs = len(texts) if texts is not None else len(token_ids or ())
        if n_inputs == 0:
            raise ValueError("no inputs")
        if self._failure is not None:
            raise GenerationAborted(self._failed_message())
        if self._closed or not self._started:
            raise GenerationAborted("the serving core is not running")
        info = self.model_info(model_id, revision)
        if info.task != TASK_TEXT_EMBEDDING or info.embedding is None:
            raise WrongTask(model_id, info.task, Capability.EMBEDDINGS)
        why = check_dimensions(info.embedding, dimensions)
        if why is not None:
            raise DimensionsNotSupported(why)
        if texts is not None:
            size = sum(prompt_bytes(t, None) for t in texts)
            if size > self.max_prompt_bytes:
                raise PromptTooLarge(size, self.max_prompt_bytes)
        else:
            vocab = info.embedding.vocab_size
            for i, ids in enumerate(token_ids or ()):
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise InvalidPrompt(f"input {i}: token id {bad} is outside the model's "
                                        f"vocabulary (0 to {vocab - 1})")
        call = _Call(info.key)
        self._admit(info)
        completed = False
        futs: list[asyncio.Future] = []
        try:
            batch = await self._embedding_ids(info, texts, token_ids)
            for i, ids in enumerate(batch):
                if len(ids) > info.max_context_tokens:
                    raise InputTooLong(i, len(ids), info.max_context_tokens)
            loop = asyncio.get_running_loop()
            queue = self._embed_queues.setdefault(info.key, _Queue())
            now = time.monotonic()
            for ids in batch:
                fut = loop.create_future()
                futs.append(fut)
                queue.items.append(_Item(ids, fut, now))
            self._pump(info.key)
            rows = await asyncio.gather(*futs)
            completed = True
        except BaseException as e:
            for f in futs:
                f.cancel()
            if futs:
                self._drop_gone(info.key)
            self._set_retry_after(e, info.key)
            raise
        finally:
            self._release(call, completed=completed)
        import numpy as np

        vectors = truncate(np.stack(rows), dimensions, info.embedding.normalize)
        return Embeddings(vectors, sum(len(ids) for ids in batch), info)

    async def _embedding_ids(self, info: ModelInfo, texts: Sequence[str] | None,
                             token_ids: Sequence[Sequence[int]] | None) -> list[list[int]]:
        """The inputs as token lists: ``texts`` tokenized on the core's tokenizer pool."""
        if texts is None:
            return [list(ids) for ids in token_ids or ()]
        tokenizer = self._tokenizers.get(info.key)
        if tokenizer is None:
            raise ModelNotLoaded(*info.key)
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, tokenize_inputs, tokenizer, list(texts))

    def _drop_gone(self, key: ModelKey) -> None:
        """Drop the waiting inputs of requests that went away (cancelled, or failed on another
        input) and pump: once per such request, so that a pump itself looks only at the head
        of the queue (n requests arriving together cost O(n) pumping, not O(n²))."""
        queue = self._embed_queues.get(key)
        if queue is not None:
            queue.items = collections.deque(it for it in queue.items if not it.fut.done())
            self._pump(key)

    def _pump(self, key: ModelKey) -> None:
        """Loop side: start the revision's next forward pass when
        :func:`~node_agent.serving.embed_batch.decide` says so, or wake up when it says to.
        Looks at no more of the queue than one batch and the input after it."""
        queue = self._embed_queues.get(key)
        if queue is None:
            return
        # a request cancelled while it waited: its futures are done before its task runs
        # _drop_gone; those at the head go now, the others are left out of the batch below
        while queue.items and queue.items[0].fut.done():
            queue.items.popleft()
        if queue.timer is not None:
            queue.timer.cancel()
            queue.timer = None
        info = self._infos.get(key)
        if info is None:
            self._fail_queue(key, GenerationAborted("the model was unloaded"))
            return
        if not queue.items:
            if not queue.busy:
                del self._embed_queues[key]
            return
        policy = BatchPolicy(info.max_concurrent_sequences,
                             info.max_concurrent_sequences * info.max_context_tokens)
        head = itertools.islice(queue.items, policy.max_inputs + 1)  # all decide needs
        decision = decide([len(it.ids) for it in head],
                          time.monotonic() - queue.items[0].queued_at, queue.busy, policy)
        if decision.take:
            taken = [it for it in (queue.items.popleft() for _ in range(decision.take))
                     if not it.fut.done()]
            queue.busy = True
            asyncio.ensure_future(self._run_batch(key, queue, taken))
        elif decision.wait_s is not None:
            assert self._loop is not None
            queue.timer = self._loop.call_later(decision.wait_s, self._pump, key)

    async def _run_batch(self, key: ModelKey, queue: _Queue, taken: list[_Item]) -> None:
        """One forward pass on the MLX thread; each input's row (or the error) to its future."""
        try:
            vectors = await self._call(self._engine.embed, key, [it.ids for it in taken])
        except ModelNotLoaded:
            error: BaseException | None = GenerationAborted("the model was unloaded")
        except GenerationAborted as e:
            error = e
        except Exception as e:  # noqa: BLE001 - this batch fails, the core goes on
            error = GenerationAborted(f"embedding failed: {type(e).__name__}: {e}",
                                      public="embedding failed")
        else:
            error = None
        for i, it in enumerate(taken):
            if it.fut.done():
                continue
            if error is not None:
                it.fut.set_exception(error)
            else:
                it.fut.set_result(vectors[i])
        queue.busy = False
        self._pump(key)

    def _fail_queue(self, key: ModelKey, error: BaseException) -> None:
        """Fail every input waiting for ``key`` (its revision is gone) and drop its queue."""
        queue = self._embed_queues.pop(key, None)
        if queue is None:
            return
        if queue.timer is not None:
            queue.timer.cancel()
        for it in queue.items:
            if not it.fut.done():
                it.fut.set_exception(error)
