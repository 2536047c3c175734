"""The node agent's MLX serving core.

One dedicated thread owns MLX: every ``mlx`` / ``mlx_lm`` call (load, prefill, decode, cache
clean-up) happens on it. The asyncio side talks to it through a ``queue.Queue`` of commands;
results come back with ``loop.call_soon_threadsafe`` into a per-request ``asyncio.Queue``.

Continuous batching is mlx-lm's :class:`mlx_lm.generate.BatchGenerator` (one per loaded model):
a request admitted while others decode is inserted into the running generator and joins the
batch at its next step. Prompt prefixes are reused through mlx-lm's
:class:`mlx_lm.models.cache.LRUPromptCache` (one per model). Sampling per request is mlx-lm's
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

Admission: at most ``max_concurrent_sequences`` sequences of a model are inside its
BatchGenerator; further requests wait in the core (FIFO). When the waiting requests of all models
would exceed ``max_queued_requests``, :class:`Overloaded` is raised at once.

Failures on the MLX thread are contained as narrowly as possible: an error while post-processing
one request's token (detokenizer, stop strings) aborts that request; any other error in a model's
step or command (``BatchGenerator.next``/``remove``/``insert`` ...) aborts that model's running
sequences and gives it a fresh BatchGenerator (waiting requests stay queued; other models are
untouched). Only an error outside every per-model guard (a ``BaseException`` that is not an
``Exception``, or a failure of the loop itself) ends the thread: the core is then *failed*
(:attr:`ServingCore.healthy` is False, :attr:`ServingCore.failure` says why), every running or
waiting call fails at once and later calls fail immediately.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from prometheus_client import CollectorRegistry

from .metrics import AgentMetrics

__all__ = [
    "ModelLoadError", "Overloaded", "ModelNotLoaded", "ContextLengthExceeded", "InvalidPrompt",
    "GenerationAborted", "ModelInfo", "Chunk", "Generation", "ServingCore",
]

log = logging.getLogger(__name__)

_PROMPT_CACHE_ENTRIES = 16
_UNSET = object()
_SAMPLER_CACHE_ENTRIES = 64
_STOP = object()


class ModelLoadError(Exception):
    """Loading a model failed. ``reason``: CamelCase (``ModelNotFound``, ``LoadFailed``,
    ``NotStarted``, ``CoreFailed`` once the MLX thread has failed); ``message``: human-readable
    detail."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class Overloaded(Exception):
    """Admission is full; retry after ``retry_after_seconds`` (whole seconds, >= 1)."""

    def __init__(self, message: str, retry_after_seconds: int = 1) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class ModelNotLoaded(LookupError):
    """The requested model id is not loaded on this agent. ``model_id`` names it."""

    def __init__(self, model_id: str) -> None:
        super().__init__(f"model {model_id!r} is not loaded on this agent")
        self.model_id = model_id


class ContextLengthExceeded(ValueError):
    """``prompt_tokens + max_tokens`` exceeds the model's ``max_context_tokens``."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_context_tokens: int) -> None:
        super().__init__(
            f"this model's maximum context length is {max_context_tokens} tokens; the request "
            f"has {prompt_tokens} prompt tokens and asks for {max_tokens} completion tokens")
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_context_tokens = max_context_tokens


class InvalidPrompt(ValueError):
    """The prompt or messages cannot be turned into tokens (e.g. the chat template fails)."""


class GenerationAborted(RuntimeError):
    """A running generation ended abnormally (model unloaded, core closed, MLX error)."""


@dataclass(frozen=True)
class ModelInfo:
    """A loaded model. ``created_unix``: load time, seconds since the epoch;
    ``max_context_tokens``: prompt + completion limit in tokens."""

    model_id: str
    revision: str
    path: str
    created_unix: int
    max_concurrent_sequences: int
    max_context_tokens: int


@dataclass(frozen=True)
class Chunk:
    """One piece of a generation: ``text`` (may be empty), ``tokens`` generated so far for the
    request, and ``finish_reason`` (``None`` until the last chunk, then ``"stop"`` or
    ``"length"``)."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None


class _Request:
    """A generation request; the fields below ``# thread`` are touched only on the MLX thread."""

    _ids = itertools.count(1)

    def __init__(self, model_id: str, prompt: str | None, messages: list[dict] | None,
                 max_tokens: int | None, temperature: float, top_p: float,
                 stop: Sequence[str], seed: int | None, out: asyncio.Queue,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.rid = next(self._ids)
        self.model_id = model_id
        self.prompt = prompt
        self.messages = messages
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.stop = [s for s in stop if s]
        self.seed = seed
        self.out = out
        self.loop = loop
        self.submitted = time.perf_counter()
        self.finished = False          # loop side: final event delivered or cancelled
        # thread
        self.tokens: list[int] = []
        self.uid: int | None = None
        self.detok: Any = None
        self.held = ""                 # text held back because it may begin a stop string
        self.n_generated = 0
        self.last_token_at: float | None = None
        self.done = False


class Generation:
    """An admitted request: async-iterate it for :class:`Chunk` s.

    ``prompt_tokens``: prompt length in tokens; ``completion_tokens``: generated so far;
    ``finish_reason`` once finished. Iteration raises :class:`GenerationAborted` when the model is
    unloaded or the core closes mid-generation. Cancelling the consuming task, calling
    :meth:`cancel`, or leaving ``async with`` before the end removes the sequence from the batch.
    """

    def __init__(self, core: "ServingCore", req: _Request, prompt_tokens: int,
                 max_tokens: int) -> None:
        self._core = core
        self._req = req
        self.id = req.rid
        self.model_id = req.model_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._ended = False

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> Chunk:
        if self._ended:
            raise StopAsyncIteration
        try:
            item = await self._req.out.get()
        except BaseException:
            self.cancel()
            raise
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        self.completion_tokens = item.completion_tokens
        if item.finish_reason is not None:
            self.finish_reason = item.finish_reason
            self._ended = True
        return item

    def cancel(self) -> None:
        """Stop generating (idempotent; a no-op after the end)."""
        self._ended = True
        self._core._cancel(self._req)

    async def __aenter__(self) -> "Generation":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class _Loaded:
    """Thread-side state of one loaded model."""

    def __init__(self, info: ModelInfo, model: Any, tokenizer: Any, generator: Any,
                 prompt_cache: Any) -> None:
        self.info = info
        self.model = model
        self.tokenizer = tokenizer
        self.generator = generator
        self.prompt_cache = prompt_cache
        self.pending: collections.deque[_Request] = collections.deque()
        self.active: dict[int, _Request] = {}

    def has_work(self) -> bool:
        return bool(self.pending or self.active)


class ServingCore:
    """Loads MLX models and generates with continuous batching on one MLX-owning thread.

    All coroutine methods must be awaited on the event loop that called :meth:`start`.
    """

    def __init__(self, *, registry: CollectorRegistry | None = None,
                 max_queued_requests: int = 64) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = AgentMetrics(self.registry)
        self.max_queued_requests = max_queued_requests
        self._cmds: queue.Queue = queue.Queue()
        self._started = False
        self._finished = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._infos: dict[str, ModelInfo] = {}
        self._inflight: dict[str, int] = {}
        self._closed = False
        self._failure: str | None = None
        # _dead: the MLX thread no longer reads _cmds. Set and read under _cmd_lock so that no
        # call is queued after the thread's final drain (it would wait forever).
        self._cmd_lock = threading.Lock()
        self._dead = False
        # thread-side state (read-only elsewhere: plain ints/len reads are safe)
        self._models: dict[str, _Loaded] = {}
        self._active_count: dict[str, int] = {}
        self._queued_count: dict[str, int] = {}
        self._peak_active: dict[str, int] = {}
        # The wired-memory limit from before the first BatchGenerator raised it (see
        # _t_new_generator); _UNSET while no generator holds it.
        self._wired_saved: Any = _UNSET
        self._samplers: collections.OrderedDict[tuple[float, float], Any] = (
            collections.OrderedDict())

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the MLX thread (idempotent)."""
        if self._started:
            return
        if self._closed:
            raise RuntimeError("ServingCore is closed")
        self._loop = asyncio.get_running_loop()
        self._started = True
        _worker_thread(self._run_and_signal)

    async def close(self) -> None:
        """Abort running generations, drop all models and stop the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        self._cmds.put(_STOP)
        await asyncio.to_thread(self._finished.wait)
        for model_id, info in list(self._infos.items()):
            self.metrics.model_loaded.labels(model_id, info.revision).set(0)
        self._infos.clear()

    @property
    def healthy(self) -> bool:
        """True while the core is started, not closed and its MLX thread has not failed.

        Errors confined to one request or one model (see the module docstring) do not make the
        core unhealthy; they are reported to the affected requests."""
        return self._started and not self._closed and self._failure is None

    @property
    def failure(self) -> str | None:
        """Why the MLX thread failed (``"<ExceptionType>: <message>"``), or ``None`` while it has
        not (also after a clean :meth:`close`). Once set it never clears: make a new core."""
        return self._failure

    def _failed_message(self) -> str:
        return f"the serving core failed: {self._failure}"

    # -- models --------------------------------------------------------------------------------
    async def load_model(self, model_id: str, path: str | os.PathLike, *, revision: str,
                         max_concurrent_sequences: int = 8,
                         max_context_tokens: int = 4096) -> ModelInfo:
        """Load ``path`` (a local mlx-lm model directory) as ``model_id`` with ``mlx_lm.load``.

        Re-loading the same id, revision, path and limits is a no-op returning the existing info.
        The same id, revision and path with other limits applies the new limits without reloading
        the weights and returns the updated info (same ``created_unix``): requests admitted from
        then on get the new ``max_context_tokens``, and at most the new
        ``max_concurrent_sequences`` sequences run (running ones are never aborted; when the
        limit shrinks, new sequences start only once the batch has drained below it). A
        different revision or path replaces the model: the old one is aborted (its running
        requests fail with :class:`GenerationAborted`) and unloaded *before* the new one loads,
        so if that load fails the id is no longer loaded at all.
        Raises :class:`ModelLoadError` (``ModelNotFound`` when ``path`` is not a directory with a
        ``config.json``, ``LoadFailed`` for any error while loading, ``NotStarted``).
        """
        if self._failure is not None:
            raise ModelLoadError("CoreFailed", self._failed_message())
        if not self._started or self._closed:
            raise ModelLoadError("NotStarted", "the serving core is not running")
        if max_concurrent_sequences < 1 or max_context_tokens < 2:
            raise ValueError("max_concurrent_sequences must be >= 1, max_context_tokens >= 2")
        spath = str(Path(path))
        existing = self._infos.get(model_id)
        if existing is not None and existing.revision == revision and existing.path == spath:
            if (existing.max_concurrent_sequences, existing.max_context_tokens) == (
                    max_concurrent_sequences, max_context_tokens):
                return existing
            info = dataclasses.replace(existing, max_concurrent_sequences=max_concurrent_sequences,
                                       max_context_tokens=max_context_tokens)
            try:
                await self._call(self._t_set_limits, info)
            except GenerationAborted as e:
                raise ModelLoadError("CoreFailed" if self._failure else "NotStarted",
                                     str(e)) from e
            if self._infos.get(model_id) is existing:
                self._infos[model_id] = info
            return info
        if not (Path(spath) / "config.json").is_file():
            raise ModelLoadError("ModelNotFound", f"no model (config.json) at {spath}")
        info = ModelInfo(model_id, revision, spath, int(time.time()), max_concurrent_sequences,
                         max_context_tokens)
        try:
            await self._call(self._t_load, info)
        except BaseException as e:
            # _t_load drops the previous model before loading (so that both never need memory
            # at once): after a failure nothing of this id is loaded any more
            if existing is not None and self._infos.get(model_id) is existing:
                del self._infos[model_id]
                self.metrics.model_loaded.labels(model_id, existing.revision).set(0)
            if isinstance(e, GenerationAborted):  # the thread failed or the core closed
                raise ModelLoadError("CoreFailed" if self._failure else "NotStarted",
                                     str(e)) from e
            raise
        if existing is not None and existing.revision != revision:
            self.metrics.model_loaded.labels(model_id, existing.revision).set(0)
        self._infos[model_id] = info
        self.metrics.model_loaded.labels(model_id, revision).set(1)
        return info

    async def unload_model(self, model_id: str) -> None:
        """Abort the model's requests, drop it and return its memory (unknown id: no-op)."""
        info = self._infos.pop(model_id, None)
        if info is None:
            return
        self.metrics.model_loaded.labels(model_id, info.revision).set(0)
        if self._started and not self._closed:
            await self._call(self._t_unload, model_id)

    def models(self) -> list[ModelInfo]:
        """The loaded models, in load order."""
        return list(self._infos.values())

    def is_loaded(self, model_id: str) -> bool:
        """True when ``model_id`` is loaded and the core can serve it."""
        return model_id in self._infos and self._failure is None

    def model_info(self, model_id: str) -> ModelInfo:
        """Raises :class:`ModelNotLoaded`."""
        try:
            return self._infos[model_id]
        except KeyError:
            raise ModelNotLoaded(model_id) from None

    # -- observability -------------------------------------------------------------------------
    def active_sequences(self, model_id: str | None = None) -> int:
        """Sequences inside the BatchGenerator(s) (prefill or decode) right now."""
        if model_id is not None:
            return self._active_count.get(model_id, 0)
        return sum(self._active_count.values())

    def queued_requests(self, model_id: str | None = None) -> int:
        """Admitted requests waiting for a batch slot right now."""
        if model_id is not None:
            return self._queued_count.get(model_id, 0)
        return sum(self._queued_count.values())

    def peak_active_sequences(self, model_id: str) -> int:
        """The largest batch occupancy seen for ``model_id`` since it was loaded or its limits
        last changed."""
        return self._peak_active.get(model_id, 0)

    def inflight_requests(self, model_id: str | None = None) -> int:
        """Admitted requests not yet finished (waiting + running), counted on the loop side."""
        if model_id is not None:
            return self._inflight.get(model_id, 0)
        return sum(self._inflight.values())

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, model_id: str, *, prompt: str | None = None,
                       messages: list[dict] | None = None, max_tokens: int | None = None,
                       temperature: float = 1.0, top_p: float = 1.0,
                       stop: str | Sequence[str] | None = None,
                       seed: int | None = None) -> Generation:
        """Admit one generation and return it for iteration.

        Exactly one of ``prompt`` (raw text, tokenized as is) or ``messages`` (OpenAI chat
        messages ``[{"role", "content"}]``, rendered with the tokenizer's chat template plus a
        generation prompt) must be given. ``max_tokens``: completion limit in tokens (default:
        the rest of the context). ``temperature`` 0 is greedy; ``top_p`` in (0, 1] (1 = off).
        ``stop``: up to 4 strings; generation ends before the first occurrence in the decoded
        text (finish_reason ``"stop"``), as it does on the tokenizer's EOS.

        ``seed`` (any int; ignored when ``temperature`` is 0): the request samples from its own
        random keys derived from ``seed`` and the token position, never from MLX's global random
        state, so it neither perturbs nor is perturbed by other requests' sampling. The same
        seed, prompt and parameters give the same tokens as long as the model's logits are
        bit-identical; they can differ in the last bits when the request shares the batch with
        different other sequences, so reproducibility is best-effort (as with OpenAI's ``seed``).
        A seeded request has a sampler of its own, so while it is in the batch mlx-lm samples
        *every* sequence of the batch separately (one call per row instead of one for the batch;
        see the module doc): it slows sampling for the whole batch, not only for itself.

        Raises :class:`ModelNotLoaded`, :class:`Overloaded`, :class:`ContextLengthExceeded`,
        :class:`InvalidPrompt`, ``ValueError`` for bad arguments, :class:`GenerationAborted`
        when the core is not running or has failed (see :attr:`failure`).
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
        info = self.model_info(model_id)
        self._admit(info)
        loop = asyncio.get_running_loop()
        req = _Request(model_id, prompt, messages, max_tokens, float(temperature), float(top_p),
                       stops, seed, asyncio.Queue(), loop)
        try:
            prompt_tokens, limit = await self._call(self._t_submit, req)
        except BaseException:
            self._cancel(req)
            raise
        return Generation(self, req, prompt_tokens, limit)

    def _admit(self, info: ModelInfo) -> None:
        waiting = sum(max(0, n - self._infos[m].max_concurrent_sequences)
                      for m, n in self._inflight.items() if m in self._infos)
        mine = self._inflight.get(info.model_id, 0)
        if mine >= info.max_concurrent_sequences and waiting >= self.max_queued_requests:
            raise Overloaded(f"{waiting} requests are already waiting (limit "
                             f"{self.max_queued_requests})",
                             retry_after_seconds=max(1, waiting // max(
                                 1, info.max_concurrent_sequences)))
        self._inflight[info.model_id] = mine + 1

    def _release(self, req: _Request) -> None:
        if req.finished:
            return
        req.finished = True
        n = self._inflight.get(req.model_id, 0) - 1
        if n > 0:
            self._inflight[req.model_id] = n
        else:
            self._inflight.pop(req.model_id, None)

    def _cancel(self, req: _Request) -> None:
        if req.finished:
            return
        self._release(req)
        if not self._closed:
            self._cmds.put(("cancel", req))

    def _deliver(self, events: list[tuple[_Request, Any]]) -> None:
        for req, item in events:
            if req.finished:
                continue
            if isinstance(item, BaseException) or item.finish_reason is not None:
                self._release(req)
            req.out.put_nowait(item)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the MLX thread and return its result (or raise its error).
        Raises :class:`GenerationAborted` when the thread has ended (closed or failed)."""
        assert self._loop is not None
        fut = self._loop.create_future()
        with self._cmd_lock:
            if self._dead:
                raise GenerationAborted(self._failed_message() if self._failure
                                        else "the serving core closed")
            self._cmds.put(("call", fn, args, fut))
        return await fut

    def _on_thread_exit(self) -> None:
        """Loop side, after the MLX thread ended: a failed core serves no model any more."""
        if self._failure is None:
            return
        for model_id, info in list(self._infos.items()):
            self.metrics.model_loaded.labels(model_id, info.revision).set(0)
        self._infos.clear()

    def _forget(self, info: ModelInfo) -> None:
        """Loop side: the thread dropped ``info``'s model on its own (it could not recover)."""
        if self._infos.get(info.model_id) is info:
            del self._infos[info.model_id]
            self.metrics.model_loaded.labels(info.model_id, info.revision).set(0)

    # -- the MLX thread ------------------------------------------------------------------------
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

    def _send(self, events: list[tuple[_Request, Any]]) -> None:
        if not events:
            return
        try:
            events[0][0].loop.call_soon_threadsafe(self._deliver, events)
        except RuntimeError:
            pass

    def _run_and_signal(self) -> None:
        try:
            try:
                self._run()
            except BaseException as e:  # noqa: BLE001 - outside every guard: the core fails
                self._failure = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                log.critical("the MLX serving thread failed; the serving core is unusable",
                             exc_info=True)
            reason = self._failed_message() if self._failure else "the serving core closed"
            for model_id in list(self._models):
                self._t_unload(model_id, reason=reason)
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
            if self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._on_thread_exit)
                except RuntimeError:  # loop closed
                    pass
        finally:
            self._finished.set()

    def _run(self) -> None:
        import mlx.core as mx

        # Like mlx_lm.server: generate on this thread's default stream, so that model, caches
        # and synchronisation all live on the one thread that owns MLX.
        stream = mx.default_stream(mx.default_device())
        self._stream = stream
        with mx.stream(stream):
            while True:
                busy = any(m.has_work() for m in self._models.values())
                try:
                    cmd = self._cmds.get(block=not busy)
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
                for loaded in list(self._models.values()):
                    if loaded.has_work():
                        try:
                            self._t_step(loaded)
                        except Exception as e:  # noqa: BLE001 - contained to this model
                            log.exception("generation step of %s failed", loaded.info.model_id)
                            self._t_reset(loaded, f"generation failed: {type(e).__name__}: {e}")

    def _t_command(self, cmd: tuple) -> None:
        if cmd[0] == "call":
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
                self._t_cancel(req)
            except Exception as e:  # noqa: BLE001 - contained to the request's model
                log.exception("cancelling a request of %s failed", req.model_id)
                loaded = self._models.get(req.model_id)
                if loaded is not None:
                    self._t_reset(loaded, f"generation failed: {type(e).__name__}: {e}")

    def _t_new_generator(self, model: Any, tokenizer: Any, info: ModelInfo) -> Any:
        from mlx_lm.generate import BatchGenerator

        generator = BatchGenerator(
            model,
            stop_tokens=[[t] for t in tokenizer.eos_token_ids],
            completion_batch_size=info.max_concurrent_sequences,
            prefill_batch_size=min(8, info.max_concurrent_sequences),
            stream=self._stream,
        )
        # mlx-lm (0.32) raises the process-wide wired limit to the recommended size in
        # BatchGenerator.__init__ and puts back the value *it* saw in close()/__del__. With one
        # generator per model that is wrong: closing A's generator would drop the limit while B
        # still runs (and the last one closed may leave it raised). So the core owns it: keep
        # the value from before the first generator, restore it when the last model goes.
        saved = getattr(generator, "_old_wired_limit", None)
        if hasattr(generator, "_old_wired_limit"):
            generator._old_wired_limit = None
        if self._wired_saved is _UNSET:
            self._wired_saved = saved
        return generator

    def _t_restore_wired_limit(self) -> None:
        """Once no model is loaded: put back the wired limit from before the first generator."""
        import mlx.core as mx

        saved, self._wired_saved = self._wired_saved, _UNSET
        if saved is _UNSET or saved is None:
            return
        try:
            mx.synchronize()
            mx.set_wired_limit(saved)
        except Exception:  # noqa: BLE001
            log.exception("restoring the wired memory limit failed")

    def _t_reset(self, loaded: _Loaded, reason: str) -> None:
        """After an error in ``loaded``'s generator: abort its running sequences with
        ``reason``, replace the generator and prompt cache (their state is unknown). Waiting
        requests stay queued. If even that fails, the model is unloaded."""
        from mlx_lm.models.cache import LRUPromptCache

        events: list[tuple[_Request, Any]] = []
        for req in loaded.active.values():
            req.done = True
            events.append((req, GenerationAborted(reason)))
        loaded.active.clear()
        self._send(events)
        old, loaded.generator = loaded.generator, None
        try:
            old.close()
        except Exception:  # noqa: BLE001
            log.exception("closing the failed batch generator of %s", loaded.info.model_id)
        del old
        try:
            loaded.generator = self._t_new_generator(loaded.model, loaded.tokenizer, loaded.info)
            loaded.prompt_cache = LRUPromptCache(max_size=_PROMPT_CACHE_ENTRIES)
        except Exception as e:  # noqa: BLE001
            log.exception("recreating the batch generator of %s failed; unloading it",
                          loaded.info.model_id)
            self._t_unload(loaded.info.model_id,
                           reason=f"{reason}; the model could not recover ({e}) and was unloaded")
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(self._forget, loaded.info)
            except RuntimeError:
                pass
            return
        self._t_update_gauges(loaded)

    def _t_load(self, info: ModelInfo) -> None:
        import mlx_lm
        from mlx_lm.models.cache import LRUPromptCache

        if info.model_id in self._models:
            self._t_unload(info.model_id, reason="the model was replaced")
        t0 = time.perf_counter()
        try:
            model, tokenizer = mlx_lm.load(info.path)
        except Exception as e:  # noqa: BLE001 - any loader failure is a LoadFailed
            raise ModelLoadError("LoadFailed", f"{type(e).__name__}: {e}") from e
        generator = self._t_new_generator(model, tokenizer, info)
        self.metrics.model_load_seconds.labels(info.model_id, info.revision).observe(
            time.perf_counter() - t0)
        self._models[info.model_id] = _Loaded(info, model, tokenizer, generator,
                                              LRUPromptCache(max_size=_PROMPT_CACHE_ENTRIES))
        self._active_count[info.model_id] = 0
        self._queued_count[info.model_id] = 0
        self._peak_active[info.model_id] = 0

    def _t_set_limits(self, info: ModelInfo) -> None:
        """Apply ``info``'s limits to the loaded model of the same id (see :meth:`load_model`)."""
        loaded = self._models.get(info.model_id)
        if loaded is None:
            raise ModelNotLoaded(info.model_id)
        loaded.info = info
        # BatchGenerator reads these public attributes at every step (as set by its __init__);
        # the core's own cap in _t_step is what bounds the batch.
        n = info.max_concurrent_sequences
        loaded.generator.prefill_batch_size = min(8, n)
        loaded.generator.completion_batch_size = max(n, loaded.generator.prefill_batch_size)
        self._peak_active[info.model_id] = len(loaded.active)
        self._t_update_gauges(loaded)

    def _t_unload(self, model_id: str, reason: str = "the model was unloaded") -> None:
        """Abort the model's requests with ``reason`` and drop it (never raises)."""
        import mlx.core as mx

        loaded = self._models.pop(model_id, None)
        if loaded is None:
            return
        events: list[tuple[_Request, Any]] = []
        for req in list(loaded.pending) + list(loaded.active.values()):
            req.done = True
            events.append((req, GenerationAborted(reason)))
        self._send(events)
        loaded.pending.clear()
        loaded.active.clear()
        labels = (model_id, loaded.info.revision)
        self.metrics.batch_occupancy.labels(*labels).set(0)
        self.metrics.queue_depth.labels(*labels).set(0)
        self._active_count.pop(model_id, None)
        self._queued_count.pop(model_id, None)
        try:
            if loaded.generator is not None:
                loaded.generator.close()
        except Exception:  # noqa: BLE001
            log.exception("closing the batch generator of %s failed", model_id)
        del loaded
        try:
            gc.collect()
            mx.clear_cache()
        except Exception:  # noqa: BLE001 - memory is returned later at worst
            log.exception("returning the memory of %s failed", model_id)
        if not self._models:
            self._t_restore_wired_limit()

    def _t_submit(self, req: _Request) -> tuple[int, int]:
        loaded = self._models.get(req.model_id)
        if loaded is None:
            raise ModelNotLoaded(req.model_id)
        tok = loaded.tokenizer
        try:
            if req.messages is not None:
                ids = tok.apply_chat_template(req.messages, add_generation_prompt=True)
                if not isinstance(ids, list):  # some transformers versions return an encoding
                    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            else:
                ids = tok.encode(req.prompt, add_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - templates/tokenizers raise many kinds
            raise InvalidPrompt(f"cannot tokenize the prompt: {e}") from e
        ids = [int(i) for i in ids]
        if not ids:
            if tok.bos_token_id is None:
                raise InvalidPrompt("the prompt is empty")
            ids = [int(tok.bos_token_id)]
        limit = loaded.info.max_context_tokens
        if req.max_tokens is None:
            req.max_tokens = limit - len(ids)
            if req.max_tokens < 1:
                raise ContextLengthExceeded(len(ids), 1, limit)
        elif len(ids) + req.max_tokens > limit:
            raise ContextLengthExceeded(len(ids), req.max_tokens, limit)
        req.tokens = ids
        req.detok = tok.detokenizer
        loaded.pending.append(req)
        labels = (req.model_id, loaded.info.revision)
        self.metrics.prompt_tokens.labels(*labels).inc(len(ids))
        self._t_update_gauges(loaded)
        return len(ids), req.max_tokens

    def _t_cancel(self, req: _Request) -> None:
        if req.done:
            return
        req.done = True
        loaded = self._models.get(req.model_id)
        if loaded is None:
            return
        try:
            loaded.pending.remove(req)
        except ValueError:
            pass
        if req.uid is not None and loaded.active.pop(req.uid, None) is not None:
            loaded.generator.remove([req.uid])
        self._t_update_gauges(loaded)

    def _t_update_gauges(self, loaded: _Loaded) -> None:
        model_id = loaded.info.model_id
        labels = (model_id, loaded.info.revision)
        n_active, n_queued = len(loaded.active), len(loaded.pending)
        self._active_count[model_id] = n_active
        self._queued_count[model_id] = n_queued
        if n_active > self._peak_active.get(model_id, 0):
            self._peak_active[model_id] = n_active
        self.metrics.batch_occupancy.labels(*labels).set(n_active)
        self.metrics.queue_depth.labels(*labels).set(n_queued)

    def _t_sampler(self, temperature: float, top_p: float, seed: int | None) -> Any:
        """The sampler for these parameters: shared per (temperature, top_p) when unseeded."""
        from mlx_lm.sample_utils import make_sampler

        top_p = top_p if 0.0 < top_p < 1.0 else 1.0
        if temperature > 0 and seed is not None:
            return _seeded_sampler(temperature, top_p, seed)
        key = (temperature, top_p) if temperature > 0 else (0.0, 1.0)  # greedy ignores top_p
        sampler = self._samplers.get(key)
        if sampler is None:
            sampler = make_sampler(key[0], top_p=key[1] if key[1] < 1.0 else 0.0)
            self._samplers[key] = sampler
            if len(self._samplers) > _SAMPLER_CACHE_ENTRIES:
                self._samplers.popitem(last=False)
        else:
            self._samplers.move_to_end(key)
        return sampler

    def _t_insert(self, loaded: _Loaded, req: _Request) -> None:
        prompt = req.tokens
        cache, cached = None, 0
        if len(prompt) >= 2:
            # Look up prompt[:-1] so that at least the last prompt token is always fed.
            cache, rest = loaded.prompt_cache.fetch_nearest_cache(req.model_id, prompt[:-1])
            cached = len(prompt) - 1 - len(rest)
            if cache is None or cached <= 0:
                cache, cached = None, 0
        sampler = self._t_sampler(req.temperature, req.top_p, req.seed)
        (uid,) = loaded.generator.insert(
            [prompt[cached:]],
            max_tokens=[req.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[prompt[:cached]],
            samplers=[sampler],
        )
        req.uid = uid
        loaded.active[uid] = req
        if cached:
            labels = (req.model_id, loaded.info.revision)
            self.metrics.prompt_cache_hits.labels(*labels).inc()
            self.metrics.prompt_cache_tokens.labels(*labels).inc(cached)

    def _t_step(self, loaded: _Loaded) -> None:
        cap = loaded.info.max_concurrent_sequences
        while loaded.pending and len(loaded.active) < cap:
            req = loaded.pending.popleft()
            try:
                self._t_insert(loaded, req)
            except Exception as e:  # noqa: BLE001
                log.exception("inserting a request failed")
                req.done = True
                self._send([(req, GenerationAborted(f"{type(e).__name__}: {e}"))])
        self._t_update_gauges(loaded)
        if not loaded.active:
            return
        # An error from here on propagates to _run, which resets this model (_t_reset).
        _, responses = loaded.generator.next()
        now = time.perf_counter()
        labels = (loaded.info.model_id, loaded.info.revision)
        events: list[tuple[_Request, Any]] = []
        to_remove: list[int] = []                # sequences that ended here but not in mlx-lm
        n_tokens = 0
        try:
            for r in responses:
                req = loaded.active.get(r.uid)
                if req is None:
                    continue
                n_tokens += 1
                try:
                    chunk = self._t_token(loaded, req, r, now, labels)
                except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                    log.exception("processing a token of request %d (%s) failed", req.rid,
                                  req.model_id)
                    chunk = GenerationAborted(f"generation failed: {type(e).__name__}: {e}")
                    req.done = True
                if req.done:
                    loaded.active.pop(r.uid, None)
                    if r.finish_reason is None:
                        to_remove.append(r.uid)
                events.append((req, chunk))
            if to_remove:
                loaded.generator.remove(to_remove)
        finally:
            # what was produced goes out even if the step fails below (then _t_reset aborts the
            # rest): a request that finished here must not wait for an event that never comes
            if n_tokens:
                self.metrics.generated_tokens.labels(*labels).inc(n_tokens)
            self._t_update_gauges(loaded)
            self._send(events)

    def _t_token(self, loaded: _Loaded, req: _Request, r: Any, now: float,
                 labels: tuple[str, str]) -> Chunk:
        """One generated token of ``req`` → its chunk; marks ``req.done`` at its end."""
        req.n_generated += 1
        if req.last_token_at is None:
            self.metrics.ttft.labels(*labels).observe(now - req.submitted)
        else:
            self.metrics.inter_token.labels(*labels).observe(now - req.last_token_at)
        req.last_token_at = now
        if r.finish_reason == "stop":  # EOS: not part of the text
            req.detok.finalize()
        else:
            req.detok.add_token(r.token)
            if r.finish_reason is not None:
                req.detok.finalize()
        text, reason = self._t_apply_stops(req, req.detok.last_segment)
        if reason is None and r.finish_reason is not None:
            text += req.held
            req.held = ""
            reason = r.finish_reason
        if reason is not None:
            req.done = True
            if r.finish_reason is not None and r.prompt_cache is not None and r.all_tokens:
                try:
                    loaded.prompt_cache.insert_cache(req.model_id, list(r.all_tokens),
                                                     r.prompt_cache)
                except Exception:  # noqa: BLE001 - only a lost cache entry
                    log.exception("caching the prompt of request %d failed", req.rid)
        return Chunk(text, req.n_generated, reason)

    @staticmethod
    def _t_apply_stops(req: _Request, segment: str) -> tuple[str, str | None]:
        """Returns (text to emit, "stop" or None); keeps a possible stop prefix in req.held."""
        if not req.stop:
            return segment, None
        buf = req.held + segment
        first = -1
        for s in req.stop:
            i = buf.find(s)
            if i >= 0 and (first < 0 or i < first):
                first = i
        if first >= 0:
            req.held = ""
            return buf[:first], "stop"
        keep = 0
        for s in req.stop:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        req.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None


# MLX keeps thread-local state whose destructor needs the GIL. A thread that used MLX and exits
# late (after ``join`` returned, while the interpreter finalizes) aborts the process. So MLX
# threads never exit: when a core closes, its thread parks in this pool and the next core reuses
# it. Parked threads are daemons and hold nothing.
_idle_workers: "queue.SimpleQueue[queue.SimpleQueue[Callable[[], None]]]" = queue.SimpleQueue()
_worker_names = itertools.count(1)


def _worker_main(inbox: "queue.SimpleQueue[Callable[[], None]]") -> None:
    while True:
        job = inbox.get()
        try:
            job()
        except BaseException:  # noqa: BLE001 - a worker must survive its job
            log.exception("MLX worker job failed")
        _idle_workers.put(inbox)


def _worker_thread(job: Callable[[], None]) -> threading.Thread | None:
    """Run ``job`` on a parked MLX worker thread (or a new one). Returns the new thread, if any."""
    try:
        inbox = _idle_workers.get_nowait()
    except queue.Empty:
        inbox = queue.SimpleQueue()
        thread = threading.Thread(target=_worker_main, args=(inbox,), daemon=True,
                                  name=f"mlx-serving-{next(_worker_names)}")
        inbox.put(job)
        thread.start()
        return thread
    inbox.put(job)
    return None


def _seeded_sampler(temperature: float, top_p: float, seed: int) -> Callable[[Any], Any]:
    """A sampler like ``make_sampler(temperature, top_p)`` whose n-th call draws with the random
    key ``key(hash(seed, n))`` instead of MLX's global random state. Takes log-probabilities of
    shape ``(rows, vocab)``, returns token ids of shape ``(rows,)``."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_p

    step = itertools.count()
    inv_temp = 1.0 / temperature

    def sample(logprobs: Any) -> Any:
        key = mx.random.key((seed * 1_000_003 + next(step)) % (2**63))
        if top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * inv_temp, key=key)

    return sample
