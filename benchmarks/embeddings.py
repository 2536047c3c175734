"""Embeddings throughput of the agent's serving path: ``POST /v1/embeddings`` over a generated
embedding model (``make_test_model(embedding=True)``: qwen3 decoder, last-token pooling).

One process serves (this script with ``--serve``: :class:`~node_agent.serving.ServingCore` +
the agent's OpenAI app, as :func:`serving.serve_ours` does for generation), this one drives it
over HTTP (aiohttp, ``encoding_format: base64`` as the ``openai`` client sends by default).
Cells (``--cells``, ``BATCHxCONCURRENCY``): requests of ``BATCH`` inputs each, ``CONCURRENCY``
at a time, until ``--inputs`` inputs are embedded; the default cells are ``1x1`` (one input at
a time: no batching possible), ``1x32`` (32 concurrent one-input requests: the core's batcher
pads them into shared forward passes) and ``32x1`` (one request of 32 inputs at a time).

Reported per cell (median over ``--rounds`` rounds after a warm-up round): inputs/s,
requests/s, request latency p50/p95, and the mean inputs per forward pass (from the server's
``mlxfleet_agent_embedding_batch_inputs`` histogram).

    python benchmarks/embeddings.py --smoke                # a few seconds (CI, this CPU)
    python benchmarks/embeddings.py --hidden-size 1024 --num-layers 28 --input-words 128
        # a Qwen3-Embedding-0.6B-sized model (the GPU machine)

Results: ``benchmarks/results/embeddings-<device>.json`` (machine, versions, every round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODEL_ID = "bench-embed"
_WORDS = ("model weights memory token batch cache prefix stream agent fleet canary revision "
          "node lease budget watermark prefill decode sample greedy latency throughput queue "
          "admission drain").split()


def parse_cell(text: str) -> tuple[int, int]:
    """``"BATCHxCONCURRENCY"`` → ``(batch, concurrency)``; raises ``ValueError``."""
    batch, _, conc = text.partition("x")
    b, c = int(batch), int(conc)
    if b < 1 or c < 1:
        raise ValueError(f"{text}: batch and concurrency must be >= 1")
    return b, c


def summarise(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median per cell of every measured number of ``rounds`` (``{"cell", ...numbers}``)."""
    cells: dict[str, list[dict[str, Any]]] = {}
    for r in rounds:
        cells.setdefault(r["cell"], []).append(r)
    return {cell: {k: statistics.median(r[k] for r in rs)
                   for k in rs[0] if k != "cell"} for cell, rs in cells.items()}


def _batch_histogram(text: str) -> tuple[float, float]:
    """``(sum, count)`` of ``mlxfleet_agent_embedding_batch_inputs`` in a /metrics text."""
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("mlxfleet_agent_embedding_batch_inputs_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("mlxfleet_agent_embedding_batch_inputs_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


async def run_round(url: str, batch: int, concurrency: int, inputs: int, words: int,
                    seed: int) -> dict[str, float]:
    import aiohttp

    rng = random.Random(seed)
    n_requests = max(1, inputs // batch)
    bodies = [{"model": MODEL_ID, "encoding_format": "base64",
               "input": [" ".join(rng.choice(_WORDS) for _ in range(words))
                         for _ in range(batch)]} for _ in range(n_requests)]
    latencies: list[float] = []
    errors = 0
    async with aiohttp.ClientSession() as session:
        before = _batch_histogram(await (await session.get(f"{url}/metrics")).text())
        queue = list(reversed(bodies))

        async def worker() -> None:
            nonlocal errors
            while queue:
                body = queue.pop()
                t = time.perf_counter()
                async with session.post(f"{url}/v1/embeddings", json=body) as resp:
                    await resp.read()
                    errors += resp.status != 200
                latencies.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        after = _batch_histogram(await (await session.get(f"{url}/metrics")).text())
    latencies.sort()
    passes = after[1] - before[1]
    return {"inputs_per_second": n_requests * batch / wall,
            "requests_per_second": n_requests / wall,
            "latency_p50_seconds": latencies[len(latencies) // 2],
            "latency_p95_seconds": latencies[min(len(latencies) - 1,
                                                 int(0.95 * len(latencies)))],
            "inputs_per_forward_pass": (after[0] - before[0]) / passes if passes else 0.0,
            "errors": errors}


async def serve(model: Path, port: int, max_sequences: int, max_context: int) -> None:
    """The agent's serving path for one embedding model until SIGTERM."""
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from node_agent.openai_api import build_app
    from node_agent.serving import ServingCore

    core = ServingCore(registry=CollectorRegistry(), max_queued_requests=4 * max_sequences)
    await core.start()
    await core.load_model(MODEL_ID, model, revision="bench", task="TextEmbedding",
                          max_concurrent_sequences=max_sequences,
                          max_context_tokens=max_context)
    runner = web.AppRunner(build_app(core, health=lambda: (True, {}), registry=core.registry),
                           access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await core.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--input-words", type=int, default=32, help="words per input (default 32)")
    p.add_argument("--inputs", type=int, default=512, help="inputs per round (default 512)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cells", nargs="+", default=["1x1", "1x32", "32x1"],
                   help="BATCHxCONCURRENCY cells (default 1x1 1x32 32x1)")
    p.add_argument("--max-sequences", type=int, default=32,
                   help="the deployment's maxConcurrentSequences: inputs per forward pass")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model and few inputs: seconds, to check the script runs")
    p.add_argument("--output", type=Path,
                   help="default benchmarks/results/embeddings-<device>.json")
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve is not None:
        asyncio.run(serve(args.serve, args.port, args.max_sequences, 8192))
        return 0
    if args.smoke:
        args.hidden_size, args.num_layers, args.inputs, args.rounds = 64, 2, 64, 1
    cells = [parse_cell(c) for c in args.cells]

    import mlx.core as mx

    sys.path.insert(0, str(HERE))
    from common import machine
    from serving import Server, _free_port

    from mlx_fleet.testmodel import make_test_model

    device = "gpu" if "gpu" in str(mx.default_device()) else "cpu"
    work = Path(tempfile.mkdtemp(prefix="mlxfleet-embed-bench-"))
    model = make_test_model(work / "model", hidden_size=args.hidden_size,
                            num_layers=args.num_layers, embedding=True,
                            num_heads=max(1, args.hidden_size // 64))
    server = Server("ours", [sys.executable, str(Path(__file__).resolve()), "--serve",
                             str(model), "--port", str(_free_port()), "--max-sequences",
                             str(args.max_sequences)], work / "server.log", MODEL_ID)
    rounds: list[dict[str, Any]] = []
    try:
        server.wait_ready()
        for batch, conc in cells:
            cell = f"{batch}x{conc}"
            asyncio.run(run_round(server.url, batch, conc, min(args.inputs, 64),
                                  args.input_words, seed=-1))   # warm-up
            for i in range(args.rounds):
                r = asyncio.run(run_round(server.url, batch, conc, args.inputs,
                                          args.input_words, seed=i))
                rounds.append({"cell": cell, **r})
                print(f"{cell:>6}  {r['inputs_per_second']:9.1f} inputs/s  "
                      f"p50 {r['latency_p50_seconds'] * 1000:7.1f} ms  "
                      f"{r['inputs_per_forward_pass']:5.1f} inputs/pass  "
                      f"errors {r['errors']}", flush=True)
    finally:
        server.stop()
    result = {"machine": machine(), "versions": {
        k: metadata.version(k) for k in ("mlx", "mlx-lm")},
        "params": {k: v for k, v in vars(args).items() if k not in ("serve", "port", "output")},
        "summary": summarise(rounds), "rounds": rounds}
    out = args.output or RESULTS / f"embeddings-{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 0 if not any(r["errors"] for r in rounds) else 1


if __name__ == "__main__":
    raise SystemExit(main())
