"""The node agent's MLX serving core.

One dedicated thread owns MLX: every ``mlx`` / ``mlx_lm`` call (load, prefill, decode, cache
clean-up) happens on it. The asyncio side talks to it through a ``queue.Queue`` of commands;
results come back with ``loop.call_soon_threadsafe`` into a per-request
:class:`~node_agent.serving.inbox.Inbox`. What the thread does to a revision is
:class:`~node_agent.serving.engine.Engine`; :class:`ServingCore` is the asyncio API, one class
in four modules, one job each: this one (its state, start and close, observability, generation
and admission), :mod:`~node_agent.serving.revisions` (loading, unloading and draining
revisions), :mod:`~node_agent.serving.channel` (the command channel) and
:mod:`~node_agent.serving.step_loop` (the thread's step loop).

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

A revision loaded with ``task="TextEmbedding"`` has no BatchGenerator and no prompt cache: it
serves :meth:`ServingCore.embed` (whole forward passes over batches of inputs, see
:mod:`node_agent.serving.embeddings`), and :meth:`ServingCore.generate` refuses it
(:class:`~node_agent.serving.errors.WrongTask`), as :meth:`ServingCore.embed` refuses a
generation revision.

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
import logging
import os
import queue
import threading
import time
from typing import Any, Sequence

from prometheus_client import CollectorRegistry

from mlx_fleet.capabilities import TASK_TEXT_GENERATION, Capability

from ..metrics import AgentMetrics
from .admission import DrainRate, admit, retry_after_seconds
from .channel import _STOP, _CommandChannel
from .coalesce import Coalescer, SharedGeneration, coalesce_key
from .constrain import compile_grammar
from .embeddings import _Embeddings
from .engine import Engine, Events
from .errors import (GenerationAborted, Overloaded, StreamBufferOverflow, TooManyChoices,
                     WrongTask)
from .generation import Generation, Request
from .inbox import Inbox
from .loading import LoadPacing
from .options import ServingOptions
from .revisions import _Drain, _Load, _Revisions
from .sampling import choice_seed
from .step_loop import _StepLoop
from .tokenize import (DEFAULT_MAX_PROMPT_BYTES, PromptTooLarge, default_tokenizer_threads,
                       limit_tokenizer_parallelism, prompt_bytes, tokenize)
from .types import MemoryUsage, ModelInfo, ModelKey, ToolFormat
from .worker import run_on_worker

__all__ = ["ServingCore", "DEFAULT_MAX_CHOICES"]

#: Most choices (``n``) one request may ask for unless the agent says otherwise
#: (``--max-choices``): each is a sequence of its own in the batch.
DEFAULT_MAX_CHOICES = 8

log = logging.getLogger(__name__)


def _rss_bytes() -> int:
    """This process's resident set size in bytes (0 when it cannot be read)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - a measurement, never a failure
        return 0


class ServingCore(_Revisions, _CommandChannel, _StepLoop, _Embeddings):
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
    ``max_choices``: the largest ``n`` :meth:`generate` accepts (:data:`DEFAULT_MAX_CHOICES`).
    """

    def __init__(self, *, registry: CollectorRegistry | None = None,
                 max_queued_requests: int = 64,
                 load_pacing: LoadPacing | None = None,
                 options: ServingOptions | None = None,
                 max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
                 tokenizer_threads: int | None = None,
                 max_choices: int = DEFAULT_MAX_CHOICES) -> None:
        if max_choices < 1:
            raise ValueError(f"max_choices must be >= 1, got {max_choices}")
        self.max_choices = max_choices
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
        self._embed_queues: dict[ModelKey, Any] = {}   # loop side: _Embeddings' batch queues
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

    def tool_format(self, model_id: str, revision: str) -> ToolFormat | None:
        """How the served revision's model writes tool calls (:class:`ToolFormat`: mlx-lm's
        tool parser for its chat template), or ``None`` when mlx-lm knows no tool parser for
        it (or it is not served here). Reads the loop side's tokenizer: no MLX call."""
        tokenizer = self._tokenizers.get((model_id, revision))
        parse = getattr(tokenizer, "tool_parser", None)
        if tokenizer is None or parse is None or not tokenizer.tool_call_start:
            return None
        return ToolFormat(parser=parse.__module__.rsplit(".", 1)[-1],
                          start=tokenizer.tool_call_start, end=tokenizer.tool_call_end or "",
                          parse=parse)

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
                       seed: int | None = None, tools: list[dict] | None = None,
                       grammar: str | None = None,
                       grammar_param: str = "grammar", n: int = 1,
                       logprobs: int | None = None) -> Generation:
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

        ``tools`` (with ``messages`` only): OpenAI function tools, passed to the chat template
        (``tools=``), which renders them into the prompt. ``grammar``: an llguidance grammar
        (:mod:`~node_agent.serving.grammar`) the output must match, enforced on this sequence
        alone by constrained decoding (:mod:`~node_agent.serving.constrain`; compiled on the
        tokenizer pool, and the sequence skips the first-token fast path); a grammar that
        cannot be compiled raises :class:`InvalidConstraint` naming ``grammar_param``.

        With ``options.request_coalescing``, a request identical to one in flight whose output is
        deterministic (greedy, or seeded; :func:`~node_agent.serving.coalesce.coalesce_key`)
        joins that generation instead of starting one: its handle (own :attr:`Generation.id`,
        same token counts) streams the generation from its first chunk; it takes no batch slot
        and is never refused as :class:`Overloaded`; cancelling it leaves the generation running
        for the others (the last one leaving cancels it). Counted in
        ``mlxfleet_agent_coalesced_requests_total``.

        ``logprobs`` (``None``: off; else >= 0, at most the vocabulary counts; the HTTP API
        bounds it by OpenAI's 20 and 5):
        every chunk carries its token's log-probability and the ``logprobs`` most likely tokens
        at its position (:attr:`Chunk.logprobs`; the model's distribution after any logits
        processor, before temperature and top_p: see :mod:`node_agent.serving.logprobs`). Such
        a request is coalesced only with requests asking the same ``logprobs`` (it is part of
        the key), whose chunks are then the very same.

        ``n`` (1 .. :attr:`max_choices`, and at most the revision's
        ``max_concurrent_sequences``; else :class:`TooManyChoices`): ``n`` sequences of the same
        prompt, tokenized once and prefilled once (``Engine._insert_group``), each with its own
        sampler; with ``seed``, choice ``i`` samples with
        :func:`~node_agent.serving.sampling.choice_seed` ``(seed, i)``. One handle streams all
        of them (chunks carry their ``index``; see :class:`Generation`). Admission counts ``n``
        sequences. Never coalesced.

        Raises :class:`ModelNotLoaded` (also for a draining revision), :class:`WrongTask` (a
        ``TextEmbedding`` model), :class:`Overloaded`,
        :class:`ContextLengthExceeded`, :class:`InvalidPrompt`, :class:`InvalidConstraint`,
        :class:`TooManyChoices`, ``ValueError`` for bad arguments, :class:`GenerationAborted`
        when the core is not running or has failed (see :attr:`failure`).
        """
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if n < 1:
            raise ValueError("n must be >= 1")
        if logprobs is not None and logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if n > self.max_choices:
            raise TooManyChoices(n, self.max_choices)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if self._failure is not None:
            raise GenerationAborted(self._failed_message())
        if self._closed or not self._started:
            raise GenerationAborted("the serving core is not running")
        info = self.model_info(model_id, revision)
        if info.task != TASK_TEXT_GENERATION:
            raise WrongTask(model_id, info.task, Capability.GENERATE)
        if n > info.max_concurrent_sequences:
            raise TooManyChoices(n, min(self.max_choices, info.max_concurrent_sequences))
        size = prompt_bytes(prompt, messages)
        if size > self.max_prompt_bytes:
            raise PromptTooLarge(size, self.max_prompt_bytes)
        temperature, top_p = float(temperature), float(top_p)
        key = coalesce_key(info, prompt, messages, {
            "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
            "stop": stops, "seed": seed, "tools": tools, "grammar": grammar,
            "logprobs": logprobs,
        }) if self.options.request_coalescing and n == 1 else None
        shared = self._joinable(key)
        if shared is not None:
            self.metrics.coalesced_requests.labels(*info.key).inc()
            return await self._subscribe(shared)
        self._admit(info, n)
        loop = asyncio.get_running_loop()
        inbox = Inbox()
        reqs = [Request(info.key, prompt, messages, max_tokens, temperature, top_p,
                        stops, choice_seed(seed, i), inbox, loop, tools=tools, grammar=grammar,
                        grammar_param=grammar_param, logprobs=logprobs, index=i)
                for i in range(n)]
        req = reqs[0]
        if n > 1:
            for r in reqs:
                r.group = reqs
        if key is not None:
            return await self._lead(key, req)
        try:
            await self._tokenize(req)
            prompt_tokens, limit = await self._call(self._engine.submit, req)
        except BaseException as e:
            for r in reqs:
                self._cancel(r)
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

    async def _tokenize(self, req: Request) -> None:
        """Render and tokenize ``req``'s prompt on the tokenizer pool — never on the MLX thread
        nor the event loop — into ``req.prompt_ids``, and compile its grammar into
        ``req.constraint``, when its revision's tokenizer is known (else the engine does both
        on submission). Raises what the tokenizer raises, :class:`InvalidConstraint`."""
        tokenizer = self._tokenizers.get(req.key)
        if tokenizer is not None:
            loop = asyncio.get_running_loop()
            req.prompt_ids = await loop.run_in_executor(
                self._tokenize_pool, tokenize, tokenizer, req.prompt, req.messages, req.tools)
            # compiled once; each further sequence of a request's n gets a matcher of its own
            if req.grammar is not None:
                first = await loop.run_in_executor(
                    self._tokenize_pool, compile_grammar, tokenizer, req.grammar,
                    req.grammar_param)
                for i, r in enumerate(req.group or [req]):
                    r.constraint = first if i == 0 else first.copy()

    async def _lead(self, key: Any, req: Request) -> Generation:
        """Submit ``req`` as a shared generation joinable under ``key``; the caller's handle.
        The generation is joinable from this call on, while its prompt is still being tokenized,
        so identical requests arriving together share one tokenization and one generation."""
        shared = self._coalescer.lead(
            key, lambda: self._cancel(req), self.options.stream_buffer_chunks,
            lambda: self.metrics.stream_buffer_overflows.labels(*req.key).inc())
        shared.request = req
        req.out = shared   # the core delivers the request's events to the fan-out

        async def tokenized_and_submitted() -> Any:
            await self._tokenize(req)
            return await self._call_soon(self._engine.submit, req)

        shared.watch(asyncio.ensure_future(tokenized_and_submitted()))
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

    def _admit(self, info: ModelInfo, sequences: int = 1) -> None:
        limits = {k: i.max_concurrent_sequences for k, i in self._infos.items()}
        refused = admit(info.key, self._inflight, limits, self.max_queued_requests, sequences)
        if refused is not None:
            # the queue is shared by all revisions: it drains at all revisions' rates
            raise Overloaded(refused.message, waiting=refused.waiting,
                             retry_after_seconds=retry_after_seconds(
                                 refused.waiting, self._drain_per_second(None)))
        n = self._inflight.get(info.key, 0)
        self._inflight[info.key] = n + sequences
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
            # the n choices of one request share one inbox: n times the bound
            elif req.out.qsize() >= limit * (len(req.group) if req.group else 1):
                # the consumer is `limit` chunks behind: stop the generation (it leaves the
                # batch), hand over what is queued, then the error
                self.metrics.stream_buffer_overflows.labels(*req.key).inc()
                self._cancel(req)
                item = StreamBufferOverflow(req.out.qsize())
            req.out.put_nowait(item)
