"""One forward pass of an embedding model over a batch of token lists, on the MLX thread.

The batch is *right*-padded to its longest input and run through the model body without a KV
cache (``model.model(ids)``: mlx-lm's model classes — ``llama``, ``qwen3`` and the other
decoders — return the final-normed hidden states ``(batch, tokens, hidden)`` from their inner
model; the outer ``Model`` adds only the LM head). Every mlx-lm decoder attends causally when
no cache is given (``create_attention_mask`` → ``"causal"``), so a real token never attends to
the padding after it and keeps its position: its hidden state is the one it has when the input
runs alone (up to float rounding of the batched matmuls). Pooling then reads only real
positions (:mod:`node_agent.serving.embed_profile`): the last real token (Qwen3-Embedding's
``last_token_pool``), the mean over real tokens, or the first token; then L2 normalisation in
float32 where the profile asks for it.

Memory: no cache outlives the pass; its transient keys and values are those of one batch
(inputs × padded length), what the revision's memory estimate reserves as its KV term.
"""

from __future__ import annotations

from typing import Any, Sequence

from .embed_profile import EmbeddingProfile

__all__ = ["embed_batch", "has_body"]

#: The token id the padding positions hold (any valid id: no real position attends to them).
PAD_ID = 0


def has_body(model: Any) -> bool:
    """``model`` has the inner module :func:`embed_batch` takes hidden states from."""
    return callable(getattr(model, "model", None))


def embed_batch(model: Any, batch: Sequence[Sequence[int]], profile: EmbeddingProfile) -> Any:
    """The pooled (and, per ``profile``, L2-normalised) vectors of ``batch`` (token lists, each
    non-empty) as a float32 numpy array ``(len(batch), profile.dimensions)``. MLX thread only."""
    import mlx.core as mx
    import numpy as np

    lengths = [len(ids) for ids in batch]
    width = max(lengths)
    padded = mx.array([list(ids) + [PAD_ID] * (width - len(ids)) for ids in batch],
                      dtype=mx.int32)
    hidden = model.model(padded)                         # (batch, width, hidden)
    n = mx.array(lengths, dtype=mx.int32)
    if profile.pooling == "lasttoken":
        pooled = hidden[mx.arange(len(batch)), n - 1]
    elif profile.pooling == "cls_token":
        pooled = hidden[:, 0]
    else:  # mean_tokens: the real positions only
        real = mx.arange(width)[None, :] < n[:, None]
        pooled = (mx.where(real[..., None], hidden, 0).astype(mx.float32).sum(axis=1)
                  / n[:, None].astype(mx.float32))
    pooled = pooled.astype(mx.float32)
    if profile.normalize:
        norm = mx.linalg.norm(pooled, axis=-1, keepdims=True)
        pooled = pooled / mx.maximum(norm, 1e-12)
    mx.eval(pooled)
    return np.array(pooled, dtype=np.float32)
