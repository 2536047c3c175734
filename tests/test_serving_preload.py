"""preload_and_freeze (node_agent/serving/preload.py), in a process of its own (it freezes the
whole process's objects): the loaders' objects leave the collector's reach, and a model loaded
afterwards is still freed by the unload's collection (MLX active memory back to what it was)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from serving_fixtures import tiny_model_path  # noqa: F401

SCRIPT = """
import gc, json, sys
import mlx.core as mx
from node_agent.serving.preload import preload_and_freeze
frozen = preload_and_freeze()
import mlx_lm
before = mx.get_active_memory()
model, tokenizer = mlx_lm.load(sys.argv[1])
loaded = mx.get_active_memory()
del model, tokenizer
gc.collect()
mx.clear_cache()
print(json.dumps({"frozen": frozen, "before": before, "loaded": loaded,
                  "after": mx.get_active_memory()}))
"""


def test_frozen_imports_and_a_later_model_is_still_freed(tiny_model_path: Path) -> None:  # noqa: F811
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["frozen"] > 10_000                 # the loaders' modules, classes, functions ...
    assert r["loaded"] > r["before"]            # the model's weights ...
    assert r["after"] == r["before"]            # ... are freed by one collection, as without
