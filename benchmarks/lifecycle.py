"""Model lifecycle on the local fleet (real etcd, kube-apiserver, operator and agents serving a
generated MLX model): first-token latency by residency, the bytes an idle-unload frees, and how
long the fleet takes to serve again after losing a Mac.

Measured, in one run:

* ``ttft_warm_seconds``: time to first token (client side, streamed chat completion) of a
  resident model — median of ``--rounds`` requests;
* ``ttft_prefetched_seconds``: the first request after an idle-unload while the weights are on
  disk *and* in the OS page cache (what an Eager prefetch or a recent load leaves): the request
  reloads the model on demand — median over ``--rounds`` unloads;
* ``ttft_cold_seconds``: the same, with the weights' pages dropped from the page cache first
  (``posix_fadvise(DONTNEED)``; Linux only, elsewhere ``null``), alternated with the prefetched
  rounds so both see the same machine state;
* ``unload_freed_bytes``: what the agent reported freed by its last idle-unload (MLX active +
  cache memory, measured by the agent before and after);
* ``node_loss_to_ready_seconds``: from SIGKILL of the agent serving the model's only replica to
  the operator's status showing it Ready on the other Mac, with ``lease_ttl_seconds`` (goal:
  ≤ lease TTL + 2 s + the model's load time; the load time is reported too);
* ``itl_p99_ratio_during_load``: p99 inter-token gap of a streaming model while another model
  loads on the same serving core ÷ the same without a load (``benchmarks/load_stall.py``; goal
  ≤ 2). Left ``null`` with ``--skip-load-stall``.

    python benchmarks/lifecycle.py --help
    python benchmarks/lifecycle.py        # writes benchmarks/results/lifecycle.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from common import machine
from mlx_fleet.contract import AssignmentReport, AssignmentState, Keys
from mlx_fleet.devcluster.binaries import cache_dir, ensure_all
from mlx_fleet.devcluster.controlplane import start_control_plane
from mlx_fleet.devcluster.fleet import ROOT, start_agent, start_operator
from mlx_fleet.devcluster.kwatch import ObjectWatch
from mlx_fleet.devcluster.loadgen import LoadGenerator
from mlx_fleet.store import EtcdStore
from mlx_fleet.testmodel import make_test_model

RESULTS = Path(__file__).resolve().parent / "results"
NS = "default"
NAME = "bench-life"


def apply(cp, obj: dict) -> None:
    cp.kubectl("apply", "-f", "-", input=json.dumps(obj))


def md(source: Path, idle_seconds: int) -> dict:
    return {"apiVersion": "mlx-fleet.io/v1alpha1", "kind": "ModelDeployment",
            "metadata": {"name": NAME, "namespace": NS},
            "spec": {"model": {"source": str(source), "revision": "v1"}, "replicas": 1,
                     "resources": {"memory": "2Gi"},
                     "lifecycle": {"idleUnloadSeconds": idle_seconds, "prefetch": "Eager"}}}


def drop_page_cache(model_dir: Path) -> bool:
    """Ask the kernel to drop the clean cached pages of every file in ``model_dir``; False
    where ``posix_fadvise`` does not exist (macOS)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in model_dir.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def wait_status(cp, jsonpath: str, timeout: float = 240) -> None:
    cp.kubectl("wait", f"--for=jsonpath={jsonpath}", f"modeldeployment/{NAME}", "-n", NS,
               f"--timeout={int(timeout)}s", timeout=timeout + 10)


async def ttft(load: LoadGenerator, endpoint: str) -> float:
    o = await load.one(endpoint, "bench-lifecycle")
    if o.failed or o.ttft_seconds is None:
        raise SystemExit(f"request to {endpoint} failed: {o.error or 'no token'}")
    return o.ttft_seconds


async def residency(cp, model_dir: Path, args) -> dict:
    """Warm, prefetched and cold first-token latency, and the bytes an idle-unload frees."""
    keys = Keys(ROOT)
    apply(cp, md(model_dir, args.idle_seconds))
    wait_status(cp, "{.status.readyReplicas}=1")
    status = json.loads(cp.kubectl("get", "modeldeployment", NAME, "-n", NS, "-o",
                                   "json").stdout)["status"]
    (entry,) = status["nodes"]
    endpoint, node = entry["endpoint"], entry["name"]
    warm, prefetched, cold, freed = [], [], [], []
    async with LoadGenerator(lambda: [endpoint], NAME, sessions=[],
                             max_tokens=args.max_tokens) as load, \
            EtcdStore(cp.etcd_url) as store:
        await ttft(load, endpoint)  # the first request compiles kernels: not measured
        for _ in range(args.rounds):
            warm.append(await ttft(load, endpoint))
        for i in range(2 * args.rounds):
            await asyncio.to_thread(wait_status, cp, "{.status.nodes[0].state}=Unloaded")
            kv = await store.get(keys.report(node, NS, NAME, "v1"))
            if kv is not None:
                freed.append(AssignmentReport.from_json(kv.value).freed_bytes)
            is_cold = i % 2 == 1 and drop_page_cache(model_dir)
            (cold if is_cold else prefetched).append(await ttft(load, endpoint))
    med = lambda xs: round(statistics.median(xs), 4) if xs else None  # noqa: E731
    return {"ttft_warm_seconds": med(warm), "ttft_prefetched_seconds": med(prefetched),
            "ttft_cold_seconds": med(cold), "unload_freed_bytes": max(freed, default=None),
            "ttft_rounds": {"warm": warm, "prefetched": prefetched, "cold": cold}}


async def node_loss(cp, agents: dict, args) -> dict:
    """Seconds from SIGKILL of the serving agent to Ready on the other one."""
    status = json.loads(cp.kubectl("get", "modeldeployment", NAME, "-n", NS, "-o",
                                   "json").stdout)["status"]
    (serving,) = [n["name"] for n in status["nodes"]]
    survivor = next(n for n in agents if n != serving)
    watch = ObjectWatch(cp, "modeldeployment", NAME, NS)

    def ready_on_survivor(o: dict) -> bool:
        return any(n["name"] == survivor and n["state"] == AssignmentState.READY.value
                   for n in (o.get("status") or {}).get("nodes") or ())

    killed = time.monotonic()
    agents[serving].process.kill()  # a Mac that lost power: no lease revocation
    await asyncio.to_thread(
        cp.kubectl, "wait",
        f"--for=jsonpath={{.status.nodes[?(@.name=='{survivor}')].state}}=Ready",
        f"modeldeployment/{NAME}", "-n", NS, "--timeout=240s", timeout=250)
    watch.stop()
    ready = watch.first(ready_on_survivor)
    placed = watch.first(lambda o: any(n["name"] == survivor for n in
                                       (o.get("status") or {}).get("nodes") or ()))
    return {"node_loss_to_ready_seconds": round(ready - killed, 3) if ready else None,
            "node_loss_to_placed_seconds": round(placed - killed, 3) if placed else None,
            "lease_ttl_seconds": args.lease_ttl}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3,
                   help="requests per residency kind (default 3; cold and prefetched alternate)")
    p.add_argument("--idle-seconds", type=int, default=2,
                   help="the deployment's lifecycle.idleUnloadSeconds (default 2)")
    p.add_argument("--lease-ttl", type=int, default=5, help="agents' lease TTL, s (default 5)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per request (default 8)")
    p.add_argument("--hidden-size", type=int, default=1024,
                   help="generated model width (default 1024: ~0.3 GB of float32 weights)")
    p.add_argument("--layers", type=int, default=8, help="generated model depth (default 8)")
    p.add_argument("--skip-load-stall", action="store_true",
                   help="don't run the inter-token-latency-during-load measurement")
    p.add_argument("--out", type=Path, default=RESULTS / "lifecycle.json")
    args = p.parse_args()
    binaries = ensure_all()
    model_dir = make_test_model(cache_dir() / "models" / f"life-h{args.hidden_size}-l{args.layers}",
                                hidden_size=args.hidden_size, num_layers=args.layers)
    cp = start_control_plane(binaries=binaries)
    try:
        start_operator(cp)
        agents = {n: start_agent(cp, n, memory="64Gi", lease_ttl=args.lease_ttl)
                  for n in ("mac-a", "mac-b")}
        result = {"machine": machine(), "params": vars(args) | {"out": str(args.out)},
                  **asyncio.run(residency(cp, model_dir, args))}
        result |= asyncio.run(node_loss(cp, agents, args))
    finally:
        cp.stop()
    result["itl_p99_ratio_during_load"] = None
    if not args.skip_load_stall:
        from load_stall import Params, run  # benchmarks/load_stall.py

        stall = run(Params())
        result["itl_p99_ratio_during_load"] = stall["itl_p99_ratio_during_load"]
        result["load_stall"] = stall
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
