"""Canary window analysis: histogram arithmetic, windows from cumulative reports, verdicts."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_fleet.contract import (LATENCY_BOUNDS_SECONDS, TOKENS_PER_SECOND_BOUNDS, Histogram,
                                RevisionStats, StatsReport)
from mlx_fleet_operator.analysis import (MIN_MEMORY_AGE_SECONDS, Verdict, WindowStats, analyze,
                                         histogram_delta, merge, quantile, window_from_reports)
from mlx_fleet_operator.canary_spec import parse_canary_spec

B = (1.0, 2.0, 4.0)
GiB = 1024 ** 3


def hist(counts, bounds=B, total=0.0) -> Histogram:
    return Histogram(bounds=bounds, counts=list(counts), total=total)


def observe(values, bounds) -> Histogram:
    """A histogram of ``values`` (bucket i holds bounds[i-1] < v <= bounds[i])."""
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[next((i for i, b in enumerate(bounds) if v <= b), len(bounds))] += 1
    return Histogram(bounds=bounds, counts=counts, total=float(sum(values)))


def spec_analysis(**analysis):
    return parse_canary_spec({"targetRef": {"name": "m"}, "candidate": {"revision": "v2"},
                              "analysis": analysis}).analysis


# --- histograms ---------------------------------------------------------------------------------

@pytest.mark.parametrize("counts,q,expected", [
    ([2, 2, 0, 0], 0.5, 1.0),      # rank 2 is the top of bucket (0, 1]
    ([2, 2, 0, 0], 0.75, 1.5),     # rank 3: halfway through (1, 2]
    ([0, 0, 4, 0], 0.5, 3.0),      # rank 2 of 4 in (2, 4]: 2 + 2 × 2/4
    ([4, 0, 0, 0], 0.95, 0.95),    # the first bucket's lower edge is 0
    ([0, 0, 0, 3], 0.5, 4.0),      # in the unbounded bucket: the last bound
    ([1, 0, 0, 9], 0.05, 0.5),     # rank 0.5 of 1 in (0, 1]
    ([0, 2, 0, 0], 0.0, 1.0),      # q = 0: the lower edge of the first non-empty bucket
    ([1, 1, 1, 0], 1.0, 4.0),
])
def test_quantile_interpolates_like_prometheus(counts, q, expected):
    assert quantile(hist(counts), q) == pytest.approx(expected)


def test_quantile_of_an_empty_histogram_is_none_and_q_is_checked():
    assert quantile(hist([0, 0, 0, 0]), 0.95) is None
    for q in (-0.1, 1.1):
        with pytest.raises(ValueError, match="outside"):
            quantile(hist([1, 0, 0, 0]), q)


@given(st.lists(st.integers(0, 50), min_size=4, max_size=4).filter(any),
       st.floats(0, 1), st.floats(0, 1))
def test_quantile_is_monotonic_and_bounded(counts, q1, q2):
    lo, hi = sorted((q1, q2))
    a, b = quantile(hist(counts), lo), quantile(hist(counts), hi)
    assert a is not None and b is not None
    assert 0 <= a <= b <= B[-1]


def test_histogram_delta_subtracts_and_treats_a_reset_as_new():
    now, before = hist([5, 3, 1, 0], total=20.0), hist([2, 3, 0, 0], total=5.0)
    d = histogram_delta(now, before)
    assert (d.counts, d.total, d.bounds) == ([3, 0, 1, 0], 15.0, B)
    assert histogram_delta(now, None) == now
    assert histogram_delta(hist([1, 0, 0, 0]), hist([2, 0, 0, 0])) == hist([1, 0, 0, 0])
    assert histogram_delta(now, hist([0, 0], bounds=(1.0,))) == now


def test_merge_sums_buckets_and_checks_bounds():
    m = merge([hist([1, 2, 3, 4], total=1.0), hist([1, 0, 0, 1], total=2.0)])
    assert (m.counts, m.total) == ([2, 2, 3, 5], 3.0)
    assert merge([], bounds=B) == hist([0, 0, 0, 0])
    with pytest.raises(ValueError, match="needs bounds"):
        merge([])
    with pytest.raises(ValueError, match="different bounds"):
        merge([hist([1, 0, 0, 0]), hist([1, 0], bounds=(1.0,))])


# --- windows from reports -----------------------------------------------------------------------

def rstats(revision, *, started=100.0, requests=0, errors=0, crashes=0, latency=(), ttft=(),
           tps=(), memory=0) -> RevisionStats:
    return RevisionStats(revision=revision, started_unix=started, requests=requests,
                         errors=errors, crashes=crashes,
                         latency_seconds=observe(latency, LATENCY_BOUNDS_SECONDS),
                         ttft_seconds=observe(ttft, LATENCY_BOUNDS_SECONDS),
                         tokens_per_second=observe(tps, TOKENS_PER_SECOND_BOUNDS),
                         memory_bytes=memory)


def report(node, updated, *revs) -> StatsReport:
    return StatsReport(node=node, namespace="ns", name="m", canary_uid="u",
                       revisions={r.revision: r for r in revs}, updated_unix=updated)


def test_window_from_reports_deltas_resets_and_new_nodes():
    previous = {
        "a": report("a", 1000.0, rstats("v2", requests=10, errors=1, latency=[0.1] * 10,
                                        memory=5 * GiB)),
        "b": report("b", 1000.0, rstats("v2", requests=50, errors=5, crashes=1,
                                        latency=[0.1] * 50, memory=4 * GiB)),
        "gone": report("gone", 1000.0, rstats("v2", requests=999)),
    }
    current = {
        # a: 5 more requests, 1 more error
        "a": report("a", 1010.0, rstats("v2", requests=15, errors=2, latency=[0.1] * 10 + [2.0] * 5,
                                        memory=6 * GiB),
                    rstats("v1", requests=500)),
        # b: the agent restarted (new started_unix): everything since counts
        "b": report("b", 1008.0, rstats("v2", started=1005.0, requests=3, errors=0,
                                        latency=[0.3] * 3, memory=3 * GiB)),
        # c: no previous report
        "c": report("c", 1010.0, rstats("v2", started=1002.0, requests=2, crashes=1,
                                        latency=[5.0, 5.0], memory=2 * GiB)),
        # d: does not serve v2
        "d": report("d", 1010.0, rstats("v1", requests=7)),
    }
    w = window_from_reports(current, previous, "v2")
    assert (w.requests, w.errors, w.crashes) == (5 + 3 + 2, 1, 1)
    assert sum(w.latency.counts) == 10
    assert w.latency == merge([observe([2.0] * 5, LATENCY_BOUNDS_SECONDS),
                               observe([0.3] * 3, LATENCY_BOUNDS_SECONDS),
                               observe([5.0, 5.0], LATENCY_BOUNDS_SECONDS)])
    assert (w.memory_bytes_start, w.memory_bytes_end) == (5 * GiB, 6 * GiB)
    assert w.elapsed_hours == pytest.approx(10 / 3600)  # c: 1010 - 1002 = 8; a: 10
    assert window_from_reports(current, previous, "v1").requests == 500 + 7


def test_a_decreasing_count_is_a_reset_even_with_the_same_start():
    previous = {"a": report("a", 1000.0, rstats("v2", requests=100, errors=10))}
    current = {"a": report("a", 1010.0, rstats("v2", requests=4, errors=1))}
    w = window_from_reports(current, previous, "v2")
    assert (w.requests, w.errors) == (4, 1)


def test_an_empty_window_has_empty_histograms():
    w = window_from_reports({}, {}, "v2")
    assert w == WindowStats()
    assert w.latency.bounds == LATENCY_BOUNDS_SECONDS
    assert w.tokens_per_second.bounds == TOKENS_PER_SECOND_BOUNDS
    assert quantile(w.latency, 0.95) is None


# --- verdicts -----------------------------------------------------------------------------------

def window(requests=100, errors=0, crashes=0, latency=0.4, ttft=0.1, tps=40.0,
           memory=GiB) -> WindowStats:
    return WindowStats(requests=requests, errors=errors, crashes=crashes,
                       latency=observe([latency] * requests, LATENCY_BOUNDS_SECONDS),
                       ttft=observe([ttft] * requests, LATENCY_BOUNDS_SECONDS),
                       tokens_per_second=observe([tps] * requests, TOKENS_PER_SECOND_BOUNDS),
                       memory_bytes_start=memory, memory_bytes_end=memory)


HEALTHY = window()
OLD = {"canary_elapsed_hours": 1.0, "memory_start": GiB}


def verdicts(result):
    return {c.name: c.verdict for c in result.checks}


def test_identical_revisions_pass_every_check():
    r = analyze(spec_analysis(), HEALTHY, HEALTHY, **OLD)
    assert r.verdict is Verdict.PASS
    assert set(verdicts(r).values()) == {Verdict.PASS}
    assert list(verdicts(r)) == ["errorRate", "latencyP95", "ttftP95", "tokensPerSecond",
                                 "memoryGrowth", "crashRate"]
    assert (r.stable_requests, r.candidate_requests) == (100, 100)
    assert r.failed() == ()


@pytest.mark.parametrize("candidate,check", [
    (window(errors=3), "errorRate"),                  # 3 % > 2 × max(0 %, floor 1 %)
    (window(latency=0.75), "latencyP95"),             # 0.75 s > 1.5 × 0.4 s
    (window(ttft=0.2), "ttftP95"),                    # 0.2 s > 1.5 × 0.1 s
    (window(tps=20.0), "tokensPerSecond"),            # 20 < 0.67 × 40
    (replace(window(), memory_bytes_end=int(1.3 * GiB)), "memoryGrowth"),  # +30 %/h > 20 %/h
    (window(crashes=1), "crashRate"),                 # 1 % > 0.1 %
])
def test_each_check_fails_on_its_own(candidate, check):
    r = analyze(spec_analysis(), HEALTHY, candidate, **OLD)
    assert r.verdict is Verdict.FAIL
    assert [c.name for c in r.failed()] == [check]
    failed = r.failed()[0]
    assert failed.message in r.message
    assert failed.candidate is not None and failed.threshold is not None


@pytest.mark.parametrize("stable_errors,candidate_errors,verdict", [
    (0, 0, Verdict.PASS),
    (0, 1, Verdict.PASS),     # 0 % vs 0.1 %: not "infinitely worse", the 1 % floor applies
    (0, 2, Verdict.PASS),     # 2 % is exactly 2 × floor: not above
    (0, 3, Verdict.FAIL),
    (5, 10, Verdict.PASS),    # 10 % = 2 × 5 %
    (5, 11, Verdict.FAIL),
])
def test_error_rate_ratio_with_floor(stable_errors, candidate_errors, verdict):
    r = analyze(spec_analysis(), window(errors=stable_errors), window(errors=candidate_errors),
                **OLD)
    assert verdicts(r)["errorRate"] is verdict


def test_error_rate_message_gives_both_values():
    r = analyze(spec_analysis(), window(errors=1), window(errors=5), **OLD)
    assert r.failed()[0].message == ("errorRate: candidate 5% vs stable 1%, fails above 2% "
                                     "(2 × max(stable, floor 1%))")
    assert (r.failed()[0].stable, r.failed()[0].candidate) == (0.01, 0.05)


def test_absolute_limits_replace_the_relative_rules():
    spec = spec_analysis(checks={"errorRate": {"max": 0.1}, "latencyP95": {"maxSeconds": 10},
                                 "ttftP95": {"maxSeconds": 0.05},
                                 "tokensPerSecond": {"min": 50}})
    r = analyze(spec, HEALTHY, window(errors=8, latency=5.0), **OLD)
    v = verdicts(r)
    assert v["errorRate"] is Verdict.PASS        # 8 % <= 10 %, though 8 × stable
    assert v["latencyP95"] is Verdict.PASS       # 5 s <= 10 s, though 12 × stable
    assert v["ttftP95"] is Verdict.FAIL          # 0.1 s > 0.05 s, though equal to stable
    assert v["tokensPerSecond"] is Verdict.FAIL  # 40 < 50, though equal to stable
    assert r.verdict is Verdict.FAIL


def test_too_few_requests_makes_every_check_inconclusive_never_pass_or_fail():
    awful = window(requests=19, errors=19, crashes=19, latency=60.0, tps=1.0)
    for stable, candidate in ((HEALTHY, awful), (window(requests=5), HEALTHY)):
        r = analyze(spec_analysis(), stable, candidate, **OLD)
        assert r.verdict is Verdict.INCONCLUSIVE
        assert set(verdicts(r).values()) == {Verdict.INCONCLUSIVE}
        assert "too few requests" in r.message and "minRequests 20" in r.message
    assert analyze(spec_analysis(minRequests=5), window(requests=5), window(requests=5),
                   **OLD).verdict is Verdict.PASS


def test_a_check_without_data_is_inconclusive():
    no_tokens = replace(HEALTHY, tokens_per_second=observe([], TOKENS_PER_SECOND_BOUNDS))
    r = analyze(spec_analysis(), HEALTHY, no_tokens, **OLD)
    assert verdicts(r)["tokensPerSecond"] is Verdict.INCONCLUSIVE
    assert r.verdict is Verdict.INCONCLUSIVE
    # a failure elsewhere still fails the window
    r = analyze(spec_analysis(), HEALTHY, replace(no_tokens, crashes=5), **OLD)
    assert r.verdict is Verdict.FAIL


@pytest.mark.parametrize("hours,start,end,verdict", [
    (MIN_MEMORY_AGE_SECONDS / 3600 * 0.99, GiB, 2 * GiB, Verdict.INCONCLUSIVE),  # too young
    (1.0, 0, 2 * GiB, Verdict.INCONCLUSIVE),                                    # no baseline
    (0.5, GiB, int(1.1 * GiB), Verdict.PASS),    # +10 % in 0.5 h = 20 %/h: not above
    (0.5, GiB, int(1.11 * GiB), Verdict.FAIL),   # 22 %/h
    (2.0, GiB, int(1.3 * GiB), Verdict.PASS),    # 15 %/h
    (1.0, 2 * GiB, GiB, Verdict.PASS),           # shrinking
])
def test_memory_growth_per_hour_since_the_canary_started(hours, start, end, verdict):
    r = analyze(spec_analysis(), HEALTHY, replace(HEALTHY, memory_bytes_end=end),
                canary_elapsed_hours=hours, memory_start=start)
    m = next(c for c in r.checks if c.name == "memoryGrowth")
    assert m.verdict is verdict
    if verdict is not Verdict.INCONCLUSIVE:
        assert m.candidate == pytest.approx((end - start) / start / hours)
    assert "GiB" in m.message and "fails above +20%/h" in m.message


def test_a_young_canary_is_judged_without_memory_growth():
    """Memory growth needs canary age, not traffic: while it is too young to judge, the window
    passes on the other checks (a short step is not held for ten minutes), and it still fails
    a window once it has the data."""
    young = {"canary_elapsed_hours": MIN_MEMORY_AGE_SECONDS / 3600 / 2, "memory_start": GiB}
    r = analyze(spec_analysis(), HEALTHY, replace(HEALTHY, memory_bytes_end=2 * GiB), **young)
    assert verdicts(r)["memoryGrowth"] is Verdict.INCONCLUSIVE
    assert r.verdict is Verdict.PASS
    r = analyze(spec_analysis(), HEALTHY, replace(HEALTHY, memory_bytes_end=2 * GiB), **OLD)
    assert r.verdict is Verdict.FAIL


def test_memory_now_overrides_the_window():
    r = analyze(spec_analysis(), HEALTHY, HEALTHY, canary_elapsed_hours=1.0, memory_start=GiB,
                memory_now=2 * GiB)
    assert verdicts(r)["memoryGrowth"] is Verdict.FAIL


def test_disabled_checks_are_skipped_and_cannot_fail():
    off = {name: {"enabled": False} for name in ("errorRate", "latencyP95", "ttftP95",
                                                 "tokensPerSecond", "memoryGrowth", "crashRate")}
    awful = window(errors=100, crashes=100, latency=60.0, ttft=60.0, tps=1.0, memory=9 * GiB)
    r = analyze(spec_analysis(checks=off), HEALTHY, awful, **OLD)
    assert (r.verdict, r.checks) == (Verdict.PASS, ())


def test_result_serializes_camel_case_for_the_status():
    r = analyze(spec_analysis(), HEALTHY, window(crashes=1), **OLD)
    d = r.to_dict()
    assert d["verdict"] == "Fail" and d["stableRequests"] == 100 and d["candidateRequests"] == 100
    crash = next(c for c in d["checks"] if c["name"] == "crashRate")
    assert crash == {"name": "crashRate", "verdict": "Fail", "stable": 0.0, "candidate": 0.01,
                     "threshold": 0.001,
                     "message": "crashRate: candidate 1% vs stable 0%, fails above 0.1% (max)"}
    assert all(not isinstance(v, float) or math.isfinite(v) for c in d["checks"]
               for v in c.values())
