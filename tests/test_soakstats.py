"""The soak's pure arithmetic (mlx_fleet/devcluster/soakstats.py): outcome classes, per-phase
counts and percentiles, RSS slope."""

from __future__ import annotations

import pytest

from mlx_fleet.devcluster.loadgen import Outcome
from mlx_fleet.devcluster.soakstats import classify, percentile, phase_summary, slope


def outcome(started: float, seconds: float = 1.0, *, kind: str = "",
            ttft: float | None = 0.1) -> Outcome:
    return Outcome(started=started, ended=started + seconds, session="s", endpoint="e",
                   status=200 if kind in ("", "stream_error", "incomplete") else 0,
                   revision="v1", failed=bool(kind), error=kind,
                   first_token=None if ttft is None else started + ttft, error_kind=kind)


@pytest.mark.parametrize(("kind", "want"), [
    ("", "succeeded"),
    ("http", "failed_clean"),          # an error answer (503, 404 ...)
    ("stream_error", "failed_clean"),  # an error event in the stream
    ("connection", "failed_clean"),    # refused, reset, closed mid-answer: the client knows
    ("no_endpoint", "failed_clean"),
    ("timeout", "lost"),               # the client waited in vain
    ("incomplete", "lost"),            # cut short without [DONE] or an error: silently
    ("something-new", "lost"),         # an unknown kind is never hidden among clean errors
])
def test_classify(kind: str, want: str) -> None:
    assert classify(outcome(0.0, kind=kind)) == want


def test_percentile_interpolates_linearly() -> None:
    assert percentile([], 95) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    assert percentile(list(map(float, range(101))), 95) == pytest.approx(95.0)


def test_phase_summary_splits_by_end_time() -> None:
    # before: latencies 0.1 .. 0.5 s, twice
    outcomes = [outcome(t * 0.5, seconds=(t % 5 + 1) / 10) for t in range(10)]
    # in flight when the fault struck at 10: counts for "during"
    outcomes += [outcome(9.5, seconds=2.0, ttft=1.5)]
    outcomes += [outcome(10.0, kind="connection", ttft=None),
                 outcome(11.0, kind="http", ttft=None)]                        # during
    outcomes += [outcome(19.9, seconds=0.5), outcome(20.0, kind="timeout", ttft=None)]  # after
    outcomes += [outcome(99.0)]  # outside every phase: not counted
    phases = [("before", 0.0, 10.0), ("during", 10.0, 20.0), ("after", 20.0, 60.0)]
    got = phase_summary(outcomes, phases)
    assert list(got) == ["before", "during", "after"]
    before, during, after = got["before"], got["during"], got["after"]
    assert (before["sent"], before["succeeded"], before["failed_clean"], before["lost"]) == \
        (10, 10, 0, 0)
    assert before["p50_latency_seconds"] == pytest.approx(0.3)
    assert before["p95_latency_seconds"] == pytest.approx(0.5)
    assert before["p95_ttft_seconds"] == pytest.approx(0.1)
    assert (during["sent"], during["succeeded"], during["failed_clean"], during["lost"]) == \
        (3, 1, 2, 0)
    assert during["error_kinds"] == {"connection": 1, "http": 1}
    # only the succeeded request counts for the latency
    assert during["p95_latency_seconds"] == 2.0 and during["p95_ttft_seconds"] == 1.5
    assert (after["sent"], after["succeeded"], after["lost"]) == (2, 1, 1)
    assert after["error_kinds"] == {"timeout": 1}
    assert after["p95_latency_seconds"] == pytest.approx(0.5)
    assert (before["seconds"], during["seconds"], after["seconds"]) == (10.0, 10.0, 40.0)
    # a phase without a succeeded request has no percentiles
    assert phase_summary([outcome(0.0, kind="http")], [("x", 0.0, 2.0)])["x"][
        "p95_latency_seconds"] is None


def test_slope_of_rss_samples() -> None:
    line = [(float(t), 1000.0 + 2.5 * t) for t in range(0, 100, 5)]
    assert slope(line) == pytest.approx(2.5)
    flat_noisy = [(float(t), 500.0 + (1 if t % 2 else -1)) for t in range(10)]
    assert abs(slope(flat_noisy)) < 0.25
    assert slope(line[:2]) is None                          # too few samples
    assert slope([(1.0, 1.0), (1.0, 2.0), (1.0, 3.0)]) is None  # no time spread
