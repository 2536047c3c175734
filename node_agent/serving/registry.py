"""Thread-side state of the resident model revisions, keyed by ``(model_id, revision)``.

The :class:`Registry` and every :class:`Resident` in it are changed only on the MLX thread. Each
revision's :class:`Stats` are plain ints written there too and are safe to read from any thread
(the event loop reads them for :meth:`ServingCore.active_sequences`, ``crashes``,
``memory_bytes`` ...) without touching MLX.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Iterator

from .generation import Request
from .types import ModelInfo, ModelKey

__all__ = ["Stats", "Resident", "Registry", "parameter_bytes"]


@dataclass
class Stats:
    """One revision's counters. ``active``: sequences in its BatchGenerator; ``queued``: requests
    waiting for a slot; ``peak_active``: largest ``active`` since load or the last limits change;
    ``crashes``: batch resets after MLX errors plus core failures that hit it (kept after unload
    until the revision is loaded again); ``weight_bytes`` / ``cache_bytes``: its parameters' and
    its prompt cache's bytes (0 once unloaded)."""

    active: int = 0
    queued: int = 0
    peak_active: int = 0
    crashes: int = 0
    weight_bytes: int = 0
    cache_bytes: int = 0

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes


def parameter_bytes(model: Any) -> int:
    """The bytes of ``model``'s parameters (every array in ``model.parameters()``)."""
    from mlx.utils import tree_flatten

    return sum(int(v.nbytes) for _, v in tree_flatten(model.parameters())
               if hasattr(v, "nbytes"))


class Resident:
    """One loaded revision: its model, tokenizer, BatchGenerator, prompt cache, the requests
    waiting for a batch slot (``pending``, FIFO), those in the batch (``active``, by mlx-lm
    uid) and, of those, the ones still in the generator's prompt stages (``prefilling``: uid →
    prompt tokens it has still to feed, in insertion order; see
    :mod:`node_agent.serving.prefill`)."""

    def __init__(self, info: ModelInfo, model: Any, tokenizer: Any, generator: Any,
                 prompt_cache: Any, stats: Stats) -> None:
        self.info = info
        self.model = model
        self.tokenizer = tokenizer
        self.generator = generator
        self.prompt_cache = prompt_cache
        self.stats = stats
        self.pending: collections.deque[Request] = collections.deque()
        self.active: dict[int, Request] = {}
        self.prefilling: dict[int, int] = {}
        # token id → (text, bytes) for logprobs (logprobs.TokenTexts), made on first use
        self.token_texts: Any = None

    @property
    def key(self) -> ModelKey:
        return self.info.key

    def has_work(self) -> bool:
        return bool(self.pending or self.active)

    def refresh_stats(self) -> None:
        """Copy the batch's occupancy and the prompt cache's size into :attr:`stats`."""
        s = self.stats
        s.active, s.queued = len(self.active), len(self.pending)
        if s.active > s.peak_active:
            s.peak_active = s.active
        s.cache_bytes = (int(getattr(self.prompt_cache, "nbytes", 0) or 0)
                         if self.prompt_cache is not None else 0)


class Registry:
    """The resident revisions in load order, and the stats of every revision seen."""

    def __init__(self) -> None:
        self._resident: dict[ModelKey, Resident] = {}
        self.stats: dict[ModelKey, Stats] = {}

    def __len__(self) -> int:
        return len(self._resident)

    def __iter__(self) -> Iterator[Resident]:
        """A snapshot: the registry may change while it is iterated."""
        return iter(list(self._resident.values()))

    def get(self, key: ModelKey) -> Resident | None:
        return self._resident.get(key)

    def new_stats(self, key: ModelKey, weight_bytes: int) -> Stats:
        """Fresh stats for a revision being loaded (its crash count starts over)."""
        stats = Stats(weight_bytes=weight_bytes)
        self.stats[key] = stats
        return stats

    def add(self, resident: Resident) -> None:
        self._resident[resident.key] = resident

    def pop(self, key: ModelKey) -> Resident | None:
        """Drop a revision; its stats stay, zeroed but for ``crashes`` and ``peak_active``."""
        resident = self._resident.pop(key, None)
        if resident is not None:
            s = resident.stats
            s.active = s.queued = s.weight_bytes = s.cache_bytes = 0
        return resident
