"""Constrained decoding: a grammar (:mod:`node_agent.serving.grammar`) compiled with llguidance
against a revision's tokenizer, applied to one sequence of mlx-lm's ``BatchGenerator`` as a
per-sequence logits processor (``BatchGenerator.insert(..., logits_processors=[[p]])``, mlx-lm
0.32): the other sequences of the batch are not masked.

Why llguidance (measured by ``benchmarks/constrained.py`` on the generated test model's
tokenizer, ``benchmarks/results/constrained-*.json``): outlines-core's mask is cheaper per token
(a lookup in an index precomputed per schema: ~1 µs against llguidance's ~4–12 µs there), but
that index is built over the whole vocabulary for every new schema, on the request's path (90–134 ms
for a ``maxLength: 400`` string on a 512-token vocabulary, growing with the vocabulary and the
schema), and its JSON-schema regex does not enforce integer ``minimum``/``maximum`` (it accepted
``{"age": 999}`` for ``maximum: 120``) — a silently unenforced keyword, the failure issue 20
forbids. llguidance computes masks lazily over a token trie (no per-schema precomputation:
~1–10 ms compiles), enforces the keywords OpenAI's structured outputs use (``anyOf``,
``$ref``/``$defs``, ``enum``/``const``, ``minItems``/``maxItems``, numeric bounds, string
``pattern``/``maxLength``, ``additionalProperties``) and *reports* the ones it does not
(``lenient: false``); its per-token mask is a small part of a constrained token's cost in the
batch step (below). xgrammar needs torch. Numbers: ``docs/node-agent.md`` (*Structured outputs
and tool calls*).

Where the time goes: :func:`compile_grammar` (tokenizer adaptation once per revision: ms for the
test model, about 1 s for a large vocabulary by llguidance's own account; grammar construction
per request) runs on the core's tokenizer pool, never on the MLX thread. :class:`GrammarProcessor`
runs on the MLX thread inside ``BatchGenerator``'s step, once per generated token of the
constrained sequence: it reads the token just sampled (``.item()``: the step waits for the
previous step's sampling instead of overlapping it), advances the matcher, computes the next
mask (llguidance, Rust) and masks the row's logits (``mx.where`` over the unpacked bitmask:
``llguidance.mlx``'s kernel is Metal-only, and this runs on Linux CPU and CUDA too). (Dispatching the step's
forward pass early, ``mx.async_eval(logits)`` right after the read, so that it runs while the
mask is computed, measured no better on the 2-core CPU: the forward pass then competes with the
mask for the cores; worth trying on a GPU.) What the other sequences of
the batch pay while a constrained one is in it: that lost overlap (once per step however many
sequences are constrained) and mlx-lm's per-row path (with any logits processor in the batch,
``GenerationBatch._step`` slices the logits row by row and concatenates them). A sequence whose
grammar is complete may only end: the mask then allows only the end-of-sequence tokens.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from typing import Any

from .errors import InvalidConstraint

__all__ = ["GrammarProcessor", "Constraint", "compile_grammar", "ll_tokenizer",
           "public_grammar_error"]

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
#: The llguidance tokenizer of each mlx-lm ``TokenizerWrapper`` (weak: gone with the revision).
_LL_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
#: Longest compile error passed on to the client.
_MAX_ERROR = 300
_ECHO = re.compile(r"^\s*\d+\s*\|")   # llguidance echoes the grammar: `   1 | start: ...`


def ll_tokenizer(tokenizer: Any) -> Any:
    """The ``llguidance.LLTokenizer`` of mlx-lm ``TokenizerWrapper`` ``tokenizer`` (its Hugging
    Face fast tokenizer, its end-of-sequence ids), built once per tokenizer (ms for the test
    model, about 1 s for a 150k vocabulary) — call it off the MLX thread."""
    with _LOCK:
        cached = _LL_TOKENIZERS.get(tokenizer)
        if cached is not None:
            return cached
    import llguidance.hf

    built = llguidance.hf.from_tokenizer(tokenizer._tokenizer,
                                         eos_token=sorted(tokenizer.eos_token_ids))
    with _LOCK:
        return _LL_TOKENIZERS.setdefault(tokenizer, built)


def public_grammar_error(message: str) -> str:
    """llguidance's compile error without its echo of the grammar and position prefix, cut to
    :data:`_MAX_ERROR` characters."""
    lines = []
    for line in message.splitlines():
        if _ECHO.match(line):
            break
        lines.append(line.strip())
    text = " ".join(x for x in lines if x)
    text = re.sub(r"^at \d+\(\d+\): ", "", text)
    text = text.replace("failed to compile JSON schema: ", "")
    return text[:_MAX_ERROR] or "the grammar cannot be compiled"


class Constraint:
    """A compiled grammar for one request: :meth:`processor` makes the sequence's logits
    processor. ``grammar``: the llguidance grammar text; ``eos_ids``: the tokens that end it."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: list[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def processor(self) -> "GrammarProcessor":
        return GrammarProcessor(self.matcher, self.vocab_size, self.eos_ids)

    def copy(self) -> "Constraint":
        """The same compiled grammar with a matcher of its own, at the start (llguidance's
        ``deep_copy``: no second compile) — for each further sequence of a request's ``n``."""
        return Constraint(self.matcher.deep_copy(), self.vocab_size, self.eos_ids)

    def error(self) -> str | None:
        """Why the matcher cannot go on (a token it refused, a parser limit such as
        llguidance's per-token lexer fuel), or None. The engine then ends the request as
        failed instead of answering output that may not match the grammar."""
        return self.matcher.get_error() if self.matcher.is_error() else None


def compile_grammar(tokenizer: Any, grammar: str, param: str) -> Constraint:
    """Compile ``grammar`` for mlx-lm ``TokenizerWrapper`` ``tokenizer`` (tokenizer pool only:
    the first call per tokenizer adapts it, see :func:`ll_tokenizer`). Raises
    :class:`InvalidConstraint` naming ``param`` (the request field the grammar came from) with
    llguidance's reason — an unsupported schema keyword, a bad pattern — never ignoring it;
    also when llguidance cannot take the model's tokenizer (a slow tokenizer, a broken
    ``tokenizer.json``: the capabilities then claim no structured outputs, so only a request
    that reached here anyway meets it), never a bare exception (a 500)."""
    from llguidance import LLMatcher

    try:
        llt = ll_tokenizer(tokenizer)
    except Exception as e:  # noqa: BLE001 - any adaptation failure: constraints unavailable
        log.info("llguidance cannot build a tokenizer for this model (%s: %s)",
                 type(e).__name__, e)
        raise InvalidConstraint(param, "constrained decoding is not available for this "
                                "model (its tokenizer cannot be adapted)") from e
    matcher = LLMatcher(llt, grammar, log_level=0)  # one compile; its error is the reason
    if matcher.is_error():
        raise InvalidConstraint(param, public_grammar_error(matcher.get_error()))
    return Constraint(matcher, llt.vocab_size, sorted(tokenizer.eos_token_ids))


class GrammarProcessor:
    """mlx-lm logits processor ``(tokens, logits) -> logits`` for one sequence: masks every
    token the grammar does not allow next to ``-inf``. ``tokens``: the sequence's tokens so far
    (mlx-lm's token context, its last element the token sampled at the previous step — or the
    last prompt token at the first call); ``logits``: shape ``(1, model vocab)``.

    ``seconds`` / ``calls``: time spent advancing the matcher, computing and applying masks, and
    how many (the per-token cost ``benchmarks/constrained.py`` reports); ``wait_seconds``: time
    spent waiting for the previous step's token (``.item()``: the step's loss of overlap). A
    matcher in error (a parser limit; a refused token cannot come through this mask) allows
    only the end-of-sequence tokens, so the sequence never runs on unconstrained, and the
    engine fails the request (:meth:`Constraint.error`)."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: list[int]) -> None:
        import llguidance.numpy as llnp

        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._bitmask = llnp.allocate_token_bitmask(1, vocab_size)
        self._fill = llnp.fill_next_token_bitmask
        self._started = False
        self.seconds = 0.0
        self.wait_seconds = 0.0
        self.calls = 0

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx
        import numpy as np

        t0 = time.perf_counter()
        if self._started:
            token = int(tokens[-1].item())
            t1 = time.perf_counter()
            self.wait_seconds += t1 - t0
            t0 = t1
            if not self.matcher.consume_token(token):
                log.warning("constrained decoding: token %d refused (%s)", token,
                            self.matcher.get_error())
        self._started = True
        n = logits.shape[-1]
        if self.matcher.is_error():
            allowed = np.zeros(n, dtype=bool)
            allowed[[e for e in self.eos_ids if e < n]] = True
        else:
            self._fill(self.matcher, self._bitmask)
            bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
            allowed = bits[:n].astype(bool)
            if allowed.shape[0] < n:   # model rows beyond the tokenizer: never allowed
                allowed = np.concatenate([allowed, np.zeros(n - allowed.shape[0], bool)])
        out = mx.where(mx.array(allowed)[None], logits, mx.array(-mx.inf, logits.dtype))
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out
