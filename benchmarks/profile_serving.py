"""Where the agent's serving path spends its host time per token: the agent's serving core and
OpenAI app in this process, driven by ``benchmarks/serving.py``'s out-of-process load
generator, with ``cProfile`` on the event-loop thread and on the MLX thread.

    python benchmarks/profile_serving.py --model DIR --workload duplicate   # 20 identical
    python benchmarks/profile_serving.py --model DIR --workload unique --concurrency 32
    python benchmarks/profile_serving.py --model DIR --no-profile           # CPU times only

Prints the tokens delivered, each thread's CPU time per 1 000 delivered tokens
(``time.thread_time``; one delivered token is one subscriber's token) and, per thread, the
functions with the largest own (``tottime``) and cumulative time; ``--dump DIR`` keeps the raw
``pstats`` files (``loop.prof``, ``mlx.prof``). Profiled times are those of a profiled run
(cProfile slows Python code several-fold): read them as shares. The code profiled is the
``node_agent`` first on ``sys.path``: set ``PYTHONPATH`` to another checkout to profile it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _table(prof: cProfile.Profile, sort: str, top: int) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).strip_dirs().sort_stats(sort).print_stats(top)
    return out.getvalue()


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    import serving as bench
    from node_agent.openai_api import build_app
    from node_agent.serving import ServingCore

    mx.set_cache_limit(int(2e9))
    core = ServingCore(registry=CollectorRegistry(), max_queued_requests=256,
                       options=bench.ours_options(args.ours_args))
    await core.start()
    await core.load_model(bench.MODEL_ID, args.model, revision="bench",
                          max_concurrent_sequences=max(args.concurrency, bench.DUPLICATES),
                          max_context_tokens=8192)
    runner = web.AppRunner(build_app(core, health=lambda: (True, {}), registry=core.registry),
                           access_log=None, handler_cancellation=True)
    await runner.setup()
    port = bench._free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"

    async def client(bodies: list[dict], concurrency: int) -> dict:
        p = await asyncio.create_subprocess_exec(
            sys.executable, str(HERE / "serving.py"), "--client", url,
            "--concurrency-client", str(concurrency), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE)
        out, _ = await p.communicate(json.dumps(bodies).encode())
        return json.loads(out)

    def on_mlx_thread(fn: Any) -> Any:
        return core._call(fn)  # noqa: SLF001 - the core's command channel, between two steps

    n = c = bench.DUPLICATES if args.workload == "duplicate" else args.concurrency
    await client(bench.requests_for(args.workload, n, 8, -1), c)   # warm-up
    loop_prof, mlx_prof = cProfile.Profile(), cProfile.Profile()
    threads = ("loop", "mlx") if args.thread == "both" else (args.thread,)
    if args.profile:   # each thread's profiler is switched on (and off) on that thread
        if "mlx" in threads:
            await on_mlx_thread(mlx_prof.enable)
        if "loop" in threads:
            loop_prof.enable()
    mlx0, loop0 = await on_mlx_thread(time.thread_time), time.thread_time()
    wall0 = time.perf_counter()
    results = []
    for i in range(args.rounds):
        results.append(await client(bench.requests_for(args.workload, n, args.max_tokens, i), c))
    cpu = {"loop": time.thread_time() - loop0,
           "mlx": await on_mlx_thread(time.thread_time) - mlx0,
           "wall": time.perf_counter() - wall0}
    if args.profile:
        if "loop" in threads:
            loop_prof.disable()
        if "mlx" in threads:
            await on_mlx_thread(mlx_prof.disable)
    await runner.cleanup()
    await core.close()
    return {"loop": loop_prof, "mlx": mlx_prof, "results": results, "cpu": cpu}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="an mlx-lm model directory")
    p.add_argument("--workload", default="duplicate", choices=("duplicate", "unique", "logprobs"),
                   help="duplicate: 20 identical greedy requests (coalesced); unique: "
                        "--concurrency distinct ones; logprobs: unique's with top_logprobs "
                        "(serving.py's TOP_LOGPROBS)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ours-args", default="", help="the agent's serving flags (see serving.py)")
    p.add_argument("--top", type=int, default=25, help="functions listed per table")
    p.add_argument("--dump", type=Path, help="keep loop.prof and mlx.prof here")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="only the CPU time of each thread per delivered token (no cProfile)")
    p.add_argument("--thread", choices=("both", "loop", "mlx"), default="both",
                   help="which thread(s) to profile (default both; Python 3.12+ allows one "
                        "cProfile at a time in a process: choose loop or mlx there)")
    args = p.parse_args()
    if args.profile and args.thread == "both" and sys.version_info >= (3, 12):
        p.error("on Python 3.12+ only one thread can be profiled per run: --thread loop or "
                "--thread mlx (or --no-profile)")
    sys.path.insert(0, str(HERE))
    sys.path.append(str(HERE.parent))   # after PYTHONPATH: another checkout's code wins
    out = asyncio.run(_main(args))
    tokens = sum(r["output_tokens"] for r in out["results"])
    cpu = out["cpu"]
    print(f"{args.workload}: {tokens} tokens delivered in {args.rounds} rounds; tok/s per "
          f"round: {[round(r['output_tokens_per_second']) for r in out['results']]}")
    print(f"CPU time per 1000 delivered tokens: event loop {1e6 * cpu['loop'] / tokens:.1f} ms, "
          f"MLX thread {1e6 * cpu['mlx'] / tokens:.1f} ms (wall {cpu['wall']:.2f} s; "
          f"{tokens / cpu['wall']:.0f} tokens/s)")
    if not args.profile:
        return 0
    for name in ("loop", "mlx") if args.thread == "both" else (args.thread,):
        prof = out[name]
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            prof.dump_stats(args.dump / f"{name}.prof")
        print(f"===== {name} thread: by own time")
        print(_table(prof, "tottime", args.top))
        print(f"===== {name} thread: by cumulative time")
        print(_table(prof, "cumulative", args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
