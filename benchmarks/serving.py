"""The agent's serving path side by side with ``mlx_lm.server`` (same mlx-lm, same generated
model, same machine, same run).

Two servers run as their own processes on 127.0.0.1: **ours** — the node agent's
:class:`~node_agent.serving.ServingCore` behind its OpenAI app (:func:`node_agent.openai_api.build_app`),
the code an agent serves with, started by this script with ``--serve-ours`` — and the
**reference**, ``mlx_lm.server``'s own ``main`` from the pinned mlx-lm with the same batch limit
(``--decode-concurrency``); both with the same MLX buffer-cache limit (``--cache-limit-gb``). A
third process, the load generator (this script with ``--client``), drives one server at a time
with streamed ``/v1/chat/completions`` requests, so neither server shares a process with the
client. After a warm-up round on each, rounds alternate A B, B A, … per workload and
concurrency.

Workloads (``--workloads``): ``unique`` (distinct short prompts), ``shared_prefix`` (one long
system prompt + distinct questions: the prompt cache), ``duplicate`` (identical greedy requests
sent at once: coalescing), ``long_prompt`` (long prompt, short answer: prefill), ``long_answer``
(short prompt, long answer: decode), ``mixed_sampling`` (temperatures and top_p vary),
``logprobs`` (``unique``'s prompts with ``logprobs: true, top_logprobs: 5``: its tokens/s
against ``unique``'s in the same run is what log-probabilities cost).

Reported per workload × concurrency × server (median over rounds): TTFT p50/p95, inter-token
gap p50/p95 (between streamed content chunks), aggregate output tokens/s (completion tokens of
all requests ÷ the round's wall time), requests/s, errors; and the ratio ours ÷ reference of
tokens/s and of TTFT p50. On a GPU with ``--bandwidth-gbs``, the fraction of the
memory-bandwidth limit reached at concurrency 1 (tokens/s × weight bytes ÷ bandwidth).

    python benchmarks/serving.py --help
    python benchmarks/serving.py                       # CPU defaults: a small model, short runs
    python benchmarks/serving.py --hidden-size 2048 --num-layers 16 --max-tokens 128 \\
        --concurrency 1 8 32 64 --bandwidth-gbs 3350    # a GPU (H100 SXM: 3.35 TB/s)

``--ours-args`` passes the agent's serving flags to ours (parsed by the agent's own
``node_agent.cli.add_serving_arguments``), to measure what an optimisation buys by turning it
off, e.g. ``--ours-args=--no-prompt-cache`` or ``--ours-args="--admission-policy count"`` (with
``=``: the value starts with ``--``); the
options in force are in the results (``params.ours_args``) and on ours' ``/metrics``.

Results: ``benchmarks/results/serving-<device>.json`` (machine, versions, every round; with
``--ours-args`` ``serving-<device>-<flags>.json``, e.g. ``serving-gpu-no-coalesce-requests.json``)
and a PNG plot next to it when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODEL_ID = "bench"
WORKLOADS = ("unique", "shared_prefix", "duplicate", "long_prompt", "long_answer",
             "mixed_sampling", "logprobs")
#: ``top_logprobs`` of the ``logprobs`` workload.
TOP_LOGPROBS = 5
#: Concurrent identical requests in the ``duplicate`` workload (issue #9: 20).
DUPLICATES = 20
_WORDS = ("model weights memory token batch cache prefix stream agent fleet canary revision "
          "node lease budget watermark prefill decode sample greedy latency throughput queue "
          "admission drain").split()


# ---------------------------------------------------------------------------------------------
# workloads: what each request of a round sends
# ---------------------------------------------------------------------------------------------


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def requests_for(workload: str, n: int, max_tokens: int, round_no: int) -> list[dict]:
    """The ``n`` chat-completion bodies of one round (deterministic per round number; rounds
    differ so that a prompt cache can't serve a later round from an earlier one, except the
    shared system prompt, which is the point of ``shared_prefix``)."""
    # `logprobs` sends `unique`'s very prompts: the two differ only by the log-probabilities
    rng = random.Random(f"{'unique' if workload == 'logprobs' else workload}/{round_no}")
    system = "You are a careful assistant. " + _text(random.Random("system"), 600)
    bodies = []
    for i in range(n):
        body: dict = {"model": MODEL_ID, "stream": True, "max_tokens": max_tokens,
                      "temperature": 0.0, "stream_options": {"include_usage": True}}
        if workload in ("unique", "logprobs"):
            msgs = [{"role": "user", "content": f"{round_no}-{i}: {_text(rng, 12)}"}]
            if workload == "logprobs":
                body |= {"logprobs": True, "top_logprobs": TOP_LOGPROBS}
        elif workload == "shared_prefix":
            msgs = [{"role": "system", "content": system},
                    {"role": "user", "content": f"{round_no}-{i}: {_text(rng, 8)}"}]
        elif workload == "duplicate":
            msgs = [{"role": "user", "content": f"round {round_no}: the same question"}]
        elif workload == "long_prompt":
            msgs = [{"role": "user", "content": f"{round_no}-{i}: {_text(rng, 700)}"}]
            body["max_tokens"] = max(1, max_tokens // 8)
        elif workload == "long_answer":
            msgs = [{"role": "user", "content": f"{round_no}-{i}: go on"}]
            body["max_tokens"] = max_tokens * 4
        elif workload == "mixed_sampling":
            msgs = [{"role": "user", "content": f"{round_no}-{i}: {_text(rng, 12)}"}]
            body |= {"temperature": rng.choice([0.0, 0.5, 0.8, 1.0]),
                     "top_p": rng.choice([1.0, 0.9, 0.5]), "seed": i}
        else:
            raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
        body["messages"] = msgs
        bodies.append(body)
    return bodies


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by linear interpolation (numpy's default), ``None`` if empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ---------------------------------------------------------------------------------------------
# the load generator (its own process: --client)
# ---------------------------------------------------------------------------------------------


async def _one(http, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft, last, gaps, chunks, tokens, error = None, None, [], 0, None, ""
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                return {"error": f"HTTP {r.status}: {(await r.text())[:200]}"}
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens")
                if "error" in chunk:
                    error = str(chunk["error"])[:200]
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gaps.append(now - last)
                    last, chunks = now, chunks + 1
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        error = f"{type(e).__name__}: {e}"
    return {"ttft": ttft, "gaps": gaps, "tokens": tokens if tokens is not None else chunks,
            "error": error, "seconds": time.perf_counter() - t0}


async def run_client(url: str, bodies: list[dict], concurrency: int) -> dict:
    """Send ``bodies`` with at most ``concurrency`` in flight; one round's measurements."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async def bounded(body: dict) -> dict:
            async with sem:
                return await _one(http, url, body)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(b) for b in bodies))
        wall = time.perf_counter() - t0
    ok = [r for r in results if not r["error"]]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in ok)
    return {"wall_seconds": wall, "requests": len(results), "errors": len(results) - len(ok),
            "error_samples": sorted({r["error"] for r in results if r["error"]})[:3],
            "output_tokens": tokens, "output_tokens_per_second": tokens / wall,
            "requests_per_second": len(ok) / wall,
            "ttft_p50_seconds": percentile(ttfts, 0.5), "ttft_p95_seconds": percentile(ttfts, 0.95),
            "itl_p50_seconds": percentile(gaps, 0.5), "itl_p95_seconds": percentile(gaps, 0.95)}


# ---------------------------------------------------------------------------------------------
# the servers
# ---------------------------------------------------------------------------------------------


#: Started as the reference server: mlx_lm.server's own main, after the same MLX buffer-cache
#: limit as ours (two processes sharing one GPU each keep freed buffers cached up to the device's
#: size by default, and the second one then runs out of memory).
_REFERENCE = ("import sys, mlx.core as mx; mx.set_cache_limit(int(float(sys.argv.pop(1)) * 1e9)); "
              "from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()")


def ours_options(ours_args: str) -> Any:
    """The :class:`~node_agent.serving.ServingOptions` of agent flags given as one string
    (``--no-prompt-cache --admission-policy count``), parsed as the agent parses them."""
    from node_agent.cli import add_serving_arguments, serving_options_from_args

    p = argparse.ArgumentParser(prog="--ours-args")
    add_serving_arguments(p)
    return serving_options_from_args(p.parse_args(shlex.split(ours_args)))


async def serve_ours(model: Path, port: int, max_sequences: int, cache_limit_gb: float,
                     ours_args: str = "", memory_log: Path | None = None,
                     sample_seconds: float = 5.0) -> None:
    """The agent's serving path: ServingCore + the agent's OpenAI app, nothing else;
    ``ours_args``: the agent's serving flags (:func:`ours_options`). With ``memory_log``, every
    ``sample_seconds`` one JSON line ``{"t", "active_bytes", "cache_bytes", "rss_bytes"}``
    (``ServingCore.memory_usage()``, ``t`` in monotonic seconds) is appended to it
    (``serving_soak.py``)."""
    import mlx.core as mx
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from node_agent.openai_api import build_app
    from node_agent.serving import ServingCore

    mx.set_cache_limit(int(cache_limit_gb * 1e9))
    core = ServingCore(registry=CollectorRegistry(), max_queued_requests=4 * max_sequences,
                       options=ours_options(ours_args))
    await core.start()
    await core.load_model(MODEL_ID, model, revision="bench",
                          max_concurrent_sequences=max_sequences, max_context_tokens=8192)
    runner = web.AppRunner(build_app(core, health=lambda: (True, {}), registry=core.registry),
                           access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def sample_memory(path: Path) -> None:
        # Under PYTHONTRACEMALLOC=N each sample also has the bytes Python allocated and still
        # holds ("traced_bytes"), and the growth by source line between the sample a minute in
        # and the end goes to <log>.tracemalloc.txt: a leak in Python code shows there.
        import tracemalloc

        t0, first = time.monotonic(), None
        with path.open("a") as f:
            while not stop.is_set():
                u = await core.memory_usage()
                traced = tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else None
                f.write(json.dumps({"t": time.monotonic(), "active_bytes": u.active_bytes,
                                    "cache_bytes": u.cache_bytes, "rss_bytes": u.rss_bytes,
                                    "traced_bytes": traced}) + "\n")
                f.flush()
                if traced is not None and first is None and time.monotonic() - t0 >= 60:
                    first = tracemalloc.take_snapshot()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), sample_seconds)
        if first is not None:
            growth = tracemalloc.take_snapshot().compare_to(first, "lineno")[:30]
            path.with_suffix(".tracemalloc.txt").write_text(
                "".join(f"{stat}\n" for stat in growth))

    sampler = asyncio.create_task(sample_memory(memory_log)) if memory_log else None
    try:
        await stop.wait()
        if sampler is not None:
            await sampler
    finally:
        await runner.cleanup()
        await core.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on 127.0.0.1:``port``, ready once ``/v1/models`` answers."""

    def __init__(self, name: str, argv: list[str], log: Path, model_name: str) -> None:
        self.name, self.port = name, int(argv[argv.index("--port") + 1])
        self.model_name = model_name  # what a request's "model" must say to this server
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("wb")
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 300.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}; see "
                                 f"{self._log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)  # a process starting up offers nothing to wait on
        raise SystemExit(f"{self.name} not ready after {timeout:.0f} s; see {self._log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def ours_server(name: str, model: Path, max_sequences: int, cache_limit_gb: float,
                ours_args: str, log: Path, *extra: str) -> Server:
    """Ours (:func:`serve_ours`, in a process of its own) on a free port, serving ``model`` with
    the agent's flags ``ours_args``; ``extra``: more of this script's internal options (the
    soak's ``--memory-log``)."""
    return Server(name, [sys.executable, str(Path(__file__).resolve()), "--serve-ours",
                         str(model), "--port", str(_free_port()), "--max-sequences",
                         str(max_sequences), "--cache-limit-gb", str(cache_limit_gb),
                         f"--ours-args={ours_args}", *extra], log, MODEL_ID)


def reference_server(model: Path, max_sequences: int, cache_limit_gb: float,
                     log: Path) -> Server:
    """``mlx_lm.server`` (:data:`_REFERENCE`) on a free port, serving ``model`` with the same
    decode concurrency and MLX cache limit as ours."""
    return Server("reference", [sys.executable, "-c", _REFERENCE, str(cache_limit_gb), "--model",
                                str(model), "--port", str(_free_port()), "--decode-concurrency",
                                str(max_sequences), "--log-level", "WARNING"], log,
                  "default_model")


def client_round(server: Server, bodies: list[dict], concurrency: int) -> dict:
    """Run one round against ``server`` in a fresh load-generator process; its JSON result."""
    bodies = [b | {"model": server.model_name} for b in bodies]
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--client", server.url,
                        "--concurrency-client", str(concurrency)],
                       input=json.dumps(bodies), capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"load generator failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout)


def versions() -> dict[str, str]:
    out = {}
    for dist in ("mlx", "mlx-cuda-13", "mlx-metal", "mlx-lm", "aiohttp"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def summarise(rounds: list[dict]) -> dict:
    """Medians per (workload, concurrency, server) and the ours ÷ reference ratios (and ours ÷
    baseline, ``baseline_*_ratio``, when ``--baseline-args`` ran a third server)."""
    out: dict = {}
    keys = ("output_tokens_per_second", "requests_per_second", "ttft_p50_seconds",
            "ttft_p95_seconds", "itl_p50_seconds", "itl_p95_seconds")
    for r in rounds:
        cell = out.setdefault(r["workload"], {}).setdefault(str(r["concurrency"]), {})
        cell.setdefault(r["server"], []).append(r)
    for wl, by_c in out.items():
        for c, by_server in by_c.items():
            med = {}
            for server, rs in by_server.items():
                med[server] = {k: statistics.median(x[k] for x in rs if x[k] is not None)
                               if any(x[k] is not None for x in rs) else None for k in keys}
                med[server]["errors"] = sum(x["errors"] for x in rs)
            o, ref = med.get("ours"), med.get("reference")
            if o and ref and (o["errors"] or ref["errors"]):
                med["tokens_per_second_ratio"] = med["ttft_p50_ratio"] = None
                med["invalid"] = "a server had errors in this cell: no ratio"
            elif o and ref:
                med["tokens_per_second_ratio"] = (o["output_tokens_per_second"] /
                                                  ref["output_tokens_per_second"]
                                                  if ref["output_tokens_per_second"] else None)
                med["ttft_p50_ratio"] = (o["ttft_p50_seconds"] / ref["ttft_p50_seconds"]
                                         if o["ttft_p50_seconds"] and ref["ttft_p50_seconds"]
                                         else None)
            base = med.get("baseline")
            if o and base and (o["errors"] or base["errors"]):
                med["baseline_invalid"] = "a server had errors in this cell: no baseline ratio"
            elif o and base:
                med["baseline_tokens_per_second_ratio"] = (
                    o["output_tokens_per_second"] / base["output_tokens_per_second"]
                    if base["output_tokens_per_second"] else None)
                med["baseline_ttft_p50_ratio"] = (
                    o["ttft_p50_seconds"] / base["ttft_p50_seconds"]
                    if o["ttft_p50_seconds"] and base["ttft_p50_seconds"] else None)
            by_c[c] = med
    return out


def plot(summary: dict, path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    wls = list(summary)
    fig, axes = plt.subplots(1, len(wls), figsize=(3.2 * len(wls), 3.4), squeeze=False)
    for ax, wl in zip(axes[0], wls):
        cs = sorted(summary[wl], key=int)
        ratios = [summary[wl][c].get("tokens_per_second_ratio") for c in cs]
        ax.bar(cs, [r or 0 for r in ratios], color="#3b7dd8")
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_title(wl, fontsize=9)
        ax.set_xlabel("concurrent streams")
        ax.set_ylim(0, max([1.2, *(r for r in ratios if r)]) * 1.15)
        for x, y in zip(cs, ratios):
            ax.annotate(f"{y:.2f}×" if y else "errors:\nno ratio", (x, y or 0), ha="center",
                        va="bottom", fontsize=8, color="black" if y else "#b03030")
    axes[0][0].set_ylabel("output tokens/s, ours ÷ mlx_lm.server")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The served model's options: ``--model DIR``, or a llama generated from ``--hidden-size``,
    ``--num-layers`` and ``--vocab-size`` into ``--model-cache`` (:func:`model_from_args`)."""
    p.add_argument("--model", type=Path, help="an existing mlx-lm model directory to serve")
    p.add_argument("--model-cache", type=Path, help="where generated models are kept")
    p.add_argument("--hidden-size", type=int, default=256, help="generated model width")
    p.add_argument("--num-layers", type=int, default=4, help="generated model depth")
    p.add_argument("--vocab-size", type=int, default=1024, help="generated vocabulary")


def model_from_args(args: argparse.Namespace) -> Path:
    """``args.model``, or the generated llama of :func:`add_model_arguments` (made once, cached
    under ``--model-cache``, default ``<mlx-fleet cache>/models``)."""
    from mlx_fleet.devcluster.binaries import cache_dir
    from mlx_fleet.testmodel import make_test_model

    return Path(args.model or make_test_model(
        (args.model_cache or cache_dir() / "models") /
        f"serving-h{args.hidden_size}-l{args.num_layers}-v{args.vocab_size}",
        hidden_size=args.hidden_size, num_layers=args.num_layers, vocab_size=args.vocab_size))


def run(args: argparse.Namespace, partial: Path | None = None) -> dict:
    from common import machine

    model = model_from_args(args)
    weight_bytes = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    max_seq = max(args.concurrency + [DUPLICATES])
    servers = {
        "ours": ours_server("ours", model, max_seq, args.cache_limit_gb, args.ours_args,
                            logs / "ours.log"),
        "reference": reference_server(model, max_seq, args.cache_limit_gb,
                                      logs / "reference.log")}
    if args.baseline_args is not None:
        # ours again with some optimisations off: what they buy, measured in the same rounds
        servers["baseline"] = ours_server("baseline", model, max_seq, args.cache_limit_gb,
                                          args.baseline_args, logs / "baseline.log")
    rounds: list[dict] = []
    try:
        for s in servers.values():
            s.wait_ready()
        for wl in args.workloads:
            for c in ([DUPLICATES] if wl == "duplicate" else args.concurrency):
                n = DUPLICATES if wl == "duplicate" else max(c * args.requests_per_stream, 1)
                for s in servers.values():  # warm-up: kernels compiled, caches primed
                    client_round(s, requests_for(wl, min(n, c), 8, -1), c)
                names = list(servers)
                for i in range(args.rounds):
                    # A B (C) / B C A / C A B: each server goes first in turn (evenly when the
                    # rounds are a multiple of the servers; main() warns when they are not)
                    order = names[i % len(names):] + names[:i % len(names)]
                    for name in order:
                        r = client_round(servers[name], requests_for(wl, n, args.max_tokens, i), c)
                        rounds.append({"workload": wl, "concurrency": c, "server": name,
                                       "round": i, **r})
                        if partial is not None:  # what a killed run leaves behind
                            partial.write_text(json.dumps({"rounds": rounds}) + "\n")
                        print(f"{wl:>14} c={c:<3} {name:>9} round {i}: "
                              f"{r['output_tokens_per_second']:8.1f} tok/s  TTFT p50 "
                              f"{1000 * (r['ttft_p50_seconds'] or 0):7.1f} ms  errors "
                              f"{r['errors']}", file=sys.stderr)
    finally:
        for s in servers.values():
            s.stop()
    summary = summarise(rounds)
    result = {"benchmark": "serving", "machine": machine(), "versions": versions(),
              "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "model": {"path": str(model), "weight_bytes": weight_bytes},
              "summary": summary, "rounds": rounds}
    if args.bandwidth_gbs and "unique" in summary and "1" in summary["unique"]:
        tps = summary["unique"]["1"]["ours"]["output_tokens_per_second"]
        result["bandwidth_fraction_at_1_stream"] = tps * weight_bytes / (args.bandwidth_gbs * 1e9)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS,
                   metavar="WORKLOAD", help=f"default: all ({', '.join(WORKLOADS)})")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32],
                   help="concurrent streams per round (default 1 8 32)")
    p.add_argument("--requests-per-stream", type=int, default=2,
                   help="requests per round = concurrency × this (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds per cell (default 2)")
    p.add_argument("--max-tokens", type=int, default=32, help="completion tokens (default 32)")
    add_model_arguments(p)
    p.add_argument("--bandwidth-gbs", type=float, default=0.0,
                   help="the device's memory bandwidth in GB/s (report the fraction reached)")
    p.add_argument("--cache-limit-gb", type=float, default=8.0,
                   help="MLX buffer-cache limit of each server process, GB (default 8): both "
                        "servers share the device")
    p.add_argument("--logs", default="/tmp/mlx-fleet-serving-bench", help="server logs")
    p.add_argument("--output", type=Path, help="default benchmarks/results/serving-<device>.json")
    p.add_argument("--ours-args", default="", metavar="FLAGS",
                   help="the agent's serving flags for ours, one string after '=', e.g. "
                        "--ours-args=--no-prompt-cache or --ours-args='--admission-policy count' "
                        "(default: none, the agent's defaults)")
    p.add_argument("--baseline-args", default=None, metavar="FLAGS",
                   help="also serve ours with these agent flags as a third server in the same "
                        "rounds, e.g. --baseline-args='--prefill-batch-tokens 0': ours ÷ "
                        "baseline is what the flags' optimisations buy (default: no baseline)")
    # internal modes
    p.add_argument("--serve-ours", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--max-sequences", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--memory-log", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--sample-seconds", type=float, default=5.0, help=argparse.SUPPRESS)
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--concurrency-client", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_ours:
        asyncio.run(serve_ours(args.serve_ours, args.port, args.max_sequences,
                               args.cache_limit_gb, args.ours_args, args.memory_log,
                               args.sample_seconds))
        return 0
    if args.client:
        bodies = json.load(sys.stdin)
        print(json.dumps(asyncio.run(run_client(args.client, bodies, args.concurrency_client))))
        return 0
    import mlx.core as mx

    device = "gpu" if "gpu" in str(mx.default_device()) else "cpu"
    ours_options(args.ours_args)  # a bad agent flag fails here, not in a server
    if args.baseline_args is not None:
        ours_options(args.baseline_args)
        if args.rounds % 3:
            print(f"note: with three servers, --rounds {args.rounds} lets them go first unevenly "
                  f"(a multiple of 3 does not)", file=sys.stderr)
    def tag(flags: str) -> str:
        return "".join("-" + f.lstrip("-").replace(" ", "-") for f in shlex.split(flags))
    flags = tag(args.ours_args) + ("" if args.baseline_args is None
                                   else "-baseline" + tag(args.baseline_args))
    out = args.output or RESULTS / f"serving-{device}{flags}.json"
    result = run(args, partial=out.with_suffix(".partial.json"))
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = plot(result["summary"], out.with_suffix(".png"),
               f"{result['machine']['accelerator'] if device == 'gpu' else result['machine']['cpu']}"
               f" — generated llama h{args.hidden_size}×{args.num_layers}")
    for wl, by_c in result["summary"].items():
        cells = ", ".join(f"c={c}: " + (f"×{m['tokens_per_second_ratio']:.2f}"
                                          if m.get("tokens_per_second_ratio") else "n/a (errors)")
                          for c, m in sorted(by_c.items(), key=lambda kv: int(kv[0])))
        print(f"{wl:>14}: tokens/s ours ÷ mlx_lm.server  {cells}")
        if args.baseline_args is not None:
            cells = ", ".join(f"c={c}: " + (f"×{m['baseline_tokens_per_second_ratio']:.2f}"
                                              if m.get("baseline_tokens_per_second_ratio")
                                              else "n/a (errors)")
                              for c, m in sorted(by_c.items(), key=lambda kv: int(kv[0])))
            print(f"{wl:>14}: tokens/s ours ÷ ours {args.baseline_args}  {cells}")
    print(f"→ {out}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
