"""The first token of a request that finds its revision's batch empty, without BatchGenerator's
three-call admission (issue #9's TTFT goal; seed 002: no batching window when the queue is empty).

mlx-lm's ``BatchGenerator`` (0.32) admits a new sequence over three ``next()`` calls: the prompt
but its last token is prefilled; the sequence is split into a generation batch, whose first step
(the last prompt token's forward) starts asynchronously; the first token is read back. Profiled
on the lent H100 (``benchmarks/ttft_overhead.py``, the ``profile`` of
``benchmarks/results/ttft_overhead-h100.json``): about 11 + 9 + 6 ms for a 16-token prompt of a
2.7 GB llama, where ``mlx_lm.stream_generate`` returns its first token after 18 ms.

When nobody is in the batch there is nobody to batch with, so the engine instead prefills the
whole prompt (after any prompt-cache hit) in one forward pass into a plain per-layer KV cache —
the cache type mlx-lm's ``LRUPromptCache`` holds — samples the first token with the request's own
sampler from the log-probabilities (what ``BatchGenerator`` hands its samplers), sends it at once,
and hands the sequence on to the ``BatchGenerator`` with that cache (``insert(caches=...)``): it
continues there like a prompt-cache hit of its whole prompt, batched with whoever comes next.
Switched off by ``ServingOptions(fast_first_token=False)`` (agent flag ``--no-fast-first-token``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["applies", "first_token", "first_token_logprobs", "prefill", "MAX_PREFILL_TOKENS"]

#: The longest prefill the fast path does in one forward pass: mlx-lm's own prefill step
#: (``BatchGenerator(prefill_step_size=2048)``). Longer prompts are prefilled by the
#: BatchGenerator in steps, between which the MLX thread serves other revisions and commands.
MAX_PREFILL_TOKENS = 2048


def applies(enabled: bool, batch_size: int, tokens_to_prefill: int,
            max_prefill_tokens: int = MAX_PREFILL_TOKENS) -> bool:
    """Whether a request's first token takes the fast path: the flag is on, the revision's
    batch is empty (``batch_size`` sequences in it, 0) and its prompt needs at most
    ``max_prefill_tokens`` (>= 1) tokens of prefill after the prompt-cache hit."""
    return enabled and batch_size == 0 and 1 <= tokens_to_prefill <= max_prefill_tokens


def first_token(model: Any, tokens: Sequence[int], cache: list[Any],
                sampler: Callable[[Any], Any]) -> int:
    """Prefill ``tokens`` into ``cache`` (mlx-lm per-layer caches, extended in place) with one
    forward pass of ``model`` and return the next token id, sampled by ``sampler`` from the
    last position's log-probabilities. MLX thread only; raises what the model raises."""
    return first_token_logprobs(model, tokens, cache, sampler)[0]


def first_token_logprobs(model: Any, tokens: Sequence[int], cache: list[Any],
                         sampler: Callable[[Any], Any]) -> tuple[int, Any]:
    """:func:`first_token`, also returning the log-probabilities it sampled from (an evaluated
    ``mx.array`` of shape ``(vocab,)``, what mlx-lm's generation responses carry as
    ``logprobs``)."""
    import mlx.core as mx

    logits = model(mx.array(list(tokens))[None], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    y = sampler(logprobs)
    mx.eval(y, logprobs, [c.state for c in cache])
    return int(y.item()), logprobs[0]


def prefill(model: Any, tokens: Sequence[int], cache: list[Any],
            step_tokens: int = MAX_PREFILL_TOKENS) -> None:
    """Feed ``tokens`` into ``cache`` (extended in place) in forward passes of at most
    ``step_tokens``, evaluating the cache after each; no token is sampled. Used to prefill a
    prompt once for the ``n`` sequences of a request for ``n`` choices. MLX thread only."""
    import mlx.core as mx

    for i in range(0, len(tokens), step_tokens):
        model(mx.array(list(tokens[i:i + step_tokens]))[None], cache=cache)
        mx.eval([c.state for c in cache])
