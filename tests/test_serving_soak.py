"""benchmarks/serving_soak.py's arithmetic: the memory trend after the warm-up and the
per-minute request summary (plain data, no server)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from serving_soak import MIB, memory_trend, per_minute  # noqa: E402


def sample(t: float, active_mib: float, cache_mib: float, rss_mib: float) -> dict:
    return {"t": t, "active_bytes": active_mib * MIB, "cache_bytes": cache_mib * MIB,
            "rss_bytes": rss_mib * MIB}


@pytest.mark.parametrize(("samples", "warmup", "expected"), [
    # flat after a warm-up that filled the caches: slope 0 (the warm-up is left out)
    ([sample(0, 100, 0, 500), sample(30, 900, 100, 800), sample(60, 1000, 200, 900),
      sample(120, 1000, 200, 900), sample(180, 1000, 200, 900)], 60,
     {"rss": 0.0, "mlx_active": 0.0, "mlx_total": 0.0}),
    # RSS leaking 10 MiB a minute, MLX flat
    ([sample(t, 50, 5, 200 + t / 6) for t in range(0, 600, 10)], 60,
     {"rss": 10.0, "mlx_active": 0.0, "mlx_total": 0.0}),
    # cache shrinking 2 MiB/min while active grows 2 MiB/min: total flat
    ([sample(t, 100 + t / 30, 50 - t / 30, 300) for t in range(0, 300, 5)], 0,
     {"rss": 0.0, "mlx_active": 2.0, "mlx_total": 0.0}),
])
def test_memory_trend_slopes_in_mib_per_minute(samples, warmup, expected):
    trend = memory_trend(samples, warmup)
    for name, slope in expected.items():
        assert trend[name]["slope_mib_per_minute"] == pytest.approx(slope, abs=1e-6), name
    assert trend["window_seconds"][0] >= warmup


def test_memory_trend_window_and_extremes():
    samples = [sample(0, 10, 0, 100), sample(60, 40, 0, 100), sample(70, 30, 0, 100),
               sample(80, 20, 0, 100)]
    trend = memory_trend(samples, 60)
    assert trend["window_seconds"] == [60, 80]
    assert (trend["mlx_active"]["first_mib"], trend["mlx_active"]["last_mib"],
            trend["mlx_active"]["max_mib"]) == (40, 20, 40)
    assert memory_trend([], 60) == {}


def test_per_minute_counts_errors_and_rates_by_start_minute():
    ok = {"error": "", "ttft": 0.1, "gaps": [0.01, 0.03], "tokens": 10, "seconds": 1.0}
    failed = {"error": "HTTP 429: busy", "ttft": None, "gaps": [], "tokens": 0, "seconds": 0.1}
    results = [ok | {"started": 0.0}, ok | {"started": 9.0}, failed | {"started": 30.0},
               ok | {"started": 61.0}]
    first, second = per_minute(results)
    assert (first["requests"], first["errors"]) == (3, 1)
    assert first["output_tokens_per_second"] == pytest.approx(20 / 30.1)  # busy until 30.1 s
    assert (first["itl_p50_seconds"], first["ttft_p50_seconds"]) == (pytest.approx(0.02), 0.1)
    assert (second["minute"], second["requests"], second["errors"]) == (1, 1, 0)
    assert second["output_tokens_per_second"] == pytest.approx(10 / 2.0)  # 60 s → 62 s


def test_memory_trend_of_a_server_sampled_from_outside_has_rss_only():
    # --server reference: RSS read with psutil from the load generator, no MLX fields
    samples = [{"t": t, "active_bytes": None, "cache_bytes": None,
                "rss_bytes": (300 + t / 60) * MIB} for t in range(0, 300, 5)]
    trend = memory_trend(samples, 60)
    assert set(trend) == {"rss", "window_seconds"}
    assert trend["rss"]["slope_mib_per_minute"] == pytest.approx(1.0)
