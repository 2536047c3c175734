"""What the MLX thread does to resident revisions: load (its first and last steps; the chunks
between are :mod:`node_agent.serving.loading`), limits, unload, tokenize and queue a
request, insert it into the revision's mlx-lm ``BatchGenerator``, run one batch step and turn its
tokens into chunks, and reset a revision's batch after an error. One job, the MLX thread's side
of serving (hence its ~640 lines); what it delegates has modules of its own (:mod:`.loading`,
:mod:`.prefill`, :mod:`.fastpath`, :mod:`.logprobs`, :mod:`.constrain`, :mod:`.detokenize`).

The prompt cache (:class:`~node_agent.serving.options.ServingOptions` ``prompt_cache``,
``prompt_cache_bytes``) is mlx-lm's ``LRUPromptCache`` per revision with ``max_bytes`` set to
the revision's budget (:meth:`Engine.cache_budget`); after every change of the live batch
(requests inserted, a finished request's cache stored) it is trimmed with the library's
``trim_to(n_bytes=budget - BatchGenerator.prompt_cache_nbytes)``, so cache and live batch
together stay within the budget — what ``mlx_lm.server --prompt-cache-bytes`` does.

Every method of :class:`Engine` runs on the MLX thread only (see :mod:`node_agent.serving.core`,
which owns the thread, the command channel and the step loop). Results for requests go back to
the event loop through the ``send`` callback as ``(request, Chunk | exception)`` events.
"""

from __future__ import annotations

import copy
import gc
import logging
import time
from pathlib import Path
from typing import Any, Callable

from ..memory_estimate import kv_cache_bytes
from ..metrics import AgentMetrics, RevisionSeries
from . import fastpath
from .admission import admit_kv, kv_budget_bytes, request_kv_bytes
from .constrain import compile_grammar, public_grammar_error
from .detokenize import feed, next_text
from .embedder import embed_batch, has_body
from .errors import (ConstraintFailed, ContextLengthExceeded, GenerationAborted,
                     ModelLoadError, ModelNotLoaded, Overloaded)
from .generation import Request
from .logprobs import StepLogprobs, TokenLogprob
from .options import PROMPT_CACHE_ENTRIES, ServingOptions
from .prefill import MLX_LM_PREFILL_BATCH_SIZE, prefill_group_size
from .registry import Registry, Resident, parameter_bytes
from .sampling import SamplerCache
from .tokenize import tokenize
from .types import Chunk, ModelInfo, ModelKey

__all__ = ["Engine", "Events"]

log = logging.getLogger(__name__)

_UNSET = object()

#: Per-request results handed to the loop: a :class:`Chunk` or the exception that ends it.
Events = list[tuple[Request, Any]]


class _FirstToken:
    """The fast path's first token in the shape of a BatchGenerator generation response (what
    :meth:`Engine._token` reads): its prompt cache and tokens go to the prompt cache if the
    request ends with it."""

    __slots__ = ("token", "finish_reason", "prompt_cache", "all_tokens", "logprobs")

    def __init__(self, token: int, finish_reason: str | None, prompt_cache: Any,
                 all_tokens: list[int], logprobs: Any = None) -> None:
        self.token = token
        self.finish_reason = finish_reason
        self.prompt_cache = prompt_cache
        self.all_tokens = all_tokens
        self.logprobs = logprobs


class Engine:
    """The resident revisions and everything done to them on the MLX thread.

    ``send(events)`` delivers per-request results to the loop; ``forget(info)`` tells the loop
    that the thread dropped ``info``'s revision on its own (it could not recover from an error).
    """

    def __init__(self, metrics: AgentMetrics, send: Callable[[Events], None],
                 forget: Callable[[ModelInfo], None],
                 options: ServingOptions | None = None) -> None:
        self.metrics = metrics
        self.options = options if options is not None else ServingOptions()
        self.registry = Registry()
        self.samplers = SamplerCache()
        self.stream: Any = None        # the MLX thread's stream, set before the first load
        self.load_stream: Any = None   # the CPU stream weights are read on (None: the default)
        # log-probabilities of the tokens of the sequences that asked (its own MLX stream)
        self.logprobs = StepLogprobs()
        self._send = send
        self._forget = forget
        # The wired-memory limit from before the first BatchGenerator raised it (see
        # new_generator); _UNSET while no generator holds it.
        self._wired_saved: Any = _UNSET

    def has_work(self) -> bool:
        return any(r.has_work() for r in self.registry)

    # -- revisions -----------------------------------------------------------------------------
    def begin_load(self, info: ModelInfo) -> Any:
        """First MLX step of loading ``info``'s revision (the caller unloads a resident copy of
        it first, so both never need memory at once): ``mlx_lm.utils.load_model(path,
        lazy=True)`` builds the model with lazy weights; nothing is read yet (see
        :mod:`node_agent.serving.loading`). Returns the model. Raises :class:`ModelLoadError`
        (``LoadFailed``)."""
        from mlx_lm.utils import load_model

        import mlx.core as mx

        try:
            if self.load_stream is None:
                model, _ = load_model(Path(info.path), lazy=True, trust_remote_code=False)
            else:
                # mx.load's reads (and any op of mlx-lm's sanitize/quantize on the weights) are
                # scheduled on the load stream: evaluating them never waits on generation
                with mx.stream(self.load_stream):
                    model, _ = load_model(Path(info.path), lazy=True, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - any loader failure is a LoadFailed
            raise ModelLoadError("LoadFailed", f"{type(e).__name__}: {e}") from e
        if info.embedding is not None and not has_body(model):
            raise ModelLoadError("UnsupportedEmbeddingModel", f"{type(model).__module__} has no "
                                 "inner model (.model) to take hidden states from")
        return model

    def finish_load(self, info: ModelInfo, model: Any, tokenizer: Any,
                    load_seconds: float) -> None:
        """Last step of a load, once every parameter of ``model`` is evaluated: give the
        revision its BatchGenerator and prompt cache and make it resident. ``load_seconds``:
        the load's duration so far (observed in ``mlxfleet_agent_model_load_seconds``)."""
        weight_bytes = parameter_bytes(model)   # once: the weights never change
        # an embedding model runs whole forward passes (embed): no generator, no prompt cache
        embedding = info.embedding is not None
        generator = None if embedding else self.new_generator(model, tokenizer, info)
        self.metrics.model_load_seconds.labels(*info.key).observe(load_seconds)
        stats = self.registry.new_stats(info.key, weight_bytes)
        self.registry.add(Resident(info, model, tokenizer, generator,
                                   None if embedding else self.new_prompt_cache(info), stats))

    def cache_budget(self, info: ModelInfo) -> int | None:
        """The revision's byte budget for its prompt cache and live batch's KV cache together:
        ``--prompt-cache-bytes`` when given, else its KV reservation
        (``memory_estimate.kv_cache_bytes(kv bytes per token, max_context_tokens,
        max_concurrent_sequences)``); ``None`` (entries bound only) when neither is known."""
        if self.options.prompt_cache_bytes is not None:
            return self.options.prompt_cache_bytes
        if info.kv_cache_bytes_per_token <= 0:
            return None
        return kv_cache_bytes(info.kv_cache_bytes_per_token, info.max_context_tokens,
                              info.max_concurrent_sequences)

    def new_prompt_cache(self, info: ModelInfo) -> Any:
        """mlx-lm's ``LRUPromptCache`` bounded by :meth:`cache_budget`, or ``None`` with
        ``--no-prompt-cache``."""
        from mlx_lm.models.cache import LRUPromptCache

        if not self.options.prompt_cache:
            return None
        budget = self.cache_budget(info)
        if budget is None:
            return LRUPromptCache(max_size=PROMPT_CACHE_ENTRIES)
        return LRUPromptCache(max_size=PROMPT_CACHE_ENTRIES, max_bytes=budget)

    def trim_prompt_cache(self, res: Resident) -> None:
        """Trim ``res``'s prompt cache (least recently used first, mlx-lm's ``trim_to``) to its
        budget minus the KV cache its live batch holds now."""
        budget = self.cache_budget(res.info)
        if res.prompt_cache is None or budget is None or res.generator is None:
            return
        res.prompt_cache.trim_to(n_bytes=budget - res.generator.prompt_cache_nbytes)

    def release_memory(self, what: str) -> None:
        """Collect garbage and return MLX's cached buffers (after dropping a model or a
        half-loaded one; never raises)."""
        import mlx.core as mx

        try:
            gc.collect()
            mx.clear_cache()
        except Exception:  # noqa: BLE001 - memory is returned later at worst
            log.exception("returning the memory of %s failed", what)

    def set_limits(self, info: ModelInfo) -> None:
        """Apply ``info``'s limits to the resident revision of the same key without reloading."""
        res = self.registry.get(info.key)
        if res is None:
            raise ModelNotLoaded(*info.key)
        res.info = info
        if res.prompt_cache is not None:
            budget = self.cache_budget(info)
            res.prompt_cache.max_bytes = budget if budget is not None else 1 << 63
            self.trim_prompt_cache(res)
        if res.generator is None:   # an embedding model: its batches follow info's limits
            self.update_gauges(res)
            return
        # BatchGenerator reads these public attributes at every step (as set by its __init__);
        # the core's own cap in step() is what bounds the batch.
        n = info.max_concurrent_sequences
        res.generator.prefill_batch_size = min(MLX_LM_PREFILL_BATCH_SIZE, n)
        res.generator.completion_batch_size = max(n, res.generator.prefill_batch_size)
        res.stats.peak_active = len(res.active)
        self.update_gauges(res)

    def unload(self, key: ModelKey, reason: str = "the model was unloaded") -> None:
        """Abort the revision's requests with ``reason`` and drop it (never raises)."""
        res = self.registry.pop(key)
        if res is None:
            return
        events: Events = []
        for req in list(res.pending) + list(res.active.values()):
            req.done = True
            events.append((req, GenerationAborted(reason)))
        self._send(events)
        res.pending.clear()
        res.active.clear()
        self.metrics.batch_occupancy.labels(*key).set(0)
        self.metrics.queue_depth.labels(*key).set(0)
        try:
            if res.generator is not None:
                res.generator.close()
        except Exception:  # noqa: BLE001
            log.exception("closing the batch generator of %s@%s failed", *key)
        del res
        self.release_memory("%s@%s" % key)
        if not len(self.registry):
            self._restore_wired_limit()

    def memory(self) -> tuple[int, int]:
        """``(active, cache)`` bytes of MLX's allocator right now."""
        import mlx.core as mx

        return int(mx.get_active_memory()), int(mx.get_cache_memory())

    def unload_all(self, reason: str, *, crashed: bool = False) -> None:
        """Unload every revision; ``crashed``: count it as a crash of each (a core failure)."""
        for res in self.registry:
            if crashed:
                res.stats.crashes += 1
            self.unload(res.key, reason=reason)

    def reset(self, res: Resident, reason: str) -> None:
        """After an error in ``res``'s generator: abort its running sequences with ``reason``
        (clients are told only "generation failed"), replace the generator and prompt cache
        (their state is unknown) and count a crash.
        Waiting requests stay queued. If even that fails, the revision is unloaded."""
        res.stats.crashes += 1
        events: Events = []
        for req in res.active.values():
            req.done = True
            events.append((req, GenerationAborted(reason, public="generation failed")))
        res.active.clear()
        res.prefilling.clear()
        self._send(events)
        old, res.generator = res.generator, None
        try:
            old.close()
        except Exception:  # noqa: BLE001
            log.exception("closing the failed batch generator of %s@%s", *res.key)
        del old
        try:
            res.generator = self.new_generator(res.model, res.tokenizer, res.info)
            res.prompt_cache = self.new_prompt_cache(res.info)
        except Exception:  # noqa: BLE001
            log.exception("recreating the batch generator of %s@%s failed; unloading it",
                          *res.key)
            self.unload(res.key,
                        reason=f"{reason}; the model could not recover and was unloaded")
            self._forget(res.info)
            return
        self.update_gauges(res)

    def new_generator(self, model: Any, tokenizer: Any, info: ModelInfo) -> Any:
        from mlx_lm.generate import BatchGenerator

        generator = BatchGenerator(
            model,
            stop_tokens=[[t] for t in tokenizer.eos_token_ids],
            completion_batch_size=info.max_concurrent_sequences,
            prefill_batch_size=min(MLX_LM_PREFILL_BATCH_SIZE, info.max_concurrent_sequences),
            stream=self.stream,
        )
        # mlx-lm (0.32) raises the process-wide wired limit to the recommended size in
        # BatchGenerator.__init__ and puts back the value *it* saw in close()/__del__. With one
        # generator per revision that is wrong: closing A's generator would drop the limit while
        # B still runs (and the last one closed may leave it raised). So the engine owns it:
        # keep the value from before the first generator, restore it when the last one goes.
        saved = getattr(generator, "_old_wired_limit", None)
        if hasattr(generator, "_old_wired_limit"):
            generator._old_wired_limit = None
        if self._wired_saved is _UNSET:
            self._wired_saved = saved
        return generator

    def _restore_wired_limit(self) -> None:
        """Once nothing is loaded: put back the wired limit from before the first generator."""
        import mlx.core as mx

        saved, self._wired_saved = self._wired_saved, _UNSET
        if saved is _UNSET or saved is None:
            return
        try:
            mx.synchronize()
            mx.set_wired_limit(saved)
        except Exception:  # noqa: BLE001
            log.exception("restoring the wired memory limit failed")

    # -- embeddings ----------------------------------------------------------------------------
    def embed(self, key: ModelKey, batch: list[list[int]]) -> Any:
        """One forward pass of embedding revision ``key`` over ``batch`` (token lists): the
        vectors as a float32 numpy array ``(len(batch), dimensions)``
        (:func:`~node_agent.serving.embedder.embed_batch`). Counts the batch's tokens in
        ``mlxfleet_agent_prompt_tokens_total``, its size in
        ``mlxfleet_agent_embedding_batch_inputs``. Raises :class:`ModelNotLoaded`."""
        res = self.registry.get(key)
        if res is None or res.info.embedding is None:
            raise ModelNotLoaded(*key)
        vectors = embed_batch(res.model, batch, res.info.embedding)
        self.metrics.prompt_tokens.labels(*key).inc(sum(len(ids) for ids in batch))
        self.metrics.embedding_batch_inputs.labels(*key).observe(len(batch))
        return vectors

    # -- requests ------------------------------------------------------------------------------
    def submit(self, req: Request) -> tuple[int, int]:
        """Take ``req``'s prompt ids (:attr:`Request.prompt_ids`, tokenized off this thread;
        tokenized here only when absent), check its context limit and, under the ``kv``
        admission policy, its
        revision's KV budget (:func:`~node_agent.serving.admission.admit_kv`; raises
        :class:`Overloaded` with ``waiting`` set, the caller fills in ``Retry-After``), then
        queue it; returns ``(prompt tokens, max tokens)``.

        A request for ``n`` choices is submitted through its first sequence (``req.group``: all
        ``n``, in order): the prompt is tokenized once, the KV bound counts ``n`` sequences, and
        all ``n`` are queued together (:meth:`step` inserts them together)."""
        res = self.registry.get(req.key)
        if res is None:
            raise ModelNotLoaded(*req.key)
        tok = res.tokenizer
        # tokenized in the core's pool before submission (node_agent.serving.tokenize); here
        # only for a caller that hands in a raw request
        ids = (req.prompt_ids if req.prompt_ids is not None
               else tokenize(tok, req.prompt, req.messages, req.tools))
        if req.grammar is not None and req.constraint is None:  # a matcher per sequence
            first = compile_grammar(tok, req.grammar, req.grammar_param)
            for i, r in enumerate(req.group or [req]):
                r.constraint = first if i == 0 else first.copy()
        limit = res.info.max_context_tokens
        if req.max_tokens is None:
            req.max_tokens = limit - len(ids)
            if req.max_tokens < 1:
                raise ContextLengthExceeded(len(ids), 1, limit)
        elif len(ids) + req.max_tokens > limit:
            raise ContextLengthExceeded(len(ids), req.max_tokens, limit)
        req.kv_bytes = request_kv_bytes(res.info.kv_cache_bytes_per_token, len(ids),
                                        req.max_tokens)
        group = req.group or [req]
        if self.options.admission_policy == "kv":
            cap = res.info.max_concurrent_sequences
            refused = admit_kv(
                req.kv_bytes * len(group), (r.kv_bytes for r in res.active.values()),
                (r.kv_bytes for r in res.pending),
                slot_free=len(res.active) + len(res.pending) + len(group) <= cap,
                budget_bytes=kv_budget_bytes(res.info.kv_cache_bytes_per_token,
                                             res.info.max_context_tokens, cap))
            if refused is not None:
                raise Overloaded(refused.message, waiting=refused.waiting)
        for r in group:
            r.max_tokens, r.kv_bytes = req.max_tokens, req.kv_bytes
            r.tokens = ids
            r.detok = tok.detokenizer   # a new streaming detokenizer each
            res.pending.append(r)
        self.metrics.prompt_tokens.labels(*req.key).inc(len(ids))
        self.update_gauges(res)
        return len(ids), req.max_tokens

    def cancel(self, req: Request) -> None:
        if req.done:
            return
        req.done = True
        res = self.registry.get(req.key)
        if res is None:
            return
        try:
            res.pending.remove(req)
        except ValueError:
            pass
        if req.uid is not None and res.active.pop(req.uid, None) is not None:
            res.prefilling.pop(req.uid, None)
            res.generator.remove([req.uid])
        self.update_gauges(res)

    def update_gauges(self, res: Resident) -> None:
        res.refresh_stats()
        series = self.metrics.series(*res.key)
        series.batch_occupancy.set(res.stats.active)
        series.queue_depth.set(res.stats.queued)

    def _insert(self, res: Resident, req: Request) -> None:
        """Put ``req`` into ``res``'s BatchGenerator, reusing the longest cached prefix of its
        prompt. If the batch is empty (:mod:`node_agent.serving.fastpath`), its first token is
        computed and sent here, and the sequence joins the generator after it."""
        prompt = req.tokens
        cache, cached = self._cached_prefix(res, req)
        sampler = self.samplers.get(req.temperature, req.top_p, req.seed)
        to_feed, max_tokens = prompt[cached:], req.max_tokens
        # a constrained sequence's every token is masked (node_agent.serving.constrain): its
        # first one too, so it joins the batch without the fast path
        processors = None if req.constraint is None else [[req.constraint.processor()]]
        if processors is None and fastpath.applies(self.options.fast_first_token,
                                                   len(res.active), len(to_feed)):
            if cache is None:
                from mlx_lm.models.cache import make_prompt_cache
                cache = make_prompt_cache(res.model)
            token, row = fastpath.first_token_logprobs(res.model, to_feed, cache, sampler)
            if token in res.tokenizer.eos_token_ids:
                reason: str | None = "stop"
            else:
                reason = "length" if max_tokens <= 1 else None
            series = self.metrics.series(*res.key)
            lp = (self.logprobs.entries(res, [(row, token, req.logprobs)])[0]
                  if req.logprobs is not None and reason != "stop" else None)
            chunk = self._token(res, req, _FirstToken(token, reason, cache, prompt),
                                time.perf_counter(), series, lp)
            series.generated_tokens.inc()
            if not req.done:
                # into the batch before the token goes out: whoever reads the stats or cancels
                # after seeing it finds the request running
                (req.uid,) = res.generator.insert([[token]], max_tokens=[max_tokens - 1],
                                                  caches=[cache], all_tokens=[prompt],
                                                  samplers=[sampler])
                res.active[req.uid] = req
                res.prefilling[req.uid] = 1   # a one-token "prompt": a prompt-batch slot once
            self.update_gauges(res)
            self._send([(req, chunk)])
            return
        (uid,) = res.generator.insert(
            [to_feed],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[prompt[:cached]],
            samplers=[sampler],
            logits_processors=processors,
        )
        req.uid = uid
        res.active[uid] = req
        res.prefilling[uid] = len(to_feed)

    def _cached_prefix(self, res: Resident, req: Request) -> tuple[Any, int]:
        """The prompt cache's longest cached prefix of ``req``'s prompt but its last token:
        ``(cache, cached tokens)``, ``(None, 0)`` on a miss; sets ``req.cached_tokens`` and
        counts the hit or miss."""
        prompt = req.tokens
        cache, cached = None, 0
        if res.prompt_cache is not None and len(prompt) >= 2:
            # Look up prompt[:-1] so that at least the last prompt token is always fed.
            cache, rest = res.prompt_cache.fetch_nearest_cache(req.model_id, prompt[:-1])
            cached = len(prompt) - 1 - len(rest)
            if cache is None or cached <= 0:
                cache, cached = None, 0
        req.cached_tokens = cached
        if cached:
            self.metrics.prompt_cache_hits.labels(*req.key).inc()
            self.metrics.prompt_cache_tokens.labels(*req.key).inc(cached)
        elif res.prompt_cache is not None:
            self.metrics.prompt_cache_misses.labels(*req.key).inc()
        return cache, cached

    def _insert_group(self, res: Resident, group: list[Request]) -> None:
        """Put the ``n`` sequences of a request for ``n`` choices (same prompt ids) into the
        BatchGenerator sharing one prefill: the prompt but its last token is fed once (after
        the prompt cache's hit; :func:`~node_agent.serving.fastpath.prefill`, in passes of at
        most ``fastpath.MAX_PREFILL_TOKENS``, the largest pass mlx-lm makes) into one KV cache,
        of which every sequence gets a copy, and each then feeds only the last prompt token —
        like a prompt-cache hit of its whole prompt. A prefill longer than one such pass is left
        to the BatchGenerator (the ``n`` sequences are prefilled together in its padded prompt
        batch, between decode steps), so that no running sequence waits for more than one
        pass. Each sequence samples with its own sampler (``seed`` derived per choice)."""
        first = group[0]
        prompt = first.tokens
        cache, cached = self._cached_prefix(res, first)
        for r in group[1:]:
            r.cached_tokens = cached
        feed = prompt[cached:]
        if 1 < len(feed) <= fastpath.MAX_PREFILL_TOKENS + 1:
            if cache is None:
                from mlx_lm.models.cache import make_prompt_cache
                cache = make_prompt_cache(res.model)
            fastpath.prefill(res.model, feed[:-1], cache)
            feed, in_cache = feed[-1:], len(prompt) - 1
        else:
            in_cache = cached
        caches = (None if cache is None
                  else [cache] + [copy.deepcopy(cache) for _ in group[1:]])
        constrained = any(r.constraint is not None for r in group)
        uids = res.generator.insert(
            [list(feed) for _ in group],
            max_tokens=[r.max_tokens for r in group],
            caches=caches,
            all_tokens=[list(prompt[:in_cache]) for _ in group],
            samplers=[self.samplers.get(r.temperature, r.top_p, r.seed) for r in group],
            # a constrained sequence's tokens are masked by its own grammar matcher
            logits_processors=([[r.constraint.processor()] if r.constraint is not None else []
                                for r in group] if constrained else None),
        )
        for r, uid in zip(group, uids):
            r.uid = uid
            res.active[uid] = r
            res.prefilling[uid] = len(feed)

    def step(self, res: Resident) -> None:
        """Move waiting requests into free batch slots, run one batch step of ``res`` and send
        the resulting chunks. An error outside one request's post-processing propagates (the
        caller then :meth:`reset` s the revision)."""
        cap = res.info.max_concurrent_sequences
        inserted = False
        while res.pending and len(res.active) < cap:
            req = res.pending[0]
            # a request for n choices joins with all its sequences at once (into an empty
            # batch even if n is above a cap lowered since it was admitted)
            group = ([r for r in req.group if not r.done and r.uid is None]
                     if req.group else [req])
            if len(res.active) + len(group) > cap and res.active:
                break
            for r in group:
                res.pending.remove(r)
            try:
                if req.group:
                    self._insert_group(res, group)
                else:
                    self._insert(res, req)
                inserted = True
            except Exception as e:  # noqa: BLE001
                log.exception("inserting a request failed")
                for r in group:
                    if r.uid is not None:
                        res.active.pop(r.uid, None)
                        res.prefilling.pop(r.uid, None)
                        res.generator.remove([r.uid])
                    r.done = True
                self._send([(r, GenerationAborted(
                    f"{type(e).__name__}: {e}", public="the request could not join the batch"))
                    for r in group])
        if inserted:
            self.trim_prompt_cache(res)   # the live batch grew: less room for the cache
        self.update_gauges(res)
        if not res.active:
            return
        self._size_prefill(res, cap)
        prompt_responses, responses = res.generator.next()
        self._track_prefill(res, prompt_responses)
        now = time.perf_counter()
        series = self.metrics.series(*res.key)
        events: Events = []
        to_remove: list[int] = []                # sequences that ended here but not in mlx-lm
        n_tokens = 0
        try:
            logprobs = self.logprobs.of_step(res, responses)
            for r in responses:
                req = res.active.get(r.uid)
                if req is None:
                    continue
                n_tokens += 1
                try:
                    chunk: Any = self._token(res, req, r, now, series,
                                             logprobs.get(r.uid) if logprobs else None)
                except ConstraintFailed as e:   # the client's grammar: this request ends
                    log.info("request %d (%s@%s) ended: %s", req.rid, *req.key, e)
                    chunk = e
                    req.done = True
                except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                    log.exception("processing a token of request %d (%s@%s) failed", req.rid,
                                  *req.key)
                    chunk = GenerationAborted(f"generation failed: {type(e).__name__}: {e}",
                                              public="generation failed")
                    req.done = True
                if req.done:
                    res.active.pop(r.uid, None)
                    if r.finish_reason is None:
                        to_remove.append(r.uid)
                events.append((req, chunk))
            if to_remove:
                res.generator.remove(to_remove)
        finally:
            # what was produced goes out even if the step fails below (then reset aborts the
            # rest): a request that finished here must not wait for an event that never comes
            if n_tokens:
                series.generated_tokens.inc(n_tokens)
            self.update_gauges(res)
            self._send(events)

    def _size_prefill(self, res: Resident, cap: int) -> None:
        """Set the generator's prefill group for its next step
        (:func:`~node_agent.serving.prefill.prefill_group_size` of the sequences in its prompt
        stages, :attr:`Resident.prefilling`); with ``prefill_batch_tokens`` 0 the generator
        keeps mlx-lm's fixed group (``min(8, max_concurrent_sequences)``)."""
        if not res.prefilling or not self.options.prefill_batch_tokens:
            return
        res.generator.prefill_batch_size = prefill_group_size(
            list(res.prefilling.values()), cap - (len(res.active) - len(res.prefilling)),
            batch_tokens=self.options.prefill_batch_tokens)

    @staticmethod
    def _track_prefill(res: Resident, prompt_responses: Any) -> None:
        """Follow the generator's prompt stages from ``next()``'s prompt responses (mlx-lm
        ``PromptProcessingBatch.Response``): a sequence leaves :attr:`Resident.prefilling` once
        split into the generation batch (``end_of_prompt``), else keeps the tokens it has left
        (``progress``: fed, total)."""
        for p in prompt_responses:
            if p.uid not in res.prefilling:
                continue
            if p.end_of_prompt:
                del res.prefilling[p.uid]
            else:
                fed, total = p.progress
                res.prefilling[p.uid] = max(1, total - fed)

    def _token(self, res: Resident, req: Request, r: Any, now: float,
               series: RevisionSeries, logprobs: TokenLogprob | None = None) -> Chunk:
        """One generated token of ``req`` → its chunk (with ``logprobs``: the token's entry,
        when the request asked); marks ``req.done`` at its end."""
        req.n_generated += 1
        if req.last_token_at is None:
            series.ttft.observe(now - req.submitted)
        else:
            series.inter_token.observe(now - req.last_token_at)
        req.last_token_at = now
        error = req.constraint.error() if req.constraint is not None else None
        if error is not None:
            # the grammar could not be followed (a parser limit of the client's grammar): end
            # the request rather than answer output that may not match it
            raise ConstraintFailed(req.grammar_param, public_grammar_error(error))
        segment = feed(req.detok, r.token, r.finish_reason)
        text, req.held, reason = next_text(req.stop, req.held, segment, r.finish_reason)
        if reason is not None:
            req.done = True
            if (res.prompt_cache is not None and r.finish_reason is not None
                    and r.prompt_cache is not None and r.all_tokens):
                try:
                    res.prompt_cache.insert_cache(req.model_id, list(r.all_tokens),
                                                  r.prompt_cache)
                    self.trim_prompt_cache(res)
                except Exception:  # noqa: BLE001 - only a lost cache entry
                    log.exception("caching the prompt of request %d failed", req.rid)
        return Chunk(text, req.n_generated, reason, req.index, logprobs)
