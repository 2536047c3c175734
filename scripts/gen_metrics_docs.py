#!/usr/bin/env python3
"""Generate docs/metrics.md from the metrics the code registers.

The operator's table walks the registry ``/metrics`` serves (``prometheus_client.REGISTRY``)
after importing the operator's modules and registering the fleet collector over an empty
runtime; the agent's walks a fresh ``CollectorRegistry`` holding a new ``AgentMetrics``. Name,
type and help come from the registry; label names from the metric objects themselves (the
operator modules' ``prometheus_client`` metrics, ``fleet_metrics.FAMILIES``, ``AgentMetrics``'
attributes). A family the registry has but whose labels cannot be found is an error, not a
silent gap. The fleet router's walks a fresh registry holding a new ``RouterMetrics`` likewise.
Only the prose about no single metric lives here. The operator, the agent and the router never
import each other; this script imports all three.

    python scripts/gen_metrics_docs.py                       # rewrite docs/metrics.md
    python scripts/gen_metrics_docs.py --check               # exit 1 when it is out of date
    python scripts/gen_metrics_docs.py --print               # the page on stdout
    python scripts/gen_metrics_docs.py --exposition operator # a sample scrape
                                                             # (operator|agent|router)

``--exposition`` prints a text exposition with samples in every family (a small fleet), for
``promtool check metrics`` (tests/test_metrics_docs.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

REPO = Path(__file__).resolve().parents[1]
DOC_PATH = REPO / "docs" / "metrics.md"
PREFIX = "mlxfleet_"
#: Operator modules imported before the walk, so every metric they register is seen.
OPERATOR_MODULES = ("mlx_fleet_operator.metrics", "mlx_fleet_operator.fleet_metrics",
                    "mlx_fleet_operator.handlers", "mlx_fleet_operator.canary_handlers")

INTRO = """\
Every component serves Prometheus' text format on `GET /metrics`: the operator on
`--metrics-port` (default 8080), each node agent on its `--listen` address and the fleet router
on its `--port`, next to their OpenAI-compatible APIs. Besides the metrics below, the
operator's registry carries `prometheus_client`'s standard `process_*` and `python_*` metrics.

Conventions:

* base units in the name (`_seconds`, `_bytes`), counters end in `_total`, histograms expose
  `_bucket{le}` (cumulative), `_sum` and `_count`;
* label values are bounded: node names, namespaces, deployments, revisions, model ids, roles and
  enum states — never request ids, prompts or session keys;
* the operator's fleet metrics (everything from `mlxfleet_operator_nodes` down to
  `mlxfleet_operator_fleet_collect_errors_total` below) are built at scrape time from its etcd
  views (`operator/mlx_fleet_operator/fleet_metrics.py`), so the series of a deleted
  ModelDeployment, an unloaded revision or a vanished node are gone from the next scrape;
  assignment series are those of the operator's last reconcile of each ModelDeployment;
* a ModelDeployment is labelled `deployment` on the fleet metrics; `deployment_replicas` and the
  Canary metrics keep their older `name` (on the Canary metrics `name` is the Canary and `target`
  its ModelDeployment);
* `mlxfleet_operator_revision_*` re-export the agents' per-revision statistics (written while a
  Canary runs on the deployment), summed over nodes. The sums never go down when one agent
  restarts or a node vanishes (the last value of each node's counting period is kept while the
  revision is exported), so `rate()` works on them; they start again when the operator restarts,
  like any counter.

Queries the dashboards build on:

```promql
# request and error rate per revision (per deployment: sum by (namespace, deployment))
sum by (namespace, deployment, revision) (rate(mlxfleet_operator_revision_requests_total[5m]))
sum by (namespace, deployment, revision) (rate(mlxfleet_operator_revision_errors_total[5m]))
  / sum by (namespace, deployment, revision) (rate(mlxfleet_operator_revision_requests_total[5m]))
# p95 latency and time to first token per revision
histogram_quantile(0.95, sum by (le, namespace, deployment, revision)
  (rate(mlxfleet_operator_revision_request_duration_seconds_bucket[5m])))
histogram_quantile(0.95, sum by (le, namespace, deployment, revision)
  (rate(mlxfleet_operator_revision_time_to_first_token_seconds_bucket[5m])))
# models loaded per node, and which model each Ready assignment serves
mlxfleet_operator_node_assignments{state="Ready"}
mlxfleet_operator_assignment_state{state="Ready"} == 1
  and on (namespace, deployment, revision, node) mlxfleet_operator_served_model_info
```"""


@dataclasses.dataclass(frozen=True)
class Row:
    name: str  # as exposed (counters with _total)
    type: str
    labels: tuple[str, ...]
    help: str


def _exposed(name: str, type_: str) -> str:
    return {"counter": f"{name}_total", "info": f"{name}_info"}.get(type_, name)


def _wrapper_labels(objects: Iterable[Any]) -> dict[str, tuple[str, ...]]:
    """Family name (as the registry reports it) → label names, for ``prometheus_client``
    metric objects among ``objects``. ``_labelnames`` is where ``prometheus_client`` keeps
    them (no public accessor); its absence fails loudly."""
    out = {}
    for obj in objects:
        if isinstance(obj, MetricWrapperBase):
            [family] = obj.describe()
            out[family.name] = tuple(obj._labelnames)  # noqa: SLF001
    return out


def _rows(registry: CollectorRegistry, labels: dict[str, tuple[str, ...]]) -> list[Row]:
    rows = []
    for family in registry.collect():
        if not family.name.startswith(PREFIX):
            continue
        if family.name not in labels:
            raise SystemExit(f"gen_metrics_docs: {family.name} is registered but its labels are "
                             "unknown (define it in an operator module, in "
                             "fleet_metrics.FAMILIES or in AgentMetrics)")
        rows.append(Row(_exposed(family.name, family.type), family.type, labels[family.name],
                        " ".join(family.documentation.split())))
    return rows


def operator_rows() -> list[Row]:
    """The operator's metrics, walked from the default registry (empty fleet runtime)."""
    for module in OPERATOR_MODULES:
        importlib.import_module(module)
    from mlx_fleet_operator import fleet_metrics, metrics

    metrics.register_fleet(lambda: None)
    objects = [v for name, mod in sorted(sys.modules.items())
               if name.startswith("mlx_fleet_operator.") for v in vars(mod).values()]
    labels = _wrapper_labels(objects)
    for spec in fleet_metrics.FAMILIES:
        labels[spec.name.removesuffix("_total") if spec.type == "counter" else spec.name] = \
            spec.labels
    return _rows(REGISTRY, labels)


def agent_rows() -> list[Row]:
    """The node agent's metrics, walked from a fresh registry holding one AgentMetrics."""
    from node_agent.metrics import AgentMetrics

    registry = CollectorRegistry()
    return _rows(registry, _wrapper_labels(vars(AgentMetrics(registry)).values()))


def router_rows() -> list[Row]:
    """The fleet router's metrics, walked from a fresh registry holding one RouterMetrics."""
    from mlx_fleet_router.metrics import RouterMetrics

    registry = CollectorRegistry()
    return _rows(registry, _wrapper_labels(vars(RouterMetrics(registry)).values()))


def _table(rows: list[Row]) -> str:
    out = ["| Metric | Type | Labels | Meaning |", "|---|---|---|---|"]
    for r in rows:
        labels = ", ".join(f"`{x}`" for x in r.labels)
        out.append(f"| `{r.name}` | {r.type} | {labels} | {r.help.replace('|', chr(92) + '|')} |")
    return "\n".join(out)


def generate() -> str:
    """The text of docs/metrics.md."""
    return "\n\n".join([
        "<!-- Generated by scripts/gen_metrics_docs.py from the metrics the code registers: "
        "edit the code (or the script's prose) and run `python scripts/gen_metrics_docs.py`. -->",
        "# Metrics",
        INTRO,
        "## Operator (`mlx-fleet-operator`)\n\n" + _table(operator_rows()),
        "## Node agent (`mlx-fleet-agent`)\n\n" + _table(agent_rows()),
        "## Fleet router (`mlx-fleet-router`)\n\n" + _table(router_rows()),
    ]) + "\n"


# ---------------------------------------------------------------------------------------------
# Sample expositions (for promtool)
# ---------------------------------------------------------------------------------------------

def _sample_runtime() -> Any:
    """A small fleet: two nodes, a deployment with a stable and a candidate revision (one
    loading with a download under way), the agents' statistics and two supervised tasks."""
    from types import SimpleNamespace

    from mlx_fleet.contract import (LATENCY_BOUNDS_SECONDS, TOKENS_PER_SECOND_BOUNDS,
                                    Assignment, AssignmentReport, AssignmentState,
                                    DownloadProgress, Histogram, ModelSource, NodeCapacity,
                                    NodeRecord, RevisionStats, Role, StatsReport)
    from mlx_fleet.supervise import TaskHealth

    def node(name: str) -> NodeRecord:
        return NodeRecord(name=name, address=f"http://{name}:8000", capacity=NodeCapacity(
            memory_total_bytes=64 << 30, memory_available_bytes=40 << 30, chip="Apple M3 Max",
            chip_generation=3), agent_version="0.1.0")

    def asg(rev: str, role: Role) -> Assignment:
        return Assignment(namespace="ml", name="chat", generation=2, served_model_name="llama",
                          source=ModelSource(uri="file:///m", revision=rev),
                          memory_bytes=8 << 30, role=role)

    def hist(bounds: tuple[float, ...]) -> Histogram:
        counts = [0] * (len(bounds) + 1)
        counts[3], counts[5] = 2, 1
        return Histogram(bounds=bounds, counts=counts, total=0.5)

    def rstats(rev: str) -> RevisionStats:
        return RevisionStats(revision=rev, started_unix=1.0, requests=3, errors=1,
                             latency_seconds=hist(LATENCY_BOUNDS_SECONDS),
                             ttft_seconds=hist(LATENCY_BOUNDS_SECONDS),
                             tokens_per_second=hist(TOKENS_PER_SECOND_BOUNDS))

    key = ("ml", "chat")
    placed = {("mac-a", "v1"): asg("v1", Role.STABLE), ("mac-b", "v1"): asg("v1", Role.STABLE),
              ("mac-a", "v2"): asg("v2", Role.CANDIDATE)}
    reports = {("mac-a", "v1"): AssignmentReport(node="mac-a", namespace="ml", name="chat",
                                                 generation=2, revision="v1",
                                                 state=AssignmentState.READY,
                                                 resident_bytes=6 << 30),
               ("mac-a", "v2"): AssignmentReport(
                   node="mac-a", namespace="ml", name="chat", generation=2, revision="v2",
                   state=AssignmentState.PREFETCHING,
                   progress=DownloadProgress(bytes_done=1 << 30, bytes_total=4 << 30))}
    stats = {n: StatsReport(node=n, namespace="ml", name="chat",
                            revisions={"v1": rstats("v1"), "v2": rstats("v2")},
                            guard_tripped=n == "mac-b")
             for n in ("mac-a", "mac-b")}
    return SimpleNamespace(
        nodes={"mac-a": node("mac-a"), "mac-b": node("mac-b")}, placed={key: placed},
        reports={key: reports}, stats={key: stats},
        followers={"etcd follower: nodes": TaskHealth("etcd follower: nodes", alive=True),
                   "assignment gc": TaskHealth("assignment gc", alive=False, restarts=2)})


def exposition(component: str) -> bytes:
    """A text exposition of ``component`` (``operator``, ``agent`` or ``router``) with samples
    in every family."""
    from prometheus_client import generate_latest

    if component == "operator":
        for module in OPERATOR_MODULES:
            importlib.import_module(module)
        from mlx_fleet_operator import metrics

        rt = _sample_runtime()
        metrics.register_fleet(lambda: rt)
        metrics.RECONCILE_TOTAL.labels(result="changed").inc()
        metrics.observe_reconcile(0.02, success=True)
        metrics.observe_reconcile(0.3, success=False)
        metrics.watch_restarted("nodes")
        metrics.set_replicas("ml", "chat", 2, 1)
        metrics.set_canary("ml", "chat-canary", "chat", "Progressing", 25)
        metrics.CANARY_TRANSITIONS.labels(namespace="ml", name="chat-canary",
                                          phase="Progressing").inc()
        return generate_latest(REGISTRY)
    if component == "agent":
        from node_agent.metrics import AgentMetrics

        registry = CollectorRegistry()
        m = AgentMetrics(registry)
        mr = ("llama", "v1")
        m.requests.labels(*mr, "/v1/chat/completions", "200").inc()
        for h in (m.ttft, m.inter_token, m.model_load_seconds):
            h.labels(*mr).observe(0.2)
        m.embedding_batch_inputs.labels(*mr).observe(8)
        for c in (m.generated_tokens, m.prompt_tokens, m.prompt_cache_hits,
                  m.prompt_cache_misses, m.prompt_cache_tokens, m.stream_buffer_overflows,
                  m.coalesced_requests):
            c.labels(*mr).inc(3)
        m.set_serving_options({"prompt_cache": "on", "admission_policy": "kv"})
        for g in (m.queue_depth, m.batch_occupancy, m.model_loaded, m.model_idle_seconds,
                  m.download_rate):
            g.labels(*mr).set(1)
        m.download_bytes.labels(*mr).inc(4096)
        m.model_loads.labels("Assigned").inc()
        m.model_unloads.labels("IdleUnloaded").inc()
        m.model_unload_seconds.labels("IdleUnloaded").observe(0.05)
        m.unload_freed_bytes.labels("IdleUnloaded").inc(4096)
        for kind in ("weights", "kv_cache", "mlx_cache", "free"):
            m.memory_bytes.labels(kind).set(4096)
        m.model_cache_bytes.set(2**30)
        m.model_cache_deleted_bytes.labels("Unassigned").inc(4096)
        return generate_latest(registry)
    if component == "router":
        from mlx_fleet_router.breaker import Phase
        from mlx_fleet_router.metrics import RouterMetrics

        registry = CollectorRegistry()
        r = RouterMetrics(registry)
        r.requests.labels("llama", "200", "acme").inc()
        r.duration.labels("llama").observe(0.4)
        r.ttft.labels("llama").observe(0.05)
        r.attempts.labels("llama", "mac-a", "ok").inc()
        r.retries.labels("llama", "Retry").inc()
        r.in_flight.labels("mac-a").set(2)
        r.set_breaker("mac-a", Phase.CLOSED)
        r.affinity.labels("llama", "kept").inc()
        r.rate_limited.labels("acme", "RequestsPerMinute").inc()
        return generate_latest(registry)
    raise SystemExit(f"unknown component {component!r}: operator, agent or router")


def main(argv: list[str]) -> int:
    if "--exposition" in argv:
        sys.stdout.buffer.write(exposition(argv[argv.index("--exposition") + 1]))
        return 0
    text = generate()
    if "--print" in argv:
        sys.stdout.write(text)
        return 0
    if "--check" in argv:
        if not DOC_PATH.exists() or DOC_PATH.read_text() != text:
            print(f"{DOC_PATH.relative_to(REPO)} is out of date: run python "
                  "scripts/gen_metrics_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
