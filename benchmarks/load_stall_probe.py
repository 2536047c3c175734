"""What, in a load step, stalls a pipelined decode loop? A probe under the serving core's design
(node_agent.serving.loading), measured side by side in one run.

One mlx-lm ``BatchGenerator`` decodes 8 sequences of a generated llama (``--stream-hidden-size``
× 16 layers); after every ``next()`` the loop does one *variant* of work and the gaps between
``next()`` returns are recorded. Variants (alternating order over ``--rounds``):

- ``none``: nothing; ``sleep2ms`` / ``sleep8ms``: the host thread blocks, no MLX at all;
- ``load_eval``: ``mx.eval`` of the next weight array of a lazily loaded 4 GB model (one per
  step); ``load_eval_small``: the same, arrays under 1 MiB only; ``load_eval_cpu2``: the same
  model built under a separate CPU stream;
- ``load_async_cpu2``: that stream's arrays handed to ``mx.async_eval`` and not waited for;
- ``zeros_cpu_eval`` / ``zeros_gpu2_eval``: ``mx.eval`` of a fresh array of the largest weight's
  shape on the CPU / a second GPU stream (allocation without a file read).

Reading the result (``benchmarks/results/load_stall-probe-h100.json``): if host blocking adds to
the gap one for one (``sleep2ms``), the decode loop is host-bound and any wait on the MLX thread
stalls the other models; ``load_async_cpu2`` near ``none`` means an overlapped read does not.

    python benchmarks/load_stall_probe.py [--rounds 2] [--steps 150] [--stream-hidden-size 2048]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

from common import machine
from mlx_fleet.devcluster.binaries import cache_dir
from mlx_fleet.testmodel import make_test_model

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ["none", "sleep2ms", "sleep8ms", "load_eval", "load_eval_small", "load_eval_cpu2",
            "load_async_cpu2", "zeros_cpu_eval", "zeros_gpu2_eval"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150, help="decode steps per variant and round")
    ap.add_argument("--stream-hidden-size", type=int, default=2048)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--output", type=Path, default=RESULTS / "load_stall-probe.json")
    args = ap.parse_args(argv)

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load_model

    models = cache_dir() / "models"
    sp = make_test_model(models / f"probe-stream-h{args.stream_hidden_size}",
                         hidden_size=args.stream_hidden_size, num_layers=16, vocab_size=1024)
    lp = make_test_model(models / "probe-load-h2048", hidden_size=2048, num_layers=24,
                         vocab_size=1024)
    model, _ = load_model(sp)
    mx.eval(model.parameters())
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=8, prefill_batch_size=8,
                         stream=mx.new_stream(mx.default_device()))
    cpu2 = mx.new_stream(mx.cpu)
    gpu2 = mx.new_stream(mx.gpu) if mx.default_device() == mx.gpu else cpu2

    class Loader:
        def __init__(self, stream=None) -> None:
            self.stream, self.arrays, self.model = stream, [], None

        def next(self, small: bool = False):
            while True:
                if not self.arrays:
                    self.model = None
                    gc.collect()
                    if self.stream is not None:
                        with mx.stream(self.stream):
                            self.model, _ = load_model(lp, lazy=True)
                    else:
                        self.model, _ = load_model(lp, lazy=True)
                    self.arrays = [v for _, v in tree_flatten(self.model.parameters())]
                a = self.arrays.pop(0)
                if not (small and a.nbytes > 2**20):
                    return a

    plain, on_cpu2 = Loader(), Loader(cpu2)
    shapes = [a.shape for _, a in tree_flatten(load_model(lp, lazy=True)[0].parameters())]
    big = max(shapes, key=lambda s: s[0] * (s[1] if len(s) > 1 else 1))
    pending: list = []

    def interfere(v: str) -> None:
        if v == "none":
            return
        if v.startswith("sleep"):
            time.sleep(int(v[5:-2]) / 1000)
        elif v == "load_eval":
            mx.eval(plain.next())
        elif v == "load_eval_small":
            mx.eval(plain.next(small=True))
        elif v == "load_eval_cpu2":
            mx.eval(on_cpu2.next())
        elif v == "load_async_cpu2":
            pending.append(on_cpu2.next())
            mx.async_eval(pending[-1])
            del pending[:-4]
        elif v == "zeros_cpu_eval":
            mx.eval(mx.zeros(big, stream=mx.cpu))
        elif v == "zeros_gpu2_eval":
            mx.eval(mx.zeros(big, stream=gpu2))
        else:
            raise SystemExit(f"unknown variant {v!r}")

    variants = args.variants.split(",")
    gaps: dict[str, list[float]] = {v: [] for v in variants}
    host: dict[str, list[float]] = {v: [] for v in variants}
    gen.insert([[1, 2, 3, 4 + i] for i in range(8)], max_tokens=[10**7] * 8)
    for _ in range(30):
        gen.next()
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            for _ in range(5):
                gen.next()
            t = time.perf_counter()
            for _ in range(args.steps):
                gen.next()
                now = time.perf_counter()
                gaps[v].append(now - t)
                t = now
                h0 = time.perf_counter()
                interfere(v)
                host[v].append(time.perf_counter() - h0)
            mx.synchronize()
            pending.clear()

    def q(xs: list[float], p: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    out = {v: {"p50_ms": 1e3 * q(gaps[v], .5), "p90_ms": 1e3 * q(gaps[v], .9),
               "p99_ms": 1e3 * q(gaps[v], .99), "host_p50_ms": 1e3 * q(host[v], .5)}
           for v in variants}
    for v, o in out.items():
        print(f"{v:16s} gap p50 {o['p50_ms']:7.2f}  p90 {o['p90_ms']:7.2f}  p99 {o['p99_ms']:7.2f}"
              f"  host p50 {o['host_p50_ms']:6.2f} ms")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "benchmark": "load_stall_probe", "machine": machine(),
        "params": {"rounds": args.rounds, "steps": args.steps,
                   "stream_hidden_size": args.stream_hidden_size, "largest_array": list(big)},
        "variants": out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
