"""benchmarks/embeddings.py's plain parts: its cells and its summary (medians per cell)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from embeddings import _batch_histogram, parse_cell, summarise  # noqa: E402


def test_cells() -> None:
    assert parse_cell("32x1") == (32, 1) and parse_cell("1x32") == (1, 32)
    for bad in ("0x1", "1x0", "32", "ax1"):
        with pytest.raises(ValueError):
            parse_cell(bad)


def test_summary_is_the_median_per_cell() -> None:
    rounds = [{"cell": "1x1", "inputs_per_second": v, "errors": 0} for v in (10, 30, 20)]
    rounds.append({"cell": "32x1", "inputs_per_second": 100, "errors": 1})
    assert summarise(rounds) == {"1x1": {"inputs_per_second": 20, "errors": 0},
                                 "32x1": {"inputs_per_second": 100, "errors": 1}}


def test_forward_passes_from_the_metrics_text() -> None:
    text = ('mlxfleet_agent_embedding_batch_inputs_bucket{le="1.0",model="m",revision="r"} 1.0\n'
            'mlxfleet_agent_embedding_batch_inputs_count{model="m",revision="r"} 3.0\n'
            'mlxfleet_agent_embedding_batch_inputs_sum{model="m",revision="r"} 40.0\n')
    assert _batch_histogram(text) == (40.0, 3.0)
