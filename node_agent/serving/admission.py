"""Admission: whether one more request for a revision may be accepted, and when a refused client
should come back. Pure, over plain data (table-tested in ``tests/test_serving.py``).

Two bounds, chosen by the agent's ``--admission-policy`` (:data:`POLICIES`):

``count`` — every revision runs at most its ``max_concurrent_sequences`` (its *batch limit*)
sequences at once; the requests above that are *waiting*. A request for a revision whose batch
is full (in-flight >= batch limit) is refused when the requests waiting over all revisions
already number ``max_queued`` or more (:func:`admit`); a request that gets a batch slot at once
is always admitted.

``kv`` (the default) — the ``count`` bound, and also a bound on memory (:func:`admit_kv`): a
request that has to wait is refused when the estimated KV-cache bytes of its revision's running
and waiting requests plus its own would exceed the revision's *KV budget*:
:data:`KV_BUDGET_BATCHES` × the revision's KV reservation (what placement reserved for it:
``memory_estimate.kv_cache_bytes(bytes per token, max_context_tokens,
max_concurrent_sequences)``), i.e. the running batch at its limits plus as much again waiting. A
request's estimate is ``memory_estimate.kv_cache_bytes(bytes per token, prompt tokens +
max_tokens)`` (:func:`request_kv_bytes`), the same arithmetic as the revision's estimate. So
many long requests fill the queue sooner than many short ones: the queue holds about one
batch's worth of *work*, whatever the request count. A request that gets a batch slot at once is
admitted (its KV fits the reservation by construction).

A refused request is answered 429 with ``Retry-After`` (:func:`retry_after_seconds`): the time
the requests waiting ahead of it need to drain at the measured *drain rate* (requests completed
per second, :class:`DrainRate`), in whole seconds, at least 1, at most
:data:`MAX_RETRY_AFTER_SECONDS`.

No batching window: nothing here (or in the serving core) waits for a batch to fill. A request
admitted while its revision's queue is empty is handed to the MLX thread at once (the
``submit`` command; the thread blocks on its command queue only while no revision has work:
``ServingCore._run``) and inserted into the BatchGenerator at the very next step
(``Engine.step``), whose ``next()`` prefills whatever is waiting without a timer (mlx-lm 0.32
``BatchGenerator._next``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, TypeVar

from ..memory_estimate import kv_cache_bytes

__all__ = ["POLICIES", "DEFAULT_POLICY", "KV_BUDGET_BATCHES", "MAX_RETRY_AFTER_SECONDS",
           "Refusal", "waiting_requests", "admit", "request_kv_bytes", "kv_budget_bytes",
           "admit_kv", "retry_after_seconds", "DrainRate"]

K = TypeVar("K", bound=Hashable)

#: The admission policies (``--admission-policy``).
POLICIES = ("count", "kv")
#: On by default: it only refuses what the count bound alone would queue beyond the memory the
#: revision's batch was placed with.
DEFAULT_POLICY = "kv"
#: A revision's KV budget in units of its KV reservation: the running batch at its limits plus
#: one batch's worth waiting.
KV_BUDGET_BATCHES = 2
#: Upper bound of ``Retry-After`` (seconds): a drain rate measured on a few slow requests must
#: not tell clients to stay away for hours.
MAX_RETRY_AFTER_SECONDS = 60


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused. ``bound``: ``"count"`` or ``"kv"``; ``waiting``: requests
    waiting ahead of it (over all revisions for ``count``, its revision's for ``kv``);
    ``message``: human text with the numbers."""

    bound: str
    waiting: int
    message: str


def waiting_requests(inflight: Mapping[K, int], batch_limits: Mapping[K, int]) -> int:
    """Requests in flight beyond their revision's batch limit, summed over the revisions in
    ``batch_limits`` (in-flight counts of revisions not in it are ignored)."""
    return sum(max(0, n - batch_limits[k]) for k, n in inflight.items() if k in batch_limits)


def admit(key: K, inflight: Mapping[K, int], batch_limits: Mapping[K, int],
          max_queued: int, sequences: int = 1) -> Refusal | None:
    """The ``count`` bound: ``None`` when one more request for ``key`` may be admitted, else
    the :class:`Refusal`.

    ``inflight``: admitted, unfinished sequences per revision (a request for ``n`` choices
    counts ``n``); ``batch_limits``: each loaded revision's max concurrent sequences (must
    contain ``key``); ``sequences``: the new request's (its ``n``). It is refused when those of
    its sequences that would wait, added to the ones waiting, exceed ``max_queued`` (for one
    sequence: when ``max_queued`` already wait)."""
    limit = batch_limits[key]
    n = inflight.get(key, 0)
    if n + sequences <= limit:
        return None
    waiting = waiting_requests(inflight, batch_limits)
    would_wait = max(0, n + sequences - limit) - max(0, n - limit)
    if waiting + would_wait <= max_queued:
        return None
    return Refusal("count", waiting,
                   f"{waiting} requests are already waiting (limit {max_queued})")


def request_kv_bytes(bytes_per_token: int, prompt_tokens: int, max_tokens: int) -> int:
    """A request's KV-cache estimate in bytes once it runs to its ``max_tokens``:
    ``memory_estimate.kv_cache_bytes(bytes_per_token, prompt_tokens + max_tokens)``."""
    return kv_cache_bytes(bytes_per_token, prompt_tokens + max_tokens)


def kv_budget_bytes(bytes_per_token: int, max_context_tokens: int,
                    max_concurrent_sequences: int) -> int:
    """A revision's KV budget: :data:`KV_BUDGET_BATCHES` × its KV reservation
    (``memory_estimate.kv_cache_bytes(bytes_per_token, max_context_tokens,
    max_concurrent_sequences)``, the KV part of the estimate placement used)."""
    return KV_BUDGET_BATCHES * kv_cache_bytes(bytes_per_token, max_context_tokens,
                                              max_concurrent_sequences)


def admit_kv(need_bytes: int, running_bytes: Iterable[int], waiting_bytes: Iterable[int],
             *, slot_free: bool, budget_bytes: int) -> Refusal | None:
    """The ``kv`` bound for one revision: ``None`` when a request needing ``need_bytes``
    (:func:`request_kv_bytes`) may be admitted, else the :class:`Refusal`.

    ``running_bytes`` / ``waiting_bytes``: the estimates of the revision's requests in its
    batch and waiting for a slot; ``slot_free``: the request gets a batch slot at once (then it
    is admitted whatever the bytes); ``budget_bytes``: :func:`kv_budget_bytes` (0 or less: no
    bound, e.g. the model's KV size per token is unknown)."""
    if slot_free or budget_bytes <= 0:
        return None
    waiting = list(waiting_bytes)
    total = sum(running_bytes) + sum(waiting) + need_bytes
    if total <= budget_bytes:
        return None
    return Refusal("kv", len(waiting),
                   f"the running and waiting requests' KV cache would need {total} bytes with "
                   f"this one ({need_bytes}), above the model's budget of {budget_bytes} "
                   f"({len(waiting)} requests are waiting)")


def retry_after_seconds(waiting: int, drain_per_second: float | None) -> int:
    """``Retry-After`` in whole seconds for a request refused behind ``waiting`` requests:
    ``ceil(waiting / drain_per_second)`` — the time the queue ahead needs to drain at the
    measured rate (:class:`DrainRate`) —, clamped to [1, :data:`MAX_RETRY_AFTER_SECONDS`].
    No rate measured yet (``None`` or not > 0): 1."""
    if drain_per_second is None or not drain_per_second > 0:
        return 1
    seconds = math.ceil(max(0, waiting) / drain_per_second)
    return max(1, min(MAX_RETRY_AFTER_SECONDS, seconds))


class DrainRate:
    """Requests completed per second while busy: an exponentially weighted moving average of
    samples ``completions ÷ busy seconds``, one sample per ``window_seconds`` of busy time (and
    one when the work runs out), new sample weight ``weight``. Idle time is not counted: the
    clock starts at :meth:`busy` (the first request of a busy period), so the rate measures
    what the revision drains under load, not how often requests arrive. Times are seconds of
    one monotonic clock, passed in (pure).
    """

    def __init__(self, window_seconds: float = 1.0, weight: float = 0.3) -> None:
        if not window_seconds > 0 or not 0 < weight <= 1:
            raise ValueError("window_seconds must be > 0 and weight in (0, 1]")
        self.window_seconds = window_seconds
        self.weight = weight
        self.per_second: float | None = None   # None until the first sample
        self._since: float | None = None       # start of the current sample (None: idle)
        self._count = 0

    def busy(self, now: float) -> None:
        """Work arrived; starts the clock if it was idle."""
        if self._since is None:
            self._since, self._count = now, 0

    def idle(self) -> None:
        """Nothing is in flight any more (the last request was cancelled, not completed): the
        clock stops; an unfinished sample is dropped."""
        self._since = None

    def completed(self, now: float, *, idle_after: bool) -> None:
        """One request completed at ``now``; ``idle_after``: nothing is left in flight."""
        if self._since is None:
            self._since, self._count = now, 0
        self._count += 1
        elapsed = now - self._since
        if elapsed >= self.window_seconds or (idle_after and elapsed > 0):
            sample = self._count / elapsed
            self.per_second = sample if self.per_second is None else (
                self.weight * sample + (1 - self.weight) * self.per_second)
            self._since, self._count = now, 0
        if idle_after:
            self._since = None
