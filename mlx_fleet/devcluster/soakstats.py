"""The arithmetic of a soak (``benchmarks/soak.py``): plain functions over plain data.

* :func:`classify` — one request's :class:`~mlx_fleet.devcluster.loadgen.Outcome` →
  ``succeeded``, ``failed_clean`` (the client was told at once that it failed: an HTTP error
  answer, an error event in the stream, a refused or broken connection) or ``lost`` (the client
  was not told: no end within the request timeout, or a stream that stopped without ``[DONE]``
  and without an error — an answer silently cut short).
* :func:`phase_summary` — requests by phase (the phase in which each *ended*: a request in
  flight when the fault struck counts for the fault's phase, not for the baseline before it;
  one in flight when the fleet recovered counts after it): counts of each class and
  the p50/p95 end-to-end latency and p95 time to first token of the succeeded ones (seconds;
  numpy's linear-interpolation percentile).
* :func:`slope` — least-squares slope of ``(t, value)`` samples (``statistics.linear_regression``):
  the agents' RSS growth in bytes per second.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np

from mlx_fleet.devcluster.loadgen import Outcome

__all__ = ["Phase", "classify", "phase_summary", "percentile", "slope", "CLEAN_KINDS",
           "LOST_KINDS"]

Class = Literal["succeeded", "failed_clean", "lost"]
#: ``Outcome.error_kind`` values of a failure the client was told about at once.
CLEAN_KINDS = frozenset({"http", "stream_error", "connection", "no_endpoint"})
#: ``Outcome.error_kind`` values of a request that never properly ended.
LOST_KINDS = frozenset({"timeout", "incomplete"})


def classify(o: Outcome) -> Class:
    """See the module docstring. An unknown ``error_kind`` counts as lost (never hide one)."""
    if not o.failed:
        return "succeeded"
    return "failed_clean" if o.error_kind in CLEAN_KINDS else "lost"


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``xs``; None when empty."""
    return float(np.percentile(xs, q)) if len(xs) else None


Phase = tuple[str, float, float]  # name, start, end (time.monotonic(); start inclusive, end
#                                    exclusive)


def phase_summary(outcomes: Iterable[Outcome], phases: Sequence[Phase]) -> dict[str, dict]:
    """Per phase (a request belongs to the phase its ``ended`` falls in; requests outside
    every phase are left out): ``sent``, ``succeeded``, ``failed_clean``, ``lost``,
    ``error_kinds`` (kind → count), ``p50_latency_seconds``, ``p95_latency_seconds``,
    ``p95_ttft_seconds`` (of the succeeded requests; None without any), ``seconds`` (length)."""
    out: dict[str, dict] = {}
    by_phase: dict[str, list[Outcome]] = {name: [] for name, _, _ in phases}
    for o in outcomes:
        for name, start, end in phases:
            if start <= o.ended < end:
                by_phase[name].append(o)
                break
    for name, start, end in phases:
        os_ = by_phase[name]
        classes = Counter(classify(o) for o in os_)
        ok = [o for o in os_ if not o.failed]
        latencies = [o.ended - o.started for o in ok]
        ttfts = [t for o in ok if (t := o.ttft_seconds) is not None]
        out[name] = {
            "seconds": round(end - start, 3), "sent": len(os_),
            "succeeded": classes["succeeded"], "failed_clean": classes["failed_clean"],
            "lost": classes["lost"],
            "error_kinds": dict(sorted(Counter(o.error_kind for o in os_ if o.failed).items())),
            "p50_latency_seconds": percentile(latencies, 50),
            "p95_latency_seconds": percentile(latencies, 95),
            "p95_ttft_seconds": percentile(ttfts, 95),
        }
    return out


def slope(samples: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(t, value)`` (value units per t unit); None with fewer than
    three samples or all at one time."""
    if len(samples) < 3:
        return None
    ts, vs = zip(*samples)
    if len(set(ts)) < 2:
        return None
    return statistics.linear_regression(ts, vs).slope
