"""The fleet router (issue #17) on the local fleet: real etcd, kube-apiserver, operator, three
node agents serving a generated MLX model, and the router process (``python -m
mlx_fleet_router``, started by :func:`mlx_fleet.devcluster.fleet.start_router`, as the demo and
the tests start it).

Measured, in one run, each comparison alternating its two sides so both see the same machine:

* **overhead** (one replica, ``maxConcurrentSequences`` 32): the same agent directly vs through
  the router. TTFT of single streamed requests, ``--ttft-rounds`` pairs, alternating → the
  added TTFT at p50 and p95 (router − direct, in ms; goal ≤ 1 and ≤ 2). Aggregate tokens/s of
  32 concurrent streams for ``--stream-seconds`` per leg, legs alternating twice → the ratio
  router ÷ direct (goal ≥ 0.97), and the router process's CPU seconds (``/proc``, user +
  system) per 1 000 streamed chunks (tokens relayed in the window). Against a **stub**
  backend (an aiohttp app answering a fixed chat completion at once; the one place a stub is
  fine: it measures the router, not MLX): the latency the router adds to a request
  (``--latency-rounds`` sequential pairs, alternating, p50/p95), the requests/s one router
  process forwards with clients in two processes of their own, the same with two router
  processes side by side, and the router's CPU milliseconds per forwarded request (on a
  shared two-core machine the clients, the stub and the routers compete for the same cores,
  so requests/s is a floor; 1 000 ÷ CPU ms per request is what one core would forward);
* **failover** (two replicas): plain and streaming clients through the router, one serving
  agent SIGKILLed → failed requests (goal 0 for any that had not begun streaming), streams cut
  mid-answer on the killed Mac (counted: resuming them is later work), the router's retries;
* **affinity** (three replicas): a multi-turn chat workload, ``--sessions`` sessions at once,
  each ``--turns`` turns whose prompt grows turn by turn (a long system prompt of its own, then
  user/assistant turns), through the router (no session header: the prompt-prefix key) vs
  round-robin over the agents' endpoints → prompt-cache hit share
  (``usage.prompt_tokens_details.cached_tokens`` ÷ ``prompt_tokens``; goal ≥ 80 %) and TTFT
  p50 (goal: round-robin ÷ router ≥ 2).

The machine is recorded (:func:`common.machine`) with its load average: on a shared two-core
machine only the ratios of one run mean much.

    python benchmarks/router.py --help
    python benchmarks/router.py          # benchmarks/results/router.json and router.png
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
NS = "default"
NAME = "bench-router"
WORDS = ("unified memory model weights token batch cache stream agent fleet canary revision node "
         "lease budget prefill decode sample latency throughput queue router session").split()


# --- helpers -------------------------------------------------------------------------------

def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile by nearest rank (``xs`` not empty)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, int(round(q * (len(s) - 1)))))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a Linux process so far (``/proc/PID/stat``)."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) * 1024 if m else 0


async def stream_chat(http: aiohttp.ClientSession, base: str, body: dict,
                      headers: dict | None = None, stamps: list[float] | None = None) -> dict:
    """One streamed chat completion (with ``include_usage``) → ``ttft`` (s, first content
    chunk), ``chunks`` (SSE data events), ``usage`` (the final usage object or {}); raises on
    a non-200 answer or a stream without ``[DONE]``. ``stamps``: gets the
    ``time.perf_counter()`` of every chunk with content (a token)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, chunks, usage, done = None, 0, {}, False
    async with http.post(f"{base}/v1/chat/completions", json=body, headers=headers or {}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            chunks += 1
            obj = json.loads(data)
            if obj.get("usage"):
                usage = obj["usage"]
            if any((c.get("delta") or {}).get("content") for c in obj.get("choices") or ()):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                if stamps is not None:
                    stamps.append(now)
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "chunks": chunks,
            "usage": usage}


def md(model_dir: Path, replicas: int, selector: dict[str, str], name: str = NAME,
       max_seqs: int = 32) -> str:
    return json.dumps({
        "apiVersion": "mlx-fleet.io/v1alpha1", "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"source": f"file://{model_dir}", "revision": "v1",
                           "servedModelName": name},
                 "replicas": replicas, "resources": {"memory": "512Mi"},
                 "serving": {"maxConcurrentSequences": max_seqs},
                 "placement": {"nodeSelector": selector}}})


def wait_replicas(cp, name: str, n: int, router: str) -> dict:
    """Until ``name`` has ``n`` Ready replicas (API server) and the router lists ``n``."""
    cp.kubectl("wait", f"--for=jsonpath={{.status.readyReplicas}}={n}", f"modeldeployment/{name}",
               "-n", NS, "--timeout=240s", timeout=260)
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(f"{router}/v1/models", timeout=5) as r:
            listed = {m["id"]: m for m in json.load(r)["data"]}
        if listed.get(name, {}).get("ready_replicas") == n:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"the router did not list {name} with {n} replicas: {listed}")
        time.sleep(0.1)
    return json.loads(cp.kubectl("get", "modeldeployment", name, "-n", NS, "-o", "json").stdout)


def scrape(url: str) -> dict[str, float]:
    import urllib.request

    out: dict[str, float] = {}
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                out[k] = float(v)
    return out


def msum(m: dict[str, float], name: str, **labels: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(name + "{")
               and all(f'{a}="{b}"' in k for a, b in labels.items()))


# --- (a) overhead ---------------------------------------------------------------------------

async def overhead(cp, router, model_dir: Path, args) -> dict:
    cp.kubectl("apply", "-f", "-", input=md(model_dir, 1, {"agent.mlx-fleet.io/pool": "bench"}))
    obj = await asyncio.to_thread(wait_replicas, cp, NAME, 1, router.url)
    direct = obj["status"]["endpoints"][0]
    legs = {"direct": direct, "router": router.url}
    rng = random.Random(0)
    ttft: dict[str, list[float]] = {"direct": [], "router": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        def body(text: str, max_tokens: int) -> dict:
            return {"model": NAME, "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": text}]}

        for leg in ("direct", "router") * 3:  # warm-up: kernels, connections
            await stream_chat(http, legs[leg], body(f"warm {leg}", 2))
        for i in range(args.ttft_rounds):
            prompt = f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(12))
            for leg in (("direct", "router") if i % 2 == 0 else ("router", "direct")):
                r = await stream_chat(http, legs[leg], body(f"{leg} {prompt}", 2))
                ttft[leg].append(r["ttft"])

        async def streams(base: str) -> dict:
            """``--streams`` clients streaming back to back; the tokens (content chunks) that
            arrive in a window of ``--stream-seconds`` after ``--ramp-seconds`` (a steady
            state, not the quantized end of a wave of requests), and the router's CPU in it."""
            stamps: list[float] = []
            failed = 0

            async def worker(w: int) -> None:
                nonlocal failed
                for j in itertools.count():
                    try:
                        await stream_chat(http, base, body(f"stream {w} {j} {base}",
                                                           args.stream_tokens), stamps=stamps)
                    except (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError):
                        failed += 1

            tasks = [asyncio.create_task(worker(w)) for w in range(args.streams)]
            await asyncio.sleep(args.ramp_seconds)
            t0, cpu0 = time.perf_counter(), cpu_seconds(router.process.pid)
            await asyncio.sleep(args.stream_seconds)
            t1, cpu1 = time.perf_counter(), cpu_seconds(router.process.pid)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.sleep(1.0)  # the agent aborts the cancelled streams
            tokens = sum(t0 <= x < t1 for x in stamps)
            return {"tokens": tokens, "seconds": t1 - t0, "failed": failed,
                    "router_cpu_seconds": cpu1 - cpu0}

        tput: dict[str, list[dict]] = {"direct": [], "router": []}
        # a warm-up leg, not measured (in a run without it the first leg ran at half the rate
        # of the three others; on this shared machine a later leg can too, see the results)
        await streams(legs["direct"])
        for leg in ("direct", "router", "router", "direct"):
            tput[leg].append(await streams(legs[leg]))
    cp.kubectl("delete", "modeldeployment", NAME, "-n", NS, "--wait=true", timeout=120)

    def rate(leg: str) -> float:
        return (sum(r["tokens"] for r in tput[leg]) / sum(r["seconds"] for r in tput[leg]))

    rchunks = sum(r["tokens"] for r in tput["router"])
    rcpu = sum(r["router_cpu_seconds"] for r in tput["router"])
    return {
        "ttft_direct_p50_ms": 1000 * statistics.median(ttft["direct"]),
        "ttft_router_p50_ms": 1000 * statistics.median(ttft["router"]),
        "added_ttft_p50_ms": 1000 * (statistics.median(ttft["router"])
                                      - statistics.median(ttft["direct"])),
        "added_ttft_p95_ms": 1000 * (quantile(ttft["router"], 0.95)
                                      - quantile(ttft["direct"], 0.95)),
        # each router request beside the direct one sent right before or after it
        "added_ttft_paired_median_ms": 1000 * statistics.median(
            r - d for r, d in zip(ttft["router"], ttft["direct"])),
        "tokens_per_second_direct": rate("direct"), "tokens_per_second_router": rate("router"),
        "tokens_per_second_ratio": rate("router") / rate("direct"),
        "router_cpu_seconds_per_1000_chunks": 1000 * rcpu / rchunks if rchunks else None,
        "streams": args.streams, "legs": tput, "ttft_seconds": ttft}


# --- forwarding capacity against a stub backend ---------------------------------------------

STUB_ANSWER = {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0,
               "model": "stub", "choices": [{"index": 0, "finish_reason": "stop",
                                             "message": {"role": "assistant", "content": "ok"}}],
               "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}


def run_stub(port: int) -> None:
    """An OpenAI-shaped backend that answers at once (its own process)."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(STUB_ANSWER)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def run_clients(url: str, model: str, concurrency: int, seconds: float) -> dict:
    """``concurrency`` clients sending non-streamed requests to ``url`` for ``seconds`` (its
    own process) → ok, failed."""
    async def go() -> dict:
        ok = failed = 0
        stop = time.perf_counter() + seconds
        body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        conn = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=conn) as http:
            async def worker(w: int) -> None:
                nonlocal ok, failed
                while time.perf_counter() < stop:
                    try:
                        async with http.post(f"{url}/v1/chat/completions", json=body,
                                             headers={"X-Session-ID": f"c{w}"}) as r:
                            await r.read()
                            ok, failed = (ok + 1, failed) if r.status == 200 else (ok, failed + 1)
                    except aiohttp.ClientError:
                        failed += 1
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(w) for w in range(concurrency)))
            return {"ok": ok, "failed": failed, "seconds": time.perf_counter() - t0}
    return asyncio.run(go())


async def forwarding(cp, start_agent, start_router, model_dir: Path, args) -> dict:
    from mlx_fleet.devcluster.processes import free_port

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    stub = ctx.Process(target=run_stub, args=(port,), daemon=True)
    stub.start()
    stub_url = f"http://127.0.0.1:{port}"
    # a real agent registers the Mac and reports the replica Ready, advertising the stub's URL:
    # the router follows etcd as always and forwards to the stub
    agent = start_agent(cp, "stub-mac", labels={"agent.mlx-fleet.io/pool": "stub"}, lease_ttl=5,
                        extra_args=("--advertise-url", stub_url))
    routers = [start_router(cp, namespaces=(NS,), log_name=f"router-fwd-{i}") for i in range(2)]
    name = "bench-stub"
    cp.kubectl("apply", "-f", "-", input=md(model_dir, 1, {"agent.mlx-fleet.io/pool": "stub"}, name=name))
    for r in routers:
        await asyncio.to_thread(wait_replicas, cp, name, 1, r.url)
    out: dict = {}
    try:
        # the router's own added latency, MLX out of the picture: sequential non-streamed
        # requests, each through the router beside one straight to the stub, alternating
        lat: dict[str, list[float]] = {"direct": [], "router": []}
        body = {"model": name, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as http:
            for i in range(args.latency_rounds + 20):
                for leg in (("direct", "router") if i % 2 == 0 else ("router", "direct")):
                    base = stub_url if leg == "direct" else routers[0].url
                    t = time.perf_counter()
                    async with http.post(f"{base}/v1/chat/completions", json=body) as r:
                        await r.read()
                        assert r.status == 200, r.status
                    if i >= 20:  # the first 20 pairs warm connections up
                        lat[leg].append(time.perf_counter() - t)
        out["stub_latency"] = {
            "added_p50_ms": 1000 * (statistics.median(lat["router"])
                                    - statistics.median(lat["direct"])),
            "added_p95_ms": 1000 * (quantile(lat["router"], 0.95)
                                    - quantile(lat["direct"], 0.95)),
            "direct_p50_ms": 1000 * statistics.median(lat["direct"]),
            "router_p50_ms": 1000 * statistics.median(lat["router"]),
            "rounds": args.latency_rounds}
        with ctx.Pool(2) as pool:
            for label, targets in (("one_router", [routers[0].url] * 2),
                                   ("two_routers", [r.url for r in routers]),
                                   ("direct_stub", [stub_url] * 2)):
                cpu0 = [cpu_seconds(r.process.pid) for r in routers]
                runs = pool.starmap(run_clients, [(t, name, args.fwd_concurrency,
                                                   args.fwd_seconds) for t in targets])
                cpu = sum(cpu_seconds(r.process.pid) - c for r, c in zip(routers, cpu0))
                ok = sum(r["ok"] for r in runs)
                out[label] = {"requests_per_second": ok / max(r["seconds"] for r in runs),
                              "failed": sum(r["failed"] for r in runs),
                              "router_cpu_ms_per_request": 1000 * cpu / ok
                              if label != "direct_stub" and ok else None}
    finally:
        cp.kubectl("delete", "modeldeployment", name, "-n", NS, "--wait=false")
        for r in routers:
            r.process.stop()
        agent.process.stop()
        stub.terminate()
    out["client_processes"] = 2
    out["concurrency_per_client"] = args.fwd_concurrency
    return out


# --- (c) affinity ---------------------------------------------------------------------------

async def affinity(cp, router, model_dir: Path, args) -> dict:
    cp.kubectl("apply", "-f", "-", input=md(model_dir, 3, {"agent.mlx-fleet.io/pool": "bench"}))
    obj = await asyncio.to_thread(wait_replicas, cp, NAME, 3, router.url)
    endpoints = list(obj["status"]["endpoints"])
    rr = itertools.count()
    results: dict[str, list[dict]] = {"router": [], "round_robin": []}

    async def session(http, mode: str, rnd: int, s: int) -> None:
        rng = random.Random(f"{mode}-{rnd}-{s}")
        system = (f"Session {mode}-{rnd}-{s}. " +
                  " ".join(rng.choice(WORDS) for _ in range(args.system_words)))
        messages = [{"role": "system", "content": system}]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": f"Turn {turn}: " + " ".join(
                rng.choice(WORDS) for _ in range(args.turn_words))})
            base = router.url if mode == "router" else endpoints[next(rr) % len(endpoints)]
            r = await stream_chat(http, base, {"model": NAME, "max_tokens": args.turn_tokens,
                                               "temperature": 0, "messages": messages})
            u = r["usage"]
            results[mode].append({
                "turn": turn, "ttft": r["ttft"], "prompt_tokens": u.get("prompt_tokens", 0),
                "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)})
            messages.append({"role": "assistant", "content": f"Answer {turn} of {s}."})

    before = scrape(router.url)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        for ep in endpoints:  # warm-up of every agent
            await stream_chat(http, ep, {"model": NAME, "max_tokens": 2,
                                         "messages": [{"role": "user", "content": "warm"}]})
        for rnd in range(args.affinity_rounds):
            for mode in (("round_robin", "router") if rnd % 2 == 0
                         else ("router", "round_robin")):
                await asyncio.gather(*(session(http, mode, rnd, s)
                                       for s in range(args.sessions)))

    def summary(rows: list[dict]) -> dict:
        later = [r for r in rows if r["turn"] > 0]
        share = lambda rs: (sum(r["cached_tokens"] for r in rs)  # noqa: E731
                            / max(1, sum(r["prompt_tokens"] for r in rs)))
        return {"cache_hit_share": share(rows), "cache_hit_share_after_first_turn": share(later),
                "ttft_p50_ms": 1000 * statistics.median(r["ttft"] for r in rows),
                "ttft_p50_ms_after_first_turn": 1000 * statistics.median(r["ttft"] for r in later),
                "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in rows),
                "requests": len(rows)}

    after = scrape(router.url)
    out = {mode: summary(rows) for mode, rows in results.items()}
    # the router's own count: a request on its session's Mac (kept) or spilled by the load bound
    out["router"]["affinity"] = {
        k: msum(after, "mlxfleet_router_affinity_total", model=NAME, result=k)
        - msum(before, "mlxfleet_router_affinity_total", model=NAME, result=k)
        for k in ("kept", "spilled")}
    out["ttft_p50_ratio_round_robin_over_router"] = (out["round_robin"]["ttft_p50_ms"]
                                                     / out["router"]["ttft_p50_ms"])
    out["workload"] = {"sessions": args.sessions, "turns": args.turns,
                       "system_words": args.system_words, "turn_words": args.turn_words,
                       "rounds": args.affinity_rounds, "replicas": 3,
                       "router_session_key": "prompt prefix (no X-Session-ID, no user)"}
    out["requests"] = results
    return out


# --- (b) failover ---------------------------------------------------------------------------

async def failover(cp, router, agents: dict, args) -> dict:
    from mlx_fleet.devcluster.loadgen import LoadGenerator

    cp.kubectl("patch", "modeldeployment", NAME, "-n", NS, "--type=merge",
               "-p", '{"spec": {"replicas": 2}}')
    obj = await asyncio.to_thread(wait_replicas, cp, NAME, 2, router.url)
    victim = obj["status"]["nodes"][0]["name"]
    before = scrape(router.url)
    async with LoadGenerator(lambda: [router.url], NAME, stream=False,
                             sessions=[f"plain-{i}" for i in range(args.failover_plain)]
                             ) as plain, \
            LoadGenerator(lambda: [router.url], NAME,
                          sessions=[f"stream-{i}" for i in range(args.failover_streams)]
                          ) as streams:
        await plain.wait_for(4 * args.failover_plain)
        agents[victim].process.kill()
        killed = time.monotonic()
        await plain.wait_for(args.failover_after)
        await streams.wait_for(args.failover_after // 2)
    after = scrape(router.url)
    outcomes = plain.outcomes + streams.outcomes
    cut = [o for o in streams.outcomes if o.failed and o.status == 200
           and o.error_kind in ("connection", "incomplete")]
    failed = [o for o in outcomes if o.failed and o not in cut]
    return {"victim": victim, "requests": len(outcomes),
            "requests_after_kill": sum(o.ended >= killed for o in outcomes),
            "plain_requests": len(plain.outcomes), "streams": len(streams.outcomes),
            "failed": len(failed), "failed_plain": sum(o.failed for o in plain.outcomes),
            "streams_cut": len(cut), "failures": [o.error for o in failed][:5],
            "router_retries": msum(after, "mlxfleet_router_retries_total", reason="Retry")
            - msum(before, "mlxfleet_router_retries_total", reason="Retry"),
            "victim_failed_attempts": sum(
                msum(after, "mlxfleet_router_upstream_attempts_total", node=victim, result=k)
                - msum(before, "mlxfleet_router_upstream_attempts_total", node=victim, result=k)
                for k in ("connect_error", "reset", "timeout"))}


# --- (d) scale -----------------------------------------------------------------------------

async def scale(cp, start_router, args) -> dict:
    """A router following ``--scale-nodes`` simulated Macs × ``--scale-deployments``
    deployments of 2 replicas: the control-plane benchmark's simulated fleet
    (``controlplane.SimulatedFleet``: real etcd leases, node records, Ready reports written for
    each assignment), with the assignments written straight into etcd (the router reads the
    same keys whoever writes them; no operator needed to measure the router). Measured: the
    router's RSS once it lists every deployment, the seconds from ``python -m mlx_fleet_router``
    to that, and, for ``--scale-losses`` Macs one after another, the seconds from the Mac's
    lease ending in etcd (revoked, as it would expire) to the router listing its deployment
    with one Ready replica fewer (``GET /v1/models`` polled every 20 ms)."""
    import urllib.request

    from controlplane import SimulatedFleet
    from mlx_fleet.contract import Assignment, Keys, ModelSource
    from mlx_fleet.store import EtcdStore

    keys = Keys()
    n, m = args.scale_nodes, args.scale_deployments
    names = [f"sim-{i:04d}" for i in range(n)]

    def listed(url: str) -> dict[str, int]:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
            return {x["id"]: x["ready_replicas"] for x in json.load(r)["data"]}

    async with EtcdStore(cp.etcd_url) as store:
        fleet = SimulatedFleet(store, keys, ttl=30)
        await fleet.start(names)
        hosts: dict[str, list[str]] = {}
        sem = asyncio.Semaphore(64)

        async def assign(i: int, node: str) -> None:
            a = Assignment(namespace=NS, name=f"md-{i:04d}", served_model_name=f"md-{i:04d}",
                           generation=1, source=ModelSource(uri="/models/sim", revision="v1"),
                           memory_bytes=2**30)
            async with sem:
                await store.put(keys.assignment(node, NS, a.name, "v1"), a.to_json())
            hosts.setdefault(node, []).append(a.name)

        await asyncio.gather(*(assign(i, names[(2 * i + r) % n]) for i in range(m)
                               for r in range(2)))
        while fleet.reports_written < 2 * m:
            await asyncio.sleep(0.2)  # the simulated Macs answer the watch events
        t0 = time.monotonic()
        router = await asyncio.to_thread(start_router, cp, namespaces=(NS,),
                                         log_name="router-scale", timeout=300)
        while sum(v == 2 for v in (await asyncio.to_thread(listed, router.url)).values()) < m:
            await asyncio.sleep(0.2)
        synced = time.monotonic() - t0
        rss = rss_bytes(router.process.pid)
        losses = []
        # every other Mac: deployment i is on Macs 2i and 2i + 1, so each loss is watched on
        # a deployment no earlier loss touched
        for victim in [x for x in names[::2] if x in hosts][:args.scale_losses]:
            watched = hosts[victim][0]
            t = time.monotonic()
            await fleet.lose(victim)
            while (await asyncio.to_thread(listed, router.url)).get(watched, 0) >= 2:
                await asyncio.sleep(0.02)
            losses.append(time.monotonic() - t)
        rss_after = rss_bytes(router.process.pid)
        await fleet.stop()
        router.process.stop()
    return {"nodes": n, "deployments": m, "replicas": 2,
            "router_rss_bytes": rss, "router_rss_bytes_after_losses": rss_after,
            "seconds_to_list_all": synced,
            "lease_loss_to_removal_seconds": losses,
            "lease_loss_to_removal_p50_seconds": statistics.median(losses) if losses else None,
            "lease_loss_to_removal_max_seconds": max(losses, default=None),
            "simulated_lease_expiries": fleet.lease_expiries}


# --- the run --------------------------------------------------------------------------------

async def fleet_parts(cp, model_dir: Path, args, result: dict) -> None:
    """Overhead, forwarding, affinity and failover on one fleet: the operator, three agents
    and the router; fills ``result``."""
    from mlx_fleet.devcluster.fleet import start_agent, start_operator, start_router

    start_operator(cp, extra_args=("--namespace", NS))
    agents = {n: start_agent(cp, n, labels={"agent.mlx-fleet.io/pool": "bench"}, lease_ttl=5)
              for n in ("mac-1", "mac-2", "mac-3")}
    router = start_router(cp, namespaces=(NS,))
    if "overhead" in args.parts:
        result["overhead"] = await overhead(cp, router, model_dir, args)
        print("overhead:", {k: v for k, v in result["overhead"].items()
                            if not isinstance(v, (dict, list))}, flush=True)
    if "forwarding" in args.parts:
        result["forwarding"] = await forwarding(cp, start_agent, start_router, model_dir, args)
        print("forwarding:", result["forwarding"], flush=True)
    if "affinity" in args.parts:
        result["affinity"] = await affinity(cp, router, model_dir, args)
        print("affinity:", {k: v for k, v in result["affinity"].items()
                            if k != "requests"}, flush=True)
    if "failover" in args.parts:
        if "affinity" not in args.parts:
            cp.kubectl("apply", "-f", "-", input=md(model_dir, 2, {"agent.mlx-fleet.io/pool": "bench"}))
        result["failover"] = await failover(cp, router, agents, args)
        print("failover:", result["failover"], flush=True)
    result["router_rss_bytes"] = rss_bytes(router.process.pid)


async def run(args) -> dict:
    from common import machine
    from mlx_fleet.devcluster.binaries import cache_dir, ensure_all
    from mlx_fleet.devcluster.controlplane import start_control_plane
    from mlx_fleet.devcluster.fleet import start_router
    from mlx_fleet.testmodel import make_test_model

    model_dir = make_test_model(cache_dir() / "models" / f"router-h{args.hidden_size}-l{args.num_layers}",
                                hidden_size=args.hidden_size, num_layers=args.num_layers)
    load0 = os.getloadavg()
    t0 = time.monotonic()
    cp = start_control_plane(binaries=ensure_all(), keep_workdir=args.keep)
    result: dict = {"benchmark": "router", "machine": machine(),
                    "machine_note": "a 2-core machine shared with other engineers' builds and "
                                    "tests during the run: absolute times are noisy, compare "
                                    "the ratios of this one run",
                    "params": {k: (str(v) if isinstance(v, Path) else v)
                               for k, v in vars(args).items()}}
    try:
        if "scale" in args.parts:
            result["scale"] = await scale(cp, start_router, args)
            print("scale:", result["scale"], flush=True)
        else:
            await fleet_parts(cp, model_dir, args, result)
    finally:
        cp.stop()
    result["loadavg_start"], result["loadavg_end"] = load0, os.getloadavg()
    result["wall_seconds"] = time.monotonic() - t0
    return result


def plot(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    o, a, f = result.get("overhead"), result.get("affinity"), result.get("forwarding")
    if o:
        ax = axes[0]
        ax.boxplot([[1000 * x for x in o["ttft_seconds"]["direct"]],
                    [1000 * x for x in o["ttft_seconds"]["router"]]])
        ax.set_xticks([1, 2], ["direct", "router"])
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"overhead: TTFT {o['added_ttft_p50_ms']:+.1f} ms p50 (paired "
                     f"{o['added_ttft_paired_median_ms']:+.1f}), "
                     f"tok/s ×{o['tokens_per_second_ratio']:.2f} at {o['streams']} streams",
                     fontsize=9)
    if a:
        ax = axes[1]
        for mode, color in (("round_robin", "tab:red"), ("router", "tab:blue")):
            rows = a["requests"][mode]
            turns = sorted({r["turn"] for r in rows})
            ax.plot(turns, [1000 * statistics.median(r["ttft"] for r in rows if r["turn"] == t)
                            for t in turns], "o-", color=color,
                    label=f"{mode}: cache {100 * a[mode]['cache_hit_share']:.0f} %")
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_title(f"affinity: TTFT p50 round-robin ÷ router = "
                     f"{a['ttft_p50_ratio_round_robin_over_router']:.2f}", fontsize=9)
        ax.legend(fontsize=8)
    if f:
        ax = axes[2]
        labels = ["one_router", "two_routers", "direct_stub"]
        ax.bar(labels, [f[k]["requests_per_second"] for k in labels])
        ax.set_ylabel("requests/s (stub backend)")
        ax.set_title(f"stub backend: router adds {f['stub_latency']['added_p50_ms']:.2f} ms p50; "
                     f"{f['one_router']['router_cpu_ms_per_request']:.2f} CPU ms/request",
                     fontsize=9)
    fig.suptitle(f"fleet router — {result['machine']['cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["overhead", "forwarding", "affinity", "failover"],
                   choices=["overhead", "forwarding", "affinity", "failover", "scale"],
                   help="what to measure (scale runs alone: --parts scale); the results are "
                        "merged into --output's existing ones")
    p.add_argument("--scale-nodes", type=int, default=1000, help="simulated Macs")
    p.add_argument("--scale-deployments", type=int, default=500, help="deployments (2 replicas)")
    p.add_argument("--scale-losses", type=int, default=5, help="Macs lost one after another")
    p.add_argument("--hidden-size", type=int, default=256, help="generated model width")
    p.add_argument("--num-layers", type=int, default=4, help="generated model depth")
    p.add_argument("--ttft-rounds", type=int, default=60, help="direct/router TTFT pairs")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams (default 32)")
    p.add_argument("--stream-tokens", type=int, default=32, help="max_tokens of each stream")
    p.add_argument("--stream-seconds", type=float, default=8.0,
                   help="seconds of each leg's measured window")
    p.add_argument("--ramp-seconds", type=float, default=3.0,
                   help="seconds of each leg before its window")
    p.add_argument("--fwd-concurrency", type=int, default=32, help="clients per client process")
    p.add_argument("--fwd-seconds", type=float, default=5.0, help="seconds per forwarding leg")
    p.add_argument("--latency-rounds", type=int, default=300,
                   help="router/direct pairs of requests to the stub")
    p.add_argument("--sessions", type=int, default=7,
                   help="chat sessions at once (not a multiple of the 3 agents: sessions in "
                        "lock step would otherwise land round-robin on the same agent each "
                        "turn)")
    p.add_argument("--turns", type=int, default=6, help="turns per session")
    p.add_argument("--system-words", type=int, default=300, help="words of each system prompt")
    p.add_argument("--turn-words", type=int, default=20, help="words per user turn")
    p.add_argument("--turn-tokens", type=int, default=8, help="max_tokens per turn")
    p.add_argument("--affinity-rounds", type=int, default=2, help="rounds of each mode")
    p.add_argument("--failover-plain", type=int, default=8, help="plain clients")
    p.add_argument("--failover-streams", type=int, default=4, help="streaming clients")
    p.add_argument("--failover-after", type=int, default=60,
                   help="plain requests that must end after the kill")
    p.add_argument("--keep", action="store_true", help="keep the logs directory")
    p.add_argument("--output", type=Path, default=RESULTS / "router.json")
    args = p.parse_args()
    result = asyncio.run(run(args))
    if args.output.exists():  # merge: the parts measured now replace the same parts only
        earlier = json.loads(args.output.read_text())
        runs = earlier.pop("runs", {})
        runs[",".join(args.parts)] = {k: result[k] for k in ("machine", "params", "loadavg_start",
                                                            "loadavg_end", "wall_seconds")}
        result = {**earlier, **result, "runs": runs}
    else:
        result["runs"] = {",".join(args.parts): {
            k: result[k] for k in ("machine", "params", "loadavg_start", "loadavg_end",
                                   "wall_seconds")}}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    png = plot(result, args.output.with_suffix(".png"))
    print(f"→ {args.output}" + (f", {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
