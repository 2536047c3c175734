"""Time-to-first-token overhead of the serving core over raw mlx-lm, side by side in one process.

Issue #9's goal: TTFT p50 at one stream within 2 ms of raw ``mlx_lm.stream_generate`` on the
same prompt. Rounds alternate A/B: **raw** — ``mlx_lm.stream_generate`` on the model as
``mlx_lm.load`` returns it, time to its first response; **core** — the same model loaded by
the agent's :class:`~node_agent.serving.ServingCore`, time from ``generate`` to its first
chunk (admission, the MLX thread's command queue, ``BatchGenerator`` prefill, detokenizing,
the hop back to the event loop); **core-batched** — the same core with its first-token fast path
switched off (a second core with ``ServingOptions(fast_first_token=False)``: the first token goes through
``BatchGenerator``'s three-call admission, :mod:`node_agent.serving.fastpath`). Greedy, same
prompt, after a warm-up of each. Reported: median and p95 of each, and the overhead (core − raw)
at the median, in milliseconds, with and without the fast path.

    python benchmarks/ttft_overhead.py --help
    python benchmarks/ttft_overhead.py --rounds 20            # benchmarks/results/ttft_overhead-<device>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PROMPT = "Write one sentence about unified memory on Apple silicon."
WORDS = ("unified memory model weights token batch cache stream agent fleet canary revision node "
         "lease budget prefill decode sample latency throughput queue").split()


def raw_ttft(model, tokenizer, prompt: str) -> float:
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    t0 = time.perf_counter()
    for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=2,
                                    sampler=make_sampler(temp=0.0)):
        return time.perf_counter() - t0
    raise RuntimeError("stream_generate produced nothing")


async def core_ttft(core, prompt: str) -> float:
    t0 = time.perf_counter()
    gen = await core.generate("bench", prompt=prompt, max_tokens=2, temperature=0)
    async with gen:
        async for _ in gen:
            return time.perf_counter() - t0
    raise RuntimeError("the core produced nothing")


async def run(args: argparse.Namespace) -> dict:
    import mlx_lm
    from prometheus_client import CollectorRegistry

    from common import machine
    from mlx_fleet.devcluster.binaries import cache_dir
    from mlx_fleet.testmodel import make_test_model
    from node_agent.serving import ServingCore, ServingOptions

    path = make_test_model(
        (args.model_cache or cache_dir() / "models") / f"ttft-h{args.hidden_size}-l{args.num_layers}",
        hidden_size=args.hidden_size, num_layers=args.num_layers)
    model, tokenizer = mlx_lm.load(str(path))
    cores = {}
    for kind, fast in (("core", True), ("core-batched", False)):
        cores[kind] = ServingCore(registry=CollectorRegistry(),
                                  options=ServingOptions(fast_first_token=fast))
        await cores[kind].start()
        await cores[kind].load_model("bench", path, revision="r1")
    raw, ours, batched = [], [], []
    rng = random.Random(0)

    async def measure(kind: str, prompt: str) -> None:
        if kind == "raw":
            raw.append(raw_ttft(model, tokenizer, prompt))
            return
        (ours if kind == "core" else batched).append(await core_ttft(cores[kind], prompt))

    kinds = ["raw", "core", "core-batched"]
    try:
        for _ in range(3):  # warm-up: kernels compiled, caches primed
            for kind in kinds:
                await measure(kind, PROMPT)
        for i in range(args.rounds):
            # a prompt sharing no prefix with any earlier one: no prompt-cache hit for any
            prompt = f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
            for kind in (kinds if i % 2 == 0 else kinds[::-1]):
                await measure(kind, f"{kind} {prompt}")
    finally:
        for c in cores.values():
            await c.close()

    def p95(xs: list[float]) -> float:
        return sorted(xs)[max(0, int(round(0.95 * (len(xs) - 1))))]

    r50, o50, b50 = statistics.median(raw), statistics.median(ours), statistics.median(batched)
    return {"benchmark": "ttft_overhead", "machine": machine(),
            "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "raw_ttft_p50_seconds": r50, "raw_ttft_p95_seconds": p95(raw),
            "core_ttft_p50_seconds": o50, "core_ttft_p95_seconds": p95(ours),
            "core_batched_ttft_p50_seconds": b50, "core_batched_ttft_p95_seconds": p95(batched),
            "overhead_p50_ms": 1000 * (o50 - r50),
            "overhead_p50_ms_without_fast_path": 1000 * (b50 - r50),
            "raw": raw, "core": ours, "core_batched": batched}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20, help="A/B rounds (default 20)")
    p.add_argument("--hidden-size", type=int, default=256, help="generated model width")
    p.add_argument("--num-layers", type=int, default=4, help="generated model depth")
    p.add_argument("--prompt-words", type=int, default=12, help="words per prompt (default 12)")
    p.add_argument("--model-cache", type=Path, help="where generated models are kept")
    p.add_argument("--output", type=Path, help="default benchmarks/results/ttft_overhead-<device>.json")
    args = p.parse_args()
    result = asyncio.run(run(args))
    device = "gpu" if "gpu" in result["machine"]["mlx_device"] else "cpu"
    out = args.output or RESULTS / f"ttft_overhead-{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"TTFT p50 raw {1000 * result['raw_ttft_p50_seconds']:.2f} ms, core "
          f"{1000 * result['core_ttft_p50_seconds']:.2f} ms: overhead "
          f"{result['overhead_p50_ms']:.2f} ms (goal ≤ 2); without the fast path "
          f"{result['overhead_p50_ms_without_fast_path']:.2f} ms → {out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
