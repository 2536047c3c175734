"""Large prompts never stall other requests (issue 19, finding 5): a streaming request's
inter-token gaps on one ServingCore with nothing else arriving vs while four 1 MB chat prompts
arrive, side by side in one run, alternating per round.

What it measures: one greedy streaming request of a small generated llama per phase; every gap
between two consecutive chunks as its consumer on the event loop sees them. In the ``idle``
phase nothing else happens; in the ``prompts`` phase, once the stream has produced a few tokens,
four chat requests with one ``--prompt-bytes`` message each (random words, so the tokenizer has
real work) are sent at once; each is refused (``ContextLengthExceeded``: far beyond the context)
after it is tokenized — the issue's case. A gap counts as "during the prompts" when it overlaps
the interval from their submission to the last refusal. Reported: the worst gap (the issue's
measure) and the p99 of each phase, their ratio (issue 19's goal: worst during ≤ 2 × worst
idle) and how long the prompts took to be refused.

Before/after: the script drives only :meth:`ServingCore.generate`, so it runs unchanged against
an older tree (tokenization on the MLX thread):

    PYTHONPATH=/path/to/old/tree python benchmarks/prompt_stall.py --output results/prompt_stall-before.json
    python benchmarks/prompt_stall.py

Results (JSON, with the machine description) go to ``benchmarks/results/prompt_stall.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from common import machine
from load_stall import _Stream, _gaps, _overlaps, p
from mlx_fleet.devcluster.binaries import cache_dir
from mlx_fleet.testmodel import make_test_model
from node_agent.serving import ContextLengthExceeded, InvalidPrompt, ServingCore

RESULTS = Path(__file__).resolve().parent / "results"
STREAM_ID = "stream"  # load_stall._Stream streams this model id


@dataclass(frozen=True)
class Params:
    rounds: int = 2                  # idle/prompts rounds (the order alternates)
    tokens: int = 200                # tokens streamed per phase
    prompts: int = 4                 # concurrent large prompts per prompts phase
    prompt_bytes: int = 1_000_000    # bytes of each prompt's message
    hidden_size: int = 256
    num_layers: int = 4
    vocab_size: int = 1024
    freeze: bool = True              # gc.freeze() the imports first, as the agent process does


def _text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["the", "robot", "walked", "into", "a", "quiet", "garden", "and", "counted",
             "seventeen", "tulips", "before", "sunrise", "while", "humming", "softly",
             "über", "naïve", "café", "2026", "x=1;", "{", "}", "(", ")"]
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(words)
        out.append(w)
        size += len(w.encode()) + 1
    return " ".join(out)[:n]


async def _prompts(core: ServingCore, texts: list[str]) -> tuple[float, float, list[str]]:
    """Send every text as one chat request at once; ``(start, end, outcomes)``."""
    async def one(text: str) -> str:
        try:
            gen = await core.generate(STREAM_ID, messages=[{"role": "user", "content": text}],
                                      max_tokens=8, temperature=0)
        except ContextLengthExceeded:
            return "context_length_exceeded"
        except InvalidPrompt as e:  # the byte bound (PromptTooLarge), in a new tree
            return type(e).__name__
        async for _ in gen:
            pass
        return "served"

    t0 = time.perf_counter()
    outcomes = await asyncio.gather(*(one(t) for t in texts))
    return t0, time.perf_counter(), list(outcomes)


async def measure(params: Params = Params()) -> dict:
    if params.freeze:
        try:
            from node_agent.serving.preload import preload_and_freeze
        except ImportError:
            pass
        else:
            preload_and_freeze()
    path = make_test_model(cache_dir() / "models" / f"prompt-stall-h{params.hidden_size}"
                           f"-l{params.num_layers}-v{params.vocab_size}",
                           hidden_size=params.hidden_size, num_layers=params.num_layers,
                           vocab_size=params.vocab_size, seed=0)
    kwargs = {}
    if "max_prompt_bytes" in inspect.signature(ServingCore).parameters:
        # above the prompts' size: they are tokenized (off the MLX thread), not refused early
        kwargs["max_prompt_bytes"] = 2 * params.prompt_bytes
    core = ServingCore(registry=CollectorRegistry(), **kwargs)
    await core.start()
    texts = [_text(params.prompt_bytes, seed) for seed in range(params.prompts)]
    idle_gaps: list[float] = []
    during_gaps: list[float] = []
    refusal_seconds: list[float] = []
    outcomes: list[str] = []
    rounds: list[dict] = []
    try:
        await core.load_model(STREAM_ID, path, revision="r1", max_context_tokens=8192)
        await _Stream(core, 16).task                             # warm-up
        await _prompts(core, [t[:10_000] for t in texts])        # warm-up: tokenizer, template
        for i in range(params.rounds):
            for phase in (("idle", "prompts") if i % 2 == 0 else ("prompts", "idle")):
                stream = _Stream(core, params.tokens)
                if phase == "idle":
                    times = await stream.task
                    gaps = [b - a for a, b in _gaps(times)]
                    idle_gaps += gaps
                    rounds.append({"phase": phase, "gaps": len(gaps),
                                   "itl_max_seconds": max(gaps)})
                else:
                    await stream.tokens_after(10)
                    t0, t1, out = await _prompts(core, texts)
                    times = await stream.task
                    gaps = [b - a for a, b in _gaps(times) if _overlaps((a, b), [(t0, t1)])]
                    during_gaps += gaps
                    refusal_seconds.append(t1 - t0)
                    outcomes += out
                    rounds.append({"phase": phase, "gaps_during_prompts": len(gaps),
                                   "itl_max_seconds_during_prompts": max(gaps, default=None),
                                   "prompts_seconds": t1 - t0, "outcomes": out})
                print(f"round {i + 1} {phase:>7}: {json.dumps(rounds[-1])}", file=sys.stderr)
    finally:
        await core.close()
    worst_idle = max(idle_gaps)
    worst_during = max(during_gaps, default=float("nan"))
    return {
        "benchmark": "prompt_stall",
        "machine": machine(),
        "params": asdict(params),
        "core_kwargs": kwargs,
        "rounds": rounds,
        "itl_max_seconds_idle": worst_idle,
        "itl_p99_seconds_idle": p(idle_gaps, 0.99),
        "itl_p50_seconds_idle": p(idle_gaps, 0.5),
        "itl_max_seconds_during_prompts": worst_during,
        "itl_p99_seconds_during_prompts": p(during_gaps, 0.99),
        "itl_p50_seconds_during_prompts": p(during_gaps, 0.5),
        "itl_max_ratio_during_prompts": worst_during / worst_idle,
        "gaps_idle": len(idle_gaps),
        "gaps_during_prompts": len(during_gaps),
        "prompts_seconds": statistics.median(refusal_seconds),
        "prompt_outcomes": sorted(set(outcomes)),
    }


def main(argv: list[str] | None = None) -> int:
    d = Params()
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=d.rounds)
    ap.add_argument("--tokens", type=int, default=d.tokens)
    ap.add_argument("--prompts", type=int, default=d.prompts)
    ap.add_argument("--prompt-bytes", type=int, default=d.prompt_bytes)
    ap.add_argument("--hidden-size", type=int, default=d.hidden_size)
    ap.add_argument("--num-layers", type=int, default=d.num_layers)
    ap.add_argument("--vocab-size", type=int, default=d.vocab_size)
    ap.add_argument("--no-freeze", dest="freeze", action="store_false")
    ap.add_argument("--output", type=Path, default=RESULTS / "prompt_stall.json")
    args = ap.parse_args(argv)
    params = Params(**{k: v for k, v in vars(args).items() if k != "output"})
    result = asyncio.run(measure(params))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"worst inter-token gap idle {1000 * result['itl_max_seconds_idle']:.1f} ms, while "
          f"{params.prompts} x {params.prompt_bytes} B prompts arrive "
          f"{1000 * result['itl_max_seconds_during_prompts']:.1f} ms "
          f"(x{result['itl_max_ratio_during_prompts']:.2f}); prompts refused after "
          f"{result['prompts_seconds']:.2f} s ({result['prompt_outcomes']}) — "
          f"{result['machine']['cpu']}, {result['machine']['mlx_device']} → {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
