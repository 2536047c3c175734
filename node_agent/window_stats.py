"""Cumulative per-revision counters that the agent writes as a :class:`StatsReport`.

While a Canary runs, each agent writes ``<root>/stats/<node>/<namespace>/<deployment>`` "at most
once per ``stats_interval_seconds`` (plus once at a guard trip)" (:class:`StatsReport`); the
operator merges every node's cumulative counters and differences them between analyses. The
histograms use the contract's fixed bounds (:data:`LATENCY_BOUNDS_SECONDS`,
:data:`TOKENS_PER_SECOND_BOUNDS`) so that they merge exactly.

Pure: standard library and :mod:`mlx_fleet.contract` only; the caller passes ``now`` (seconds
since the epoch) to every call that needs time.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence

from mlx_fleet.contract import (LATENCY_BOUNDS_SECONDS, TOKENS_PER_SECOND_BOUNDS, Histogram,
                                RevisionStats, StatsReport)

__all__ = ["histogram_observe", "tokens_per_second", "RevisionCounters", "DeploymentStats"]


def histogram_observe(bounds: Sequence[float], counts: Sequence[int], value: float) -> list[int]:
    """``counts`` with one more observation of ``value`` (a new list; the input is unchanged).

    Buckets as in :class:`Histogram`: ``counts[i]`` holds values ``<= bounds[i]`` and
    ``> bounds[i-1]``, ``counts[len(bounds)]`` those above the last bound; ``bounds`` ascending,
    ``len(counts) == len(bounds) + 1``. Raises ``ValueError`` for NaN.
    """
    if math.isnan(value):
        raise ValueError("cannot observe NaN")
    out = list(counts)
    out[bisect.bisect_left(bounds, value)] += 1
    return out


def tokens_per_second(completion_tokens: int, decode_seconds: float | None) -> float | None:
    """A sequence's decode rate: ``(completion_tokens - 1) / decode_seconds``, the tokens after
    the first over the time from first to last token; ``None`` unless ``completion_tokens >= 2``
    and ``decode_seconds > 0`` (:class:`RevisionStats`: "for requests with at least two
    tokens")."""
    if completion_tokens < 2 or decode_seconds is None or not decode_seconds > 0:
        return None
    return (completion_tokens - 1) / decode_seconds


class _Hist:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.total = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts = histogram_observe(self.bounds, self.counts, value)
        self.total += value

    def model(self) -> Histogram:
        return Histogram(bounds=self.bounds, counts=list(self.counts), total=self.total)


class RevisionCounters:
    """Counters of one revision on this node, cumulative from ``now`` (unix seconds, the
    snapshot's ``started_unix``). Field meanings: :class:`RevisionStats`."""

    def __init__(self, revision: str, now: float) -> None:
        self.revision, self.started_unix = revision, now
        self.requests = self.errors = self.crashes = 0
        self._latency = _Hist(LATENCY_BOUNDS_SECONDS)
        self._ttft = _Hist(LATENCY_BOUNDS_SECONDS)
        self._tps = _Hist(TOKENS_PER_SECOND_BOUNDS)

    def observe(self, latency_s: float, ttft_s: float | None, completion_tokens: int,
                decode_seconds: float | None, failed: bool) -> None:
        """One finished request routed to this revision (client errors and hang-ups are not
        observed): end-to-end ``latency_s``; ``ttft_s`` (``None``: no token came);
        ``completion_tokens`` generated in ``decode_seconds`` (first to last token);
        ``failed``: a server-side failure (counts in ``errors``)."""
        self.requests += 1
        self.errors += bool(failed)
        self._latency.observe(latency_s)
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        tps = tokens_per_second(completion_tokens, decode_seconds)
        if tps is not None:
            self._tps.observe(tps)

    def crash(self) -> None:
        """A serving-core failure hit this revision (its requests are observed separately)."""
        self.crashes += 1

    def snapshot(self, memory_bytes: int) -> RevisionStats:
        """The counters now, with the revision's resident ``memory_bytes`` sampled by the
        caller."""
        return RevisionStats(revision=self.revision, started_unix=self.started_unix,
                             requests=self.requests, errors=self.errors, crashes=self.crashes,
                             latency_seconds=self._latency.model(),
                             ttft_seconds=self._ttft.model(),
                             tokens_per_second=self._tps.model(), memory_bytes=memory_bytes)


class DeploymentStats:
    """One deployment's :class:`RevisionCounters` by revision, and the write-rate limiter of its
    :class:`StatsReport`. ``now`` is unix seconds throughout."""

    def __init__(self) -> None:
        self._revisions: dict[str, RevisionCounters] = {}
        self._written: float | None = None

    def counters(self, revision: str, now: float) -> RevisionCounters:
        """The revision's counters, started at ``now`` on first use."""
        c = self._revisions.get(revision)
        if c is None:
            c = self._revisions[revision] = RevisionCounters(revision, now)
        return c

    def has_counts(self) -> bool:
        """Whether any revision has counted anything (a node that forwarded requests for a
        deployment it doesn't serve still reports them)."""
        return any(c.requests or c.crashes for c in self._revisions.values())

    def due(self, now: float, interval_seconds: float) -> bool:
        """Whether a periodic write is due: the first at once, then at most one per
        ``interval_seconds`` after :meth:`mark_written`. A wall clock that stepped back before the
        last write also makes it due (rather than silent until the clock catches up). The write
        at a guard trip does not ask."""
        last = self._written
        return last is None or now < last or now - last >= interval_seconds

    def mark_written(self, now: float) -> None:
        self._written = now

    def report(self, node: str, namespace: str, name: str, canary_uid: str,
               memory_by_revision: Mapping[str, int], guard_tripped: bool, guard_reason: str,
               now: float) -> StatsReport:
        """The :class:`StatsReport` to write now: every revision with counters or resident
        memory (a resident revision with no requests yet gets zero counters started ``now``);
        ``memory_by_revision``: resident bytes per revision, 0 when absent."""
        for revision in memory_by_revision:
            self.counters(revision, now)
        revisions = {r: c.snapshot(memory_by_revision.get(r, 0))
                     for r, c in sorted(self._revisions.items())}
        return StatsReport(node=node, namespace=namespace, name=name, canary_uid=canary_uid,
                           revisions=revisions, guard_tripped=guard_tripped,
                           guard_reason=guard_reason, updated_unix=now)
