"""vllm-mlx 0.6 as a second reference server for ``benchmarks/serving.py``: its own install and
its start command.

vllm-mlx 0.6.0 pins ``mlx-lm<0.32`` while the project pins a newer mlx-lm, so it lives in a
site directory of its own (``pip install --target``, every package ``--no-deps``), placed
before the normal site on ``PYTHONPATH`` for the vllm-mlx process only: its mlx-lm wins there,
and everything else (mlx or mlx-cuda, numpy, transformers, llguidance, …) comes from the
environment that runs the benchmark. :data:`REQUIREMENTS` are the packages its
``serve --continuous-batching`` path, its tool parsers and its ``--embedding-model`` path
import that such an environment lacks (found by starting it; see the notes on the GPU machine
in ``benchmarks/README.md``): fastapi and starlette with what the newest fastapi imports
(``opentelemetry-api``, ``annotated-doc``), uvicorn, python-multipart, jsonschema and its
parts, and mlx-embeddings (+ mlx-vlm, which it imports) for embeddings.

The site is built once into ``<mlx-fleet cache>/bench/vllm-mlx/site-<version>`` (from PyPI, or
with ``wheels`` from a folder of wheels, ``--no-index``: the GPU machine has no network) and
reused while its recorded requirement list is unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VERSION = "0.6.0"
#: Installed ``--no-deps`` into vllm-mlx's own site. mlx-lm 0.31.3: the newest its
#: ``mlx-lm<0.32`` pin allows (0.31.3 runs it). The others are pinned to what was tried.
REQUIREMENTS = (
    f"vllm-mlx=={VERSION}", "mlx-lm==0.31.3", "mlx-embeddings==0.1.0", "mlx-vlm==0.7.10",
    "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0", "python-multipart==0.0.34",
    "opentelemetry-api==1.45.2", "annotated-doc==0.0.7", "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1",
)
#: vllm-mlx's tool parser for the generated test model's chat template (the Qwen/Hermes
#: ``<tool_call>{"name", "arguments"}</tool_call>`` form, :mod:`mlx_fleet.testmodel`).
TOOL_PARSER = "hermes"

#: The vllm-mlx process: the same MLX buffer-cache limit as the other servers (first argument,
#: GB), then vllm-mlx's own CLI.
_START = ("import sys, mlx.core as mx; mx.set_cache_limit(int(float(sys.argv.pop(1)) * 1e9)); "
          "from vllm_mlx.cli import main; sys.argv[0] = 'vllm-mlx'; main()")


def install_argv(python: str, target: Path, wheels: Path | None) -> list[str]:
    """The ``pip install`` command line that fills ``target`` (offline from ``wheels``)."""
    source = ["--no-index", "--find-links", str(wheels)] if wheels is not None else []
    return [python, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
            "--disable-pip-version-check", "--target", str(target), *source, *REQUIREMENTS]


def site(wheels: Path | None = None, root: Path | None = None) -> Path:
    """vllm-mlx's site directory, built on first use (a minute from PyPI). ``root``: default
    ``<mlx-fleet cache>/bench/vllm-mlx``. Raises ``RuntimeError`` with pip's output if the
    install fails."""
    if root is None:
        from mlx_fleet.devcluster.binaries import cache_dir

        root = cache_dir() / "bench" / "vllm-mlx"
    target = root / f"site-{VERSION}"
    marker = target / ".mlx-fleet-requirements.json"
    if marker.exists() and json.loads(marker.read_text()) == list(REQUIREMENTS):
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="site-", dir=root))
    p = subprocess.run(install_argv(sys.executable, staging, wheels), capture_output=True,
                       text=True)
    if p.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"installing vllm-mlx failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    (staging / marker.name).write_text(json.dumps(list(REQUIREMENTS)))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def environment(site_dir: Path, base: dict[str, str], home: Path) -> dict[str, str]:
    """The vllm-mlx process's environment: ``site_dir`` first on ``PYTHONPATH`` (before what
    ``base`` has there), and ``HOME`` at ``home`` so the prefix cache vllm-mlx saves under
    ``~/.cache/vllm-mlx`` stays out of later runs."""
    path = os.pathsep.join([str(site_dir), *filter(None, [base.get("PYTHONPATH")])])
    return base | {"PYTHONPATH": path, "HOME": str(home), "PYTHONUNBUFFERED": "1"}


def serve_argv(python: str, model: Path, port: int, max_sequences: int, cache_limit_gb: float,
               served_name: str, embedding_model: Path | None = None) -> list[str]:
    """``vllm-mlx serve MODEL --continuous-batching`` on 127.0.0.1:``port``: ``max_sequences``
    concurrent sequences (``--max-num-seqs``, the others' batch limit), tool calls parsed with
    :data:`TOOL_PARSER`, and with ``embedding_model`` its ``/v1/embeddings`` (served under that
    path as the model name)."""
    argv = [python, "-c", _START, str(cache_limit_gb), "serve", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--continuous-batching",
            "--max-num-seqs", str(max_sequences), "--served-model-name", served_name,
            "--enable-auto-tool-choice", "--tool-call-parser", TOOL_PARSER, "--offline"]
    if embedding_model is not None:
        argv += ["--embedding-model", str(embedding_model)]
    return argv
