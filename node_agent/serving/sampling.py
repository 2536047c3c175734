"""Per-request samplers: shared per (temperature, top_p) when unseeded, private when seeded.

mlx-lm (0.32, ``BatchGenerator``'s step in ``mlx_lm/generate.py``) samples the whole batch in one
call only when every sequence holds the very same sampler object (an ``is`` check), so unseeded
requests with equal parameters share one sampler (an LRU of the last 64; every greedy request
shares one). A seeded request gets a sampler of its own that draws from random keys derived from
its seed, never from MLX's global random state. Called on the MLX thread only.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from typing import Any, Callable

__all__ = ["SamplerCache", "seeded_sampler", "choice_seed"]

_SAMPLER_CACHE_ENTRIES = 64


class SamplerCache:
    """The sampler for a request's parameters (see the module docstring)."""

    def __init__(self, entries: int = _SAMPLER_CACHE_ENTRIES) -> None:
        self._entries = entries
        self._samplers: collections.OrderedDict[tuple[float, float], Any] = (
            collections.OrderedDict())

    def get(self, temperature: float, top_p: float, seed: int | None) -> Any:
        """The sampler for these parameters: shared per (temperature, top_p) when unseeded."""
        from mlx_lm.sample_utils import make_sampler

        top_p = top_p if 0.0 < top_p < 1.0 else 1.0
        if temperature > 0 and seed is not None:
            return seeded_sampler(temperature, top_p, seed)
        key = (temperature, top_p) if temperature > 0 else (0.0, 1.0)  # greedy ignores top_p
        sampler = self._samplers.get(key)
        if sampler is None:
            sampler = make_sampler(key[0], top_p=key[1] if key[1] < 1.0 else 0.0)
            self._samplers[key] = sampler
            if len(self._samplers) > self._entries:
                self._samplers.popitem(last=False)
        else:
            self._samplers.move_to_end(key)
        return sampler


def seeded_sampler(temperature: float, top_p: float, seed: int) -> Callable[[Any], Any]:
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


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request for ``n`` choices with ``seed``: ``seed``
    itself for choice 0 (so ``n`` = 1 and the first of ``n`` choices draw alike), else the
    first 63 bits of ``blake2b("<seed>:<index>")`` — distinct per choice, so the choices are
    distinct draws, and the same for the same seed. ``None`` stays ``None``."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
