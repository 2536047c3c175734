"""Per-revision cumulative counters (node_agent.window_stats)."""

from __future__ import annotations

import math

import pytest

from mlx_fleet.contract import LATENCY_BOUNDS_SECONDS, TOKENS_PER_SECOND_BOUNDS, StatsReport
from node_agent.window_stats import (DeploymentStats, RevisionCounters, histogram_observe,
                                     tokens_per_second)

B = (1.0, 2.0, 5.0)


@pytest.mark.parametrize(("value", "index"), [
    (-1.0, 0), (0.0, 0), (1.0, 0),  # <= bounds[0]
    (math.nextafter(1.0, 2.0), 1), (2.0, 1),  # > bounds[0], <= bounds[1]
    (2.5, 2), (5.0, 2),
    (math.nextafter(5.0, 6.0), 3), (math.inf, 3),  # above the last bound
])
def test_histogram_observe_buckets_at_the_bounds(value: float, index: int) -> None:
    counts = [0, 7, 0, 0]
    out = histogram_observe(B, counts, value)
    expected = [0, 7, 0, 0]
    expected[index] += 1
    assert out == expected
    assert counts == [0, 7, 0, 0]  # input unchanged


def test_histogram_observe_rejects_nan() -> None:
    with pytest.raises(ValueError):
        histogram_observe(B, [0] * 4, math.nan)


@pytest.mark.parametrize(("tokens", "decode", "expected"), [
    (0, None, None), (1, 0.5, None), (2, 0.0, None), (2, None, None), (5, -1.0, None),
    (2, 0.5, 2.0), (11, 2.0, 5.0),
])
def test_tokens_per_second_rule(tokens: int, decode: float | None,
                                expected: float | None) -> None:
    assert tokens_per_second(tokens, decode) == expected
    c = RevisionCounters("r1", now=0)
    c.observe(0.1, 0.05, tokens, decode, failed=False)
    tps = c.snapshot(0).tokens_per_second
    assert sum(tps.counts) == (expected is not None)
    assert tps.total == (expected or 0.0)


def test_snapshot_shapes_and_roundtrip_through_the_report() -> None:
    c = RevisionCounters("r2", now=1000.0)
    c.observe(0.3, 0.02, 11, 2.0, failed=False)  # 5 tok/s
    c.observe(1.0, None, 0, None, failed=True)
    c.crash()
    s = c.snapshot(memory_bytes=123)
    assert (s.revision, s.started_unix, s.requests, s.errors, s.crashes, s.memory_bytes) == (
        "r2", 1000.0, 2, 1, 1, 123)
    assert s.latency_seconds.bounds == s.ttft_seconds.bounds == LATENCY_BOUNDS_SECONDS
    assert s.tokens_per_second.bounds == TOKENS_PER_SECOND_BOUNDS
    lat = s.latency_seconds.counts
    assert len(lat) == len(LATENCY_BOUNDS_SECONDS) + 1 and sum(lat) == 2
    assert lat[LATENCY_BOUNDS_SECONDS.index(0.3)] == lat[LATENCY_BOUNDS_SECONDS.index(1.0)] == 1
    assert s.latency_seconds.total == pytest.approx(1.3)
    assert sum(s.ttft_seconds.counts) == 1 and s.ttft_seconds.total == 0.02
    assert s.tokens_per_second.counts[TOKENS_PER_SECOND_BOUNDS.index(5)] == 1

    report = StatsReport(node="mac-1", namespace="team", name="chat", revisions={"r2": s})
    assert StatsReport.from_json(report.to_json()) == report


def test_counters_are_cumulative_across_snapshots() -> None:
    c = RevisionCounters("r1", now=5.0)
    c.observe(0.1, 0.01, 3, 1.0, failed=False)
    first = c.snapshot(10)
    c.observe(0.1, 0.01, 3, 1.0, failed=True)
    second = c.snapshot(20)
    assert (first.requests, first.errors) == (1, 0)
    assert (second.requests, second.errors) == (2, 1)
    assert sum(first.latency_seconds.counts) == 1 and sum(second.latency_seconds.counts) == 2
    assert second.tokens_per_second.total == 4.0
    assert first.started_unix == second.started_unix == 5.0


def test_rate_limiter_first_at_once_then_one_per_interval() -> None:
    d = DeploymentStats()
    written = []
    for now in [100.0 + 0.5 * i for i in range(60)]:  # 30 s in half-second steps
        if d.due(now, 10.0):
            d.mark_written(now)
            written.append(now)
    assert written == [100.0, 110.0, 120.0]


def test_rate_limiter_after_clock_steps_back() -> None:
    d = DeploymentStats()
    d.mark_written(1000.0)
    assert not d.due(1005.0, 10.0)
    assert d.due(900.0, 10.0)


def test_report_holds_every_revision_and_round_trips() -> None:
    d = DeploymentStats()
    d.counters("r1", now=50.0).observe(0.2, 0.01, 4, 0.3, failed=False)
    assert d.counters("r1", now=60.0).started_unix == 50.0  # same counters on later use
    r = d.report("mac-1", "team", "chat", "uid-1", {"r1": 100, "r2": 200}, True,
                 "candidate r2: 3 of 3 requests failed", now=70.0)
    assert (r.node, r.namespace, r.name, r.canary_uid) == ("mac-1", "team", "chat", "uid-1")
    assert (r.guard_tripped, r.guard_reason, r.updated_unix) == (
        True, "candidate r2: 3 of 3 requests failed", 70.0)
    assert {k: (v.requests, v.memory_bytes, v.started_unix) for k, v in r.revisions.items()} == {
        "r1": (1, 100, 50.0), "r2": (0, 200, 70.0)}
    assert StatsReport.from_json(r.to_json()) == r
    # A revision with counters but no memory entry reports 0 bytes.
    assert d.report("mac-1", "team", "chat", "uid-1", {}, False, "", now=80.0).revisions[
        "r1"].memory_bytes == 0
