"""Admission: whether one more request for a revision may be accepted. Pure, over plain data.

Every revision runs at most its ``max_concurrent_sequences`` (its *batch limit*) sequences at
once; the requests above that are *waiting*. A request for a revision whose batch is full
(in-flight >= batch limit) is refused when the requests waiting over all revisions already
number ``max_queued`` or more; a request that gets a batch slot at once is always admitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, TypeVar

__all__ = ["Refusal", "waiting_requests", "admit"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: ``waiting`` requests are already queued; retry after
    ``retry_after_seconds`` (>= 1: roughly how many batch generations the queue ahead needs)."""

    waiting: int
    retry_after_seconds: int


def waiting_requests(inflight: Mapping[K, int], batch_limits: Mapping[K, int]) -> int:
    """Requests in flight beyond their revision's batch limit, summed over the revisions in
    ``batch_limits`` (in-flight counts of revisions not in it are ignored)."""
    return sum(max(0, n - batch_limits[k]) for k, n in inflight.items() if k in batch_limits)


def admit(key: K, inflight: Mapping[K, int], batch_limits: Mapping[K, int],
          max_queued: int) -> Refusal | None:
    """``None`` when one more request for ``key`` may be admitted, else the :class:`Refusal`.

    ``inflight``: admitted, unfinished requests per revision; ``batch_limits``: each loaded
    revision's max concurrent sequences (must contain ``key``)."""
    limit = batch_limits[key]
    if inflight.get(key, 0) < limit:
        return None
    waiting = waiting_requests(inflight, batch_limits)
    if waiting < max_queued:
        return None
    return Refusal(waiting, max(1, waiting // max(1, limit)))
