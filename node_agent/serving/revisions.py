"""Loading, unloading and draining revisions: the event loop's side of :class:`ServingCore`'s
models.

:class:`_Revisions` is one part of :class:`~node_agent.serving.core.ServingCore` (a mixin; the
state it reads and writes is set up in ``ServingCore.__init__``): :meth:`~_Revisions.load_model`
(the tokenizer and the KV bytes per token read on worker threads, then the load queued to the
MLX thread as a :class:`_Load`), :meth:`~_Revisions.unload_model` with its drain
(:class:`_Drain`), and the loop-side record of the resident revisions (``_infos``, in load
order) with the choice of the revision a request goes to (``_serving``: the named one, else the
newest that is not draining). The MLX thread's side of a load is
:mod:`node_agent.serving.step_loop`; how loads overlap decoding is in
:mod:`node_agent.serving.core`'s docstring. Shapes and errors: each method's docstring
(:class:`~node_agent.serving.errors.ModelLoadError`,
:class:`~node_agent.serving.errors.ModelNotLoaded`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

from mlx_fleet.capabilities import TASK_TEXT_EMBEDDING, TASK_TEXT_GENERATION, TASKS

from ..memory_estimate import ModelFileError, kv_cache_bytes_per_token, read_config
from .embed_profile import UnsupportedEmbeddingModel, read_profile
from .errors import LOAD_CANCELLED, GenerationAborted, ModelLoadError, ModelNotLoaded
from .capabilities import tokenizer_features
from .loading import Materialization, load_tokenizer
from .types import LoadProgress, ModelInfo, ModelKey

log = logging.getLogger("node_agent.serving.core")  # the name its log lines always had


def _kv_bytes_per_token(path: str) -> int:
    """KV bytes per token of the model at ``path`` (its ``config.json``, the estimate's formula);
    0, with a warning, when the config cannot give it (no KV bound then)."""
    try:
        return kv_cache_bytes_per_token(read_config(path))
    except (ModelFileError, OSError) as e:
        log.warning("no KV-cache size for %s (%s): no KV budget applies to it", path, e)
        return 0


class _Drain:
    """A revision that admits no new requests while its in-flight ones finish. ``done`` is set
    when its in-flight count reaches 0, or when the drain is called off (``cancelled``: the
    revision was loaded or unloaded by another call meanwhile)."""

    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.cancelled = False


class _Load:
    """One model load, from its tokenizer to resident. ``fut`` (loop side) resolves when the
    load is over: ``None`` once the revision is resident, else the error. ``cancelled`` is set
    by the loop (an unload of the revision, or the caller gave up) and read by the thread before
    each chunk. ``queued``: handed to the MLX thread. The thread sets ``replaced`` (it unloaded
    a resident copy of the revision) and ``materialization`` (the chunked read, whose ints the
    loop reads for progress)."""

    def __init__(self, info: ModelInfo, fut: asyncio.Future) -> None:
        self.info = info
        self.fut = fut
        self.tokenizer: Any = None     # handed to the thread (which drops it once resident)
        self.served_tokenizer: Any = None   # loop side: kept for the core's tokenizer pool
        self.tokenizer_seconds = 0.0
        self.cancelled = False
        self.queued = False
        self.settled = False           # loop side: _settle_load ran
        # thread
        self.replaced = False
        self.model: Any = None
        self.materialization: Materialization | None = None
        self.started_at = 0.0

    def progress(self) -> LoadProgress:
        m = self.materialization
        state = ("ReadingWeights" if m is not None else "Queued" if self.queued
                 else "LoadingTokenizer")
        return LoadProgress(self.info.model_id, self.info.revision, state,
                            m.done_bytes if m else 0, m.total_bytes if m else 0,
                            m.chunks if m else 0)


_CANCELLED = "the load was called off by an unload of the revision or by its caller"


class _Revisions:
    """The models part of :class:`~node_agent.serving.core.ServingCore` (see the module
    docstring)."""

    # -- models --------------------------------------------------------------------------------
    async def load_model(self, model_id: str, path: str | os.PathLike, *, revision: str,
                         max_concurrent_sequences: int = 8,
                         max_context_tokens: int = 4096,
                         task: str = TASK_TEXT_GENERATION) -> ModelInfo:
        """Load ``path`` (a local mlx-lm model directory) as revision ``revision`` of
        ``model_id`` (mlx-lm's loader; weights read in chunks between the other revisions'
        decode steps, see the module docstring). The revision is visible (:meth:`models`,
        :meth:`generate`) only once all its weights are read.

        A revision that is not loaded is added *next to* the other revisions of ``model_id``
        (they keep serving; requests that name no revision go to the newest). Re-loading the
        same id, revision, path and limits is a no-op returning the existing info. The same id,
        revision and path with other limits applies the new limits without reloading the
        weights and returns the updated info (same ``created_unix``): requests admitted from
        then on get the new ``max_context_tokens``, and at most the new
        ``max_concurrent_sequences`` sequences run (running ones are never aborted; when the
        limit shrinks, new sequences start only once the batch has drained below it). The same
        id and revision from another path replaces that revision: the old one is aborted (its
        running requests fail with :class:`GenerationAborted`) and unloaded *before* the new one
        loads, so if that load fails the revision is no longer loaded at all. Loading a
        revision that is draining calls the drain off (it admits requests again and the pending
        :meth:`unload_model` leaves it loaded).
        A call for a revision and path whose load is under way joins that load (the weights
        are read once; its limits are applied after it). Loads queue: one materialises at a
        time, in call order. An :meth:`unload_model` of the
        revision, or :meth:`close`, calls a load off (queued or half read: what it read is
        freed). If the calling task is cancelled the load is called off too, unless it has
        already completed (then the revision stays loaded).
        ``task`` (:data:`mlx_fleet.capabilities.TASKS`): ``TextGeneration`` (a BatchGenerator and a
        prompt cache, :meth:`generate`) or ``TextEmbedding`` (no generator: :meth:`embed`, how it
        pools read from the directory, :mod:`node_agent.serving.embed_profile`); the same id,
        revision and path with another task is a replacement.
        Raises :class:`ModelLoadError` (``ModelNotFound`` when ``path`` is not a directory with a
        ``config.json``, ``UnsupportedEmbeddingModel`` when its embedding recipe is not served,
        ``LoadFailed`` for any error while loading — tokenizer, model build or
        any chunk of weights; nothing of it stays resident —, ``Cancelled`` when an unload
        called it off, ``NotStarted`` when the core is closed, ``CoreFailed``).
        """
        if self._failure is not None:
            raise ModelLoadError("CoreFailed", self._failed_message())
        if not self._started or self._closed:
            raise ModelLoadError("NotStarted", "the serving core is not running")
        if max_concurrent_sequences < 1 or max_context_tokens < 2:
            raise ValueError("max_concurrent_sequences must be >= 1, max_context_tokens >= 2")
        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}")
        spath = str(Path(path))
        key = (model_id, revision)
        joined = next((j for j in self._loading if j.info.key == key and j.info.path == spath
                       and not j.cancelled and not j.fut.done()), None)
        if joined is not None:
            # the same load is under way (e.g. the controller and a reload on demand): wait
            # for it instead of reading the weights twice, then apply these limits to it
            try:
                await asyncio.shield(joined.fut)
            except GenerationAborted as e:
                raise ModelLoadError("CoreFailed" if self._failure else "NotStarted",
                                     str(e)) from e
            return await self.load_model(model_id, path, revision=revision,
                                         max_concurrent_sequences=max_concurrent_sequences,
                                         max_context_tokens=max_context_tokens, task=task)
        existing = self._infos.get(key)
        if existing is not None and existing.path == spath and existing.task == task:
            self._end_drain(key)
            if (existing.max_concurrent_sequences, existing.max_context_tokens) == (
                    max_concurrent_sequences, max_context_tokens):
                return existing
            info = dataclasses.replace(existing, max_concurrent_sequences=max_concurrent_sequences,
                                       max_context_tokens=max_context_tokens)
            try:
                await self._call(self._engine.set_limits, info)
            except GenerationAborted as e:
                raise ModelLoadError("CoreFailed" if self._failure else "NotStarted",
                                     str(e)) from e
            if self._infos.get(key) is existing:
                self._infos[key] = info
            return info
        if not (Path(spath) / "config.json").is_file():
            raise ModelLoadError("ModelNotFound", f"no model (config.json) at {spath}")
        info = ModelInfo(model_id, revision, spath, int(time.time()), max_concurrent_sequences,
                         max_context_tokens, task=task)
        self._end_drain(key)
        assert self._loop is not None
        job = _Load(info, self._loop.create_future())
        self._loading.append(job)
        job.fut.add_done_callback(lambda _: self._settle_load(job))
        try:
            await self._hand_to_thread(job)
        except BaseException as e:  # it never reached the MLX thread
            if not job.fut.done():
                if isinstance(e, ModelLoadError):
                    job.fut.set_exception(e)
                else:
                    job.fut.cancel()
            if existing is not None and self._infos.get(key) is existing:
                # a replacement that fails leaves the revision unloaded, whatever stage failed
                self._drop(key)
                self._post(self._engine.unload, key)
            raise
        try:
            await asyncio.shield(job.fut)
        except asyncio.CancelledError:
            job.cancelled = True   # the thread drops it; _settle_load runs when it has
            raise
        except GenerationAborted as e:  # the thread failed or the core closed
            raise ModelLoadError("CoreFailed" if self._failure else "NotStarted", str(e)) from e
        finally:
            if job.fut.done():
                self._settle_load(job)
        return job.info        # with its KV bytes per token (_hand_to_thread)

    async def _hand_to_thread(self, job: _Load) -> None:
        """Load ``job``'s tokenizer, read its KV bytes per token and its tokenizer's features
        (into ``job.info``) off the MLX thread, then queue the job on it. Raises
        :class:`ModelLoadError` (``LoadFailed``, ``Cancelled``, ``CoreFailed``, ``NotStarted``)."""
        t0 = time.perf_counter()
        try:
            # pure Python (tokenizers, Jinja): off the MLX thread, which keeps decoding
            job.tokenizer = await asyncio.to_thread(load_tokenizer, job.info.path)
        except Exception as e:  # noqa: BLE001 - any tokenizer failure is a LoadFailed
            raise ModelLoadError("LoadFailed", f"{type(e).__name__}: {e}") from e
        job.served_tokenizer = job.tokenizer
        job.tokenizer_seconds = time.perf_counter() - t0
        per_token = await asyncio.to_thread(_kv_bytes_per_token, job.info.path)
        job.info = dataclasses.replace(job.info, kv_cache_bytes_per_token=per_token)
        if job.info.task == TASK_TEXT_GENERATION:   # tool parser, grammar: generation only
            features = await asyncio.to_thread(tokenizer_features, job.tokenizer)
            job.info = dataclasses.replace(job.info, features=features)
        if job.info.task == TASK_TEXT_EMBEDDING:
            try:
                profile = await asyncio.to_thread(read_profile, job.info.path)
            except UnsupportedEmbeddingModel as e:
                job.tokenizer = None
                raise ModelLoadError("UnsupportedEmbeddingModel", str(e)) from e
            except OSError as e:
                job.tokenizer = None
                raise ModelLoadError("LoadFailed", f"{type(e).__name__}: {e}") from e
            job.info = dataclasses.replace(job.info, embedding=profile)
        if job.cancelled:
            job.tokenizer = None
            raise ModelLoadError(LOAD_CANCELLED, _CANCELLED)
        with self._cmd_lock:
            if self._dead:
                job.tokenizer = None
                raise ModelLoadError("CoreFailed" if self._failure else "NotStarted",
                                     self._failed_message() if self._failure
                                     else "the serving core closed")
            self._cmds.put(("load", job))
            job.queued = True

    def _settle_load(self, job: _Load) -> None:
        """Loop side, once the thread is done with ``job`` (idempotent): a resident copy it
        replaced is no longer served; on success the revision is (last in load order, so the
        newest)."""
        if job.settled:
            return
        job.settled = True
        with contextlib.suppress(ValueError):
            self._loading.remove(job)
        key = job.info.key
        if job.replaced:
            self._drop(key)
        if job.fut.cancelled() or job.fut.exception() is not None:
            return      # (exception() also marks the error as retrieved)
        self._infos.pop(key, None)
        self._infos[key] = job.info
        self._tokenizers[key] = job.served_tokenizer
        job.served_tokenizer = None
        self.metrics.model_loaded.labels(*key).set(1)

    def loads(self) -> list[LoadProgress]:
        """The loads in progress (queued ones too), in the order they were started."""
        return [j.progress() for j in self._loading if not j.fut.done()]

    async def unload_model(self, model_id: str, revision: str | None = None, *,
                           drain_seconds: float = 0) -> None:
        """Unload revision ``revision`` of ``model_id`` (``None``: every revision of it) and
        return its memory; what is not loaded is a no-op.

        With ``drain_seconds`` > 0 each revision first stops admitting requests (:meth:`generate`
        raises :class:`ModelNotLoaded` for it, requests naming no revision go to another one),
        and the call waits up to ``drain_seconds`` for its running and queued requests to finish
        in full; whatever is still running after that is aborted (:class:`GenerationAborted`).
        Without a drain, running requests are aborted at once. A drain is called off for a
        revision that is loaded again meanwhile (it stays loaded). If this call is cancelled
        while it waits, the revisions it started draining admit requests again.

        Loads of the matching revisions in progress or queued are called off first (their
        :meth:`load_model` raises ``ModelLoadError("Cancelled")``); the call waits until the
        MLX thread has dropped them (at its next iteration: after at most one chunk).
        """
        def matches(k: ModelKey) -> bool:
            return k[0] == model_id and (revision is None or k[1] == revision)

        loads = [j for j in self._loading if matches(j.info.key) and not j.fut.done()]
        for j in loads:
            j.cancelled = True
        if loads:
            await asyncio.wait([j.fut for j in loads])
        keys = [k for k in self._infos if matches(k)]
        if not keys:
            return
        if drain_seconds > 0 and self.healthy:
            drains = await self._drain(keys, drain_seconds)
            keys = [k for k, d in drains if not d.cancelled]
            for k, d in drains:
                if self._drains.get(k) is d:
                    del self._drains[k]
        dropped = [k for k in keys if self._drop(k)]
        if self._started and not self._closed:
            for k in dropped:
                await self._call(self._engine.unload, k)

    async def _drain(self, keys: list[ModelKey], seconds: float) -> list[tuple[ModelKey, _Drain]]:
        """Stop admitting to ``keys`` and wait (up to ``seconds``) until none has a request in
        flight; returns each key's drain."""
        drains: list[tuple[ModelKey, _Drain]] = []
        mine: list[tuple[ModelKey, _Drain]] = []
        for k in keys:
            d = self._drains.get(k)
            if d is None:
                d = self._drains[k] = _Drain()
                mine.append((k, d))
                if not self._inflight.get(k):
                    d.done.set()
            drains.append((k, d))
        try:
            await asyncio.wait_for(asyncio.gather(*(d.done.wait() for _, d in drains)), seconds)
        except asyncio.TimeoutError:
            log.warning("draining %s timed out after %gs; aborting what is left",
                        ", ".join(f"{m}@{r}" for m, r in keys), seconds)
        except asyncio.CancelledError:
            for k, d in mine:
                if self._drains.get(k) is d:
                    self._end_drain(k)
            raise
        return drains

    def _end_drain(self, key: ModelKey) -> None:
        """Call off ``key``'s drain, if any: it admits requests again."""
        d = self._drains.pop(key, None)
        if d is not None:
            d.cancelled = True
            d.done.set()

    def _drop(self, key: ModelKey) -> bool:
        """Loop side: ``key`` is no longer served. False when it was not loaded."""
        self._end_drain(key)
        info = self._infos.pop(key, None)
        self._tokenizers.pop(key, None)
        if info is None:
            return False
        self._drain_rates.pop(key, None)
        self.metrics.model_loaded.labels(*key).set(0)
        return True

    def _drop_all(self) -> None:
        for key in list(self._infos):
            self._drop(key)

    def models(self) -> list[ModelInfo]:
        """Every resident revision (draining ones included), in load order."""
        return list(self._infos.values())

    def revisions(self, model_id: str) -> list[ModelInfo]:
        """The resident revisions of ``model_id`` (draining ones included), in load order."""
        return [i for k, i in self._infos.items() if k[0] == model_id]

    def _serving(self, model_id: str, revision: str | None) -> ModelInfo | None:
        """The revision a request for ``(model_id, revision)`` goes to: that one if it is loaded
        and not draining; with ``revision`` None, the most recently loaded such revision."""
        if revision is not None:
            key = (model_id, revision)
            return None if key in self._drains else self._infos.get(key)
        for key in reversed(self._infos):
            if key[0] == model_id and key not in self._drains:
                return self._infos[key]
        return None

    def is_loaded(self, model_id: str, revision: str | None = None) -> bool:
        """True when the core can serve ``model_id`` (that ``revision`` of it, if given): loaded,
        not draining, and the core has not failed."""
        return self._failure is None and self._serving(model_id, revision) is not None

    def model_info(self, model_id: str, revision: str | None = None) -> ModelInfo:
        """The revision :meth:`generate` would use for these arguments. Raises
        :class:`ModelNotLoaded` (also for a draining revision)."""
        info = self._serving(model_id, revision)
        if info is None:
            raise ModelNotLoaded(model_id, revision)
        return info
