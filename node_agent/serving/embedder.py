"""One forward pass of an embedding model over a batch of token lists, on the MLX thread.

The batch is *right*-padded to its longest input and run through the model body
(``model.model(ids)``, without a KV cache up to mlx-lm's prefill step, in chunks over one
beyond it: mlx-lm's model classes — ``llama``, ``qwen3`` and the other
decoders — return the final-normed hidden states ``(batch, tokens, hidden)`` from their inner
model; the outer ``Model`` adds only the LM head). Every mlx-lm decoder attends causally
(``create_attention_mask``: ``"causal"`` without a cache, the cache's causal mask from its
offset with one), so a real token never attends to the padding after it and keeps its position: its hidden state is the one it has when the input
runs alone (up to float rounding of the batched matmuls). Pooling then reads only real
positions (:mod:`node_agent.serving.embed_profile`): the last real token (Qwen3-Embedding's
``last_token_pool``), the mean over real tokens, or the first token; then L2 normalisation in
float32 where the profile asks for it.

Memory: no cache outlives the pass; its transient keys and values are those of one batch
(inputs × padded length), what the revision's memory estimate reserves as its KV term, and
attention spans at most one prefill step of queries at a time.
"""

from __future__ import annotations

from typing import Any, Sequence

from .embed_profile import EmbeddingProfile
from .prefill import MLX_LM_PREFILL_STEP_TOKENS

__all__ = ["embed_batch", "has_body"]

#: The token id the padding positions hold (any valid id: no real position attends to them).
PAD_ID = 0


def has_body(model: Any) -> bool:
    """``model`` has the inner module :func:`embed_batch` takes hidden states from."""
    return callable(getattr(model, "model", None))


def embed_batch(model: Any, batch: Sequence[Sequence[int]], profile: EmbeddingProfile, *,
                step_tokens: int = MLX_LM_PREFILL_STEP_TOKENS) -> Any:
    """The pooled (and, per ``profile``, L2-normalised) vectors of ``batch`` (token lists, each
    non-empty) as a float32 numpy array ``(len(batch), profile.dimensions)``. MLX thread only.

    A batch longer than ``step_tokens`` (mlx-lm's prefill step, 2048) runs in chunks of that
    many positions over a KV cache of the batch (``make_prompt_cache``; freed on return), as
    mlx-lm prefills a prompt, so attention never spans more than ``step_tokens`` queries at once;
    each chunk's hidden states are pooled as they come (the last real token of a row falls in one
    chunk; the mean sums over chunks)."""
    import mlx.core as mx
    import numpy as np

    lengths = [len(ids) for ids in batch]
    width = max(lengths)
    padded = mx.array([list(ids) + [PAD_ID] * (width - len(ids)) for ids in batch],
                      dtype=mx.int32)
    n = mx.array(lengths, dtype=mx.int32)
    rows = mx.arange(len(batch))
    cache = None
    if width > step_tokens:
        from mlx_lm.models.cache import make_prompt_cache
        cache = make_prompt_cache(model)
    pooled: Any = None
    for start in range(0, width, step_tokens):
        chunk = padded[:, start:start + step_tokens]
        hidden = model.model(chunk, cache=cache)          # (batch, chunk, hidden)
        size = hidden.shape[1]
        if profile.pooling == "lasttoken":
            last = n - 1 - start                          # the row's last real position here
            here = (last >= 0) & (last < size)
            got = hidden[rows, mx.clip(last, 0, size - 1)].astype(mx.float32)
            # (a row whose last token lies in a later chunk is overwritten there)
            pooled = got if pooled is None else mx.where(here[:, None], got, pooled)
        elif profile.pooling == "cls_token":
            if pooled is None:
                pooled = hidden[:, 0].astype(mx.float32)
        else:  # mean_tokens: the real positions only
            real = (mx.arange(start, start + size)[None, :] < n[:, None])
            part = mx.where(real[..., None], hidden, 0).astype(mx.float32).sum(axis=1)
            pooled = part if pooled is None else pooled + part
        if cache is not None:   # one chunk at a time: its graph evaluated before the next
            mx.eval(pooled, [c.state for c in cache])
    if profile.pooling == "mean_tokens":
        pooled = pooled / n[:, None].astype(mx.float32)
    if profile.normalize:
        norm = mx.linalg.norm(pooled, axis=-1, keepdims=True)
        pooled = pooled / mx.maximum(norm, 1e-12)
    mx.eval(pooled)
    return np.array(pooled, dtype=np.float32)
