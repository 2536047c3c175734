"""benchmarks/constrained.py's mask measurement on the generated test model's tokenizer (its
smoke size, about a second): both libraries accept every valid instance, and llguidance — what
the agent uses — refuses every instance that breaks a bound or pattern of its schema."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from constrained import SCHEMAS, measure_masks  # noqa: E402


def test_mask_measurement(test_model_dir: Path) -> None:
    masks = measure_masks(test_model_dir, rounds=1)
    assert set(masks) == set(SCHEMAS)
    for name, row in masks.items():
        assert row["tokens"] > 0
        for lib in ("llguidance", "outlines-core"):
            assert row[lib]["accepts_valid"], (name, lib)
            assert row[lib]["mask_us_per_token"] > 0 and row[lib]["compile_ms"] > 0
        assert row["llguidance"]["enforces"], name
