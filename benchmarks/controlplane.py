"""Control-plane scale: the real etcd, kube-apiserver and operator with N simulated Macs and M
ModelDeployments.

The Macs are the one place a stub is acceptable (issue #9): a thousand MLX agents don't fit on
a laptop. Each simulated Mac is what the operator sees of an agent — a real etcd lease kept
alive every TTL/3, a node record under it, and a Ready :class:`~mlx_fleet.contract.AssignmentReport`
written (under the lease) for each assignment it gets, deleted when the assignment goes — run
as asyncio tasks sharing one etcd client, with no MLX behind them.

Measured, per N (``--nodes``, default 100 300 1000) with M deployments (``--deployments``,
default 500, 2 replicas of 1 GiB each):

* ``converge_seconds``: from ``kubectl apply`` of all M to every one ``Ready`` (seen through a
  watch on the API server, :func:`wait_all_ready`);
* ``reconcile_p50_seconds`` / ``reconcile_p99_seconds`` from the operator's own
  ``mlxfleet_operator_reconcile_duration_seconds`` histogram (bucket upper bounds), and the
  reconciles by result;
* etcd ``puts``/``txns``/``ranges`` per reconcile (etcd's ``etcd_mvcc_*_total`` counters);
* ``idle_writes``: etcd revisions advanced in ``--idle-seconds`` with nothing changing (goal 0);
* ``node_join``/``node_leave``: reconciles and etcd writes caused by one node joining, and by
  one node that hosts replicas losing its lease (plus the seconds until all are Ready again);
* the operator's CPU seconds and peak RSS.

Goal (issue #9, on the project's 2-core machine): 1 000 nodes × 500 deployments converge in
≤ 60 s. Results: ``benchmarks/results/controlplane.json`` and a PNG of convergence time vs N.

    python benchmarks/controlplane.py --help
    python benchmarks/controlplane.py --nodes 100 300 1000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path

from common import machine
from mlx_fleet.contract import (AssignmentReport, AssignmentState, Keys, NodeCapacity,
                                NodeRecord)
from mlx_fleet.devcluster.binaries import ensure_all
from mlx_fleet.devcluster.controlplane import start_control_plane
from mlx_fleet.devcluster.fleet import start_operator
from mlx_fleet.devcluster.processes import free_port
from mlx_fleet.store import EtcdStore, Snapshot, StoreError, WatchEvent, follow_prefix

RESULTS = Path(__file__).resolve().parent / "results"
PROFILING = Path(__file__).resolve().parent / "profiling"
GiB = 2**30
NS = "default"


class SimulatedFleet:
    """N simulated Macs in etcd (module docstring)."""

    def __init__(self, store: EtcdStore, keys: Keys, ttl: int) -> None:
        self.store, self.keys, self.ttl = store, keys, ttl
        self.leases: dict[str, int] = {}
        self.reports_written = 0
        #: leases found expired at a keep-alive (the benchmark process was starved of CPU for
        #: a TTL): the Mac registers again, as an agent would — a disturbed run, reported
        self.lease_expiries = 0
        self._tasks: list[asyncio.Task] = []
        self._sem = asyncio.Semaphore(64)

    @staticmethod
    def record(name: str) -> NodeRecord:
        return NodeRecord(name=name, address=f"http://{name}.sim:8000",
                          capacity=NodeCapacity(memory_total_bytes=64 * GiB,
                                                memory_available_bytes=60 * GiB,
                                                chip="Apple M4 Max", chip_generation=4,
                                                simulated=True))

    async def add(self, name: str) -> None:
        async with self._sem:
            lease = await self.store.grant_lease(self.ttl)
            self.leases[name] = lease
            await self.store.put(self.keys.node(name), self.record(name).to_json(), lease=lease)

    async def lose(self, name: str) -> None:
        """The Mac vanishes: its lease is revoked (as it would expire), keys and all."""
        lease = self.leases.pop(name)
        with contextlib.suppress(StoreError):  # expired already
            await self.store.revoke_lease(lease)

    async def start(self, names: list[str]) -> None:
        await asyncio.gather(*(self.add(n) for n in names))
        self._tasks = [asyncio.create_task(self._keepalive()),
                       asyncio.create_task(follow_prefix(self.store, self.keys.assignments_prefix,
                                                         self._on_snapshot, self._on_event))]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)  # the agent's keep-alive period

            async def one(name: str, lease: int) -> None:
                async with self._sem:
                    try:
                        alive = await self.store.keepalive(lease) > 0
                    except StoreError:
                        alive = False
                if not alive and self.leases.get(name) == lease:
                    self.lease_expiries += 1
                    await self.add(name)

            await asyncio.gather(*(one(n, le) for n, le in list(self.leases.items())),
                                 return_exceptions=True)

    async def _ready(self, key: str, value: bytes) -> None:
        from mlx_fleet.contract import Assignment

        parsed = self.keys.parse_assignment(key)
        if parsed is None:
            return
        node, ns, name, revision = parsed
        lease = self.leases.get(node)
        if lease is None:
            return
        a = Assignment.from_json(value)
        report = AssignmentReport(node=node, namespace=ns, name=name, revision=revision,
                                  generation=a.generation, state=AssignmentState.READY,
                                  reason="ModelLoaded", endpoint=f"http://{node}.sim:8000")
        async with self._sem:
            try:
                await self.store.put(self.keys.report(node, ns, name, revision),
                                     report.to_json(), lease=lease)
            except StoreError:  # the lease expired meanwhile: the Mac registers again
                return
        self.reports_written += 1

    async def _on_snapshot(self, snap: Snapshot) -> None:
        await asyncio.gather(*(self._ready(kv.key, kv.value) for kv in snap.items))

    async def _on_event(self, ev: WatchEvent) -> None:
        if ev.type == "PUT":
            asyncio.ensure_future(self._ready(ev.kv.key, ev.kv.value))
        else:
            parsed = self.keys.parse_assignment(ev.kv.key)
            if parsed is not None:
                asyncio.ensure_future(self.store.delete(self.keys.report(*parsed)))


# ---------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text exposition → {sample name with labels: value}."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items()
               if k == name or k.startswith(name + "{"))


def histogram_quantile(after: dict, before: dict, name: str, q: float) -> float | None:
    """The ``q`` quantile of a histogram's increase, as the upper bound of its bucket."""
    buckets = []
    for k, v in after.items():
        m = re.match(rf'{name}_bucket\{{(.*)\}}$', k)
        if m:
            le = re.search(r'le="([^"]+)"', m.group(1))
            result = re.search(r'result="([^"]+)"', m.group(1))
            if le and (result is None or result.group(1) == "success"):
                buckets.append((float(le.group(1)), v - before.get(k, 0.0)))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    for le, count in buckets:
        if count >= q * total:
            return le
    return None


def proc_usage(pid: int) -> dict[str, float]:
    """CPU seconds and peak RSS of a Linux process (empty elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    import os

    tick = os.sysconf("SC_CLK_TCK")
    peak = re.search(r"VmHWM:\s+(\d+) kB", status)
    return {"cpu_seconds": (int(stat[11]) + int(stat[12])) / tick,
            "peak_rss_bytes": int(peak.group(1)) * 1024 if peak else None}


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """name → CPU seconds (user + system) so far of each process, and ``benchmark``: this
    process with its finished children (kubectl)."""
    out = {name: proc_usage(pid).get("cpu_seconds", 0.0) for name, pid in pids.items()}
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    out["benchmark"] = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    return out


def apiserver_requests(cp) -> dict[str, int]:
    """``"VERB resource[/subresource]"`` → requests the kube-apiserver has served so far
    (its ``apiserver_request_total``; WATCH counts watches opened, not events sent)."""
    text = cp.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    out: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        what = labels.get("resource", "") + (f"/{labels['subresource']}"
                                             if labels.get("subresource") else "")
        key = f"{labels.get('verb', '?')} {what}"
        out[key] = out.get(key, 0) + int(float(line.rpartition(" ")[2]))
    return out


def deployments(m: int, replicas: int) -> str:
    items = [{"apiVersion": "mlx-fleet.io/v1alpha1", "kind": "ModelDeployment",
              "metadata": {"name": f"md-{i:04d}", "namespace": NS},
              "spec": {"model": {"source": "/models/sim", "revision": "v1"},
                       "replicas": replicas, "resources": {"memory": "1Gi"}}}
             for i in range(m)]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})


def is_ready(obj: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions", []))


async def wait_macnodes(cp, n: int, timeout: float) -> float:
    """Seconds until the operator has created the ``n`` MacNodes (polled once a second)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        out = await asyncio.to_thread(cp.kubectl, "get", "macnodes", "-o", "name", timeout=120)
        if len(out.stdout.split()) >= n:
            return time.monotonic() - t0
        await asyncio.sleep(1.0)  # the fleet's start-up, before anything is measured
    raise SystemExit(f"not all {n} MacNodes created after {timeout:.0f} s")


async def wait_all_ready(cp, m: int, timeout: float) -> float:
    """Seconds until all ``m`` ModelDeployments are Ready, seen through one watch on the API
    server (``kubectl get --watch``, as ``kubectl wait`` would): a poll listing every object
    twice a second cost the 2-core machine more CPU than the operator itself."""
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        str(cp.binaries.kubectl), "--kubeconfig", str(cp.kubeconfig), "get", "modeldeployments",
        "-n", NS, "-o", "json", "--watch", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    ready: dict[str, bool] = {}
    decoder, buf = json.JSONDecoder(), ""

    async def follow() -> None:
        nonlocal buf
        while sum(ready.values()) < m:
            chunk = await proc.stdout.read(1 << 16)
            if not chunk:
                raise SystemExit("kubectl get --watch ended")
            buf += chunk.decode()
            while True:
                buf = buf.lstrip()
                try:
                    obj, end = decoder.raw_decode(buf)
                except json.JSONDecodeError:
                    break  # an incomplete object: read more
                buf = buf[end:]
                ready[obj["metadata"]["name"]] = is_ready(obj)

    try:
        await asyncio.wait_for(follow(), timeout)
    except asyncio.TimeoutError:
        raise SystemExit(f"{sum(ready.values())} of {m} deployments Ready after "
                         f"{timeout:.0f} s") from None
    finally:
        proc.kill()
        await proc.wait()
    return time.monotonic() - t0


async def one_size(binaries, n: int, args) -> dict:
    cp = start_control_plane(binaries=binaries)
    try:
        keys = Keys()
        mport = free_port()
        env = {}
        if args.profile:  # cProfile of the whole operator process (profiling/sitecustomize.py)
            args.profile.mkdir(parents=True, exist_ok=True)
            env = {"PYTHONPATH": os.pathsep.join([str(PROFILING), os.environ.get("PYTHONPATH", "")]),
                   "MLXF_PROFILE_OUT": str(args.profile / f"operator-{n}.prof")}
        op = start_operator(cp, metrics_port=mport, env=env)
        pids = {"operator": op.pid, "etcd": cp.etcd.process.pid,
                "kube_apiserver": cp.apiserver.pid, "kube_etcd": cp.kube_etcd.process.pid}
        metrics_url = f"http://127.0.0.1:{mport}/metrics"
        etcd_metrics = f"{cp.etcd_url}/metrics"
        async with EtcdStore(cp.etcd_url) as store:
            fleet = SimulatedFleet(store, keys, args.lease_ttl)
            t = time.monotonic()
            await fleet.start([f"sim-{i:04d}" for i in range(n)])
            register_s = time.monotonic() - t
            # the fleet at rest before the clock starts: the operator has mirrored every Mac
            # into a MacNode (1 000 creations that would otherwise overlap the convergence)
            mirror_s = await wait_macnodes(cp, n, args.timeout)
            m0, e0 = scrape(metrics_url), scrape(etcd_metrics)
            cpu0, a0 = cpu_seconds(pids), await asyncio.to_thread(apiserver_requests, cp)
            t0 = time.monotonic()
            # in a thread: the simulated Macs' keep-alives run on this loop
            await asyncio.to_thread(cp.kubectl, "apply", "-f", "-",
                                    input=deployments(args.deployments, args.replicas),
                                    timeout=300)
            converge = await wait_all_ready(cp, args.deployments, args.timeout)
            converge_total = time.monotonic() - t0
            m1, e1 = scrape(metrics_url), scrape(etcd_metrics)
            cpu1, a1 = cpu_seconds(pids), await asyncio.to_thread(apiserver_requests, cp)
            if args.profile:  # the operator writes its profile so far (profiling/sitecustomize.py)
                os.kill(op.pid, signal.SIGUSR1)
            reconciles = delta(m1, m0, "mlxfleet_operator_reconcile_total")

            # idle: nothing changes, nothing should be written
            rev0 = (await store.list(keys.placement_epoch)).revision
            await asyncio.sleep(args.idle_seconds)  # the quiet period being measured
            rev1 = (await store.list(keys.placement_epoch)).revision

            # one node joins
            m2, e2 = scrape(metrics_url), scrape(etcd_metrics)
            await fleet.add("sim-joiner")
            await asyncio.sleep(args.settle_seconds)  # the effects of one join to count
            m3, e3 = scrape(metrics_url), scrape(etcd_metrics)

            # one node that hosts replicas leaves (lease gone)
            placed = [keys.parse_assignment(kv.key)[0]
                      for kv in (await store.list(keys.assignments_prefix)).items]
            victim = sorted(placed)[0]
            on_victim = placed.count(victim)
            t_leave = time.monotonic()
            await fleet.lose(victim)
            # the operator sees the node gone and re-places; wait until all Ready again
            await asyncio.sleep(1.0)  # let the status of the affected ones drop first
            leave_ready = await wait_all_ready(cp, args.deployments, args.timeout) + 1.0
            m4, e4 = scrape(metrics_url), scrape(etcd_metrics)
            usage = proc_usage(op.pid)
            await fleet.stop()
    finally:
        cp.stop()
    writes = lambda a, b: delta(a, b, "etcd_mvcc_put_total") + delta(  # noqa: E731
        a, b, "etcd_mvcc_delete_total")
    return {
        "nodes": n, "deployments": args.deployments, "replicas": args.replicas,
        "register_seconds": round(register_s, 2), "macnodes_mirrored_seconds": round(mirror_s, 2),
        "converge_seconds": round(converge, 2), "converge_total_seconds": round(converge_total, 2),
        "reconciles": reconciles,
        "reconciles_by_result": {k.split('result="')[1].rstrip('"}'): v - m0.get(k, 0.0)
                                 for k, v in m1.items()
                                 if k.startswith("mlxfleet_operator_reconcile_total{")},
        "reconcile_p50_seconds": histogram_quantile(
            m1, m0, "mlxfleet_operator_reconcile_duration_seconds", 0.5),
        "reconcile_p99_seconds": histogram_quantile(
            m1, m0, "mlxfleet_operator_reconcile_duration_seconds", 0.99),
        "etcd_per_reconcile": {
            "puts": delta(e1, e0, "etcd_mvcc_put_total") / max(reconciles, 1),
            "txns": delta(e1, e0, "etcd_mvcc_txn_total") / max(reconciles, 1),
            "ranges": delta(e1, e0, "etcd_mvcc_range_total") / max(reconciles, 1)},
        "idle_writes": rev1 - rev0, "idle_seconds": args.idle_seconds,
        "node_join": {"reconciles": delta(m3, m2, "mlxfleet_operator_reconcile_total"),
                      "etcd_writes": writes(e3, e2)},
        "node_leave": {"reconciles": delta(m4, m3, "mlxfleet_operator_reconcile_total"),
                       "etcd_writes": writes(e4, e3),
                       "seconds_to_all_ready": round(leave_ready, 2),
                       "replicas_on_lost_node": on_victim},
        "operator": usage,
        "cpu_seconds_while_converging": {k: round(cpu1[k] - cpu0[k], 2) for k in cpu1},
        "apiserver_requests_while_converging": {
            k: v - a0.get(k, 0) for k, v in sorted(a1.items(), key=lambda kv: -kv[1])
            if v - a0.get(k, 0) > 0},
        "simulated_reports_written": fleet.reports_written,
        "simulated_lease_expiries": fleet.lease_expiries,
        "wall_seconds_for_leave_measure": round(time.monotonic() - t_leave, 2),
    }


def plot(runs: list[dict], path: Path, before: Path | None = None) -> Path | None:
    """Convergence time vs simulated Macs; ``before``: an earlier result file drawn dashed for
    comparison (its own harness and code, as that file's ``machine``/``params`` say)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    ns = [r["nodes"] for r in runs]
    ax.plot(ns, [r["converge_total_seconds"] for r in runs], "o-",
            label="kubectl apply starts → all Ready")
    ax.plot(ns, [r["converge_seconds"] for r in runs], "s-", label="apply done → all Ready")
    if before is not None and before.exists():
        old = json.loads(before.read_text())["runs"]
        ax.plot([r["nodes"] for r in old], [r["converge_seconds"] for r in old], "x--",
                color="grey", label=f"before: apply done → all Ready ({before.name})")
    ax.axhline(60, color="grey", ls=":", lw=1, label="goal (60 s)")
    ax.set_xlabel("simulated Macs")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{runs[0]['deployments']} ModelDeployments × {runs[0]['replicas']} replicas",
                 fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[100, 300, 1000],
                   help="simulated Macs per run (default 100 300 1000)")
    p.add_argument("--deployments", type=int, default=500, help="ModelDeployments (default 500)")
    p.add_argument("--replicas", type=int, default=2, help="replicas each (default 2)")
    p.add_argument("--lease-ttl", type=int, default=15, help="simulated agents' TTL, s")
    p.add_argument("--idle-seconds", type=float, default=10.0,
                   help="quiet period in which etcd writes are counted (default 10)")
    p.add_argument("--settle-seconds", type=float, default=5.0,
                   help="time a node join is given to cause work (default 5)")
    p.add_argument("--timeout", type=float, default=600.0, help="per convergence, s")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="write a cProfile of the operator process, from its start until all are "
                        "Ready, to DIR/operator-<N>.prof")
    p.add_argument("--before", type=Path, default=RESULTS / "controlplane-before-view.json",
                   help="an earlier result drawn dashed in the plot, for comparison")
    p.add_argument("--out", type=Path, default=RESULTS / "controlplane.json")
    args = p.parse_args()
    binaries = ensure_all()
    runs: list[dict] = []
    result = {"benchmark": "controlplane", "machine": machine(), "params": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for n in args.nodes:
        r = asyncio.run(one_size(binaries, n, args))
        print(f"{n:5d} nodes × {args.deployments} deployments: converged in "
              f"{r['converge_seconds']:.1f} s, {r['reconciles']:.0f} reconciles, idle writes "
              f"{r['idle_writes']}, join → {r['node_join']['reconciles']:.0f} reconciles, "
              f"leave → {r['node_leave']['reconciles']:.0f}", file=sys.stderr)
        runs.append(r)
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # each size as it completes
    png = plot(runs, args.out.with_suffix(".png"), args.before)
    print(json.dumps(runs, indent=2))
    print(f"→ {args.out}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
