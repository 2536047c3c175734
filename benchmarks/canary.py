"""Canary rollback and revision-edit timings on the local fleet (real etcd, kube-apiserver,
operator and two agents serving generated MLX models), under a steady streamed load.

Measured, in one run:

* ``local_guard_seconds``: from the first failed request of the faulty candidate to the start of
  the last request any agent still routed to it (after that, each agent's local guard sends the
  whole deployment to stable) — the worst node counts;
* ``fleet_rollback_seconds``: from that first failure to the moment the operator has written
  ``phase: RolledBack`` (seen on a watch of the Canary);
* ``candidate_requests_per_second``: the rate at which requests reached the candidate, beside
  both times: the local guard trips only once the candidate has ``minFailures`` failed requests
  (default 3, :class:`mlx_fleet.contract.LocalGuard`) making up ``failureRatio`` of its requests
  in its window, so both times follow this rate — about ``(minFailures - 1) / rate`` after the
  first failure for a candidate that fails every request (``local_guard_expected_seconds``).
  The rate is the candidate's requests over the span from the first one's start to the last
  one's (None with fewer than two); ``load_requests_per_second`` is the whole load's rate
  before the Canary (× the weight: what the candidate should get);
* ``stable_session_errors``: failed requests of sessions whose bucket hashes to the stable side;
* ``revision_edit_failed_requests`` and ``revision_edit_max_unready_seconds``: a plain edit of
  ``spec.model.revision`` under the same load — failed requests, and the longest time any
  ModelDeployment status seen on a watch had an empty ``status.endpoints``.

Goals at default settings (issue #5): local guard ≤ 2 s, fleet rollback ≤ 10 s, 0 stable-session
errors, 0 failed requests on a revision edit.

    python benchmarks/canary.py --help
    python benchmarks/canary.py          # writes benchmarks/results/canary.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from common import machine
from mlx_fleet.contract import LocalGuard
from mlx_fleet.devcluster.binaries import cache_dir, ensure_all
from mlx_fleet.devcluster.controlplane import start_control_plane
from mlx_fleet.devcluster.fleet import start_agent, start_operator
from mlx_fleet.devcluster.kwatch import ObjectWatch
from mlx_fleet.devcluster.loadgen import LoadGenerator
from mlx_fleet.routing.split import bucket
from mlx_fleet.testmodel import Fault, make_test_model

RESULTS = Path(__file__).resolve().parent / "results"
NS = "default"


def apply(cp, obj: dict) -> None:
    cp.kubectl("apply", "-f", "-", input=json.dumps(obj))


def md(name: str, source: Path, revision: str) -> dict:
    return {"apiVersion": "mlx-fleet.io/v1alpha1", "kind": "ModelDeployment",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"source": str(source), "revision": revision}, "replicas": 2,
                     "resources": {"memory": "1Gi"}}}


async def rollback(cp, healthy: Path, faulty: Path, args) -> dict:
    name = "bench-canary"
    apply(cp, md(name, healthy, "v1"))
    cp.kubectl("wait", "--for=condition=Ready", f"modeldeployment/{name}", "-n", NS,
               "--timeout=240s", timeout=250)
    endpoints = json.loads(cp.kubectl("get", "modeldeployment", name, "-n", NS, "-o",
                                      "json").stdout)["status"]["endpoints"]
    sessions = [f"bench-{i}" for i in range(args.concurrency)]
    stable_side = {s for s in sessions if bucket(f"{NS}/{name}", s) >= args.weight * 100}
    async with LoadGenerator(lambda: endpoints, name, sessions=sessions,
                             max_tokens=args.max_tokens) as load:
        await load.wait_for(args.concurrency * 2)
        warm = list(load.outcomes)
        apply(cp, {"apiVersion": "mlx-fleet.io/v1alpha1", "kind": "Canary",
                   "metadata": {"name": f"{name}-bad", "namespace": NS},
                   "spec": {"targetRef": {"name": name},
                            "candidate": {"revision": "bad", "source": str(faulty)},
                            "steps": [{"setWeight": args.weight}, {"setWeight": 100}]}})
        watch = ObjectWatch(cp, "canary", f"{name}-bad", NS)  # the object exists now
        await asyncio.to_thread(cp.kubectl, "wait", "--for=jsonpath={.status.phase}=RolledBack",
                                f"canary/{name}-bad", "-n", NS, "--timeout=240s", timeout=250)
        await load.wait_for(args.concurrency * 2)
    watch.stop()
    out = load.outcomes
    first_fail = min((o.ended for o in out if o.failed and o.revision == "bad"), default=None)
    if first_fail is None:
        raise SystemExit("the faulty candidate never served a request: nothing was measured")
    to_candidate = sorted(o.started for o in out if o.revision == "bad")
    last_to_candidate = to_candidate[-1]
    span = to_candidate[-1] - to_candidate[0]
    rate = (len(to_candidate) - 1) / span if len(to_candidate) > 1 and span > 0 else None
    load_span = max(o.ended for o in warm) - min(o.started for o in warm)
    guard = LocalGuard()  # the Canary below sets no localGuard: the contract's defaults
    rolled_back = watch.first(lambda o: (o.get("status") or {}).get("phase") == "RolledBack")
    return {
        "local_guard_seconds": round(max(last_to_candidate - first_fail, 0.0), 3),
        "fleet_rollback_seconds": round(rolled_back - first_fail, 3) if rolled_back else None,
        "candidate_requests_per_second": round(rate, 2) if rate else None,
        "local_guard_expected_seconds": (round((guard.min_failures - 1) / rate, 3)
                                         if rate else None),
        "load_requests_per_second": round(len(warm) / load_span, 2) if load_span > 0 else None,
        "guard_min_failures": guard.min_failures,
        "guard_window_seconds": guard.window_seconds,
        "candidate_requests": len(to_candidate),
        "stable_session_errors": sum(o.failed for o in out if o.session in stable_side),
        "candidate_failed_requests": sum(o.failed for o in out if o.revision == "bad"),
        "requests": len(out),
    }


async def revision_edit(cp, healthy: Path, args) -> dict:
    name = "bench-edit"
    apply(cp, md(name, healthy, "v1"))
    cp.kubectl("wait", "--for=condition=Ready", f"modeldeployment/{name}", "-n", NS,
               "--timeout=240s", timeout=250)
    endpoints = json.loads(cp.kubectl("get", "modeldeployment", name, "-n", NS, "-o",
                                      "json").stdout)["status"]["endpoints"]
    watch = ObjectWatch(cp, "modeldeployment", name, NS)
    async with LoadGenerator(lambda: endpoints, name,
                             sessions=[f"edit-{i}" for i in range(args.concurrency)],
                             max_tokens=args.max_tokens) as load:
        await load.wait_for(args.concurrency * 2)
        edited = time.monotonic()
        cp.kubectl("patch", "modeldeployment", name, "-n", NS, "--type=merge", "-p",
                   '{"spec": {"model": {"revision": "v2"}}}')
        await asyncio.to_thread(  # the edit is seen (else the old Complete would satisfy the wait)
            cp.kubectl, "wait", "--for=jsonpath={.status.observedGeneration}=2",
            f"modeldeployment/{name}", "-n", NS, "--timeout=240s", timeout=250)
        await asyncio.to_thread(cp.kubectl, "wait", "--for=jsonpath={.status.updatedReplicas}=2",
                                f"modeldeployment/{name}", "-n", NS, "--timeout=240s",
                                timeout=250)
        await asyncio.to_thread(
            cp.kubectl, "wait",
            "--for=jsonpath={.status.conditions[?(@.type=='Progressing')].reason}=Complete",
            f"modeldeployment/{name}", "-n", NS, "--timeout=240s", timeout=250)
        done = time.monotonic()
        await load.wait_for(args.concurrency * 2)
    watch.stop()
    gap, since = 0.0, None
    for t, o in watch.events:
        empty = not (o.get("status") or {}).get("endpoints")
        if empty and since is None:
            since = t
        elif not empty and since is not None:
            gap, since = max(gap, t - since), None
    if since is not None:
        gap = max(gap, done - since)
    return {"revision_edit_failed_requests": sum(o.failed for o in load.outcomes),
            "revision_edit_max_unready_seconds": round(gap, 3),
            "revision_edit_seconds": round(done - edited, 3),
            "revision_edit_requests": len(load.outcomes)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=8, help="concurrent sessions (default 8)")
    p.add_argument("--weight", type=int, default=50,
                   help="the canary's first setWeight, percent (default 50)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    p.add_argument("--out", type=Path, default=RESULTS / "canary.json")
    args = p.parse_args()
    binaries = ensure_all()
    models = cache_dir() / "models"
    healthy = make_test_model(models / "tiny-llama")
    faulty = make_test_model(models / "tiny-llama-faulty", fault=Fault("raise", after_tokens=2))
    cp = start_control_plane(binaries=binaries)
    try:
        start_operator(cp)
        for n in ("mac-a", "mac-b"):
            start_agent(cp, n, memory="64Gi", lease_ttl=5)
        result = {"machine": machine(), "params": vars(args) | {"out": str(args.out)},
                  **asyncio.run(rollback(cp, healthy, faulty, args)),
                  **asyncio.run(revision_edit(cp, healthy, args))}
    finally:
        cp.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
