"""Loads never stall serving: the inter-token gaps of a streaming model on one ServingCore with
nothing loading vs while another, larger model loads on the same core, measured side by side in
one run, alternating A/B per round.

What it measures: one greedy streaming request of the *stream* model per phase; every gap
between two consecutive chunks as its consumer on the event loop sees them. In the ``idle``
phase nothing else happens; in the ``load`` phase the *load* model (a larger generated llama) is
loaded, unloaded and loaded again for as long as the stream runs (two tokens apart, so no gap
spans both), and a gap counts as "during a load" when it overlaps a ``load_model`` call, "during
an unload" when it overlaps an ``unload_model`` call. Reported: p50/p99 of the gaps of each
kind, the p99 ratio during a load (issue 6's goal: ≤ 2 × idle), and the median seconds of one
load of the load model while the stream runs and while nothing else does. A third phase,
``load-sync``, does the same with ``LoadPacing(overlap=False)`` (each chunk read synchronously on
the MLX thread, the core's behaviour before overlapped reads): what overlapping buys, in the
same run. The claim is the ratio on one machine in one run, never an absolute number.

The core reads a load in chunks of whole arrays (:mod:`node_agent.serving.loading`); in the
synchronous phase the stall depends on the load model's largest array relative to the stream
model's decode step: ``--load-hidden-size`` sets it (the MLP matrices are hidden × 2·hidden
float32).

    python benchmarks/load_stall.py --help
    python benchmarks/load_stall.py --rounds 3 --load-hidden-size 512 --load-num-layers 24

Importable: :func:`measure` (the coroutine) and :func:`run` (runs it, returns the result);
``benchmarks/lifecycle.py`` reuses them for its ``itl_p99_ratio_during_load``. Results (JSON,
with the machine description) go to ``benchmarks/results/load_stall.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from prometheus_client import CollectorRegistry

from common import machine
from mlx_fleet.devcluster.binaries import cache_dir
from mlx_fleet.testmodel import make_test_model
from node_agent.serving import ServingCore

RESULTS = Path(__file__).resolve().parent / "results"
STREAM_ID = "stream"
LOAD_ID = "load"
PROMPT = "Once upon a time there was a little robot who"


@dataclass(frozen=True)
class Params:
    """Model sizes (generated llama models, float32) and the run's shape."""

    rounds: int = 3                  # A/B rounds (the order alternates)
    tokens: int = 400                # tokens streamed per phase
    stream_hidden_size: int = 256
    stream_num_layers: int = 4
    load_hidden_size: int = 512
    load_num_layers: int = 24
    vocab_size: int = 1024
    compare_sync: bool = True        # also a phase with LoadPacing(overlap=False) (the A/B)
    freeze: bool = True              # gc.freeze() the imports first, as the agent process does


def p(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, by linear interpolation (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _model(hidden: int, layers: int, vocab: int, seed: int) -> Path:
    return make_test_model(cache_dir() / "models" / f"stall-h{hidden}-l{layers}-v{vocab}-s{seed}",
                           hidden_size=hidden, num_layers=layers, vocab_size=vocab, seed=seed)


class _Stream:
    """One greedy stream of ``tokens`` tokens: ``times`` are its chunks' arrival times
    (perf_counter); :meth:`tokens_after` waits until ``n`` more have arrived."""

    def __init__(self, core: ServingCore, tokens: int) -> None:
        self.times: list[float] = []
        self._arrived = asyncio.Event()
        self.task = asyncio.create_task(self._run(core, tokens))

    async def _run(self, core: ServingCore, tokens: int) -> list[float]:
        gen = await core.generate(STREAM_ID, prompt=PROMPT, max_tokens=tokens, temperature=0)
        async for _ in gen:
            self.times.append(time.perf_counter())
            self._arrived.set()
        self._arrived.set()
        return self.times

    async def tokens_after(self, n: int) -> None:
        """Wait for ``n`` more tokens (or the end of the stream)."""
        target = len(self.times) + n
        while len(self.times) < target and not self.task.done():
            self._arrived.clear()
            await self._arrived.wait()


async def _load_cycle(core: ServingCore, load_path: Path, stream: _Stream,
                      loads: list[tuple[float, float]],
                      unloads: list[tuple[float, float]]) -> None:
    """Load, unload, load ... the load model until ``stream`` ends; records each load's and
    each unload's ``(start, end)``. Between the two the stream delivers two tokens, so that no
    gap spans both a load and an unload: they are told apart."""
    n = 0
    while not stream.task.done():
        n += 1
        t0 = time.perf_counter()
        await core.load_model(LOAD_ID, load_path, revision=f"r{n}")
        loads.append((t0, time.perf_counter()))
        await stream.tokens_after(2)
        t0 = time.perf_counter()
        await core.unload_model(LOAD_ID)
        unloads.append((t0, time.perf_counter()))
        await stream.tokens_after(2)


def _gaps(times: list[float]) -> list[tuple[float, float]]:
    return list(zip(times, times[1:]))


def _overlaps(gap: tuple[float, float], intervals: list[tuple[float, float]]) -> bool:
    return any(gap[0] < end and start < gap[1] for start, end in intervals)


async def measure(params: Params = Params()) -> dict:
    """Run the benchmark in this event loop; returns the result dict (see the module doc)."""
    if params.freeze:
        try:
            from node_agent.serving.preload import preload_and_freeze
        except ImportError:          # an older agent (before/after comparisons)
            pass
        else:
            preload_and_freeze()
    stream_path = _model(params.stream_hidden_size, params.stream_num_layers,
                         params.vocab_size, 0)
    load_path = _model(params.load_hidden_size, params.load_num_layers, params.vocab_size, 1)
    core = ServingCore(registry=CollectorRegistry())
    overlapped = core.load_pacing
    await core.start()
    rounds: list[dict] = []
    idle_gaps: list[float] = []
    load_gaps: list[float] = []
    phase_gaps: list[float] = []
    unload_gaps: list[float] = []
    loads_during_stream: list[float] = []
    sync_gaps: list[float] = []
    sync_loads: list[float] = []
    loads_alone: list[float] = []
    try:
        await core.load_model(STREAM_ID, stream_path, revision="r1", max_context_tokens=8192)
        await _Stream(core, 16).task                             # warm-up: kernels, caches
        for _ in range(2):                                       # warm-up: page cache
            t0 = time.perf_counter()
            await core.load_model(LOAD_ID, load_path, revision="warm")
            loads_alone.append(time.perf_counter() - t0)
            await core.unload_model(LOAD_ID)
        loads_alone.clear()
        phases = ["idle", "load"] + (["load-sync"] if params.compare_sync else [])
        for i in range(params.rounds):
            for phase in (phases if i % 2 == 0 else phases[::-1]):
                if phase == "idle":
                    times = await _Stream(core, params.tokens).task
                    gaps = [b - a for a, b in _gaps(times)]
                    idle_gaps += gaps
                    t0 = time.perf_counter()
                    await core.load_model(LOAD_ID, load_path, revision="alone")
                    loads_alone.append(time.perf_counter() - t0)
                    await core.unload_model(LOAD_ID)
                    rounds.append({"phase": phase, "gaps": len(gaps),
                                   "itl_p99_seconds": p(gaps, 0.99)})
                else:
                    core.load_pacing = (overlapped if phase == "load"
                                        else replace(overlapped, overlap=False))
                    intervals: list[tuple[float, float]] = []
                    unloads: list[tuple[float, float]] = []
                    stream = _Stream(core, params.tokens)
                    await _load_cycle(core, load_path, stream, intervals, unloads)
                    times = await stream.task
                    core.load_pacing = overlapped
                    during = [b - a for a, b in _gaps(times) if _overlaps((a, b), intervals)]
                    if phase == "load":
                        load_gaps += during
                        unload_gaps += [b - a for a, b in _gaps(times)
                                        if _overlaps((a, b), unloads)]
                        phase_gaps += [b - a for a, b in _gaps(times)]
                        loads_during_stream += [e - s for s, e in intervals]
                    else:
                        sync_gaps += during
                        sync_loads += [e - s for s, e in intervals]
                    rounds.append({"phase": phase, "gaps_during_load": len(during),
                                   "loads": len(intervals),
                                   "itl_p99_seconds_during_load": p(during, 0.99)})
                print(f"round {i + 1} {phase:>9}: {json.dumps(rounds[-1])}", file=sys.stderr)
    finally:
        await core.close()
    idle99, load99 = p(idle_gaps, 0.99), p(load_gaps, 0.99)
    return {
        "benchmark": "load_stall",
        "machine": machine(),
        "params": asdict(params),
        "load_model_bytes": sum(f.stat().st_size for f in load_path.glob("*.safetensors")),
        "rounds": rounds,
        "itl_p50_seconds_idle": p(idle_gaps, 0.5),
        "itl_p99_seconds_idle": idle99,
        "itl_p50_seconds_during_load": p(load_gaps, 0.5),
        "itl_p99_seconds_during_load": load99,
        "itl_max_seconds_during_load": max(load_gaps, default=float("nan")),
        "itl_p99_seconds_during_unload": p(unload_gaps, 0.99),
        "itl_p99_seconds_load_phase": p(phase_gaps, 0.99),
        "itl_p99_ratio_during_load": load99 / idle99,
        "gaps_idle": len(idle_gaps),
        "gaps_during_load": len(load_gaps),
        "gaps_during_unload": len(unload_gaps),
        "load_seconds": statistics.median(loads_during_stream) if loads_during_stream else None,
        "load_seconds_alone": statistics.median(loads_alone) if loads_alone else None,
        "loads": len(loads_during_stream),
        # the same with LoadPacing(overlap=False): synchronous chunks (what overlapping buys)
        "itl_p50_seconds_during_load_sync": p(sync_gaps, 0.5),
        "itl_p99_seconds_during_load_sync": p(sync_gaps, 0.99),
        "itl_p99_ratio_during_load_sync": p(sync_gaps, 0.99) / idle99 if sync_gaps else None,
        "load_seconds_sync": statistics.median(sync_loads) if sync_loads else None,
    }


def run(params: Params = Params()) -> dict:
    """:func:`measure` in a fresh event loop."""
    return asyncio.run(measure(params))


def main(argv: list[str] | None = None) -> int:
    d = Params()
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=d.rounds, help="A/B rounds (order alternates)")
    ap.add_argument("--tokens", type=int, default=d.tokens, help="tokens streamed per phase")
    ap.add_argument("--stream-hidden-size", type=int, default=d.stream_hidden_size)
    ap.add_argument("--stream-num-layers", type=int, default=d.stream_num_layers)
    ap.add_argument("--load-hidden-size", type=int, default=d.load_hidden_size)
    ap.add_argument("--load-num-layers", type=int, default=d.load_num_layers)
    ap.add_argument("--vocab-size", type=int, default=d.vocab_size)
    ap.add_argument("--no-compare-sync", dest="compare_sync", action="store_false",
                    help="skip the phase that loads with LoadPacing(overlap=False)")
    ap.add_argument("--no-freeze", dest="freeze", action="store_false",
                    help="don't gc.freeze() the imports first (the agent process does)")
    ap.add_argument("--output", type=Path, default=RESULTS / "load_stall.json",
                    help="result JSON (default: %(default)s)")
    args = ap.parse_args(argv)
    params = Params(**{k: v for k, v in vars(args).items() if k != "output"})
    result = run(params)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"p99 inter-token gap idle {1000 * result['itl_p99_seconds_idle']:.2f} ms, during a "
          f"load {1000 * result['itl_p99_seconds_during_load']:.2f} ms "
          f"(×{result['itl_p99_ratio_during_load']:.2f}); one load "
          f"{result['load_seconds']:.3f} s during the stream, {result['load_seconds_alone']:.3f} s "
          f"alone; synchronous chunks: ×{result['itl_p99_ratio_during_load_sync'] or float('nan'):.2f}"
          f" — {result['machine']['cpu']}, {result['machine']['mlx_device']} → {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
