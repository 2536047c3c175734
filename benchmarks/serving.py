"""The agent's serving path side by side with ``mlx_lm.server`` — and vllm-mlx 0.6 where it
runs — (same generated model, same machine, same run).

Servers (``--servers``, default ``ours reference``), each its own process on 127.0.0.1:
**ours** — the node agent's :class:`~node_agent.serving.ServingCore` behind its OpenAI app
(:func:`node_agent.openai_api.build_app`), the code an agent serves with, started by this script
with ``--serve-ours`` —, the **reference**, ``mlx_lm.server``'s own ``main`` from the pinned
mlx-lm with the same batch limit (``--decode-concurrency``), and **vllm-mlx**
(``vllm-mlx serve MODEL --continuous-batching --max-num-seqs N``, from an install of its own
with its own mlx-lm pin: :mod:`vllm_mlx_server`); all with the same MLX buffer-cache limit
(``--cache-limit-gb``). A further process, the load generator (this script with ``--client``),
drives one server at a time, so no server shares a process with the client. After a warm-up
round on each, rounds rotate the servers' order (A B, B A, …) per workload and concurrency.

Workloads (``--workloads``): ``unique`` (distinct short prompts), ``shared_prefix`` (one long
system prompt + distinct questions: the prompt cache), ``duplicate`` (identical greedy requests
sent at once: coalescing), ``long_prompt`` (long prompt, short answer: prefill), ``long_answer``
(short prompt, long answer: decode), ``mixed_sampling`` (temperatures and top_p vary), and the
OpenAI features of issue 20:

* ``json`` — chat with ``response_format: json_schema`` of :data:`served.JSON_SCHEMA`, and in the
  same rounds the same prompts without it (``json-plain``), so each server's constrained ÷
  unconstrained tokens/s (``constrained_over_plain``) is measured side by side. A JSON answer
  ends when its object closes, so ``json-plain``'s ``max_tokens`` is, per server and cell, the
  mean completion tokens of that server's constrained answers in the warm-up round (recorded
  as the round's ``max_tokens``; ours' for a server without valid constrained answers): both
  sides decode about as many tokens per request;
* ``tools`` — chat with ``tools`` (:data:`served.TOOL`) and ``tool_choice: required``;
* ``logprobs`` — ``unique``'s prompts with ``logprobs: true, top_logprobs:`` :data:`TOP_LOGPROBS`:
  its tokens/s against ``unique``'s in the same run is what log-probabilities cost (an answer
  counts when it carries them, :func:`served.check_logprobs`);
* ``embeddings`` — ``POST /v1/embeddings`` of a generated embedding model
  (``make_test_model(embedding=True)``) in two cells: ``1x32`` (requests of 1 input, 32 at a
  time) and ``32x1`` (requests of 32 inputs, one at a time); inputs/s.

These count a response only when it shows the feature was applied (:mod:`served`: the content
validates against the schema with ``jsonschema``, a tool call's arguments validate against the
function's parameters, one vector per input); a server that refuses the feature (a 4xx on every
request) or ignores it (no answer shows it) is **not served** for that workload, with the
reason, and gets no ratio. The ``json`` and ``tools`` answers get ``max(--max-tokens, 256)``
tokens, more than the schema's longest JSON, so a constrained answer ends on its own.

Reported per workload × concurrency × server (median over rounds): TTFT p50/p95, inter-token
gap p50/p95 (between streamed content chunks), aggregate output tokens/s (completion tokens of
all requests ÷ the round's wall time; ``embeddings``: inputs/s), requests/s, errors (with
samples) or ``not_served``; and the ratios ours ÷ reference (``tokens_per_second_ratio``,
``ttft_p50_ratio``) and ours ÷ vllm-mlx (``vllm_mlx_…``) of tokens/s and of TTFT p50. On a GPU
with ``--bandwidth-gbs``, the fraction of the memory-bandwidth limit reached at concurrency 1
(tokens/s × weight bytes ÷ bandwidth).

    python benchmarks/serving.py --help
    python benchmarks/serving.py                       # CPU defaults: a small model, short runs
    python benchmarks/serving.py --hidden-size 2048 --num-layers 16 --max-tokens 128 \\
        --concurrency 1 8 32 64 --bandwidth-gbs 3350    # a GPU (H100 SXM: 3.35 TB/s)
    python benchmarks/serving.py --servers ours reference vllm-mlx \\
        --workloads json tools embeddings --concurrency 8 32   # issue 20's features

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

import served

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODEL_ID = "bench"
WORKLOADS = ("unique", "shared_prefix", "duplicate", "long_prompt", "long_answer",
             "mixed_sampling", "json", "tools", "embeddings", "logprobs")
#: ``top_logprobs`` of the ``logprobs`` workload.
TOP_LOGPROBS = 5
#: A workload measured together with its unconstrained twin, in the same rounds.
PLAIN_TWIN = {"json": "json-plain"}
SERVERS = ("ours", "reference", "vllm-mlx")
#: ``embeddings`` cells ``BATCHxCONCURRENCY``: 1 input × 32 concurrent requests, 32 inputs × 1.
EMBEDDING_CELLS = ("1x32", "32x1")
#: Inputs per ``embeddings`` round, per ``--requests-per-stream``.
EMBEDDING_INPUTS = 128
EMBEDDING_ID = "bench-embed"
#: ``max_tokens`` floor of the ``json`` and ``tools`` answers: above the longest JSON that
#: :data:`served.JSON_SCHEMA` allows, so a constrained answer ends on its own.
FEATURE_MAX_TOKENS = 256
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
    # a workload and its unconstrained twin send the same prompts; `logprobs` sends `unique`'s
    base = next((k for k, v in PLAIN_TWIN.items() if v == workload), workload)
    base = "unique" if workload == "logprobs" else base
    rng = random.Random(f"{base}/{round_no}")
    system = "You are a careful assistant. " + _text(random.Random("system"), 600)
    bodies = []
    for i in range(n):
        body: dict = {"model": MODEL_ID, "stream": True, "max_tokens": max_tokens,
                      "temperature": 0.0, "stream_options": {"include_usage": True}}
        if base == "unique":
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
        elif base == "json":
            msgs = [{"role": "user", "content": f"{round_no}-{i}: describe a person as JSON: "
                                                f"{_text(rng, 12)}"}]
            body["max_tokens"] = max(max_tokens, FEATURE_MAX_TOKENS)
            if workload == "json":
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "person", "schema": served.JSON_SCHEMA, "strict": True}}
        elif workload == "tools":
            msgs = [{"role": "user", "content": f"{round_no}-{i}: the weather in "
                                                f"{_text(rng, 3)}?"}]
            body |= {"max_tokens": max(max_tokens, FEATURE_MAX_TOKENS), "tools": [served.TOOL],
                     "tool_choice": "required"}
        else:
            raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
        body["messages"] = msgs
        bodies.append(body)
    return bodies


def embedding_requests(cell: str, n_inputs: int, round_no: int) -> list[dict]:
    """The ``/v1/embeddings`` bodies of one ``embeddings`` round in ``cell`` (``BATCHxCONC``):
    ``n_inputs`` inputs of 32 words in requests of ``BATCH`` (at least one request)."""
    batch = int(cell.partition("x")[0])
    rng = random.Random(f"embeddings/{round_no}")
    return [{"model": EMBEDDING_ID, "encoding_format": "float",
             "input": [f"{round_no}-{j}: {_text(rng, 32)}" for j in range(batch)]}
            for _ in range(max(1, n_inputs // batch))]


def cell_concurrency(cell: str | int) -> int:
    """Requests in flight of a cell: ``8`` → 8, ``"1x32"`` → 32."""
    return int(str(cell).rpartition("x")[2])


def cell_order(cell: str) -> tuple[int, int]:
    """Sort key of summary cells: concurrencies by number, then ``BATCHxCONC`` cells."""
    return (int(cell), 0) if cell.isdigit() else (cell_concurrency(cell), 1)


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


def merge_tool_call_deltas(calls: dict[int, dict], deltas: list[dict]) -> None:
    """Fold streamed ``delta.tool_calls`` entries into ``calls`` (by ``index``: the ``id``
    and ``function.name`` where sent, ``function.arguments`` concatenated), OpenAI's
    streaming shape."""
    for d in deltas:
        call = calls.setdefault(d.get("index", len(calls)),
                                {"id": None, "function": {"name": None, "arguments": ""}})
        call["id"] = d.get("id") or call["id"]
        fn = d.get("function") or {}
        call["function"]["name"] = fn.get("name") or call["function"]["name"]
        call["function"]["arguments"] += fn.get("arguments") or ""


def check_chat(workload: str, content: str, tool_calls: list[dict],
               finish_reason: str | None, logprob_entries: int = 0) -> str | None:
    """The :mod:`served` check of a chat answer in ``workload`` (``None``: nothing to check);
    ``logprob_entries``: the ``logprobs.content`` entries its events carried."""
    if workload == "logprobs":
        return served.check_logprobs(logprob_entries)
    if workload == "json":
        return served.check_json(content, finish_reason)
    if workload == "tools":
        return served.check_tool_calls(tool_calls, finish_reason, content)
    return None


async def _one(http, url: str, body: dict, workload: str = "") -> dict:
    """One streamed chat completion: its TTFT, gaps, tokens, error and (for the feature
    workloads) the :mod:`served` check of its answer."""
    t0 = time.perf_counter()
    ttft, last, gaps, chunks, tokens, error = None, None, [], 0, None, ""
    content, calls, finish, entries = [], {}, None, 0
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                return {"error": f"HTTP {r.status}: {(await r.text())[:200]}",
                        "status": r.status}
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens")
                if "error" in chunk:
                    error = str(chunk["error"])[:200]
                fresh = False
                for c in chunk.get("choices") or ():
                    delta = c.get("delta") or {}
                    finish = c.get("finish_reason") or finish
                    if delta.get("content"):
                        content.append(delta["content"])
                        fresh = True
                    if delta.get("tool_calls"):
                        merge_tool_call_deltas(calls, delta["tool_calls"])
                        fresh = True
                    entries += len((c.get("logprobs") or {}).get("content") or ())
                if fresh:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gaps.append(now - last)
                    last, chunks = now, chunks + 1
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        error = f"{type(e).__name__}: {e}"
    check = None if error else check_chat(workload, "".join(content),
                                          [calls[k] for k in sorted(calls)], finish, entries)
    return {"ttft": ttft, "gaps": gaps, "tokens": tokens if tokens is not None else chunks,
            "error": error, "status": 200, "check": check,
            "seconds": time.perf_counter() - t0}


async def _embed(http, url: str, body: dict) -> dict:
    """One ``/v1/embeddings`` request: its latency, inputs and :func:`served.check_embeddings`."""
    t0 = time.perf_counter()
    try:
        async with http.post(f"{url}/v1/embeddings", json=body) as r:
            if r.status != 200:
                return {"error": f"HTTP {r.status}: {(await r.text())[:200]}",
                        "status": r.status, "inputs": 0}
            answer = await r.json(content_type=None)
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        return {"error": f"{type(e).__name__}: {e}", "status": None, "inputs": 0}
    return {"error": "", "status": 200, "inputs": len(body["input"]),
            "check": served.check_embeddings(answer, len(body["input"])),
            "seconds": time.perf_counter() - t0}


def round_result(workload: str, outcomes: list[dict], wall: float) -> dict:
    """One round's measurements from its requests' outcomes (:func:`_one`, :func:`_embed`) and
    wall time: rates count only answers without error that pass their check; ``not_served``,
    ``errors`` and ``error_samples`` per :func:`served.classify`."""
    verdict = served.classify(outcomes)
    ok = [r for r in outcomes if not r.get("error") and r.get("check") in (None, "valid")]
    ttfts = [r["ttft"] for r in ok if r.get("ttft") is not None]
    gaps = [g for r in ok for g in r.get("gaps", ())]
    tokens = sum(r.get("tokens", 0) for r in ok)
    out = {"wall_seconds": wall, "requests": len(outcomes), **verdict,
           "output_tokens": tokens, "output_tokens_per_second": tokens / wall,
           "tokens_per_request": tokens / len(ok) if ok else None,
           "requests_per_second": len(ok) / wall,
           "ttft_p50_seconds": percentile(ttfts, 0.5),
           "ttft_p95_seconds": percentile(ttfts, 0.95),
           "itl_p50_seconds": percentile(gaps, 0.5), "itl_p95_seconds": percentile(gaps, 0.95)}
    if workload == "embeddings":
        latencies = [r["seconds"] for r in ok]
        out |= {"inputs_per_second": sum(r["inputs"] for r in ok) / wall,
                "latency_p50_seconds": percentile(latencies, 0.5),
                "latency_p95_seconds": percentile(latencies, 0.95)}
    return out


async def run_client(url: str, bodies: list[dict], concurrency: int, workload: str = "") -> dict:
    """Send ``bodies`` of ``workload`` with at most ``concurrency`` in flight; one round's
    measurements (:func:`round_result`)."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async def bounded(body: dict) -> dict:
            async with sem:
                if workload == "embeddings":
                    return await _embed(http, url, body)
                return await _one(http, url, body, workload)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(b) for b in bodies))
        wall = time.perf_counter() - t0
    return round_result(workload, results, wall)


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
                     sample_seconds: float = 5.0, embedding_model: Path | None = None) -> None:
    """The agent's serving path: ServingCore + the agent's OpenAI app, nothing else;
    ``ours_args``: the agent's serving flags (:func:`ours_options`); with ``embedding_model``
    also that embedding model as :data:`EMBEDDING_ID` (task ``TextEmbedding``, up to 32 inputs
    per forward pass, as the agent loads one). With ``memory_log``, every
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
    if embedding_model is not None:
        await core.load_model(EMBEDDING_ID, embedding_model, revision="bench",
                              task="TextEmbedding", max_concurrent_sequences=32,
                              max_context_tokens=8192)
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
    """A server process on 127.0.0.1:``port``, ready once ``/v1/models`` answers; ``env``:
    its environment (default this one's); ``embedding_model_name``: what an embeddings
    request's ``"model"`` must say to it."""

    def __init__(self, name: str, argv: list[str], log: Path, model_name: str,
                 env: dict[str, str] | None = None, embedding_model_name: str = EMBEDDING_ID
                 ) -> None:
        self.name, self.port = name, int(argv[argv.index("--port") + 1])
        self.model_name = model_name  # what a request's "model" must say to this server
        self.embedding_model_name = embedding_model_name
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("wb")
        env = (env or os.environ) | {"PYTHONUNBUFFERED": "1"}
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

    def log_errors(self, limit: int = 5) -> list[str]:
        """The distinct exception lines (``SomethingError: …``) of this server's log, first
        ``limit``: why a server failed requests, where its answers only say "500"."""
        import re

        found: list[str] = []
        with contextlib.suppress(OSError):
            for line in Path(self._log.name).read_text(errors="replace").splitlines():
                m = re.match(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.*)$", line)
                if m and (text := f"{m[1]}: {m[2]}"[:240]) not in found:
                    found.append(text)
        return found[:limit]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def ours_server(name: str, model: Path, max_sequences: int, cache_limit_gb: float,
                ours_args: str, log: Path, *extra: str, embedding_model: Path | None = None
                ) -> Server:
    """Ours (:func:`serve_ours`, in a process of its own) on a free port, serving ``model`` with
    the agent's flags ``ours_args``; ``extra``: more of this script's internal options (the
    soak's ``--memory-log``)."""
    return Server(name, [sys.executable, str(Path(__file__).resolve()), "--serve-ours",
                         str(model), "--port", str(_free_port()), "--max-sequences",
                         str(max_sequences), "--cache-limit-gb", str(cache_limit_gb),
                         f"--ours-args={ours_args}", *extra,
                         *(["--embedding-model", str(embedding_model)] if embedding_model
                           else [])], log, MODEL_ID)


def reference_server(model: Path, max_sequences: int, cache_limit_gb: float,
                     log: Path) -> Server:
    """``mlx_lm.server`` (:data:`_REFERENCE`) on a free port, serving ``model`` with the same
    decode concurrency and MLX cache limit as ours."""
    return Server("reference", [sys.executable, "-c", _REFERENCE, str(cache_limit_gb), "--model",
                                str(model), "--port", str(_free_port()), "--decode-concurrency",
                                str(max_sequences), "--log-level", "WARNING"], log,
                  "default_model")


def vllm_mlx_server(model: Path, max_sequences: int, cache_limit_gb: float, log: Path,
                    embedding_model: Path | None = None, wheels: Path | None = None) -> Server:
    """vllm-mlx (:mod:`vllm_mlx_server`: its own install, built once, first on ``PYTHONPATH``
    for its process only) on a free port, serving ``model`` (and ``embedding_model``) with the
    same sequence limit and MLX cache limit as ours."""
    import vllm_mlx_server as vm

    site = vm.site(wheels)
    home = log.parent / "vllm-mlx-home"
    home.mkdir(parents=True, exist_ok=True)
    return Server("vllm-mlx", vm.serve_argv(sys.executable, model, _free_port(), max_sequences,
                                            cache_limit_gb, MODEL_ID, embedding_model),
                  log, MODEL_ID, env=vm.environment(site, dict(os.environ), home),
                  embedding_model_name=str(embedding_model))


def client_round(server: Server, bodies: list[dict], concurrency: int,
                 workload: str = "") -> dict:
    """Run one round of ``workload`` against ``server`` in a fresh load-generator process; its
    JSON result."""
    name = server.embedding_model_name if workload == "embeddings" else server.model_name
    bodies = [b | {"model": name} for b in bodies]
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--client", server.url,
                        "--concurrency-client", str(concurrency), "--workload-client",
                        workload],
                       input=json.dumps(bodies), capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"load generator failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout)


def versions() -> dict[str, str]:
    out = {}
    for dist in ("mlx", "mlx-cuda-13", "mlx-metal", "mlx-lm", "aiohttp", "llguidance",
                 "jsonschema"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


#: The servers ours is compared with, and the prefix of the ratio keys: ours ÷ that server.
COMPARED = {"reference": "", "vllm-mlx": "vllm_mlx_", "baseline": "baseline_"}
_MEDIANS = ("output_tokens_per_second", "requests_per_second", "ttft_p50_seconds",
            "ttft_p95_seconds", "itl_p50_seconds", "itl_p95_seconds", "inputs_per_second",
            "latency_p50_seconds", "latency_p95_seconds", "tokens_per_request")


def rate_key(workload: str) -> str:
    """The throughput a workload is compared by: inputs/s for embeddings, else tokens/s."""
    return "inputs_per_second" if workload == "embeddings" else "output_tokens_per_second"


def _server_cell(rs: list[dict]) -> dict:
    """One server's rounds of one cell: medians, errors (with samples), or ``not_served``."""
    reason = next((x["not_served"] for x in rs if x.get("not_served")), None)
    if reason is not None:
        return {"not_served": reason}
    med: dict = {k: statistics.median(x[k] for x in rs if x.get(k) is not None)
                 if any(x.get(k) is not None for x in rs) else None
                 for k in _MEDIANS if any(k in x for x in rs)}
    med["errors"] = sum(x["errors"] for x in rs)
    samples = sorted({e for x in rs for e in x.get("error_samples", ())})[:3]
    if samples:
        med["error_samples"] = samples
    return med


def summarise(rounds: list[dict]) -> dict:
    """Medians per (workload, concurrency, server) and the ratios ours ÷ reference
    (``tokens_per_second_ratio``, ``ttft_p50_ratio``; for ``embeddings`` the first is of
    inputs/s), ours ÷ vllm-mlx (``vllm_mlx_*``) and ours ÷ baseline (``baseline_*``, when
    ``--baseline-args`` ran a third server). A cell where either side had errors has no ratio
    (``invalid``, ``vllm_mlx_invalid``, ``baseline_invalid``), nor one where either side does
    not serve the workload (``not_served``, …). Where ``json`` and ``json-plain`` both ran,
    each ``json`` cell gets ``constrained_over_plain``: per server, its ``json`` tokens/s ÷ its
    ``json-plain`` tokens/s (``None`` where either is not served or had errors)."""
    out: dict = {}
    for r in rounds:
        cell = out.setdefault(r["workload"], {}).setdefault(str(r["concurrency"]), {})
        cell.setdefault(r["server"], []).append(r)
    for wl, by_c in out.items():
        rate = rate_key(wl)
        for c, by_server in by_c.items():
            med: dict = {server: _server_cell(rs) for server, rs in by_server.items()}
            o = med.get("ours")
            for other, prefix in COMPARED.items():
                ref = med.get(other)
                if not (o and ref):
                    continue
                if "not_served" in o or "not_served" in ref:
                    med[f"{prefix}tokens_per_second_ratio"] = None
                    med[f"{prefix}ttft_p50_ratio"] = None
                    med[f"{prefix}not_served"] = (
                        f"{'ours' if 'not_served' in o else other} does not serve this "
                        f"workload: no ratio")
                elif o["errors"] or ref["errors"]:
                    if other != "baseline":
                        med[f"{prefix}tokens_per_second_ratio"] = None
                        med[f"{prefix}ttft_p50_ratio"] = None
                    med[f"{prefix}invalid"] = (
                        "a server had errors in this cell: no "
                        f"{'ratio' if other == 'reference' else other + ' ratio'}")
                else:
                    med[f"{prefix}tokens_per_second_ratio"] = (
                        o[rate] / ref[rate] if ref.get(rate) else None)
                    med[f"{prefix}ttft_p50_ratio"] = (
                        o["ttft_p50_seconds"] / ref["ttft_p50_seconds"]
                        if o.get("ttft_p50_seconds") and ref.get("ttft_p50_seconds") else None)
            by_c[c] = med
    for constrained, plain in PLAIN_TWIN.items():
        for c, cell in out.get(constrained, {}).items():
            twin = out.get(plain, {}).get(c, {})
            ratios = {}
            for server in SERVERS + ("baseline",):
                a, b = cell.get(server), twin.get(server)
                if a is None or b is None:
                    continue
                usable = all("not_served" not in x and not x["errors"]
                             and x.get("output_tokens_per_second") for x in (a, b))
                ratios[server] = (a["output_tokens_per_second"] / b["output_tokens_per_second"]
                                  if usable else None)
            cell["constrained_over_plain"] = ratios
    return out


def plot_bars(summary: dict) -> list[tuple[str, list[str], dict[str, list]]]:
    """What :func:`plot` draws, one panel per workload: ``(title, cells, {series: values})``,
    a value being a ratio or a reason it is missing (``"not served"``, ``"errors"``). Series:
    ours ÷ each compared server that ran; for ``json`` a further panel of each server's
    constrained ÷ plain."""
    panels = []
    for wl, by_c in summary.items():
        cs = sorted(by_c, key=cell_order)
        series: dict[str, list] = {}
        for other, prefix in COMPARED.items():
            if not any(other in by_c[c] for c in cs):
                continue
            vals = []
            for c in cs:
                cell = by_c[c]
                ratio = cell.get(f"{prefix}tokens_per_second_ratio")
                vals.append(ratio if ratio else "not served" if cell.get(f"{prefix}not_served")
                            else "errors")
            series[f"ours ÷ {other}"] = vals
        panels.append((wl + (" (inputs/s)" if wl == "embeddings" else ""), cs, series))
        if any("constrained_over_plain" in by_c[c] for c in cs):
            servers = [x for x in (*SERVERS, "baseline")
                       if any(x in by_c[c]["constrained_over_plain"] for c in cs)]
            panels.append((f"{wl}: constrained ÷ plain", cs, {
                x: [by_c[c]["constrained_over_plain"].get(x)
                    or ("not served" if "not_served" in (by_c[c].get(x) or {}) else "errors")
                    for c in cs] for x in servers}))
    return panels


def plot(summary: dict, path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    panels = plot_bars(summary)
    colours = ("#3b7dd8", "#e08a2c", "#5aa05a", "#9a6fc0")
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.6), squeeze=False)
    for ax, (name, cs, series) in zip(axes[0], panels):
        width = 0.8 / max(1, len(series))
        top = 1.2
        for k, (label, vals) in enumerate(series.items()):
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(cs))]
            ys = [v if isinstance(v, float) else 0 for v in vals]
            ax.bar(xs, ys, width, color=colours[k % len(colours)], label=label)
            top = max(top, *ys)
            for x, v in zip(xs, vals):
                ok = isinstance(v, float)
                ax.annotate(f"{v:.2f}×" if ok else v.replace(" ", "\n"), (x, v if ok else 0),
                            ha="center", va="bottom", fontsize=7,
                            color="black" if ok else "#b03030")
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_xticks(range(len(cs)), cs)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("inputs × requests" if "embeddings" in name else "concurrent streams")
        ax.set_ylim(0, top * 1.2)
        if series:
            ax.legend(fontsize=7, loc="upper right")
    axes[0][0].set_ylabel("output tokens/s ratio")
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


def embedding_model_from_args(args: argparse.Namespace) -> Path:
    """``args.embedding_model``, or an embedding model generated at the same size as the served
    llama (``make_test_model(embedding=True)``, cached like :func:`model_from_args`'s)."""
    from mlx_fleet.devcluster.binaries import cache_dir
    from mlx_fleet.testmodel import make_test_model

    return Path(args.embedding_model or make_test_model(
        (args.model_cache or cache_dir() / "models") /
        f"serving-embed-h{args.hidden_size}-l{args.num_layers}",
        hidden_size=args.hidden_size, num_layers=args.num_layers, embedding=True,
        num_heads=max(1, args.hidden_size // 64)))


def cells_of(workload: str, args: argparse.Namespace) -> list:
    """The concurrencies (or ``embeddings`` cells) a workload runs at."""
    if workload == "duplicate":
        return [DUPLICATES]
    if workload == "embeddings":
        return list(EMBEDDING_CELLS)
    if workload in ("json", "tools"):
        return list(args.feature_concurrency)
    return list(args.concurrency)


def round_bodies(workload: str, cell, args: argparse.Namespace, round_no: int,
                 warm_up: bool = False, max_tokens: int | None = None) -> list[dict]:
    """The bodies of one round of ``workload`` at ``cell`` (a warm-up round: one per stream,
    8 tokens — but a feature workload's full tokens, so its answers can complete);
    ``max_tokens``: every body's, instead of the workload's."""
    if max_tokens is not None:
        return [b | {"max_tokens": max_tokens}
                for b in round_bodies(workload, cell, args, round_no, warm_up)]
    if workload == "embeddings":
        n = 32 if warm_up else EMBEDDING_INPUTS * args.requests_per_stream
        return embedding_requests(cell, n, round_no)
    c = cell_concurrency(cell)
    n = DUPLICATES if workload == "duplicate" else max(c * args.requests_per_stream, 1)
    base = next((k for k, v in PLAIN_TWIN.items() if v == workload), workload)
    if warm_up:
        return requests_for(workload, min(n, c), args.max_tokens if base in ("json", "tools")
                            else 8, -1)
    return requests_for(workload, n, args.max_tokens, round_no)


def twin_max_tokens(warm_up: dict[str, dict]) -> dict[str, int | None]:
    """Per server, the ``max_tokens`` of a plain twin's requests from its constrained warm-up
    round (``{server: round result}``): the mean completion tokens of its valid answers,
    rounded; for a server with none (not served, errors only), ours' (else the first
    server's that has one), so the plain twin stays comparable across servers; ``None`` (the
    workload's own ``max_tokens``) where no server has one."""
    own = {name: (max(1, round(w["tokens_per_request"]))
                  if not w.get("not_served") and w.get("tokens_per_request") else None)
           for name, w in warm_up.items()}
    fallback = own.get("ours") or next((t for t in own.values() if t), None)
    return {name: t or fallback for name, t in own.items()}


def start_servers(args: argparse.Namespace, model: Path, embedding_model: Path | None,
                  logs: Path, not_started: dict[str, dict]) -> dict[str, Server]:
    """The servers of ``--servers`` (and the baseline of ``--baseline-args``), started; a
    reference server that cannot be installed goes into ``not_started`` with why."""
    max_seq = max(args.concurrency + args.feature_concurrency + [DUPLICATES])
    servers: dict[str, Server] = {}
    if "ours" in args.servers:
        servers["ours"] = ours_server("ours", model, max_seq, args.cache_limit_gb,
                                      args.ours_args, logs / "ours.log",
                                      embedding_model=embedding_model)
    if "reference" in args.servers:
        servers["reference"] = reference_server(model, max_seq, args.cache_limit_gb,
                                                logs / "reference.log")
    if "vllm-mlx" in args.servers:
        try:
            servers["vllm-mlx"] = vllm_mlx_server(model, max_seq, args.cache_limit_gb,
                                                  logs / "vllm-mlx.log", embedding_model,
                                                  args.vllm_mlx_wheels)
        except RuntimeError as e:  # its install failed: pip's words
            not_started["vllm-mlx"] = {"reason": str(e)[-1000:], "log_errors": []}
            print(f"vllm-mlx not installed: {e}", file=sys.stderr)
    if args.baseline_args is not None:
        # ours again with some optimisations off: what they buy, measured in the same rounds
        servers["baseline"] = ours_server("baseline", model, max_seq, args.cache_limit_gb,
                                          args.baseline_args, logs / "baseline.log",
                                          embedding_model=embedding_model)
    return servers


def _progress(wl: str, c, name: str, i: int, r: dict) -> str:
    rate = (f"{r['inputs_per_second']:8.1f} inputs/s" if wl == "embeddings"
            else f"{r['output_tokens_per_second']:8.1f} tok/s  TTFT p50 "
                 f"{1000 * (r['ttft_p50_seconds'] or 0):7.1f} ms")
    verdict = (f"NOT SERVED ({r['not_served']})" if r.get("not_served")
               else f"errors {r['errors']}" + (f" {r['error_samples'][0][:100]!r}"
                                               if r["errors"] else ""))
    return f"{wl:>14} c={c!s:<4} {name:>9} round {i}: {rate}  {verdict}"


def run(args: argparse.Namespace, partial: Path | None = None) -> dict:
    from common import machine

    model = model_from_args(args)
    embedding_model = (embedding_model_from_args(args) if "embeddings" in args.workloads
                       else None)
    weight_bytes = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    not_started: dict[str, dict] = {}
    servers = start_servers(args, model, embedding_model, logs, not_started)
    rounds: list[dict] = []
    try:
        for name, s in list(servers.items()):
            try:
                s.wait_ready()
            except SystemExit as e:
                if name in ("ours", "baseline"):
                    raise
                # a reference server that does not start (vllm-mlx on a platform it does not
                # support, say) is reported with why, and the others are measured
                s.stop()
                not_started[name] = {"reason": str(e), "log_errors": s.log_errors()}
                del servers[name]
                print(f"{name} did not start: {e} {not_started[name]['log_errors']}",
                      file=sys.stderr)
        for wl in args.workloads:
            variants = [wl, PLAIN_TWIN[wl]] if wl in PLAIN_TWIN else [wl]
            for c in cells_of(wl, args):
                conc = cell_concurrency(c)
                warm: dict[str, dict] = {}
                for name, s in servers.items():  # warm-up: kernels compiled, caches primed
                    for v in variants:
                        w = client_round(s, round_bodies(v, c, args, -1, warm_up=True), conc, v)
                        if v == wl:
                            warm[name] = w
                twin_tokens = twin_max_tokens(warm) if len(variants) > 1 else {}
                names = list(servers)
                for i in range(args.rounds):
                    # A B (C) / B C A / C A B: each server goes first in turn (evenly when the
                    # rounds are a multiple of the servers; main() warns when they are not);
                    # a workload and its plain twin alternate too
                    order = names[i % len(names):] + names[:i % len(names)]
                    for name in order:
                        for v in (variants if i % 2 == 0 else variants[::-1]):
                            limit = twin_tokens.get(name) if v != wl else None
                            r = client_round(servers[name],
                                             round_bodies(v, c, args, i, max_tokens=limit),
                                             conc, v)
                            rounds.append({"workload": v, "concurrency": c, "server": name,
                                           "round": i, **r,
                                           **({"max_tokens": limit} if limit else {})})
                            if partial is not None:  # what a killed run leaves behind
                                partial.write_text(json.dumps({"rounds": rounds}) + "\n")
                            print(_progress(v, c, name, i, r), file=sys.stderr)
    finally:
        for s in servers.values():
            s.stop()
    log_errors = {name: errs for name, s in servers.items() if (errs := s.log_errors())}
    summary = summarise(rounds)
    result = {"benchmark": "serving", "machine": machine(), "versions": versions(),
              "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "model": {"path": str(model), "weight_bytes": weight_bytes},
              "summary": summary, "rounds": rounds}
    if log_errors:  # why a server failed requests, from its own log
        result["server_log_errors"] = log_errors
    if not_started:
        result["servers_not_started"] = not_started
    if embedding_model is not None:
        result["embedding_model"] = {"path": str(embedding_model)}
    if "vllm-mlx" in servers:
        import vllm_mlx_server

        result["versions"]["vllm-mlx install"] = list(vllm_mlx_server.REQUIREMENTS)
    if args.bandwidth_gbs and "unique" in summary and "1" in summary["unique"]:
        tps = summary["unique"]["1"]["ours"]["output_tokens_per_second"]
        result["bandwidth_fraction_at_1_stream"] = tps * weight_bytes / (args.bandwidth_gbs * 1e9)
    return result


def table(summary: dict) -> list[str]:
    """One line per workload × cell: each server's rate (tokens/s, or inputs/s for
    ``embeddings``), ``not served`` or its errors, the ratios, and for ``json`` each server's
    constrained ÷ plain."""
    lines = []
    for wl, by_c in summary.items():
        unit = "inputs/s" if wl == "embeddings" else "tok/s"
        for c, cell in sorted(by_c.items(), key=lambda kv: cell_order(kv[0])):
            parts = []
            for server in (*SERVERS, "baseline"):
                m = cell.get(server)
                if m is None:
                    continue
                if "not_served" in m:
                    parts.append(f"{server} not served ({m['not_served'][:60]})")
                elif m["errors"]:
                    parts.append(f"{server} {m['errors']} errors "
                                 f"({(m.get('error_samples') or [''])[0][:60]})")
                else:
                    parts.append(f"{server} {m[rate_key(wl)]:.1f} {unit}")
            for other, prefix in COMPARED.items():
                ratio = cell.get(f"{prefix}tokens_per_second_ratio")
                if ratio:
                    parts.append(f"ours÷{other} ×{ratio:.2f}")
            for server, ratio in (cell.get("constrained_over_plain") or {}).items():
                parts.append(f"{server} constrained÷plain "
                             + (f"×{ratio:.2f}" if ratio else "n/a"))
            lines.append(f"{wl:>14} {c:>5}: " + "; ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS,
                   metavar="WORKLOAD", help=f"default: all ({', '.join(WORKLOADS)})")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32],
                   help="concurrent streams per round (default 1 8 32)")
    p.add_argument("--feature-concurrency", nargs="+", type=int, default=[8, 32],
                   help="concurrent streams of the json and tools workloads (default 8 32)")
    p.add_argument("--servers", nargs="+", default=["ours", "reference"], choices=SERVERS,
                   help="servers to measure side by side (default ours reference; vllm-mlx "
                        "is installed on first use into the mlx-fleet cache)")
    p.add_argument("--vllm-mlx-wheels", type=Path, metavar="DIR",
                   help="install vllm-mlx from this folder of wheels (--no-index: a machine "
                        "without network) instead of PyPI")
    p.add_argument("--embedding-model", type=Path, metavar="DIR",
                   help="the embeddings workload's model (default: one generated at "
                        "--hidden-size × --num-layers)")
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
    p.add_argument("--workload-client", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_ours:
        asyncio.run(serve_ours(args.serve_ours, args.port, args.max_sequences,
                               args.cache_limit_gb, args.ours_args, args.memory_log,
                               args.sample_seconds, args.embedding_model))
        return 0
    if args.client:
        bodies = json.load(sys.stdin)
        print(json.dumps(asyncio.run(run_client(args.client, bodies, args.concurrency_client,
                                                args.workload_client))))
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
    for line in table(result["summary"]):
        print(line)
    for name, errs in result.get("server_log_errors", {}).items():
        print(f"{name}'s log: " + " | ".join(errs))
    for name, why in result.get("servers_not_started", {}).items():
        print(f"{name} did not start: {why['reason']} " + " | ".join(why["log_errors"]))
    print(f"→ {out}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
