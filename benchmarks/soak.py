"""A bounded soak of the local fleet with one fault injected mid-way (issue 8 §4).

The real control plane (etcd, kube-apiserver), the operator and two agents (``mac-a``,
``mac-b``) serve a generated MLX model as one ModelDeployment with two replicas (one per Mac).
Clients keep ``--concurrency`` streamed chat completions in flight for ``--duration`` seconds
(10 minutes by default), each following ``status.endpoints`` as the API server sends it
(:class:`~mlx_fleet.devcluster.loadgen.LoadGenerator`; a client pauses ``--failure-pause`` s
after a failed request, as a client's back-off would). A third of the way in, the fault:

1. ``mac-b``'s agent is SIGKILLed (a Mac losing power: no lease revocation); its lease expires,
   the operator drops it from ``status.endpoints``;
2. the agent is started again (the Mac comes back) and the replica is Ready on it again;
3. the fleet's etcd is stopped (SIGTERM), left down ``--etcd-down`` seconds, and restarted
   from its data directory on the same port; the agents re-establish their leases;
4. recovered: etcd healthy, both agents' ``/health`` 200 and two Ready replicas again.

Phases: ``before`` the kill, ``during`` (kill → recovered), ``after``; a request counts for
the phase in which it ended (one in flight at the kill is the fault's, not the baseline's).
Every request is classified (:mod:`mlx_fleet.devcluster.soakstats`): succeeded, failed with a
clean error (an error answer or event, a refused or broken connection: the client knows at
once) or **lost** (no end within ``--request-timeout``, a stream cut short silently, or a
request that never ended) — the goal is 0 lost. Per phase: counts and p50/p95 latency, p95 time
to first token. Every ``--sample-interval`` s the agents' RSS (psutil) is sampled; the
least-squares slope per agent process is reported in bytes/s and MiB/hour.

    python benchmarks/soak.py                   # 10 minutes → benchmarks/results/soak.json
    python benchmarks/soak.py --duration 180    # 3 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import psutil

from common import machine
from mlx_fleet.devcluster.binaries import cache_dir, ensure_all
from mlx_fleet.devcluster.controlplane import ControlPlane, start_control_plane
from mlx_fleet.devcluster.fleet import AgentProcess, start_agent, start_operator
from mlx_fleet.devcluster.kwatch import ObjectWatch
from mlx_fleet.devcluster.loadgen import LoadGenerator
from mlx_fleet.devcluster.processes import ManagedProcess
from mlx_fleet.devcluster.soakstats import classify, phase_summary, slope
from mlx_fleet.testmodel import make_test_model

RESULTS = Path(__file__).resolve().parent / "results"
NS, NAME = "default", "soak"
NODES = ("mac-a", "mac-b")
VICTIM = "mac-b"


def manifest(source: Path) -> str:
    return json.dumps({
        "apiVersion": "mlx-fleet.io/v1alpha1", "kind": "ModelDeployment",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {"model": {"source": str(source), "revision": "v1"}, "replicas": 2,
                 "resources": {"memory": "256Mi"}}})


def wait_ready(cp: ControlPlane, replicas: int, timeout: float = 240) -> None:
    cp.kubectl("wait", f"--for=jsonpath={{.status.readyReplicas}}={replicas}",
               f"modeldeployment/{NAME}", "-n", NS, f"--timeout={int(timeout)}s",
               timeout=timeout + 10)


def restart_etcd(cp: ControlPlane, down_seconds: float) -> tuple[float, float]:
    """Stop the fleet's etcd (SIGTERM), wait ``down_seconds``, start it again with the same
    command line (same port, same data directory); returns (stopped, healthy) monotonic
    times."""
    old = cp.etcd.process
    old.stop()
    stopped = time.monotonic()
    time.sleep(down_seconds)  # the fault's length, not a wait for something
    new = ManagedProcess(old.name, old.argv, old.log_path)
    cp.etcd.process = new  # cp.stop() stops this one
    new.wait_until(cp.etcd.healthy, timeout=60, what="healthy after its restart")
    return stopped, time.monotonic()


def agents_healthy(agents: dict[str, AgentProcess]) -> bool:
    return all(a.health()[0] == 200 for a in agents.values())


class RssSampler:
    """Every ``interval`` s: the RSS of every agent process (by pid: a restarted agent is a new
    series)."""

    def __init__(self, agents: dict[str, AgentProcess], interval: float, t0: float) -> None:
        self.agents, self.interval, self.t0 = agents, interval, t0
        self.samples: list[dict] = []

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            now = time.monotonic()
            for name, a in list(self.agents.items()):
                try:
                    rss = psutil.Process(a.process.pid).memory_info().rss
                except psutil.Error:
                    continue  # killed between the listing and the read
                if a.process.alive():
                    self.samples.append({"t_s": round(now - self.t0, 2), "agent": name,
                                         "pid": a.process.pid, "rss_bytes": rss})
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    def slopes(self) -> dict[str, dict]:
        """Per agent process: samples, first/last RSS, slope (bytes/s, MiB/hour). The first
        sample of each process is left out of the fit (start-up allocation, not a trend)."""
        out: dict[str, dict] = {}
        series: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for s in self.samples:
            series.setdefault((s["agent"], s["pid"]), []).append((s["t_s"], s["rss_bytes"]))
        for (agent, pid), pts in series.items():
            b = slope(pts[1:])
            out[f"{agent} (pid {pid})"] = {
                "samples": len(pts), "from_s": pts[0][0], "to_s": pts[-1][0],
                "rss_first_bytes": int(pts[0][1]), "rss_last_bytes": int(pts[-1][1]),
                "slope_bytes_per_second": None if b is None else round(b, 1),
                "slope_mib_per_hour": None if b is None else round(b * 3600 / 2**20, 2)}
        return out


async def soak(cp: ControlPlane, agents: dict[str, AgentProcess], args) -> dict:
    first = json.loads(cp.kubectl("get", f"modeldeployment/{NAME}", "-n", NS, "-o", "json")
                       .stdout)["status"]["endpoints"]
    watch = ObjectWatch(cp, "modeldeployment", NAME, NS)

    def endpoints() -> list[str]:
        seen = [s.get("endpoints") for s in watch.statuses if s.get("endpoints") is not None]
        return seen[-1] if seen else first

    t0 = time.monotonic()
    marks: dict[str, float] = {}
    sampler = RssSampler(agents, args.sample_interval, t0)
    stop_sampling = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop_sampling))
    sessions = [f"soak-{i}" for i in range(args.concurrency)]
    load = LoadGenerator(endpoints, NAME, sessions=sessions, max_tokens=args.max_tokens,
                         timeout=args.request_timeout, failure_pause=args.failure_pause)
    try:
        async with load:
            await asyncio.sleep(args.duration / 3)  # the "before" phase: steady load
            victim = agents[VICTIM]
            marks["agent_killed"] = time.monotonic()
            victim.process.kill()
            print(f"[{marks['agent_killed'] - t0:6.1f}s] SIGKILL agent {VICTIM}", flush=True)
            await asyncio.to_thread(cp.kubectl, "wait", "--for=jsonpath={.status.readyReplicas}=1",
                                    f"modeldeployment/{NAME}", "-n", NS, "--timeout=120s",
                                    timeout=130)
            marks["endpoints_without_victim"] = watch.first(
                lambda o: victim.url not in ((o.get("status") or {}).get("endpoints") or [])
            ) or time.monotonic()
            agents[VICTIM] = await asyncio.to_thread(start_agent, cp, VICTIM,
                                                     lease_ttl=args.lease_ttl)
            marks["agent_restarted"] = time.monotonic()
            await asyncio.to_thread(wait_ready, cp, 2)
            marks["ready_again"] = time.monotonic()
            print(f"[{marks['ready_again'] - t0:6.1f}s] {VICTIM} back, 2 replicas Ready",
                  flush=True)
            marks["etcd_stopped"], marks["etcd_healthy"] = await asyncio.to_thread(
                restart_etcd, cp, args.etcd_down)
            print(f"[{marks['etcd_healthy'] - t0:6.1f}s] etcd restarted", flush=True)
            await asyncio.to_thread(agents[VICTIM].process.wait_until,
                                    lambda: agents_healthy(agents), timeout=120,
                                    what="healthy with the others after etcd's restart")
            await asyncio.to_thread(wait_ready, cp, 2)
            marks["recovered"] = time.monotonic()
            print(f"[{marks['recovered'] - t0:6.1f}s] recovered", flush=True)
            left = t0 + args.duration - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)  # the "after" phase: steady load again
            marks["load_stopped"] = time.monotonic()
        # `async with` exit: every request in flight ended (at most --request-timeout)
    finally:
        stop_sampling.set()
        await sampling
        watch.stop()
    end = marks["load_stopped"]
    phases = [("before", t0, marks["agent_killed"]),
              ("during", marks["agent_killed"], marks["recovered"]),
              ("after", marks["recovered"], end)]
    outcomes = load.outcomes
    classes = [classify(o) for o in outcomes]
    never_ended = load.sent - len(outcomes)
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.failed:
            key = f"{o.error_kind}: {o.error[:120]}"
            errors[key] = errors.get(key, 0) + 1
    return {
        "timeline_seconds": {k: round(v - t0, 3) for k, v in marks.items()},
        "requests": {"sent": load.sent, "succeeded": classes.count("succeeded"),
                     "failed_clean": classes.count("failed_clean"),
                     "lost": classes.count("lost") + never_ended,
                     "never_ended": never_ended},
        "phases": phase_summary(outcomes, phases),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:15]),
        "rss": {"slopes": sampler.slopes(), "samples": sampler.samples},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600,
                   help="seconds of load in all (default 600: 10 minutes); the fault starts "
                        "at a third of it")
    p.add_argument("--concurrency", type=int, default=8,
                   help="clients, each with one request in flight (default 8)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    p.add_argument("--request-timeout", type=float, default=30,
                   help="seconds after which a request without an end counts as lost "
                        "(default 30)")
    p.add_argument("--failure-pause", type=float, default=0.25,
                   help="seconds a client waits after a failed request (default 0.25)")
    p.add_argument("--etcd-down", type=float, default=10,
                   help="seconds etcd stays stopped before its restart (default 10)")
    p.add_argument("--lease-ttl", type=int, default=5, help="agents' lease TTL, s (default 5)")
    p.add_argument("--sample-interval", type=float, default=5,
                   help="seconds between RSS samples (default 5)")
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = p.parse_args()
    binaries = ensure_all()
    model_dir = make_test_model(cache_dir() / "models" / "tiny-llama")
    cp = start_control_plane(binaries=binaries)
    try:
        start_operator(cp)
        agents = {n: start_agent(cp, n, lease_ttl=args.lease_ttl) for n in NODES}
        cp.kubectl("apply", "-f", "-", input=manifest(model_dir))
        wait_ready(cp, 2)
        result = {"benchmark": "soak", "machine": machine(),
                  "params": {k: (str(v) if isinstance(v, Path) else v)
                             for k, v in vars(args).items()},
                  **asyncio.run(soak(cp, agents, args))}
    finally:
        cp.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: result[k] for k in ("timeline_seconds", "requests")}
    summary["phases"] = {name: {k: v for k, v in ph.items() if k != "error_kinds"}
                         for name, ph in result["phases"].items()}
    summary["rss_slopes"] = result["rss"]["slopes"]
    print(json.dumps(summary, indent=2))
    return 0 if result["requests"]["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
