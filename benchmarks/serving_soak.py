"""Soak of the agent's serving path: steady streaming load for a fixed time, and whether the
server's memory grows (issue #9 §2: "10-minute soak at concurrency 8: RSS and MLX memory
slope ≈ 0, no errors").

The server is the one ``benchmarks/serving.py`` calls **ours** — the node agent's
:class:`~node_agent.serving.ServingCore` behind its OpenAI app, in its own process — started
with ``--memory-log``: every ``--sample-seconds`` it records ``ServingCore.memory_usage()``
(MLX active and cache bytes, read on the MLX thread between steps, and the process RSS) as a
JSON line. The load generator runs in this process: ``--concurrency`` workers, each sending
streamed ``/v1/chat/completions`` requests back to back (distinct prompts, the ``unique``
workload of ``serving.py``) until ``--duration`` seconds have passed.

Reported: requests sent, succeeded, failed (with samples of the errors); output tokens/s and
TTFT / inter-token gap p50 and p95 per minute; and for RSS, MLX active and MLX active + cache
the least-squares slope in MiB per minute over the samples after ``--warmup`` seconds (the
first minute fills the buffer cache and the prompt cache to their budgets, so it is left out),
with the first and last values. A leak shows as a slope that stays positive however long the
run; ≈ 0 is the goal.

    python benchmarks/serving_soak.py --help
    python benchmarks/serving_soak.py --duration 120                       # this CPU, small model
    python benchmarks/serving_soak.py --hidden-size 2048 --num-layers 16 --max-tokens 128   # a GPU, 10 min

Results: ``benchmarks/results/serving-soak-<device>.json`` (machine, versions, every sample and
minute) and a PNG plot of memory over time next to it when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from mlx_fleet.devcluster.soakstats import slope  # noqa: E402
from serving import (MODEL_ID, RESULTS, _one, add_model_arguments,  # noqa: E402
                     model_from_args, ours_server, percentile, reference_server, requests_for,
                     versions)

MIB = 1024 * 1024


def memory_trend(samples: list[dict], warmup: float) -> dict:
    """Per series (``rss``, ``mlx_active``, ``mlx_total`` = active + cache): the least-squares
    slope (:func:`~mlx_fleet.devcluster.soakstats.slope`) in MiB per minute over the samples
    taken ``warmup`` seconds or more after the first, and the first, last and largest values
    in MiB of that window."""
    if not samples:
        return {}
    t0 = samples[0]["t"]
    window = [s for s in samples if s["t"] - t0 >= warmup] or samples
    series = {"rss": lambda s: s["rss_bytes"], "mlx_active": lambda s: s["active_bytes"],
              "mlx_total": lambda s: s["active_bytes"] + s["cache_bytes"]}
    out = {}
    for name, get in series.items():
        if name != "rss" and window[0].get("active_bytes") is None:
            continue   # sampled from outside the process (the reference): RSS only
        pts = [(s["t"] - t0, get(s) / MIB) for s in window]
        per_second = slope(pts)
        out[name] = {"slope_mib_per_minute": None if per_second is None else per_second * 60,
                     "first_mib": pts[0][1], "last_mib": pts[-1][1],
                     "max_mib": max(v for _, v in pts)}
    out["window_seconds"] = [window[0]["t"] - t0, window[-1]["t"] - t0]
    return out


async def drive(url: str, concurrency: int, duration: float, max_tokens: int, *,
                model_name: str = MODEL_ID, rss_of: int | None = None,
                memlog: Path | None = None, sample_seconds: float = 5.0) -> list[dict]:
    """``concurrency`` workers sending back to back until ``duration`` s have passed; every
    request's outcome with its start time (seconds since the start). ``rss_of``: a server
    process that logs no memory itself (the reference): its RSS is sampled from here every
    ``sample_seconds`` into ``memlog``, in the server's format with no MLX fields."""
    import psutil

    sampler: asyncio.Task | None = None
    if rss_of is not None and memlog is not None:
        proc = psutil.Process(rss_of)

        async def sample() -> None:
            with memlog.open("a") as f:
                while True:
                    try:
                        rss = proc.memory_info().rss
                    except psutil.Error as e:   # the server died: the requests show it too
                        print(f"RSS sampling stopped: {e}", file=sys.stderr)
                        return
                    f.write(json.dumps({"t": time.monotonic(), "active_bytes": None,
                                        "cache_bytes": None, "rss_bytes": rss}) + "\n")
                    f.flush()
                    await asyncio.sleep(sample_seconds)   # a fixed sampling period
        sampler = asyncio.create_task(sample())
    try:
        return await _load(url, concurrency, duration, max_tokens, model_name)
    finally:
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler


async def _load(url: str, concurrency: int, duration: float, max_tokens: int,
                model_name: str) -> list[dict]:
    import aiohttp

    results: list[dict] = []
    t0 = time.monotonic()
    deadline = t0 + duration
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async def worker(w: int) -> None:
            i = 0
            while time.monotonic() < deadline:
                body = requests_for("unique", concurrency, max_tokens, i)[w] | {"model": model_name}
                started = time.monotonic() - t0
                r = await _one(http, url, body)  # (a failed request: only its "error")
                results.append({"ttft": None, "gaps": [], "tokens": 0} | r | {
                    "started": started, "seconds": time.monotonic() - t0 - started})
                i += 1

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return results


def per_minute(results: list[dict]) -> list[dict]:
    """Requests grouped by the minute they started in: counts, TTFT and gap p50/p95, and
    output tokens/s = the minute's succeeded completion tokens ÷ the time from the minute's
    start to the end of the last of its requests."""
    out = []
    for m in range(int(max((r["started"] for r in results), default=0) // 60) + 1):
        rs = [r for r in results if m * 60 <= r["started"] < (m + 1) * 60]
        ok = [r for r in rs if not r["error"]]
        ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
        gaps = [g for r in ok for g in r["gaps"]]
        busy = max((r["started"] + r["seconds"] for r in rs), default=0) - m * 60
        out.append({"minute": m, "requests": len(rs), "errors": len(rs) - len(ok),
                    "output_tokens_per_second": sum(r["tokens"] for r in ok) / busy if busy else 0,
                    "ttft_p50_seconds": percentile(ttfts, 0.5),
                    "ttft_p95_seconds": percentile(ttfts, 0.95),
                    "itl_p50_seconds": percentile(gaps, 0.5),
                    "itl_p95_seconds": percentile(gaps, 0.95)})
    return out


def plot(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    samples = result["memory_samples"]
    t0 = samples[0]["t"]
    ts = [(s["t"] - t0) / 60 for s in samples]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(ts, [s["rss_bytes"] / MIB for s in samples], label="process RSS")
    if samples[0].get("active_bytes") is not None:
        ax.plot(ts, [s["active_bytes"] / MIB for s in samples], label="MLX active")
        ax.plot(ts, [(s["active_bytes"] + s["cache_bytes"]) / MIB for s in samples],
                label="MLX active + cache")
    ax.axvline(result["params"]["warmup"] / 60, color="grey", lw=1, ls="--")
    ax.set_xlabel("minutes")
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8)
    ax.set_title(f"serving soak ({result['params'].get('server', 'ours')}), "
                 f"{result['params']['concurrency']} streams, "
                 f"{result['machine']['accelerator']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def run(args: argparse.Namespace) -> dict:
    from common import machine

    model = model_from_args(args)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    memlog = logs / "memory.jsonl"
    memlog.unlink(missing_ok=True)
    max_sequences = max(args.concurrency, 8)
    if args.server == "ours":
        server = ours_server("ours", model, max_sequences, args.cache_limit_gb, args.ours_args,
                             logs / "ours-soak.log", "--memory-log", str(memlog),
                             "--sample-seconds", str(args.sample_seconds))
    else:
        server = reference_server(model, max_sequences, args.cache_limit_gb,
                                  logs / "reference-soak.log")
    try:
        server.wait_ready()
        print(f"soak: {args.concurrency} streams for {args.duration:.0f} s against "
              f"{server.name} at {server.url}", file=sys.stderr)
        results = asyncio.run(drive(server.url, args.concurrency, args.duration,
                                    args.max_tokens, model_name=server.model_name,
                                    rss_of=None if args.server == "ours" else server.proc.pid,
                                    memlog=memlog, sample_seconds=args.sample_seconds))
    finally:
        server.stop()
    samples = [json.loads(line) for line in memlog.read_text().splitlines() if line.strip()]
    ok = [r for r in results if not r["error"]]
    result = {
        "benchmark": "serving_soak", "machine": machine(), "versions": versions(),
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {"path": str(model),
                  "weight_bytes": sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))},
        "requests": {"sent": len(results), "succeeded": len(ok),
                     "failed": len(results) - len(ok),
                     "error_samples": sorted({r["error"] for r in results if r["error"]})[:5],
                     "output_tokens": sum(r["tokens"] for r in ok)},
        "memory": memory_trend(samples, args.warmup),
        "minutes": per_minute(results),
        "memory_samples": samples,
    }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent streams (default 8)")
    p.add_argument("--max-tokens", type=int, default=32, help="completion tokens (default 32)")
    p.add_argument("--warmup", type=float, default=60.0,
                   help="seconds left out of the memory slope (default 60)")
    p.add_argument("--sample-seconds", type=float, default=5.0,
                   help="memory sampling interval, seconds: in the server (ours) or of its RSS "
                        "from outside (the reference) (default 5)")
    add_model_arguments(p)
    p.add_argument("--cache-limit-gb", type=float, default=8.0,
                   help="MLX buffer-cache limit of the server, GB (default 8)")
    p.add_argument("--ours-args", default="", metavar="FLAGS",
                   help="the agent's serving flags, as for serving.py (default: none)")
    p.add_argument("--server", choices=("ours", "reference"), default="ours",
                   help="soak ours (RSS and MLX memory logged by the server) or mlx_lm.server "
                        "(its RSS sampled from outside; same load, same prompt cache on) "
                        "(default: ours)")
    p.add_argument("--logs", default="/tmp/mlx-fleet-serving-soak", help="server log and samples")
    p.add_argument("--output", type=Path,
                   help="default benchmarks/results/serving-soak-<device>.json")
    args = p.parse_args(argv)
    if args.server == "reference" and args.ours_args:
        p.error("--ours-args applies to --server ours only")
    import mlx.core as mx

    device = "gpu" if "gpu" in str(mx.default_device()) else "cpu"
    out = args.output or RESULTS / (f"serving-soak-{device}.json" if args.server == "ours"
                                    else f"serving-soak-{device}-reference.json")
    result = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = plot(result, out.with_suffix(".png")) if result["memory_samples"] else None
    req, mem = result["requests"], result["memory"]
    print(f"requests sent {req['sent']}, succeeded {req['succeeded']}, failed {req['failed']}",
          file=sys.stderr)
    for name in ("rss", "mlx_active", "mlx_total"):
        if name in mem:
            s = mem[name]["slope_mib_per_minute"]
            print(f"{name:>10}: {mem[name]['first_mib']:.1f} → {mem[name]['last_mib']:.1f} MiB, "
                  f"slope {'n/a' if s is None else f'{s:+.2f}'} MiB/min", file=sys.stderr)
    print(f"wrote {out}" + (f" and {png}" if png else ""), file=sys.stderr)
    return 1 if req["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
