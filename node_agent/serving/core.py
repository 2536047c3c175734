"""The node agent's MLX serving core.

One dedicated thread owns MLX: every ``mlx`` / ``mlx_lm`` call (load, prefill, decode, cache
clean-up) happens on it. The asyncio side talks to it through a ``queue.Queue`` of commands;
results come back with ``loop.call_soon_threadsafe`` into a per-request
:class:`~node_agent.serving.inbox.Inbox`. What the thread does to a revision is
:class:`~node_agent.serving.engine.Engine`; this module is the asyncio API, the command channel
and the thread's step loop.

Identity: a loaded model is a *revision* ``(model_id, revision)``. Several revisions of one model
id can be resident at once (a rolling update's surge, a canary's stable and candidate); each has
its own weights, BatchGenerator, prompt cache, limits, metrics series (labelled
``model, revision``) and crash count. A request names a model id and optionally a revision;
without one it goes to the only revision, or if several, to the most recently loaded one that
still admits requests. Unloading a revision can *drain* it first: it stops admitting requests,
its running and queued requests finish, then it is unloaded (see
:meth:`ServingCore.unload_model`).

Loading never stalls serving (:mod:`node_agent.serving.loading`): the tokenizer loads on a
worker thread of the event loop, the model is built with lazy weights on the MLX thread, and
its parameters are then read in chunks on a CPU stream of their own, advanced once per
iteration of the step loop after the decode step of every revision with work; while others
decode the thread never waits for a read (chunks are submitted with ``mx.async_eval`` and
confirmed once due, :class:`~node_agent.serving.loading.LoadPacing`), so the other revisions
keep emitting tokens at their rate during a load. Loads queue (one materialises at a time); commands (unload, cancel, new
requests) are served between chunks. A revision becomes visible only once fully read.

Continuous batching is mlx-lm's :class:`mlx_lm.generate.BatchGenerator` (one per loaded
revision): a request admitted while others decode is inserted into the running generator and
joins the batch at its next step. Prompt prefixes are reused through mlx-lm's
:class:`mlx_lm.models.cache.LRUPromptCache` (one per revision). Sampling per request is mlx-lm's
``make_sampler`` (temperature, top_p); samplers are shared between requests with equal
parameters (an LRU of the last 64; every greedy request shares one), because mlx-lm (0.32,
``BatchGenerator``'s step in ``mlx_lm/generate.py``) samples the batch in one call only when
*every* sequence in it holds the very same sampler object (an ``is`` check). As soon as one
sequence differs (a seeded request, which always gets a sampler of its own, see
:meth:`ServingCore.generate`; a request with a different temperature or top_p; a greedy request
next to a sampling one) *every* row of the batch is sampled separately, one sampler call per
sequence followed by a concatenate, at every decode step for as long as that sequence is in the
batch. So one seeded or differently-parameterised request makes sampling slower for the whole
batch (its cost grows with the batch size instead of staying one call), not just for itself;
the forward pass is still batched.

Admission (:mod:`node_agent.serving.admission`): at most ``max_concurrent_sequences`` sequences
of a revision are inside its BatchGenerator; further requests wait in the core (FIFO). When the
waiting requests of all revisions would exceed ``max_queued_requests`` — or, under the ``kv``
policy (:class:`~node_agent.serving.options.ServingOptions`), the estimated KV cache of a
revision's running and waiting requests would exceed its budget (checked on the MLX thread right
after tokenizing, in ``Engine.submit``) —, :class:`Overloaded` is raised at once, with
``retry_after_seconds`` from the measured drain rate (a :class:`~.admission.DrainRate` per
revision, fed when requests finish). There is no batching window: see the admission module.

Streams are bounded: the chunks of a request wait for its consumer in its own queue; when more
than ``stream_buffer_chunks`` wait (the client reads slower than the model generates), the
request is stopped and leaves the batch, and its consumer gets :class:`StreamBufferOverflow`
after the chunks already queued. The MLX thread never waits for a consumer (it hands chunks to
the loop with ``call_soon_threadsafe``), so a slow reader costs the others nothing.

Failures on the MLX thread are contained as narrowly as possible: an error while post-processing
one request's token (detokenizer, stop strings) aborts that request; any other error in a
revision's step or command (``BatchGenerator.next``/``remove``/``insert`` ...) aborts that
revision's running sequences and gives it a fresh BatchGenerator (waiting requests stay queued;
other revisions are untouched; :meth:`ServingCore.crashes` counts it). Only an error outside
every per-revision guard (a ``BaseException`` that is not an ``Exception``, or a failure of the
loop itself) ends the thread: the core is then *failed* (:attr:`ServingCore.healthy` is False,
:attr:`ServingCore.failure` says why), every running or waiting call fails at once and later
calls fail immediately.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from prometheus_client import CollectorRegistry

from ..memory_estimate import ModelFileError, kv_cache_bytes_per_token, read_config
from ..metrics import AgentMetrics
from .admission import DrainRate, admit, retry_after_seconds
from .coalesce import Coalescer, SharedGeneration, coalesce_key
from .engine import Engine, Events
from .errors import (LOAD_CANCELLED, GenerationAborted, ModelLoadError, ModelNotLoaded,
                     Overloaded, StreamBufferOverflow)
from .generation import Generation, Request
from .inbox import Inbox
from .loading import LoadPacing, Materialization, load_tokenizer
from .options import ServingOptions
from .tokenize import (DEFAULT_MAX_PROMPT_BYTES, PromptTooLarge, default_tokenizer_threads,
                       limit_tokenizer_parallelism, prompt_bytes, tokenize)
from .types import LoadProgress, MemoryUsage, ModelInfo, ModelKey
from .worker import run_on_worker

__all__ = ["ServingCore"]

log = logging.getLogger(__name__)

_STOP = object()


def _rss_bytes() -> int:
    """This process's resident set size in bytes (0 when it cannot be read)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - a measurement, never a failure
        return 0


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


class ServingCore:
    """Loads MLX models and generates with continuous batching on one MLX-owning thread.

    All coroutine methods must be awaited on the event loop that called :meth:`start`.
    ``load_pacing``: how loads are cut into chunks and overlapped with decode steps (default
    :class:`~node_agent.serving.loading.LoadPacing`: ~40 ms chunks read without waiting while
    others decode; 512 MiB chunks read synchronously while nothing decodes).
    ``options``: the serving switches (:class:`~node_agent.serving.options.ServingOptions`:
    prompt cache and its budget, admission policy, stream buffer, request coalescing
    (:mod:`node_agent.serving.coalesce`), the first-token fast path
    (:mod:`node_agent.serving.fastpath`)), exported as ``mlxfleet_agent_serving_option_info``.
    ``max_prompt_bytes``: the largest prompt (:func:`~node_agent.serving.tokenize.prompt_bytes`)
    :meth:`generate` tokenizes; a larger one is refused at once (:class:`PromptTooLarge`).
    ``tokenizer_threads``: the pool that renders chat templates and tokenizes prompts, off the
    MLX thread and off the event loop (:mod:`node_agent.serving.tokenize`; default
    :func:`~node_agent.serving.tokenize.default_tokenizer_threads`); the core also sets
    ``TOKENIZERS_PARALLELISM=false`` unless it is set
    (:func:`~node_agent.serving.tokenize.limit_tokenizer_parallelism`).
    """

    def __init__(self, *, registry: CollectorRegistry | None = None,
                 max_queued_requests: int = 64,
                 load_pacing: LoadPacing | None = None,
                 options: ServingOptions | None = None,
                 max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
                 tokenizer_threads: int | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = AgentMetrics(self.registry)
        self.options = options if options is not None else ServingOptions()
        self.metrics.set_serving_options(self.options.as_record())
        self.max_queued_requests = max_queued_requests
        self.max_prompt_bytes = max_prompt_bytes
        limit_tokenizer_parallelism(os.environ)
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=(tokenizer_threads if tokenizer_threads is not None
                         else default_tokenizer_threads(os.cpu_count())),
            thread_name_prefix="mlxfleet-tokenize")
        self._tokenizers: dict[ModelKey, Any] = {}   # loop side: each served revision's
        self._coalescer = Coalescer()
        self.load_pacing = load_pacing if load_pacing is not None else LoadPacing()
        self._cmds: queue.Queue = queue.Queue()
        self._started = False
        self._finished = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # loop side: the loaded revisions in load order, requests in flight, draining revisions
        self._infos: dict[ModelKey, ModelInfo] = {}
        self._inflight: dict[ModelKey, int] = {}
        self._drains: dict[ModelKey, _Drain] = {}
        self._drain_rates: dict[ModelKey, DrainRate] = {}   # requests completed per second
        self._loading: list[_Load] = []          # loads handed to the thread, in order
        self._failed = asyncio.Event()            # set once the MLX thread has failed
        self._closed = False
        self._failure: str | None = None
        # _dead: the MLX thread no longer reads _cmds. Set and read under _cmd_lock so that no
        # call is queued after the thread's final drain (it would wait forever).
        self._cmd_lock = threading.Lock()
        self._dead = False
        # thread side (its Stats are plain ints, read here)
        self._engine = Engine(self.metrics, self._send, self._forget_threadsafe, self.options)
        self._loads: collections.deque[_Load] = collections.deque()   # thread: the load queue

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the MLX thread (idempotent)."""
        if self._started:
            return
        if self._closed:
            raise RuntimeError("ServingCore is closed")
        self._loop = asyncio.get_running_loop()
        self._started = True
        run_on_worker(self._run_and_signal)

    async def close(self) -> None:
        """Abort running generations, drop all models and stop the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        self._cmds.put(_STOP)
        await asyncio.to_thread(self._finished.wait)
        self._drop_all()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        """True while the core is started, not closed and its MLX thread has not failed.

        Errors confined to one request or one revision (see the module docstring) do not make
        the core unhealthy; they are reported to the affected requests."""
        return self._started and not self._closed and self._failure is None

    @property
    def failure(self) -> str | None:
        """Why the MLX thread failed (``"<ExceptionType>: <message>"``), or ``None`` while it has
        not (also after a clean :meth:`close`). Once set it never clears: make a new core."""
        return self._failure

    async def wait_failure(self) -> str:
        """Wait until the MLX thread fails and return :attr:`failure` (at once when it already
        has). A core that never fails (also one closed cleanly) keeps this waiting: cancel it.
        The agent process uses it to stop and exit instead of staying registered with a
        serving core that can no longer serve."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    def _failed_message(self) -> str:
        return f"the serving core failed: {self._failure}"

    # -- models --------------------------------------------------------------------------------
    async def load_model(self, model_id: str, path: str | os.PathLike, *, revision: str,
                         max_concurrent_sequences: int = 8,
                         max_context_tokens: int = 4096) -> ModelInfo:
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
        Raises :class:`ModelLoadError` (``ModelNotFound`` when ``path`` is not a directory with a
        ``config.json``, ``LoadFailed`` for any error while loading — tokenizer, model build or
        any chunk of weights; nothing of it stays resident —, ``Cancelled`` when an unload
        called it off, ``NotStarted`` when the core is closed, ``CoreFailed``).
        """
        if self._failure is not None:
            raise ModelLoadError("CoreFailed", self._failed_message())
        if not self._started or self._closed:
            raise ModelLoadError("NotStarted", "the serving core is not running")
        if max_concurrent_sequences < 1 or max_context_tokens < 2:
            raise ValueError("max_concurrent_sequences must be >= 1, max_context_tokens >= 2")
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
                                         max_context_tokens=max_context_tokens)
        existing = self._infos.get(key)
        if existing is not None and existing.path == spath:
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
                         max_context_tokens)
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
        """Load ``job``'s tokenizer and read its KV bytes per token (into ``job.info``) off the
        MLX thread, then queue the job on it. Raises
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

    # -- observability -------------------------------------------------------------------------
    def _stat(self, attr: str, model_id: str | None, revision: str | None) -> list[int]:
        return [getattr(s, attr) for k, s in list(self._engine.registry.stats.items())
                if (model_id is None or k[0] == model_id)
                and (revision is None or k[1] == revision)]

    def active_sequences(self, model_id: str | None = None, revision: str | None = None) -> int:
        """Sequences inside the BatchGenerator(s) (prefill or decode) right now, of every
        revision of ``model_id`` (every model when None) or of that ``revision``."""
        return sum(self._stat("active", model_id, revision))

    def queued_requests(self, model_id: str | None = None, revision: str | None = None) -> int:
        """Admitted requests waiting for a batch slot right now (filtered as
        :meth:`active_sequences`)."""
        return sum(self._stat("queued", model_id, revision))

    def peak_active_sequences(self, model_id: str, revision: str | None = None) -> int:
        """The largest batch occupancy seen for the revision since it was loaded or its limits
        last changed (``revision`` None: the largest over ``model_id``'s revisions)."""
        return max(self._stat("peak_active", model_id, revision), default=0)

    def drain_rate(self, model_id: str, revision: str) -> float | None:
        """The revision's measured drain rate: requests completed per second while it had work
        (:class:`~node_agent.serving.admission.DrainRate`), what ``Retry-After`` is estimated
        from; ``None`` before a request of it completed."""
        return self._drain_per_second((model_id, revision))

    def inflight_requests(self, model_id: str | None = None, revision: str | None = None) -> int:
        """Admitted requests not yet finished (waiting + running), counted on the loop side."""
        return sum(n for k, n in self._inflight.items()
                   if (model_id is None or k[0] == model_id)
                   and (revision is None or k[1] == revision))

    def crashes(self, model_id: str, revision: str) -> int:
        """How many times the revision's batch was reset after an MLX error, plus core failures
        while it was loaded, since it was (last) loaded. Kept after an unload until the revision
        is loaded again; 0 for a revision never loaded. Reads plain ints: no MLX call."""
        s = self._engine.registry.stats.get((model_id, revision))
        return s.crashes if s is not None else 0

    def memory_bytes(self, model_id: str, revision: str) -> int:
        """An estimate of the revision's resident bytes: its parameters (summed once at load)
        plus its prompt cache's entries; 0 when it is not loaded. Reads plain ints: no MLX
        call."""
        s = self._engine.registry.stats.get((model_id, revision))
        return s.memory_bytes if s is not None else 0

    async def memory_usage(self) -> MemoryUsage:
        """Measure the process's memory now: MLX's active and cache bytes — read on the MLX
        thread, between two steps, so no step is half done — and the process RSS. Raises
        :class:`GenerationAborted` when the core is not running."""
        if not self._started or self._closed:
            raise GenerationAborted("the serving core is not running")
        active, cache = await self._call(self._engine.memory)
        return MemoryUsage(active, cache, _rss_bytes())

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, model_id: str, *, revision: str | None = None,
                       prompt: str | None = None,
                       messages: list[dict] | None = None, max_tokens: int | None = None,
                       temperature: float = 1.0, top_p: float = 1.0,
                       stop: str | Sequence[str] | None = None,
                       seed: int | None = None) -> Generation:
        """Admit one generation and return it for iteration.

        ``revision``: the revision of ``model_id`` to use; ``None``: the only loaded one, or if
        several, the most recently loaded one that is not draining. Exactly one of ``prompt``
        (raw text, tokenized as is) or ``messages`` (OpenAI chat messages ``[{"role",
        "content"}]``, rendered with the tokenizer's chat template plus a generation prompt)
        must be given. ``max_tokens``: completion limit in tokens (default: the rest of the
        context). ``temperature`` 0 is greedy; ``top_p`` in (0, 1] (1 = off). ``stop``: up to 4
        strings; generation ends before the first occurrence in the decoded text
        (finish_reason ``"stop"``), as it does on the tokenizer's EOS.

        ``seed`` (any int; ignored when ``temperature`` is 0): the request samples from its own
        random keys derived from ``seed`` and the token position, never from MLX's global random
        state, so it neither perturbs nor is perturbed by other requests' sampling. The same
        seed, prompt and parameters give the same tokens as long as the model's logits are
        bit-identical; they can differ in the last bits when the request shares the batch with
        different other sequences, so reproducibility is best-effort (as with OpenAI's ``seed``).
        A seeded request has a sampler of its own, so while it is in the batch mlx-lm samples
        *every* sequence of the batch separately (one call per row instead of one for the batch;
        see the module doc): it slows sampling for the whole batch, not only for itself.

        With ``options.request_coalescing``, a request identical to one in flight whose output is
        deterministic (greedy, or seeded; :func:`~node_agent.serving.coalesce.coalesce_key`)
        joins that generation instead of starting one: its handle (own :attr:`Generation.id`,
        same token counts) streams the generation from its first chunk; it takes no batch slot
        and is never refused as :class:`Overloaded`; cancelling it leaves the generation running
        for the others (the last one leaving cancels it). Counted in
        ``mlxfleet_agent_coalesced_requests_total``.

        Raises :class:`ModelNotLoaded` (also for a draining revision), :class:`Overloaded`,
        :class:`ContextLengthExceeded`, :class:`InvalidPrompt`, ``ValueError`` for bad
        arguments, :class:`GenerationAborted` when the core is not running or has failed (see
        :attr:`failure`).
        """
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if self._failure is not None:
            raise GenerationAborted(self._failed_message())
        if self._closed or not self._started:
            raise GenerationAborted("the serving core is not running")
        info = self.model_info(model_id, revision)
        size = prompt_bytes(prompt, messages)
        if size > self.max_prompt_bytes:
            raise PromptTooLarge(size, self.max_prompt_bytes)
        temperature, top_p = float(temperature), float(top_p)
        key = coalesce_key(info, prompt, messages, {
            "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
            "stop": stops, "seed": seed}) if self.options.request_coalescing else None
        shared = self._joinable(key)
        if shared is not None:
            self.metrics.coalesced_requests.labels(*info.key).inc()
            return await self._subscribe(shared)
        self._admit(info)
        loop = asyncio.get_running_loop()
        req = Request(info.key, prompt, messages, max_tokens, temperature, top_p,
                      stops, seed, Inbox(), loop)
        tokenizer = self._tokenizers.get(info.key)
        if tokenizer is not None:
            try:
                req.prompt_ids = await loop.run_in_executor(
                    self._tokenize_pool, tokenize, tokenizer, prompt, messages)
            except BaseException:
                self._cancel(req)
                raise
            shared = self._joinable(key)  # an identical request may have led meanwhile
            if shared is not None:
                self._cancel(req)
                self.metrics.coalesced_requests.labels(*info.key).inc()
                return await self._subscribe(shared)
        if key is not None:
            return await self._lead(key, req)
        try:
            prompt_tokens, limit = await self._call(self._engine.submit, req)
        except BaseException as e:
            self._cancel(req)
            self._set_retry_after(e, req.key)
            raise
        return Generation(self._cancel, req, prompt_tokens, limit)

    def _joinable(self, key: Any) -> SharedGeneration | None:
        """The shared generation in flight under coalescing ``key`` that a request may join,
        or None. (A joiner gets every event so far at once: far into a long generation it would
        start near its buffer bound, so it leads a generation of its own instead.)"""
        shared = self._coalescer.get(key)
        if shared is not None and len(shared.events) < self.options.stream_buffer_chunks // 2:
            return shared
        return None

    def _set_retry_after(self, e: BaseException, key: ModelKey) -> None:
        """A refusal by the kv bound (:meth:`Engine.submit`, on the MLX thread) gets its
        ``Retry-After`` here, from the revision's measured drain rate."""
        if isinstance(e, Overloaded):
            e.retry_after_seconds = retry_after_seconds(e.waiting, self._drain_per_second(key))

    async def _lead(self, key: Any, req: Request) -> Generation:
        """Submit ``req`` as a shared generation joinable under ``key``; the caller's handle."""
        shared = self._coalescer.lead(
            key, lambda: self._cancel(req), self.options.stream_buffer_chunks,
            lambda: self.metrics.stream_buffer_overflows.labels(*req.key).inc())
        shared.request = req
        req.out = shared   # the core delivers the request's events to the fan-out
        try:
            shared.watch(self._call_soon(self._engine.submit, req))
        except BaseException:
            shared.abandon()
            raise
        return await self._subscribe(shared)

    async def _subscribe(self, shared: SharedGeneration) -> Generation:
        """A handle on ``shared`` for one more caller, once its request is admitted on the MLX
        thread (its error, if it was refused)."""
        out = shared.subscribe()
        try:
            prompt_tokens, limit = await asyncio.shield(shared.submitted)
        except BaseException as e:
            shared.leave(out)
            self._set_retry_after(e, shared.request.key)
            raise
        return Generation(lambda _req: shared.leave(out), shared.request, prompt_tokens, limit,
                          out=out)

    def _drain_per_second(self, key: ModelKey | None) -> float | None:
        """The measured drain rate (requests completed per second) of revision ``key``, or of
        all revisions together (``None``); ``None`` before anything was measured."""
        rates = [r.per_second for k, r in self._drain_rates.items()
                 if (key is None or k == key) and r.per_second is not None]
        return sum(rates) if rates else None

    def _admit(self, info: ModelInfo) -> None:
        limits = {k: i.max_concurrent_sequences for k, i in self._infos.items()}
        refused = admit(info.key, self._inflight, limits, self.max_queued_requests)
        if refused is not None:
            # the queue is shared by all revisions: it drains at all revisions' rates
            raise Overloaded(refused.message, waiting=refused.waiting,
                             retry_after_seconds=retry_after_seconds(
                                 refused.waiting, self._drain_per_second(None)))
        n = self._inflight.get(info.key, 0)
        self._inflight[info.key] = n + 1
        self._drain_rates.setdefault(info.key, DrainRate()).busy(time.monotonic())

    def _release(self, req: Request, *, completed: bool = False) -> None:
        """``req`` is no longer in flight; ``completed``: it ran to its end (it counts in the
        drain rate)."""
        if req.finished:
            return
        req.finished = True
        n = self._inflight.get(req.key, 0) - 1
        rate = self._drain_rates.get(req.key)
        if rate is not None:
            if completed:
                rate.completed(time.monotonic(), idle_after=n <= 0)
            elif n <= 0:
                rate.idle()
        if n > 0:
            self._inflight[req.key] = n
            return
        self._inflight.pop(req.key, None)
        drain = self._drains.get(req.key)
        if drain is not None:
            drain.done.set()

    def _cancel(self, req: Request) -> None:
        if req.finished:
            return
        self._release(req)
        if not self._closed:
            self._cmds.put(("cancel", req))

    def _deliver(self, events: Events) -> None:
        limit = self.options.stream_buffer_chunks
        for req, item in events:
            if req.finished:
                continue
            if isinstance(item, BaseException):
                self._release(req)
            elif item.finish_reason is not None:
                self._release(req, completed=True)
            elif req.out.qsize() >= limit:
                # the consumer is `limit` chunks behind: stop the generation (it leaves the
                # batch), hand over what is queued, then the error
                self.metrics.stream_buffer_overflows.labels(*req.key).inc()
                self._cancel(req)
                item = StreamBufferOverflow(req.out.qsize())
            req.out.put_nowait(item)

    # -- the command channel -------------------------------------------------------------------
    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the MLX thread and return its result (or raise its error).
        Raises :class:`GenerationAborted` when the thread has ended (closed or failed)."""
        return await self._call_soon(fn, *args)

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Queue ``fn(*args)`` on the MLX thread now; the future of its result (or error).
        Raises :class:`GenerationAborted` when the thread has ended (closed or failed)."""
        assert self._loop is not None
        fut = self._loop.create_future()
        with self._cmd_lock:
            if self._dead:
                raise GenerationAborted(self._failed_message() if self._failure
                                        else "the serving core closed")
            self._cmds.put(("call", fn, args, fut))
        return fut

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` on the MLX thread without waiting for it (``fn`` must not raise;
        nothing is queued once the thread has ended)."""
        assert self._loop is not None
        with self._cmd_lock:
            if not self._dead:
                self._cmds.put(("call", fn, args, self._loop.create_future()))

    def _on_thread_exit(self) -> None:
        """Loop side, after the MLX thread ended: a failed core serves no model any more."""
        if self._failure is None:
            return
        self._drop_all()
        self._failed.set()

    def _forget(self, info: ModelInfo) -> None:
        """Loop side: the thread dropped ``info``'s revision on its own (it could not recover)."""
        if self._infos.get(info.key) is info:
            self._drop(info.key)

    def _forget_threadsafe(self, info: ModelInfo) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._forget, info)
        except RuntimeError:  # loop closed
            pass

    def _resolve(self, fut: asyncio.Future, result: Any = None,
                 error: BaseException | None = None) -> None:
        def done() -> None:
            if fut.cancelled():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(done)
        except RuntimeError:  # loop closed
            pass

    def _send(self, events: Events) -> None:
        if not events:
            return
        try:
            events[0][0].loop.call_soon_threadsafe(self._deliver, events)
        except RuntimeError:
            pass

    # -- the MLX thread ------------------------------------------------------------------------
    def _run_and_signal(self) -> None:
        try:
            try:
                self._run()
            except BaseException as e:  # noqa: BLE001 - outside every guard: the core fails
                self._failure = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                log.critical("the MLX serving thread failed; the serving core is unusable",
                             exc_info=True)
            reason = self._failed_message() if self._failure else "the serving core closed"
            while self._loads:
                self._t_drop_load(GenerationAborted(reason))
            self._engine.unload_all(reason, crashed=self._failure is not None)
        finally:
            self._t_exit()

    def _t_exit(self) -> None:
        """Last thing on the thread: fail every queued call, tell the loop, signal the end."""
        try:
            reason = self._failed_message() if self._failure else "the serving core closed"
            with self._cmd_lock:
                self._dead = True
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, tuple) and cmd[0] == "call":
                    self._resolve(cmd[3], error=GenerationAborted(reason))
                elif isinstance(cmd, tuple) and cmd[0] == "load":
                    self._resolve(cmd[1].fut, error=GenerationAborted(reason))
            if self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._on_thread_exit)
                except RuntimeError:  # loop closed
                    pass
        finally:
            self._finished.set()

    def _run(self) -> None:
        """The step loop: run queued commands, then one batch step of every revision with work,
        then one chunk of the load in progress; block on the command queue only while no
        revision has work and no load is queued."""
        import mlx.core as mx

        # Like mlx_lm.server: generate on this thread's default stream, so that model, caches
        # and synchronisation all live on the one thread that owns MLX.
        stream = mx.default_stream(mx.default_device())
        self._engine.stream = stream
        # Weights are read on a CPU stream of their own, so a load's reads never queue behind
        # (or in front of) the generation stream's work (see node_agent.serving.loading).
        self._engine.load_stream = mx.new_stream(mx.cpu)
        with mx.stream(stream):
            while True:
                try:
                    cmd = self._cmds.get(block=not (self._engine.has_work() or self._loads))
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if cmd is _STOP:
                        return
                    self._t_command(cmd)
                    try:
                        cmd = self._cmds.get_nowait()
                    except queue.Empty:
                        cmd = None
                decoding = self._engine.has_work()
                if decoding:
                    self._t_step_all()
                if self._loads:
                    self._t_load_step(decoding)

    def _t_load_step(self, decoding: bool) -> None:
        """Advance the load at the head of the queue by one stage: drop it if it was called
        off, else build its lazy model (cheap) and advance the read of its weights (overlapped
        with decoding when ``decoding``: something decoded this iteration; see
        :class:`~node_agent.serving.loading.Materialization`), and once all is read
        make it resident. A failure of any stage drops the load (``LoadFailed``)."""
        job = self._loads[0]
        if job.cancelled:
            self._t_drop_load(ModelLoadError(LOAD_CANCELLED, _CANCELLED))
            return
        try:
            if job.materialization is None:
                job.started_at = time.perf_counter()
                if self._engine.registry.get(job.info.key) is not None:
                    job.replaced = True
                    self._engine.unload(job.info.key, reason="the model was replaced")
                job.model = self._engine.begin_load(job.info)
                job.materialization = Materialization(job.model, self.load_pacing)
            if not job.materialization.done:
                job.materialization.step(decoding)
            if job.materialization.done:
                self._engine.finish_load(
                    job.info, job.model, job.tokenizer,
                    job.tokenizer_seconds + time.perf_counter() - job.started_at)
                self._loads.popleft()
                job.model = job.tokenizer = None
                job.materialization.release()
                self._resolve(job.fut, None)
        except ModelLoadError as e:
            self._t_drop_load(e)
        except Exception as e:  # noqa: BLE001 - a read error of one chunk fails this load only
            log.exception("loading %s@%s failed", *job.info.key)
            self._t_drop_load(ModelLoadError("LoadFailed", f"{type(e).__name__}: {e}"))

    def _t_drop_load(self, error: BaseException) -> None:
        """Drop the load at the head of the queue, free what it read, fail its caller."""
        job = self._loads.popleft()
        # keep the materialization's ints for progress(); drop every array reference
        job.model = job.tokenizer = None
        if job.materialization is not None:
            job.materialization.release()
        self._engine.release_memory("the load of %s@%s" % job.info.key)
        self._resolve(job.fut, error=error)

    def _t_step_all(self) -> None:
        """One batch step of every revision with work. A function of its own so that no frame
        of the step loop keeps the last revision it looked at (and so its weights) alive after
        that revision is unloaded."""
        for res in self._engine.registry:
            if res.has_work():
                try:
                    self._engine.step(res)
                except Exception as e:  # noqa: BLE001 - contained to this revision
                    log.exception("generation step of %s@%s failed", *res.key)
                    self._engine.reset(res, f"generation failed: {type(e).__name__}: {e}")

    def _t_command(self, cmd: tuple) -> None:
        if cmd[0] == "load":
            self._loads.append(cmd[1])
        elif cmd[0] == "call":
            _, fn, args, fut = cmd
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._resolve(fut, error=e)
            else:
                self._resolve(fut, result)
        elif cmd[0] == "cancel":
            req = cmd[1]
            try:
                self._engine.cancel(req)
            except Exception as e:  # noqa: BLE001 - contained to the request's revision
                log.exception("cancelling a request of %s@%s failed", *req.key)
                res = self._engine.registry.get(req.key)
                if res is not None:
                    self._engine.reset(res, f"generation failed: {type(e).__name__}: {e}")
