"""Where the agent's serving path spends its host time per token: the agent's serving core and
OpenAI app in this process under ``cProfile`` (one profile of the event-loop thread, one of the
MLX thread), driven by ``benchmarks/serving.py``'s out-of-process load generator.

    python benchmarks/profile_serving.py --workload duplicate            # 20 identical, coalesced
    python benchmarks/profile_serving.py --workload unique --concurrency 32

Prints the CPU time each thread spent per delivered token and, per thread, the functions with the largest own time (``tottime``) and cumulative time,
with their share of that thread's profiled time, plus the tokens delivered; ``--dump DIR`` keeps
the raw ``pstats`` files (``loop.prof``, ``mlx.prof``). The numbers are those of a profiled run
(cProfile slows Python code several-fold): read them as shares, not as speeds.
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

HERE = Path(__file__).resolve().parent


def _table(prof: cProfile.Profile, sort: str, top: int) -> str:
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.strip_dirs().sort_stats(sort).print_stats(top)
    return out.getvalue()


async def _main(args: argparse.Namespace) -> dict:
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

    n = bench.DUPLICATES if args.workload == "duplicate" else args.concurrency
    c = bench.DUPLICATES if args.workload == "duplicate" else args.concurrency
    await client(bench.requests_for(args.workload, n, 8, -1), c)   # warm-up
    loop_prof, mlx_prof = cProfile.Profile(), cProfile.Profile()
    results = []
    # the MLX thread's profiler is switched on and off on that thread, between two steps
    # (its CPU time is read there too: time.thread_time is per thread)
    if args.profile:
        await core._call(mlx_prof.enable)  # noqa: SLF001 - the core's command channel
        loop_prof.enable()
    mlx0, loop0, wall0 = await core._call(time.thread_time), time.thread_time(), time.perf_counter()  # noqa: SLF001
    for i in range(args.rounds):
        results.append(await client(bench.requests_for(args.workload, n, args.max_tokens, i), c))
    cpu = {"loop": time.thread_time() - loop0,
           "mlx": await core._call(time.thread_time) - mlx0,  # noqa: SLF001
           "wall": time.perf_counter() - wall0}
    if args.profile:
        loop_prof.disable()
        await core._call(mlx_prof.disable)  # noqa: SLF001
    await runner.cleanup()
    await core.close()
    return {"loop": loop_prof, "mlx": mlx_prof, "results": results, "cpu": cpu}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="duplicate", choices=("duplicate", "unique"))
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", type=Path, required=True, help="an mlx-lm model directory")
    p.add_argument("--ours-args", default="")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--dump", type=Path)
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="only the CPU time of each thread per delivered token (no cProfile)")
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    sys.path.append(str(HERE.parent))  # after PYTHONPATH: profile another checkout's code
    out = asyncio.run(_main(args))
    tokens = sum(r["output_tokens"] for r in out["results"])
    print(f"{args.workload}: {tokens} tokens delivered in {len(out['results'])} rounds; "
          f"tok/s per round: {[round(r['output_tokens_per_second']) for r in out['results']]}")
    cpu = out["cpu"]
    print(f"CPU time per 1000 delivered tokens: event loop {1000 * cpu['loop'] / tokens * 1000:.1f} "
          f"ms, MLX thread {1000 * cpu['mlx'] / tokens * 1000:.1f} ms (wall {cpu['wall']:.2f} s; "
          f"{tokens / cpu['wall']:.0f} tokens/s)")
    if not args.profile:
        return 0
    for name in ("loop", "mlx"):
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
