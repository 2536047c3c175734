"""Analysis of one canary window: the stable and candidate revisions' statistics compared.

Inputs are the agents' cumulative per-revision counters (:class:`mlx_fleet.contract.StatsReport`,
one per node); :func:`window_from_reports` turns two snapshots into one window's
:class:`WindowStats` per revision, :func:`analyze` judges a window. The checks and their default
thresholds are issue #5's (see :mod:`.canary_spec`): error rate > 2 × stable, p95 latency
> 1.5 × stable, p95 time to first token > 1.5 × stable, per-sequence tokens/s (p50)
< 0.67 × stable, memory growth > 20 %/h, serving-core crash rate > 0.1 %.

Quantiles follow Prometheus' ``histogram_quantile``. Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlx_fleet.contract import (LATENCY_BOUNDS_SECONDS, TOKENS_PER_SECOND_BOUNDS, Histogram,
                                RevisionStats, StatsReport)

from .canary_spec import AnalysisSpec
from .spec import format_bytes

#: Memory growth is Inconclusive until the canary is this old (seconds): a rate per hour from a
#: few seconds of data is noise (a prompt cache warming up looks like a leak of thousands of
#: percent per hour). Ten minutes, the interval at which the seed's soak judges memory slope.
MIN_MEMORY_AGE_SECONDS = 600.0
#: Checks whose Inconclusive does not hold a window: they need time, not traffic, and a canary
#: shorter than that time is judged on the others (the check still fails once it has the data).
NON_BLOCKING = frozenset({"memoryGrowth"})


# ---------------------------------------------------------------------------------------------
# Histograms
# ---------------------------------------------------------------------------------------------

def histogram_delta(now: Histogram, before: Histogram | None) -> Histogram:
    """Observations between two cumulative snapshots of one histogram (``now - before``).

    ``before`` None, with other bounds, or with any count above ``now``'s (a counter reset):
    ``now`` itself."""
    if (before is None or before.bounds != now.bounds
            or any(b > n for b, n in zip(before.counts, now.counts))):
        return now
    return Histogram(bounds=now.bounds, counts=[n - b for n, b in zip(now.counts, before.counts)],
                     total=max(0.0, now.total - before.total))


def merge(hs: Iterable[Histogram], bounds: tuple[float, ...] | None = None) -> Histogram:
    """Bucket-wise sum of histograms with identical bounds. ``bounds``: the bounds expected
    (needed when ``hs`` may be empty; the result is then all zeros). Raises ``ValueError``
    for mismatched bounds, or for an empty ``hs`` without ``bounds``."""
    hs = list(hs)
    if bounds is None:
        if not hs:
            raise ValueError("merge of no histograms needs bounds")
        bounds = hs[0].bounds
    counts, total = [0] * (len(bounds) + 1), 0.0
    for h in hs:
        if h.bounds != bounds or len(h.counts) != len(counts):
            raise ValueError(f"cannot merge histograms with different bounds: {h.bounds} vs "
                             f"{bounds}")
        counts = [a + b for a, b in zip(counts, h.counts)]
        total += h.total
    return Histogram(bounds=bounds, counts=counts, total=total)


def quantile(h: Histogram, q: float) -> float | None:
    """The ``q``-quantile (0 ≤ q ≤ 1) of a histogram, as Prometheus' ``histogram_quantile``:
    linear interpolation within the bucket holding rank ``q × count`` (the first bucket's lower
    edge is 0). None when the histogram is empty; the last bound when the rank falls into the
    unbounded last bucket. Raises ``ValueError`` for ``q`` outside [0, 1]."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} is outside [0, 1]")
    n = sum(h.counts)
    if n == 0:
        return None
    rank, below = q * n, 0
    for i, c in enumerate(h.counts):
        if c and below + c >= rank:
            if i == len(h.bounds):
                return h.bounds[-1]
            lower = h.bounds[i - 1] if i else 0.0
            return lower + (h.bounds[i] - lower) * (rank - below) / c
        below += c
    raise AssertionError("unreachable: rank <= total count")


# ---------------------------------------------------------------------------------------------
# One window
# ---------------------------------------------------------------------------------------------

def _empty(bounds: tuple[float, ...]) -> Histogram:
    return Histogram(bounds=bounds, counts=[0] * (len(bounds) + 1))


@dataclass(frozen=True)
class WindowStats:
    """One revision's traffic in one window, summed over nodes.

    ``requests``/``errors``/``crashes``: counts in the window (see
    :class:`mlx_fleet.contract.RevisionStats`). ``latency``, ``ttft`` (seconds) and
    ``tokens_per_second`` (per sequence): the window's observations. ``memory_bytes_start`` /
    ``memory_bytes_end``: the largest per-node resident bytes of the revision at the window's
    start / end (a leak shows per replica; node count changes don't). ``elapsed_hours``: the
    window's length (the longest over nodes)."""

    requests: int = 0
    errors: int = 0
    crashes: int = 0
    latency: Histogram = field(default_factory=lambda: _empty(LATENCY_BOUNDS_SECONDS))
    ttft: Histogram = field(default_factory=lambda: _empty(LATENCY_BOUNDS_SECONDS))
    tokens_per_second: Histogram = field(default_factory=lambda: _empty(TOKENS_PER_SECOND_BOUNDS))
    memory_bytes_start: int = 0
    memory_bytes_end: int = 0
    elapsed_hours: float = 0.0


def _is_reset(cur: RevisionStats, prev: RevisionStats) -> bool:
    if cur.started_unix != prev.started_unix:
        return True
    if cur.requests < prev.requests or cur.errors < prev.errors or cur.crashes < prev.crashes:
        return True
    return any(b > n for hc, hp in ((cur.latency_seconds, prev.latency_seconds),
                                    (cur.ttft_seconds, prev.ttft_seconds),
                                    (cur.tokens_per_second, prev.tokens_per_second))
               for n, b in zip(hc.counts, hp.counts))


def window_from_reports(current: Mapping[str, StatsReport], previous: Mapping[str, StatsReport],
                        revision: str) -> WindowStats:
    """``revision``'s window between two snapshots of the nodes' reports (node → report; pass
    only reports of the Canary's ``canary_uid``).

    Per node: ``current - previous``; when the node has no previous counters for the revision,
    or they were reset (``started_unix`` changed or a count decreased), the current counters
    whole (all counted since the reset is new). Nodes absent from ``current`` contribute
    nothing. Summed over nodes; histograms merged."""
    reqs = errs = crashes = mem_start = mem_end = 0
    lat: list[Histogram] = []
    ttft: list[Histogram] = []
    tps: list[Histogram] = []
    elapsed = 0.0
    for node, report in current.items():
        cur = report.revisions.get(revision)
        if cur is None:
            continue
        prev_report = previous.get(node)
        prev = prev_report.revisions.get(revision) if prev_report else None
        if prev_report is None or prev is None or _is_reset(cur, prev):
            d_req, d_err, d_crash = cur.requests, cur.errors, cur.crashes
            hists = (cur.latency_seconds, cur.ttft_seconds, cur.tokens_per_second)
            since, mem_before = cur.started_unix, cur.memory_bytes
        else:
            d_req, d_err = cur.requests - prev.requests, cur.errors - prev.errors
            d_crash = cur.crashes - prev.crashes
            hists = (histogram_delta(cur.latency_seconds, prev.latency_seconds),
                     histogram_delta(cur.ttft_seconds, prev.ttft_seconds),
                     histogram_delta(cur.tokens_per_second, prev.tokens_per_second))
            since, mem_before = prev_report.updated_unix, prev.memory_bytes
        reqs, errs, crashes = reqs + d_req, errs + d_err, crashes + d_crash
        lat.append(hists[0])
        ttft.append(hists[1])
        tps.append(hists[2])
        mem_start, mem_end = max(mem_start, mem_before), max(mem_end, cur.memory_bytes)
        elapsed = max(elapsed, report.updated_unix - since)
    return WindowStats(requests=reqs, errors=errs, crashes=crashes,
                       latency=merge(lat, LATENCY_BOUNDS_SECONDS),
                       ttft=merge(ttft, LATENCY_BOUNDS_SECONDS),
                       tokens_per_second=merge(tps, TOKENS_PER_SECOND_BOUNDS),
                       memory_bytes_start=mem_start, memory_bytes_end=mem_end,
                       elapsed_hours=max(0.0, elapsed) / 3600)


# ---------------------------------------------------------------------------------------------
# Verdicts
# ---------------------------------------------------------------------------------------------

class Verdict(str, enum.Enum):
    PASS = "Pass"
    FAIL = "Fail"
    INCONCLUSIVE = "Inconclusive"


@dataclass(frozen=True)
class CheckResult:
    """One check of one window. ``stable``/``candidate``: the compared values (None: no data);
    ``threshold``: the candidate value beyond which the check fails (None: not computable);
    ``message``: one line with both values, e.g. ``"errorRate: candidate 3% vs stable 0.5%,
    fails above 1%"``."""

    name: str
    verdict: Verdict
    stable: float | None
    candidate: float | None
    threshold: float | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict.value, "stable": self.stable,
                "candidate": self.candidate, "threshold": self.threshold,
                "message": self.message}


@dataclass(frozen=True)
class AnalysisResult:
    """A window's verdict: Fail if any enabled check failed; else Inconclusive if either
    revision had fewer than ``minRequests`` requests (then every check is Inconclusive) or any
    check was; else Pass. ``checks``: the enabled checks, in spec order. ``message``: the
    failed (or inconclusive) checks' messages, or a one-line pass summary."""

    verdict: Verdict
    checks: tuple[CheckResult, ...]
    stable_requests: int
    candidate_requests: int
    message: str

    def failed(self) -> tuple[CheckResult, ...]:
        return tuple(c for c in self.checks if c.verdict is Verdict.FAIL)

    def to_dict(self) -> dict[str, Any]:
        """camelCase, for the Canary's ``status.lastAnalysis``."""
        return {"verdict": self.verdict.value, "message": self.message,
                "stableRequests": self.stable_requests,
                "candidateRequests": self.candidate_requests,
                "checks": [c.to_dict() for c in self.checks]}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.3g}%"


def _per_hour(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.3g}%/h"


def _num(x: float | None, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:.3g}{unit}"


def _verdict(candidate: float | None, threshold: float | None, above: bool) -> Verdict:
    """Fail when ``candidate`` is beyond ``threshold`` (above it, or below it if not ``above``);
    Inconclusive when either is None."""
    if candidate is None or threshold is None:
        return Verdict.INCONCLUSIVE
    return Verdict.FAIL if (candidate > threshold if above else candidate < threshold) \
        else Verdict.PASS


def _judge(name: str, stable: float | None, candidate: float | None, threshold: float | None,
           above: bool, fmt: Callable[[float | None], str], rule: str) -> CheckResult:
    msg = (f"{name}: candidate {fmt(candidate)} vs stable {fmt(stable)}, fails "
           f"{'above' if above else 'below'} {fmt(threshold)} ({rule})")
    return CheckResult(name, _verdict(candidate, threshold, above), stable, candidate, threshold,
                       msg)


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def analyze(spec: AnalysisSpec, stable: WindowStats, candidate: WindowStats, *,
            canary_elapsed_hours: float = 0.0, memory_start: int = 0,
            memory_now: int | None = None) -> AnalysisResult:
    """Judge one window (pure; thresholds from ``spec.checks``, defaults issue #5's).

    * errorRate: rate = errors / requests; fails when candidate > ``maxRatio`` × max(stable,
      ``floor``) (so 0 % vs 0.1 % is not "infinitely worse"), or > ``max`` when set.
    * latencyP95, ttftP95: p95 seconds; fails when candidate > ``maxRatio`` × stable, or
      > ``maxSeconds`` when set.
    * tokensPerSecond: p50 of per-sequence decode tokens/s; fails when candidate < ``minRatio``
      × stable, or < ``min`` when set.
    * memoryGrowth: (``memory_now`` − ``memory_start``) / ``memory_start`` /
      ``canary_elapsed_hours``, the candidate's growth per hour since the canary started
      (``memory_start``: its bytes then; ``memory_now`` defaults to
      ``candidate.memory_bytes_end``); fails when > ``maxPerHour``; Inconclusive before the
      canary is :data:`MIN_MEMORY_AGE_SECONDS` old or without a ``memory_start``.
    * crashRate: candidate crashes / requests; fails when > ``max`` (absolute).

    A check without data (no latency observations ...) is Inconclusive, which holds the window
    — except for :data:`NON_BLOCKING` checks (memory growth needs canary age, not traffic).
    """
    c = spec.checks
    seconds, tok_s = (lambda x: _num(x, "s")), (lambda x: _num(x, " tok/s"))
    results: list[CheckResult] = []

    def relative(name: str, s: float | None, k: float | None, ratio: float,
                 absolute: float | None, above: bool, fmt: Callable[[float | None], str],
                 absolute_name: str, base: float | None = None, base_rule: str = "stable"
                 ) -> CheckResult:
        if absolute is not None:
            return _judge(name, s, k, absolute, above, fmt, absolute_name)
        base = s if base is None else base
        return _judge(name, s, k, None if base is None else ratio * base, above, fmt,
                      f"{ratio:g} × {base_rule}")

    if c.error_rate.enabled:
        e = c.error_rate
        s, k = _ratio(stable.errors, stable.requests), _ratio(candidate.errors, candidate.requests)
        results.append(relative("errorRate", s, k, e.max_ratio, e.max_absolute, True, _pct, "max",
                                None if s is None else max(s, e.floor),
                                f"max(stable, floor {_pct(e.floor)})"))
    if c.latency_p95.enabled:
        results.append(relative("latencyP95", quantile(stable.latency, 0.95),
                                quantile(candidate.latency, 0.95), c.latency_p95.max_ratio,
                                c.latency_p95.max_seconds, True, seconds, "maxSeconds"))
    if c.ttft_p95.enabled:
        results.append(relative("ttftP95", quantile(stable.ttft, 0.95),
                                quantile(candidate.ttft, 0.95), c.ttft_p95.max_ratio,
                                c.ttft_p95.max_seconds, True, seconds, "maxSeconds"))
    if c.tokens_per_second.enabled:
        results.append(relative("tokensPerSecond", quantile(stable.tokens_per_second, 0.5),
                                quantile(candidate.tokens_per_second, 0.5),
                                c.tokens_per_second.min_ratio, c.tokens_per_second.min_absolute,
                                False, tok_s, "min"))
    if c.memory_growth.enabled:
        limit = c.memory_growth.max_per_hour
        now_bytes = candidate.memory_bytes_end if memory_now is None else memory_now
        old_enough = canary_elapsed_hours * 3600 >= MIN_MEMORY_AGE_SECONDS
        growth = ((now_bytes - memory_start) / memory_start / canary_elapsed_hours
                  if old_enough and memory_start > 0 else None)
        results.append(CheckResult(
            "memoryGrowth", _verdict(growth, limit, True), None, growth, limit,
            f"memoryGrowth: candidate {_per_hour(growth)} ({format_bytes(memory_start)} → "
            f"{format_bytes(now_bytes)} in {canary_elapsed_hours:.3g}h), fails above "
            f"{_per_hour(limit)} (maxPerHour; judged from {MIN_MEMORY_AGE_SECONDS:g}s of age)"))
    if c.crash_rate.enabled:
        results.append(_judge("crashRate", _ratio(stable.crashes, stable.requests),
                              _ratio(candidate.crashes, candidate.requests),
                              c.crash_rate.max_per_request, True, _pct, "max"))

    if min(stable.requests, candidate.requests) < spec.min_requests:
        few = (f"too few requests (stable {stable.requests}, candidate {candidate.requests}; "
               f"minRequests {spec.min_requests})")
        results = [CheckResult(r.name, Verdict.INCONCLUSIVE, r.stable, r.candidate, r.threshold,
                               f"{r.name}: inconclusive, {few}") for r in results]
        return AnalysisResult(Verdict.INCONCLUSIVE, tuple(results), stable.requests,
                              candidate.requests, f"inconclusive: {few}")
    by = {v: [r for r in results if r.verdict is v and not (
        v is Verdict.INCONCLUSIVE and r.name in NON_BLOCKING)] for v in Verdict}
    if by[Verdict.FAIL]:
        verdict, msg = Verdict.FAIL, "; ".join(r.message for r in by[Verdict.FAIL])
    elif by[Verdict.INCONCLUSIVE]:
        verdict = Verdict.INCONCLUSIVE
        msg = "inconclusive: " + "; ".join(r.message for r in by[Verdict.INCONCLUSIVE])
    else:
        verdict, msg = Verdict.PASS, f"all {len(by[Verdict.PASS])} judged checks passed"
    return AnalysisResult(verdict, tuple(results), stable.requests, candidate.requests, msg)
