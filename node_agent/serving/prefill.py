"""How many waiting prompts one prefill forward pass takes: the serving core's prefill grouping.
Pure, over plain data (table-tested in ``tests/test_serving_prefill.py``).

mlx-lm's ``BatchGenerator`` (0.32) prefills the prompts waiting for a batch slot in groups of at
most ``prefill_batch_size`` (default 8; ``mlx_lm.server --prompt-concurrency``), one group per
``next()`` call, each group right-padded to its longest prompt and cut into chunks of
``prefill_step_size`` (2048) tokens. A burst of 32 short prompts therefore takes four prefill
passes, each with a decode step of the running batch and a merge of the new sequences' KV caches
into it between them, and the last group's first token waits for all four — on the lent H100 the
time to first token at 32 streams was of the order of the whole decode of a 128-token answer
(``benchmarks/results/serving-gpu-3.json``: TTFT p50 651 ms, inter-token gap 9.8 ms).

The core instead sizes each group by *tokens*: before every ``next()`` it sets the generator's
``prefill_batch_size`` to :func:`prefill_group_size` of the sequences in the generator's prompt
stages — those waiting for the prompt batch and those in it, with the prompt tokens each has
still to feed, which the engine follows from ``next()``'s prompt responses
(``Resident.prefilling``) — i.e. as many (first come, first served) as fit a budget of padded
prompt tokens per pass. The default budget, :data:`DEFAULT_PREFILL_BATCH_TOKENS` = 8 × 2048, is
the largest pass mlx-lm's defaults already make (8 prompts of 2048 tokens or more), so no pass
feeds more tokens — the activations, and how long it holds up the running batch's decoding —
than one mlx-lm would; short prompts simply share a pass instead of queueing behind one
another. (The budget counts the tokens a pass feeds, not the KV cache its sequences already
hold from a prompt-cache hit: that memory is the revision's KV budget's, see
:mod:`node_agent.serving.admission`.) A budget below 2048 can make long prompts go one per pass,
slower than mlx-lm's groups. ``ServingOptions(prefill_batch_tokens=0)`` (agent flag
``--prefill-batch-tokens 0``) leaves the generator at mlx-lm's fixed groups of
``min(``:data:`MLX_LM_PREFILL_BATCH_SIZE` ``, max_concurrent_sequences)`` (the engine then never
calls :func:`prefill_group_size`).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["MLX_LM_PREFILL_BATCH_SIZE", "MLX_LM_PREFILL_STEP_TOKENS",
           "DEFAULT_PREFILL_BATCH_TOKENS", "prefill_group_size"]

#: mlx-lm 0.32 ``BatchGenerator(prefill_batch_size=8)`` and ``mlx_lm.server
#: --prompt-concurrency``'s default: prompts prefilled together when grouping by count.
MLX_LM_PREFILL_BATCH_SIZE = 8
#: mlx-lm 0.32 ``BatchGenerator(prefill_step_size=2048)``: the longest chunk of one prompt that
#: one prefill pass processes (longer prompts take several passes).
MLX_LM_PREFILL_STEP_TOKENS = 2048
#: Padded prompt tokens one prefill pass may process: the largest pass mlx-lm's defaults make.
DEFAULT_PREFILL_BATCH_TOKENS = MLX_LM_PREFILL_BATCH_SIZE * MLX_LM_PREFILL_STEP_TOKENS


def prefill_group_size(waiting: Sequence[int], free_slots: int, *, batch_tokens: int,
                       step_tokens: int = MLX_LM_PREFILL_STEP_TOKENS) -> int:
    """The ``prefill_batch_size`` to give the generator for its next prefill pass.

    ``waiting``: the prompt tokens each sequence in the generator's prompt stages has still to
    feed, in the order the generator takes them (those already in the prompt batch first, then
    those waiting for it, first inserted first; a sequence whose prompt is fed but for its last
    token counts 1 until the generator moves it to the generation batch). ``free_slots``: how
    many sequences the revision's batch may hold beyond those decoding
    (``max_concurrent_sequences`` − sequences past their prompt). ``batch_tokens``: the
    padded-token budget of one pass (>= 1).

    Returns the largest ``n`` such that the first ``n`` sequences' pass — ``n`` × the longest of
    their next chunks (``min(tokens, step_tokens)``), the right-padded shape mlx-lm builds — is at
    most ``batch_tokens``, capped by ``free_slots``; at least 1, so that a prompt alone over the
    budget still proceeds (in chunks of ``step_tokens``). Raises ``ValueError`` on a budget or a
    ``step_tokens`` below 1.
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if step_tokens < 1:
        raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
    n, longest = 0, 0
    for tokens in waiting[:max(free_slots, 1)]:
        chunk = max(1, min(tokens, step_tokens))
        longest = max(longest, chunk)
        if (n + 1) * longest > batch_tokens:
            break
        n += 1
    return max(n, 1)
