"""benchmarks/serving.py's summary: medians per cell and the ratios ours ÷ reference and, when a
third server ran with --baseline-args, ours ÷ baseline (plain data, no server)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from serving import TOP_LOGPROBS, requests_for, summarise  # noqa: E402


def round_(server: str, tps: float, ttft: float, errors: int = 0) -> dict:
    return {"workload": "unique", "concurrency": 8, "server": server,
            "output_tokens_per_second": tps, "requests_per_second": tps / 100,
            "ttft_p50_seconds": ttft, "ttft_p95_seconds": ttft, "itl_p50_seconds": 0.01,
            "itl_p95_seconds": 0.02, "errors": errors}


def test_ratios_against_the_reference_and_the_baseline() -> None:
    rounds = [round_("ours", 300, 0.1), round_("ours", 500, 0.3), round_("reference", 200, 0.4),
              round_("baseline", 250, 0.2), round_("baseline", 350, 0.2)]
    cell = summarise(rounds)["unique"]["8"]
    assert cell["ours"]["output_tokens_per_second"] == 400          # medians
    assert cell["tokens_per_second_ratio"] == pytest.approx(2.0)
    assert cell["ttft_p50_ratio"] == pytest.approx(0.5)
    assert cell["baseline_tokens_per_second_ratio"] == pytest.approx(400 / 300)
    assert cell["baseline_ttft_p50_ratio"] == pytest.approx(1.0)


def test_a_server_with_errors_gives_no_ratio() -> None:
    cell = summarise([round_("ours", 300, 0.1), round_("reference", 200, 0.4),
                      round_("baseline", 100, 0.2, errors=3)])["unique"]["8"]
    assert cell["tokens_per_second_ratio"] == pytest.approx(1.5)
    assert "baseline_tokens_per_second_ratio" not in cell and cell["baseline_invalid"]
    cell = summarise([round_("ours", 300, 0.1, errors=1),
                      round_("reference", 200, 0.4)])["unique"]["8"]
    assert cell["tokens_per_second_ratio"] is None and cell["invalid"]


def test_the_logprobs_workload_is_unique_with_logprobs() -> None:
    """Same prompts as ``unique`` in the same round, so tokens/s of the two in one run is the
    cost of log-probabilities alone."""
    unique, logprobs = (requests_for(w, 4, 16, round_no=3) for w in ("unique", "logprobs"))
    assert [b["messages"] for b in logprobs] == [b["messages"] for b in unique]
    for u, lp in zip(unique, logprobs):
        assert lp == {**u, "logprobs": True, "top_logprobs": TOP_LOGPROBS}


def test_a_logprobs_answer_counts_only_with_logprobs() -> None:
    """A server that ignores ``logprobs`` (no entries in any event) is not served for the
    workload; one entry is enough to show it applied."""
    from served import classify
    from serving import check_chat

    assert check_chat("logprobs", "text", [], "length", 3) == "valid"
    ignored = check_chat("logprobs", "text", [], "length", 0)
    assert ignored.startswith("ignored")
    assert check_chat("unique", "text", [], "length", 0) is None
    verdict = classify([{"status": 200, "error": "", "check": ignored}] * 2)
    assert verdict["not_served"] and verdict["not_served"].startswith("ignored")
