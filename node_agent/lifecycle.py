"""Idle-unload, eviction under memory pressure and predictive prefetch: plain functions over
plain data.

The issue: "A model with no request for idleUnloadSeconds (0 = never) is unloaded ... A
minReady-style pin keeps hot models resident; under memory pressure idle models are evicted
least-recently-used first ... Predictive prefetch: the agent keeps a short per-model usage
history and prefetches what its rule predicts will be needed within the prefetch window".

* :func:`idle_unloads` — which loaded models have been idle long enough to unload. Anchors:
  Ollama's ``keep_alive`` (default 5 min) and vllm-mlx's ``--auto-unload-idle-seconds``; the
  default here is :class:`mlx_fleet.contract.LifecyclePolicy`'s 300 s (seed 001:
  ``idle_timeout_sec: 300``), 0 = never.
* :func:`evictions` — which idle models to unload, least recently used first, to make room for
  a load — its memory and, under the node's limit on loaded models (seed 004: "Per-worker max
  loaded models: 2"), its place in the count; ``None`` when even all of them are not enough
  (the caller refuses with the numbers).
* :class:`UsageHistory` and :func:`predict_prefetch` — which unloaded models to load ahead of a
  request that a periodicity rule expects within the window (seed 001:
  ``prefetch_window_sec: 30``, ``max_prefetch_per_gpu: 2``).
* :func:`plan_convergence` — which assignments' convergence tasks to cancel and which to start
  (issue 6 §3: "The agent converges assignments concurrently (one slow download never blocks
  another assignment's load or unload)"): one task per assignment key, restarted when what it
  works towards changes, started again when a failed load's retry is due.

Pure: standard library and :mod:`mlx_fleet.contract` only. Time is an injected clock: every
``now``/``last_used``/timestamp is seconds of one monotonic clock chosen by the caller. Model
keys are any hashable, mutually ordered values (``str``, or tuples of ``str`` such as
``(namespace, name, revision)``); ties are broken by key order, so every result is
deterministic.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Any

from mlx_fleet.contract import LifecyclePolicy

__all__ = [
    "DEFAULT_BURST_SECONDS", "DEFAULT_HISTORY_EVENTS", "DEFAULT_IDLE_UNLOAD_SECONDS",
    "DEFAULT_MAX_PREFETCHES", "DEFAULT_MIN_ARRIVALS", "DEFAULT_PREFETCH_WINDOW_SECONDS",
    "DEFAULT_TOLERANCE", "ConvergePlan", "KeyState", "ModelUse", "UsageHistory", "evictions",
    "expected_arrival", "idle_unloads", "plan_convergence", "predict_prefetch",
]

#: Seconds without a request before a model is unloaded: the contract's default (seed 001
#: ``idle_timeout_sec: 300``; Ollama's ``keep_alive`` default is the same 5 minutes).
DEFAULT_IDLE_UNLOAD_SECONDS: float = LifecyclePolicy.model_fields["idle_unload_seconds"].default

#: How far ahead prefetch looks, seconds (seed 001 ``prefetch_window_sec: 30``).
DEFAULT_PREFETCH_WINDOW_SECONDS = 30.0

#: Most prefetches started per node per decision (seed 001 ``max_prefetch_per_gpu: 2``).
DEFAULT_MAX_PREFETCHES = 2

#: Request timestamps a :class:`UsageHistory` keeps per model (the oldest are dropped).
DEFAULT_HISTORY_EVENTS = 32

#: Requests less than this many seconds after the previous one belong to the same arrival
#: (a client's burst is one arrival for the periodicity rule).
DEFAULT_BURST_SECONDS = 1.0

#: Arrivals the periodicity rule looks at (the most recent ones; 4 arrivals = 3 gaps).
DEFAULT_MIN_ARRIVALS = 4

#: How far each gap may stray from the mean gap, as a share of it, for usage to count as
#: regular; also how late an expected arrival may be and still be predicted.
DEFAULT_TOLERANCE = 0.2


@dataclasses.dataclass(frozen=True)
class ModelUse:
    """What the lifecycle decisions need to know about one model (revision) on a node.

    ``key``: the model's identity (hashable, ordered). ``last_used``: clock seconds of its last
    request (start or end, whichever the caller records later). ``in_flight``: requests being
    served now (a model with any is never unloaded). ``idle_unload_seconds``: unload after this
    long idle, 0 = never (:class:`~mlx_fleet.contract.LifecyclePolicy`, default 300 s).
    ``pinned``: kept resident whatever happens (the minReady-style pin for hot models).
    ``resident_bytes``: memory it frees when unloaded. ``loaded``: resident now.

    Raises ``ValueError`` for negative ``in_flight``, ``idle_unload_seconds`` or
    ``resident_bytes``.
    """

    key: Hashable
    last_used: float
    in_flight: int = 0
    idle_unload_seconds: float = DEFAULT_IDLE_UNLOAD_SECONDS
    pinned: bool = False
    resident_bytes: int = 0
    loaded: bool = True

    def __post_init__(self) -> None:
        if self.in_flight < 0:
            raise ValueError(f"{self.key!r}: in_flight must be >= 0, got {self.in_flight}")
        if self.idle_unload_seconds < 0:
            raise ValueError(f"{self.key!r}: idle_unload_seconds must be >= 0 (0 = never), "
                             f"got {self.idle_unload_seconds}")
        if self.resident_bytes < 0:
            raise ValueError(f"{self.key!r}: resident_bytes must be >= 0, "
                             f"got {self.resident_bytes}")

    def idle_for(self, now: float) -> float:
        """Seconds since the last request (negative if ``last_used`` is after ``now``)."""
        return now - self.last_used


def _unique(models: Iterable[ModelUse]) -> list[ModelUse]:
    out = list(models)
    seen: set[Any] = set()
    for m in out:
        if m.key in seen:
            raise ValueError(f"model {m.key!r} is listed twice")
        seen.add(m.key)
    return out


def _lru_order(m: ModelUse) -> tuple[float, Any]:
    return (m.last_used, m.key)


def idle_unloads(models: Iterable[ModelUse], now: float) -> list[Hashable]:
    """Keys of the models to unload for idleness at ``now``, least recently used first.

    A model is unloaded when it is loaded, has no request in flight, is not pinned, its
    ``idle_unload_seconds`` is above 0 (0 = never) and it has been idle at least that long
    (``now - last_used >= idle_unload_seconds``). Raises ``ValueError`` for a key listed twice.
    """
    return [m.key for m in sorted(_unique(models), key=_lru_order)
            if m.loaded and m.in_flight == 0 and not m.pinned and m.idle_unload_seconds > 0
            and m.idle_for(now) >= m.idle_unload_seconds]


def evictions(models: Iterable[ModelUse], need_bytes: int, free_bytes: int, now: float, *,
              min_idle_seconds: float = 0.0, max_loaded_models: int = 0,
              resident: int | None = None) -> list[Hashable] | None:
    """Keys of the models to evict so that a load fits, least recently used first.

    ``need_bytes``: memory the caller wants to take (e.g. a load's estimate); ``free_bytes``:
    budget left now. Candidates are loaded, not pinned, with no request in flight and idle for
    at least ``min_idle_seconds`` at ``now`` (default 0: any model not serving; a positive value
    keeps a model that just finished a request from being thrashed). ``idle_unload_seconds``
    does not protect a model here — 0 means "no timed unload", not a pin (as Ollama evicts
    ``keep_alive: -1`` models when a load needs their memory); ``pinned`` does.

    The count constraint: with ``max_loaded_models`` above 0 (the node's limit on resident
    revisions, seed 004 "Per-worker max loaded models: 2"; 0 = no limit), the load must leave at
    most that many resident, itself included: ``resident - evicted + 1 <= max_loaded_models``.
    ``resident``: revisions resident now besides the one to load, including those that are not
    in ``models`` (draining, being loaded); default: the loaded ones in ``models``.

    Candidates are taken in order of ``last_used`` (then key) until both constraints hold:
    ``free_bytes`` plus their ``resident_bytes`` reach ``need_bytes``, and enough of them are
    gone for the count. Returns ``[]`` when the load already fits, ``None`` when even evicting
    every candidate is not enough (nothing should be evicted then; the caller refuses the load
    with the numbers — :func:`evictions` again with ``max_loaded_models=0`` tells whether memory
    alone would have been satisfied, i.e. which constraint failed). Raises ``ValueError`` for
    negative bytes, a negative limit or count, or a key listed twice.
    """
    if need_bytes < 0:
        raise ValueError(f"need_bytes must be >= 0, got {need_bytes}")
    if max_loaded_models < 0:
        raise ValueError(f"max_loaded_models must be >= 0 (0 = no limit), "
                         f"got {max_loaded_models}")
    listed = _unique(models)
    if resident is None:
        resident = sum(1 for m in listed if m.loaded)
    if resident < 0:
        raise ValueError(f"resident must be >= 0, got {resident}")
    candidates = [m for m in sorted(listed, key=_lru_order)
                  if m.loaded and not m.pinned and m.in_flight == 0
                  and m.idle_for(now) >= min_idle_seconds]

    def fits(free: int, count: int) -> bool:
        return free >= need_bytes and (max_loaded_models == 0 or count < max_loaded_models)

    chosen: list[Hashable] = []
    free, count = free_bytes, resident
    for m in candidates:
        if fits(free, count):
            break
        chosen.append(m.key)
        free += m.resident_bytes
        count -= 1
    return chosen if fits(free, count) else None


class UsageHistory:
    """A short per-model history of request timestamps (clock seconds).

    Keeps the latest ``max_events`` (default :data:`DEFAULT_HISTORY_EVENTS`) timestamps per
    model in ascending order; a timestamp older than ones already recorded is inserted in
    order (requests recorded out of order by concurrent handlers), and the oldest beyond the
    bound are dropped. Raises ``ValueError`` for ``max_events`` < 2.
    """

    def __init__(self, max_events: int = DEFAULT_HISTORY_EVENTS) -> None:
        if max_events < 2:
            raise ValueError(f"max_events must be >= 2, got {max_events}")
        self.max_events = max_events
        self._events: dict[Hashable, list[float]] = {}

    def record(self, key: Hashable, t: float) -> None:
        """Record a request for ``key`` at clock time ``t``."""
        events = self._events.setdefault(key, [])
        if not events or t >= events[-1]:
            events.append(t)
        else:
            bisect.insort(events, t)
        if len(events) > self.max_events:
            del events[:len(events) - self.max_events]

    def times(self, key: Hashable) -> tuple[float, ...]:
        """The recorded timestamps of ``key``, oldest first (empty if none)."""
        return tuple(self._events.get(key, ()))

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s history (the model is no longer assigned)."""
        self._events.pop(key, None)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._events))

    def __len__(self) -> int:
        return len(self._events)


def _arrivals(times: Iterable[float], burst_s: float) -> list[float]:
    out: list[float] = []
    previous: float | None = None
    for t in sorted(times):
        if previous is None or t - previous >= burst_s:
            out.append(t)
        previous = t
    return out


def expected_arrival(times: Iterable[float], *, min_arrivals: int = DEFAULT_MIN_ARRIVALS,
                     tolerance: float = DEFAULT_TOLERANCE,
                     burst_s: float = DEFAULT_BURST_SECONDS) -> tuple[float, float] | None:
    """The periodicity rule on one model's request timestamps: ``(next arrival, period)`` in
    clock seconds, or ``None`` when its usage is not regular.

    1. Requests less than ``burst_s`` after the previous request join its burst; each burst is
       one *arrival*, at the time of its first request.
    2. Take the latest ``min_arrivals`` arrivals (fewer: ``None``) and their gaps; the
       *period* is the mean gap.
    3. Usage is regular when every gap is within ``tolerance`` × period of the period
       (default ±20 %); then the next arrival is expected one period after the last arrival.

    Raises ``ValueError`` for ``min_arrivals`` < 3 (two gaps are the fewest that can show a
    regularity) or a negative tolerance or burst.
    """
    if min_arrivals < 3:
        raise ValueError(f"min_arrivals must be >= 3, got {min_arrivals}")
    if tolerance < 0 or burst_s < 0:
        raise ValueError("tolerance and burst_s must be >= 0")
    arrivals = _arrivals(times, burst_s)
    if len(arrivals) < min_arrivals:
        return None
    recent = arrivals[-min_arrivals:]
    gaps = [b - a for a, b in zip(recent, recent[1:])]
    period = sum(gaps) / len(gaps)
    if period <= 0 or any(abs(g - period) > tolerance * period for g in gaps):
        return None
    return recent[-1] + period, period


def predict_prefetch(history: UsageHistory, now: float, *, unloaded: Iterable[Hashable],
                     window_s: float = DEFAULT_PREFETCH_WINDOW_SECONDS,
                     max_prefetches: int = DEFAULT_MAX_PREFETCHES,
                     min_arrivals: int = DEFAULT_MIN_ARRIVALS,
                     tolerance: float = DEFAULT_TOLERANCE,
                     burst_s: float = DEFAULT_BURST_SECONDS) -> list[Hashable]:
    """Keys of the models to prefetch (load ahead of need) at ``now``, soonest expected first.

    The rule: a model in ``unloaded`` (assigned here but not resident) is predicted when its
    usage is periodic — its latest ``min_arrivals`` (default 4) arrivals, bursts under
    ``burst_s`` (1 s) counted once, are spaced by gaps within ``tolerance`` (±20 %) of their
    mean (:func:`expected_arrival`) — and its next arrival, one mean gap after the last one, is
    due within the window: ``now - tolerance × period <= expected <= now + window_s`` (an
    arrival a little late, within the same tolerance, is still expected; later the pattern is
    taken as broken). E.g. a job calling every 60 s, last at t = 100, is prefetched from
    t = 130 (window 30 s, seed 001) until t = 172.

    At most ``max_prefetches`` keys (seed 001: 2 per node; pass what is left of the node's
    allowance when prefetches are already running), ordered by expected arrival, then key.
    Whether a prediction fits in memory is the caller's decision (a prefetch must not evict).
    Raises ``ValueError`` for a negative window or cap (and as :func:`expected_arrival`).
    """
    if window_s < 0 or max_prefetches < 0:
        raise ValueError("window_s and max_prefetches must be >= 0")
    due: list[tuple[float, Any]] = []
    for key in set(unloaded):
        got = expected_arrival(history.times(key), min_arrivals=min_arrivals,
                               tolerance=tolerance, burst_s=burst_s)
        if got is None:
            continue
        expected, period = got
        if now - tolerance * period <= expected <= now + window_s:
            due.append((expected, key))
    due.sort()
    return [key for _, key in due[:max_prefetches]]


@dataclasses.dataclass(frozen=True)
class KeyState:
    """One assignment key as :func:`plan_convergence` sees it (plain values compared with ``==``).

    ``desired``: the assignment wanted now (None: not assigned here any more). ``target``: the
    part of it whose change must restart work under way — source, serving limits, served name —
    (None when not assigned); a change elsewhere (generation, role) lets the running task finish
    and is picked up after it. ``busy``: a task of the key runs now; ``running``: the target it
    works towards (None: it retires the key). ``done``: the desired value the key's last
    finished task converged to (None: none did, or what it did must be done again).
    ``retry_at``: clock seconds of the retry of a failed load of the current target (None: none
    pending, or the failure is permanent).
    """

    desired: Any = None
    target: Any = None
    busy: bool = False
    running: Any = None
    done: Any = None
    retry_at: float | None = None


@dataclasses.dataclass(frozen=True)
class ConvergePlan:
    """What the converge dispatcher does now. ``cancel``: keys whose running task works towards
    a target that is no longer wanted (changed or unassigned); ``start``: keys that get a new
    task — each started only once the key's previous task has ended, so a key's work never
    interleaves; ``wake_at``: clock seconds of the earliest retry still to come (None: none)."""

    cancel: tuple[Hashable, ...] = ()
    start: tuple[Hashable, ...] = ()
    wake_at: float | None = None


def plan_convergence(keys: Mapping[Hashable, KeyState], now: float) -> ConvergePlan:
    """Per assignment key, whether to cancel its task and whether to start one, at ``now``.

    The rule, for each key (one task per key, keys independent of each other, so a slow
    download of one never holds up another's load, unload or unassignment):

    1. a task loads a target that is no longer the key's (its source, limits or name changed,
       or the key was unassigned): cancel it and start a new one — it loads the new target, or
       retires the key (drains what is loaded, deletes the report);
    2. any other running task (one loading the current target, or one retiring the key) is
       left to finish; what changed meanwhile is picked up by rule 3 once it has ended;
    3. no task runs: start one when ``desired`` ≠ ``done`` (new, changed or unassigned since
       the last task), or when a retry is due (``retry_at`` ≤ ``now``); a retry still to come
       sets ``wake_at``.

    Keys in ``cancel`` and ``start`` are in key order (deterministic). Raises ``ValueError``
    for a ``retry_at`` that is not a finite number.
    """
    cancel: list[Hashable] = []
    start: list[Hashable] = []
    wake: list[float] = []
    for key in sorted(keys):  # type: ignore[type-var]
        k = keys[key]
        if k.retry_at is not None and not math.isfinite(k.retry_at):
            raise ValueError(f"{key!r}: retry_at must be finite, got {k.retry_at}")
        if k.busy:
            if k.running is not None and k.running != k.target:
                cancel.append(key)
                start.append(key)
            continue
        if k.desired != k.done:
            start.append(key)
        elif k.retry_at is not None:
            if k.retry_at <= now:
                start.append(key)
            else:
                wake.append(k.retry_at)
    return ConvergePlan(tuple(cancel), tuple(start), min(wake) if wake else None)
