"""The fleet state the operator holds, re-exported to Prometheus at scrape time.

:class:`FleetCollector` is a ``prometheus_client`` custom collector: every ``collect()`` builds
its metric families afresh from the :class:`~.runtime.Runtime`'s in-memory views (``nodes``,
``placed``, ``reports``, ``stats``, ``followers``), which the etcd followers and reconciles keep
current. Nothing is set in advance, so the series of a deleted ModelDeployment, an unloaded
revision or a vanished node are gone from the next scrape by construction (no stale gauges, no
``remove()`` to forget).

Sources, and what bounds each label (no request ids, prompts or session keys anywhere):

* node families: ``Runtime.nodes`` (node records in etcd); ``node`` = a registered Mac, ``health``
  and ``state`` = enum values (:class:`~mlx_fleet.contract.NodeHealth`,
  :class:`~mlx_fleet.contract.AssignmentState`);
* assignment families: ``Runtime.placed`` (this operator's last reconcile of each
  ModelDeployment: (node, revision) → :class:`~mlx_fleet.contract.Assignment`) joined with the
  agents' reports; one series per assignment (deployment × revision × node), ``role`` = enum;
* revision families: the agents' cumulative :class:`~mlx_fleet.contract.StatsReport` counters
  (every 15 s after new requests, or at a canary's analysis interval), summed over nodes, for the revisions that are still assigned.

The state an assignment is in follows the ModelDeployment status (:mod:`.status`): the agent's
reported state when its report is for the assignment's generation, else ``Pending``.

Counters summed over nodes must not go down when one agent restarts (its counters start again
from zero, with a new ``started_unix``) or one node's report vanishes: :class:`CounterEpochs`
keeps the last value seen of each (node, ``started_unix``) counting epoch of a revision and the
sum runs over all of them, so the exported sum only grows while the revision is exported (an
operator restart is an ordinary counter reset). The epochs of a revision are dropped with its
series.

With kopf peering, only the active replica exports the fleet families: the Runtime's
``fleet_active`` (kept by the operator from the peering objects, :mod:`.peering`; absent or True
when standalone) gates them, so two replicas never export the same fleet series twice.
``mlxfleet_operator_fleet_exporter`` says which replica does; the per-process task families
(``task_up``, ``task_restarts_total``) and ``fleet_collect_errors_total`` stay on every replica.

Conversions are pure functions (:func:`assignment_state`, :func:`cumulative_buckets`,
:func:`sum_revision_stats`); the contract's histograms hold per-bucket counts (``counts[i]``
observations in ``(bounds[i-1], bounds[i]]``), Prometheus wants cumulative ``le`` buckets.

The collector runs in the metrics server's thread while the asyncio loop mutates the views: it
copies each dict (one C-level call under the GIL) before iterating it, and a failure while
building the families is logged and counted (``mlxfleet_operator_fleet_collect_errors_total``)
instead of failing the whole scrape.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from mlx_fleet.contract import (LATENCY_BOUNDS_SECONDS, TOKENS_PER_SECOND_BOUNDS, Assignment,
                                AssignmentReport, AssignmentState, Histogram, NodeHealth,
                                NodeRecord, RevisionStats, StatsReport)
from mlx_fleet.supervise import TaskHealth

from .holders import current_report, held_stats
from .analysis import merge
from .placement import node_budget_bytes

__all__ = ["FleetCollector", "FamilySpec", "FAMILIES", "CounterEpochs", "RevisionTotals",
           "assignment_state", "cumulative_buckets", "sum_revision_stats"]

log = logging.getLogger(__name__)

PREFIX = "mlxfleet_operator_"
_ASSIGNMENT = ("namespace", "deployment", "revision", "node", "role")
_REVISION = ("namespace", "deployment", "revision")


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """One metric family of the collector. ``name`` is the exposed name (counters end in
    ``_total``); ``type``: ``gauge``, ``counter`` or ``histogram``; ``labels`` in order."""

    name: str
    type: str
    labels: tuple[str, ...]
    help: str


def _spec(name: str, type_: str, labels: Iterable[str], help_: str) -> FamilySpec:
    return FamilySpec(PREFIX + name, type_, tuple(labels), help_)


#: Every family the collector exports, in exposition order (docs/metrics.md is generated from
#: the registry, which reads these).
FAMILIES: tuple[FamilySpec, ...] = (
    _spec("nodes", "gauge", ["health"],
          "Node records in etcd by health (Healthy, Degraded, Draining; every value exported)"),
    _spec("node_info", "gauge", ["node", "chip", "agent_version", "simulated"],
          "1 per registered node, with its chip, agent version and whether chip and memory "
          "are simulated (true/false)"),
    _spec("node_memory_total_bytes", "gauge", ["node"],
          "Unified memory of the node (hw.memsize), as its agent reports it"),
    _spec("node_memory_available_bytes", "gauge", ["node"],
          "Unified memory free or reclaimable on the node at its agent's last report"),
    _spec("node_memory_budget_bytes", "gauge", ["node"],
          "Bytes assignments may reserve on the node: total x the node's memory watermark "
          "(its agent's --memory-watermark, default 0.8), capped by the GPU wired limit"),
    _spec("node_memory_reserved_bytes", "gauge", ["node"],
          "Sum of the memory_bytes of the assignments placed on the node (what placement "
          "counts against the budget)"),
    _spec("node_assignments", "gauge", ["node", "state"],
          "Assignments placed on the node by state (every AssignmentState exported; "
          "state=Ready: models loaded)"),
    _spec("assignment_state", "gauge", [*_ASSIGNMENT, "state"],
          "1 for the assignment's current state, 0 for the other AssignmentStates (Pending "
          "until the agent reports the assignment's generation)"),
    _spec("served_model_info", "gauge", ["namespace", "deployment", "model", "revision", "node",
                                         "role"],
          "1 per assignment: joins a ModelDeployment to the OpenAI model id it serves, the "
          "revision, the node and the role (Stable, Candidate, Previous)"),
    _spec("assignment_resident_bytes", "gauge", _ASSIGNMENT,
          "Unified memory the assignment's model occupies on its node, as the agent reports "
          "it (reports for the current generation only)"),
    _spec("download_completed_bytes", "gauge", _ASSIGNMENT,
          "Bytes of the assignment's model downloaded so far (only while a download is "
          "reported)"),
    _spec("download_expected_bytes", "gauge", _ASSIGNMENT,
          "Total bytes of the assignment's model download (only while a download is reported "
          "and its size is known)"),
    _spec("revision_requests_total", "counter", _REVISION,
          "Generation requests routed to the revision, summed over nodes (client errors and "
          "hang-ups excluded)"),
    _spec("revision_errors_total", "counter", _REVISION,
          "Requests to the revision that failed on the server side (5xx, stream ended by an "
          "error), summed over nodes"),
    _spec("revision_crashes_total", "counter", _REVISION,
          "Serving-core failures that hit the revision (batch reset, MLX thread failure), "
          "summed over nodes"),
    _spec("revision_request_duration_seconds", "histogram", _REVISION,
          "End-to-end duration of the revision's requests, summed over nodes"),
    _spec("revision_time_to_first_token_seconds", "histogram", _REVISION,
          "Time from admission to the first generated token of the revision's requests, "
          "summed over nodes"),
    _spec("revision_decode_tokens_per_second", "histogram", _REVISION,
          "Per-sequence decode rate ((completion tokens - 1) / first-to-last-token time, "
          "requests with at least two tokens) of the revision, summed over nodes"),
    _spec("canary_guard_tripped_nodes", "gauge", ["namespace", "deployment"],
          "Nodes whose local guard sent all of the deployment's traffic to the stable revision"),
    _spec("fleet_exporter", "gauge", [],
          "1 while this operator replica exports the fleet families (standalone, or the active "
          "kopf peer), 0 while another replica does (kopf peering paused this one)"),
    _spec("task_up", "gauge", ["task"],
          "1 while the operator's supervised background task (etcd follower, assignment GC) "
          "runs, 0 while it backs off after a failure"),
    _spec("task_restarts_total", "counter", ["task"],
          "Unexpected stops of a supervised background task (each one restarted with backoff)"),
    _spec("fleet_collect_errors_total", "counter", [],
          "Scrapes in which building the fleet metrics failed (logged; those families were "
          "empty)"),
)
_BY_NAME = {f.name.removeprefix(PREFIX): f for f in FAMILIES}


# ---------------------------------------------------------------------------------------------
# Pure conversions
# ---------------------------------------------------------------------------------------------

def assignment_state(asg: Assignment, report: AssignmentReport | None) -> AssignmentState:
    """The state of one assignment as the ModelDeployment status shows it: the agent's report
    when it is for the assignment's ``generation``, else ``Pending`` (no report yet, or one
    about an older spec)."""
    if report is None or report.generation != asg.generation:
        return AssignmentState.PENDING
    return report.state


def cumulative_buckets(h: Histogram) -> list[tuple[str, float]]:
    """A contract :class:`~mlx_fleet.contract.Histogram` (per-bucket counts) as Prometheus
    buckets: ``[(le, observations <= le), ...]`` with ``le`` formatted as Prometheus does
    (``"0.005"``, ``"1.0"``) and ``("+Inf", total count)`` last. Raises ``ValueError`` when
    ``len(counts) != len(bounds) + 1`` or the bounds do not ascend."""
    if len(h.counts) != len(h.bounds) + 1:
        raise ValueError(f"{len(h.counts)} counts for {len(h.bounds)} bounds "
                         "(need one more count than bounds)")
    if any(b >= a for a, b in zip(h.bounds[1:], h.bounds)):
        raise ValueError(f"bounds must ascend strictly: {h.bounds}")
    out: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip(h.bounds, h.counts):
        running += count
        out.append((floatToGoString(bound), float(running)))
    out.append(("+Inf", float(running + h.counts[-1])))
    return out


@dataclasses.dataclass(frozen=True)
class RevisionTotals:
    """One revision's counters summed over nodes (and counting epochs)."""

    requests: int
    errors: int
    crashes: int
    latency_seconds: Histogram
    ttft_seconds: Histogram
    tokens_per_second: Histogram


def _merge_matching(hs: Iterable[Histogram], bounds: tuple[float, ...]) -> Histogram:
    """Bucket-wise sum of the histograms that have the contract's ``bounds``; others (an agent
    of another version) cannot be merged exactly and are left out."""
    return merge([h for h in hs if tuple(h.bounds) == bounds and len(h.counts) == len(bounds) + 1],
                 bounds)


def sum_revision_stats(stats: Iterable[RevisionStats]) -> RevisionTotals:
    """Sum of several nodes' (or counting epochs') :class:`RevisionStats` of one revision:
    counters added, histograms merged bucket by bucket (histograms whose bounds differ from the
    contract's are left out). An empty input gives zeros."""
    stats = list(stats)
    return RevisionTotals(
        requests=sum(s.requests for s in stats), errors=sum(s.errors for s in stats),
        crashes=sum(s.crashes for s in stats),
        latency_seconds=_merge_matching((s.latency_seconds for s in stats),
                                        LATENCY_BOUNDS_SECONDS),
        ttft_seconds=_merge_matching((s.ttft_seconds for s in stats), LATENCY_BOUNDS_SECONDS),
        tokens_per_second=_merge_matching((s.tokens_per_second for s in stats),
                                          TOKENS_PER_SECOND_BOUNDS))


RevisionKey = tuple[str, str, str]  # (namespace, deployment, revision)


class CounterEpochs:
    """The last :class:`RevisionStats` seen of every counting epoch — (node, ``started_unix``)
    — of every exported revision, so that sums over nodes never go down (module docstring).

    :meth:`update` takes the current per-node stats of the revisions to export and returns, per
    revision, the stats to sum: the current ones plus the last seen of epochs that ended (an
    agent restarted, a node's report vanished). Revisions absent from the input are forgotten.
    Thread-safe (scrapes may run concurrently)."""

    def __init__(self) -> None:
        self._epochs: dict[RevisionKey, dict[tuple[str, float], RevisionStats]] = {}
        self._lock = threading.Lock()

    def update(self, current: Mapping[RevisionKey, Mapping[str, RevisionStats]]
               ) -> dict[RevisionKey, list[RevisionStats]]:
        with self._lock:
            epochs = {key: self._epochs.get(key, {}) for key in current}
            for key, per_node in current.items():
                seen = epochs[key] = dict(epochs[key])
                for node, rs in per_node.items():
                    seen[(node, rs.started_unix)] = rs
            self._epochs = epochs
            return {key: list(seen.values()) for key, seen in epochs.items()}


# ---------------------------------------------------------------------------------------------
# The collector
# ---------------------------------------------------------------------------------------------

def _family(spec: FamilySpec) -> Metric:
    name = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
    cls = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily,
           "histogram": HistogramMetricFamily}[spec.type]
    return cls(name, spec.help, labels=spec.labels)


class FleetState(Protocol):
    """What the collector reads of the operator's :class:`~.runtime.Runtime` (any object with
    these attributes; a missing one reads as empty, ``fleet_active`` as True)."""

    nodes: Mapping[str, NodeRecord]
    placed: Mapping[tuple[str, str], Mapping[tuple[str, str], Assignment]]
    reports: Mapping[tuple[str, str], Mapping[tuple[str, str], AssignmentReport]]
    stats: Mapping[tuple[str, str], Mapping[str, StatsReport]]
    followers: Mapping[str, TaskHealth]
    fleet_active: bool


def _copy(d: Mapping | None) -> dict:
    return dict(d) if d else {}


class FleetCollector(Collector):
    """A custom collector over the operator's Runtime (module docstring).

    ``runtime_getter`` returns the Runtime, or None while the operator is starting (every family
    is then exported without samples). The collector reads the Runtime's ``nodes``, ``placed``,
    ``reports``, ``stats`` and ``followers``, whichever exist."""

    def __init__(self, runtime_getter: Callable[[], FleetState | None]) -> None:
        self.runtime_getter = runtime_getter
        self._epochs = CounterEpochs()
        self._errors = 0

    def describe(self) -> list[Metric]:
        """The families without samples (for the registry's duplicate check; no Runtime read)."""
        return [_family(s) for s in FAMILIES]

    def collect(self) -> Iterator[Metric]:
        fams = {name: _family(spec) for name, spec in _BY_NAME.items()}
        try:
            rt = self.runtime_getter()
            active = rt is not None and getattr(rt, "fleet_active", True)
            fams["fleet_exporter"].add_metric([], 1 if active else 0)
            if active:
                self._fill(rt, fams)
            if rt is not None:
                self._fill_tasks(rt, fams)
        except Exception:  # never fail the whole scrape (reconcile metrics share it)
            log.exception("building the fleet metrics failed")
            self._errors += 1
            fams = {name: _family(spec) for name, spec in _BY_NAME.items()}
        fams["fleet_collect_errors_total"].add_metric([], self._errors)
        yield from fams.values()

    def _fill(self, rt: FleetState, fams: dict[str, Metric]) -> None:
        nodes = _copy(getattr(rt, "nodes", None))
        placed = {k: _copy(v) for k, v in _copy(getattr(rt, "placed", None)).items()}
        reports = {k: _copy(v) for k, v in _copy(getattr(rt, "reports", None)).items()}
        stats = {k: _copy(v) for k, v in _copy(getattr(rt, "stats", None)).items()}

        # -- nodes -------------------------------------------------------------------------
        by_health = {h.value: 0 for h in NodeHealth}
        for rec in nodes.values():
            by_health[rec.health.value] = by_health.get(rec.health.value, 0) + 1
        for health, n in by_health.items():
            fams["nodes"].add_metric([health], n)

        # -- assignments -------------------------------------------------------------------
        per_node: dict[str, dict[str, int]] = {}
        reserved: dict[str, int] = {}
        live_revisions: dict[tuple[str, str], set[str]] = {}
        for (ns, dep), slots in sorted(placed.items()):
            for (node, revision), asg in sorted(slots.items()):
                live_revisions.setdefault((ns, dep), set()).add(revision)
                report = reports.get((ns, dep), {}).get((node, revision))
                state = assignment_state(asg, report)
                current = current_report((node, revision), reports.get((ns, dep), {}), slots)
                labels = [ns, dep, revision, node, asg.role.value]
                for s in AssignmentState:
                    fams["assignment_state"].add_metric(labels + [s.value],
                                                        1 if s is state else 0)
                fams["served_model_info"].add_metric(
                    [ns, dep, asg.served_model_name, revision, node, asg.role.value], 1)
                if current is not None:
                    fams["assignment_resident_bytes"].add_metric(labels, current.resident_bytes)
                    if current.progress is not None:
                        fams["download_completed_bytes"].add_metric(
                            labels, current.progress.bytes_done)
                        if current.progress.bytes_total:
                            fams["download_expected_bytes"].add_metric(
                                labels, current.progress.bytes_total)
                counts = per_node.setdefault(node, {s.value: 0 for s in AssignmentState})
                counts[state.value] += 1
                reserved[node] = reserved.get(node, 0) + asg.memory_bytes

        for name, rec in sorted(nodes.items()):
            cap = rec.capacity
            fams["node_info"].add_metric(
                [name, cap.chip, rec.agent_version, "true" if cap.simulated else "false"], 1)
            fams["node_memory_total_bytes"].add_metric([name], cap.memory_total_bytes)
            fams["node_memory_available_bytes"].add_metric([name], cap.memory_available_bytes)
            fams["node_memory_budget_bytes"].add_metric([name], node_budget_bytes(rec))
            fams["node_memory_reserved_bytes"].add_metric([name], reserved.get(name, 0))
            for state, n in per_node.get(name, {s.value: 0 for s in AssignmentState}).items():
                fams["node_assignments"].add_metric([name, state], n)

        # -- revisions (the agents' cumulative statistics) ---------------------------------
        current_stats: dict[RevisionKey, dict[str, RevisionStats]] = {}
        for (ns, dep), by_node in sorted(stats.items()):
            live = live_revisions.get((ns, dep))
            if not live:
                continue  # deployment deleted (or not reconciled by this operator yet)
            tripped = 0
            # only nodes holding a slot of the deployment count (.holders: another Mac's
            # agent credential could write stats for it)
            for node, rep in sorted(held_stats(by_node, placed.get((ns, dep), {})).items()):
                if not isinstance(rep, StatsReport):
                    continue
                tripped += bool(rep.guard_tripped)
                for revision, rs in rep.revisions.items():
                    if revision in live:
                        current_stats.setdefault((ns, dep, revision), {})[node] = rs
            fams["canary_guard_tripped_nodes"].add_metric([ns, dep], tripped)
        for key, epochs in sorted(self._epochs.update(current_stats).items()):
            totals = sum_revision_stats(epochs)
            labels = list(key)
            fams["revision_requests_total"].add_metric(labels, totals.requests)
            fams["revision_errors_total"].add_metric(labels, totals.errors)
            fams["revision_crashes_total"].add_metric(labels, totals.crashes)
            for fam, h in (("revision_request_duration_seconds", totals.latency_seconds),
                           ("revision_time_to_first_token_seconds", totals.ttft_seconds),
                           ("revision_decode_tokens_per_second", totals.tokens_per_second)):
                fams[fam].add_metric(labels, cumulative_buckets(h), h.total)

    @staticmethod
    def _fill_tasks(rt: FleetState, fams: dict[str, Metric]) -> None:
        """The operator's own background tasks: per process, exported by every replica."""
        followers = _copy(getattr(rt, "followers", None))
        for name, health in sorted(followers.items()):
            fams["task_up"].add_metric([name], 1 if health.alive else 0)
            fams["task_restarts_total"].add_metric([name], health.restarts)
