"""Per-token log-probabilities of the sampled token and of the most likely ones (OpenAI's
``logprobs`` / ``top_logprobs``), gathered on the MLX thread for the requests that asked.

Which distribution: mlx-lm (0.32) hands every sequence's sampler the log-softmax of the model's
logits *after* the sequence's logits processors (``GenerationBatch._step``:
``logprobs = logits - logsumexp(logits)``); the sampler then applies ``temperature`` and
``top_p`` to it (``make_sampler`` / :func:`~node_agent.serving.sampling.seeded_sampler`). That
vector is what is reported: the model's own distribution — before temperature and top_p, after
any logits processor (a constrained-decoding mask puts disallowed tokens at ``-inf``) — which is
what OpenAI reports (its logprobs do not change with ``temperature``), and the one the sampled
token was drawn from before it was reshaped by the sampling parameters. So at ``temperature`` 0
the sampled token is always the first of the top list. ``-inf`` (a masked token) is reported as
:data:`MIN_LOGPROB`, OpenAI's own floor (JSON has no infinity).

Cost: nothing for a step none of whose sequences asked (no MLX op is added). For a step where
some did: one ``stack`` of their rows (already evaluated by mlx-lm), the top ``k`` (the largest
asked) by :func:`top_k_ids` (``O(vocab)`` per row, no sort), two gathers and one ``eval``; then
``k + 1`` floats and ids per row cross into Python, never the vocabulary-wide vector. Measured
in ``docs/node-agent.md`` (*Log-probabilities and n*).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["MIN_LOGPROB", "TOP_K_BLOCK", "top_k_ids", "TokenLogprob",
           "TopLogprob", "gather", "TokenTexts", "raw_bytes", "StepLogprobs"]

#: What a log-probability of ``-inf`` (a token a logits processor masked) is reported as:
#: OpenAI's ``-9999.0``.
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position: its ``text`` (the token decoded alone),
    ``bytes`` (that text's UTF-8 bytes) and natural-log ``logprob``."""

    text: str
    bytes: tuple[int, ...]
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token at one position and the ``top`` most likely tokens there (most likely
    first; ``()`` when ``top_logprobs`` is 0). ``token_id``: the sampled token's id."""

    token_id: int
    text: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[TopLogprob, ...]


def _finite(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB


#: Tokens per block of :func:`top_k_ids`' first stage.
TOP_K_BLOCK = 128


def top_k_ids(m: Any, k: int, block: int = TOP_K_BLOCK) -> Any:
    """The ids of the ``k`` largest entries of each row of ``m`` (``mx.array``, shape ``(rows,
    vocab)``, 1 <= k <= vocab), in no particular order: an ``mx.array`` ``(rows, k)``, lazy.

    In two stages when the vocabulary is large against ``k`` (``2 · k · block <= vocab``):
    the row but its last ``vocab mod block`` entries is cut into blocks of ``block``; the ``k``
    blocks with the largest maxima are kept, with those last entries, and ``argpartition`` picks
    the ``k`` largest among those ``k · block + tail`` candidates. Exact: an entry among the
    row's ``k`` largest lies in one of those ``k`` blocks (were its block not among them, ``k``
    blocks would each hold an entry at least as large, i.e. ``k`` others at least as large),
    so the values picked are the row's ``k`` largest (among equal values, which ids is
    unspecified, as with one ``argpartition``). Why: MLX's CPU ``argpartition`` over a whole
    vocabulary row costs tens of nanoseconds an entry (about 8 ms for 8 rows of 32 000 on the
    development CPU; the two stages about 0.5 ms), while a block maximum is one pass. Otherwise
    one ``argpartition`` of the rows."""
    import mlx.core as mx

    rows, vocab = m.shape
    nb = vocab // block
    if 2 * k * block > vocab:
        return mx.argpartition(-m, kth=k - 1, axis=-1)[:, :k]
    main = m[:, :nb * block].reshape(rows, nb, block)
    blocks = mx.argpartition(-main.max(axis=-1), kth=k - 1, axis=-1)[:, :k]
    cand = mx.take_along_axis(main, blocks[:, :, None], axis=1).reshape(rows, k * block)
    ids = (blocks[:, :, None].astype(mx.int32) * block
           + mx.arange(block, dtype=mx.int32)[None, None, :]).reshape(rows, k * block)
    if nb * block < vocab:
        cand = mx.concatenate([cand, m[:, nb * block:]], axis=-1)
        tail = mx.arange(nb * block, vocab, dtype=mx.int32)[None, :]
        ids = mx.concatenate([ids, mx.broadcast_to(tail, (rows, vocab - nb * block))], axis=-1)
    pick = mx.argpartition(-cand, kth=k - 1, axis=-1)[:, :k]
    return mx.take_along_axis(ids, pick, axis=-1)


def gather(rows: Sequence[tuple[Any, int, int]],
           stream: Any = None) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each ``(logprobs, token, k)`` — ``logprobs``: one sequence's log-probability vector
    over the vocabulary (an ``mx.array`` of shape ``(vocab,)``, as in mlx-lm's generation
    responses), ``token``: the sampled id, ``k``: top entries wanted (0..vocab) — returns
    ``(logprob of token, [(id, logprob)] of the k most likely, most likely first, ties by
    lower id)``. Log-probabilities below :data:`MIN_LOGPROB` (``-inf``) are reported as it.
    One MLX evaluation for all rows (see the module docstring); MLX thread only.

    ``stream``: the MLX stream to compute on (default: the current one). mlx-lm's
    ``BatchGenerator`` returns a step's (evaluated) rows while the next step's forward pass
    already runs asynchronously on the generation stream; evaluating there would wait for that
    pass. On a stream of its own the gather waits only for its rows."""
    import mlx.core as mx

    if not rows:
        return []
    if stream is not None:
        with mx.stream(stream):
            return gather(rows)
    m = mx.stack([r for r, _, _ in rows])
    if m.dtype != mx.float32:      # bf16/fp16 models: report float32 values
        m = m.astype(mx.float32)
    vocab = m.shape[-1]
    tokens = mx.array([t for _, t, _ in rows], dtype=mx.uint32)[:, None]
    chosen = mx.take_along_axis(m, tokens, axis=-1)[:, 0]
    kmax = min(max(k for _, _, k in rows), vocab)
    if kmax > 0:
        idx = (top_k_ids(m, kmax) if kmax < vocab
               else mx.broadcast_to(mx.arange(vocab), m.shape))
        vals = mx.take_along_axis(m, idx, axis=-1)
        mx.eval(chosen, idx, vals)
        idx_l, vals_l = idx.tolist(), vals.tolist()
    else:
        mx.eval(chosen)
        idx_l = vals_l = [[] for _ in rows]
    out = []
    for (_, _, k), c, ids, vs in zip(rows, chosen.tolist(), idx_l, vals_l):
        top = sorted(zip(ids, vs), key=lambda p: (-p[1], p[0]))[:k]
        out.append((_finite(c), [(i, _finite(v)) for i, v in top]))
    return out


class TokenTexts:
    """Token id → ``(text, bytes)`` of one tokenizer, memoised (at most one entry per
    vocabulary id). The text is the token decoded alone (``decode([id])``; a token that is
    only part of a multi-byte character decodes to U+FFFD). The bytes are the token's own bytes
    when ``raw(id)`` gives them (:func:`raw_bytes` of a byte-level BPE tokenizer: a partial
    character's real bytes, so that concatenated ``bytes`` rebuild the text, which is what
    OpenAI's ``bytes`` field is for), else the text's UTF-8 bytes (what vLLM gives)."""

    def __init__(self, decode: Callable[[list[int]], str],
                 raw: Callable[[int], bytes | None] | None = None) -> None:
        self._decode = decode
        self._raw = raw
        self._memo: dict[int, tuple[str, tuple[int, ...]]] = {}

    def __call__(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        hit = self._memo.get(token_id)
        if hit is None:
            text = self._decode([token_id])
            raw = self._raw(token_id) if self._raw is not None else None
            hit = self._memo[token_id] = (
                text, tuple(raw if raw is not None else text.encode("utf-8", "replace")))
        return hit

    def entry(self, token_id: int, logprob: float,
              top: Sequence[tuple[int, float]]) -> TokenLogprob:
        """A :class:`TokenLogprob` from :func:`gather`'s ids and values."""
        text, raw = self(token_id)
        return TokenLogprob(token_id, text, raw, logprob,
                            tuple(TopLogprob(*self(i), v) for i, v in top))


def raw_bytes(tokenizer: Any) -> Callable[[int], bytes | None] | None:
    """Token id → the token's bytes, for an mlx-lm tokenizer whose streaming detokenizer is
    the byte-level BPE one (GPT-2's byte-to-unicode map, ``mlx_lm.tokenizer_utils``); ``None``
    for other tokenizers (then :class:`TokenTexts` encodes the decoded text). A symbol outside
    the byte map (an added token) is taken as its UTF-8 text, as mlx-lm's detokenizer does."""
    try:
        from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder
    except ImportError:  # another mlx-lm: fall back to the text's bytes
        return None
    detok = getattr(tokenizer, "_detokenizer", None)
    if not isinstance(detok, BPEStreamingDetokenizer):
        return None
    tokenmap, table = detok.tokenmap, _byte_decoder()

    def raw(token_id: int) -> bytes | None:
        if not 0 <= token_id < len(tokenmap) or tokenmap[token_id] is None:
            return None
        out = bytearray()
        for c in tokenmap[token_id]:
            b = table.get(c)
            out.extend(bytes([b]) if b is not None else c.encode("utf-8"))
        return bytes(out)

    return raw


class StepLogprobs:
    """The engine's gathering of one step's log-probabilities, on the MLX thread only: for the
    sequences of a revision's batch that asked (a request's ``logprobs`` is its ``k``), their
    :class:`TokenLogprob` entries, with the revision's memoised token texts
    (``res.token_texts``, made on first use). ``stream``: the MLX stream it gathers on, made on
    first use (see :meth:`entries`)."""

    def __init__(self) -> None:
        self.stream: Any = None

    def of_step(self, res: Any, responses: Any) -> dict[int, TokenLogprob]:
        """The log-probabilities of this step's tokens (mlx-lm ``GenerationBatch`` responses of
        ``res``, a :class:`~node_agent.serving.registry.Resident`) for the sequences that asked,
        by uid; ``{}`` (and no MLX op) when none did.
        An end-of-sequence token (mlx-lm ``finish_reason`` ``"stop"``) has none: it is no part
        of the text."""
        asked = []
        for r in responses:
            req = res.active.get(r.uid)
            if req is not None and req.logprobs is not None and r.finish_reason != "stop":
                asked.append((r, req.logprobs))
        if not asked:
            return {}
        return dict(zip((r.uid for r, _ in asked),
                        self.entries(res, [(r.logprobs, r.token, k) for r, k in asked])))

    def entries(self, res: Any, rows: list[tuple[Any, int, int]]) -> list[TokenLogprob]:
        """:func:`gather` of ``rows`` (``(logprobs row, token, k)``) as token entries, with the
        revision's memoised token texts. On a GPU it is computed on a stream of its own
        (:attr:`stream`), so that its evaluation does not wait for the next step's
        forward pass, which mlx-lm has already started (the host's work on this step's tokens
        then still overlaps that pass). On the CPU it stays on the generation stream: a second
        stream there competes with the forward pass for the same cores (measured: tokens/s of 8
        streams with top_logprobs 5 fell 21–38 % with its own stream, 4–19 % without, on the
        2-core development machine)."""
        import mlx.core as mx

        if self.stream is None:
            device = mx.default_device()
            self.stream = (mx.default_stream(device) if device == mx.cpu
                           else mx.new_stream(device))
        if res.token_texts is None:
            res.token_texts = TokenTexts(res.tokenizer.decode, raw_bytes(res.tokenizer))
        texts = res.token_texts
        return [texts.entry(token, lp, top)
                for (_, token, _), (lp, top) in zip(rows, gather(rows, self.stream))]
