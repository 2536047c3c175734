"""The operator's fleet metrics (mlx_fleet_operator.fleet_metrics) and the metrics module's
helpers: pure conversions table-tested, then real scrapes of a real ``runtime.Runtime`` whose
views are filled directly (no etcd), parsed back with ``prometheus_client.parser``.

Pure: no cluster.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client import Histogram as PromHistogram
from prometheus_client.parser import text_string_to_metric_families

from mlx_fleet.contract import (LATENCY_BOUNDS_SECONDS, TOKENS_PER_SECOND_BOUNDS, Assignment,
                                AssignmentReport, AssignmentState, DownloadProgress, Histogram,
                                Keys, ModelSource, NodeCapacity, NodeHealth, NodeRecord,
                                RevisionStats, Role, StatsReport)
from mlx_fleet.supervise import TaskHealth
from mlx_fleet_operator import metrics
from mlx_fleet_operator.fleet_metrics import (FAMILIES, CounterEpochs, FleetCollector,
                                              assignment_state, cumulative_buckets,
                                              sum_revision_stats)
from mlx_fleet_operator.runtime import Runtime
from mlx_fleet_operator.placement import node_budget_bytes
from node_agent.window_stats import histogram_observe

GiB = 1 << 30
P = "mlxfleet_operator_"

# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------


def node(name: str, health: NodeHealth = NodeHealth.HEALTHY, total: int = 64 * GiB,
         available: int = 40 * GiB, simulated: bool = False) -> NodeRecord:
    return NodeRecord(name=name, address=f"http://{name}:8000", health=health,
                      agent_version="0.1.0",
                      capacity=NodeCapacity(memory_total_bytes=total,
                                            memory_available_bytes=available,
                                            chip="Apple M3 Max", chip_generation=3,
                                            simulated=simulated))


def asg(name: str, revision: str, role: Role = Role.STABLE, generation: int = 2,
        memory: int = 8 * GiB, served: str = "llama") -> Assignment:
    return Assignment(namespace="ml", name=name, generation=generation, served_model_name=served,
                      source=ModelSource(uri="file:///models/x", revision=revision),
                      memory_bytes=memory, role=role)


def report(node_: str, name: str, revision: str, state: AssignmentState, generation: int = 2,
           **kw) -> AssignmentReport:
    return AssignmentReport(node=node_, namespace="ml", name=name, revision=revision,
                            generation=generation, state=state, **kw)


def hist(bounds: tuple[float, ...], buckets: dict[int, int], total: float) -> Histogram:
    counts = [0] * (len(bounds) + 1)
    for i, n in buckets.items():
        counts[i] = n
    return Histogram(bounds=bounds, counts=counts, total=total)


def rstats(revision: str, requests: int, errors: int = 0, crashes: int = 0,
           started: float = 100.0, latency: dict[int, int] | None = None,
           latency_total: float = 0.0) -> RevisionStats:
    return RevisionStats(
        revision=revision, started_unix=started, requests=requests, errors=errors,
        crashes=crashes,
        latency_seconds=hist(LATENCY_BOUNDS_SECONDS, latency or {}, latency_total),
        ttft_seconds=hist(LATENCY_BOUNDS_SECONDS, {0: requests}, 0.001 * requests),
        tokens_per_second=hist(TOKENS_PER_SECOND_BOUNDS, {len(TOKENS_PER_SECOND_BOUNDS): 1},
                               5000.0))


def scrape(collector: FleetCollector) -> dict[tuple[str, frozenset], float]:
    """One scrape through a fresh registry, parsed back: (sample name, labels) → value."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def of(samples: dict, name: str) -> dict[frozenset, float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def L(**labels: str) -> frozenset:
    return frozenset(labels.items())


# ---------------------------------------------------------------------------------------------
# Pure conversions
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("bounds", "counts", "expected"), [
    ((1.0, 2.0), [1, 0, 2], [("1.0", 1), ("2.0", 1), ("+Inf", 3)]),
    ((1.0, 2.0), [0, 0, 0], [("1.0", 0), ("2.0", 0), ("+Inf", 0)]),
    ((0.005, 0.5, 10.0), [3, 4, 5, 6], [("0.005", 3), ("0.5", 7), ("10.0", 12), ("+Inf", 18)]),
    ((1,), [0, 4], [("1.0", 0), ("+Inf", 4)]),  # integer bounds format like Prometheus floats
    ((), [9], [("+Inf", 9)]),
])
def test_cumulative_buckets(bounds, counts, expected) -> None:
    assert cumulative_buckets(Histogram(bounds=bounds, counts=counts)) == expected


@pytest.mark.parametrize(("bounds", "counts"), [
    ((1.0, 2.0), [1, 2]),  # one count short
    ((1.0, 2.0), [1, 2, 3, 4]),  # one too many
    ((2.0, 1.0), [0, 0, 0]),  # descending
    ((1.0, 1.0), [0, 0, 0]),  # repeated bound
])
def test_cumulative_buckets_rejects_malformed(bounds, counts) -> None:
    with pytest.raises(ValueError):
        cumulative_buckets(Histogram(bounds=bounds, counts=counts))


@given(st.lists(st.floats(min_value=0, max_value=200, allow_nan=False), max_size=40))
def test_cumulative_buckets_match_prometheus_client(values: list[float]) -> None:
    """The agent's per-bucket histogram (node_agent.window_stats), converted, is exactly what
    prometheus_client's own Histogram exposes for the same observations."""
    counts = [0] * (len(LATENCY_BOUNDS_SECONDS) + 1)
    for v in values:
        counts = histogram_observe(LATENCY_BOUNDS_SECONDS, counts, v)
    ours = cumulative_buckets(Histogram(bounds=LATENCY_BOUNDS_SECONDS, counts=counts))

    registry = CollectorRegistry()
    ref = PromHistogram("ref_seconds", "ref", buckets=LATENCY_BOUNDS_SECONDS, registry=registry)
    for v in values:
        ref.observe(v)
    theirs = [(s.labels["le"], s.value) for fam in registry.collect() for s in fam.samples
              if s.name == "ref_seconds_bucket"]
    assert ours == theirs


@pytest.mark.parametrize(("rep", "expected"), [
    (None, AssignmentState.PENDING),
    (report("a", "chat", "v1", AssignmentState.READY, generation=1), AssignmentState.PENDING),
    (report("a", "chat", "v1", AssignmentState.READY, generation=3), AssignmentState.PENDING),
    (report("a", "chat", "v1", AssignmentState.READY), AssignmentState.READY),
    (report("a", "chat", "v1", AssignmentState.FAILED), AssignmentState.FAILED),
    (report("a", "chat", "v1", AssignmentState.PREFETCHING), AssignmentState.PREFETCHING),
])
def test_assignment_state(rep, expected) -> None:
    assert assignment_state(asg("chat", "v1", generation=2), rep) is expected


def test_sum_revision_stats_adds_counters_and_merges_buckets() -> None:
    a = rstats("v1", 3, errors=1, crashes=0, latency={0: 1, 5: 2}, latency_total=0.2)
    b = rstats("v1", 5, errors=0, crashes=2, latency={5: 1, 24: 4}, latency_total=600.0)
    t = sum_revision_stats([a, b])
    assert (t.requests, t.errors, t.crashes) == (8, 1, 2)
    expected = [0] * (len(LATENCY_BOUNDS_SECONDS) + 1)
    expected[0], expected[5], expected[24] = 1, 3, 4
    assert t.latency_seconds.counts == expected
    assert t.latency_seconds.total == pytest.approx(600.2)
    assert t.ttft_seconds.counts[0] == 8
    assert t.tokens_per_second.counts[-1] == 2


def test_sum_revision_stats_leaves_out_histograms_of_other_bounds() -> None:
    odd = RevisionStats(revision="v1", started_unix=1.0, requests=4,
                        latency_seconds=Histogram(bounds=(1.0,), counts=[4, 0], total=2.0),
                        ttft_seconds=hist(LATENCY_BOUNDS_SECONDS, {1: 4}, 0.04),
                        tokens_per_second=hist(TOKENS_PER_SECOND_BOUNDS, {}, 0.0))
    t = sum_revision_stats([odd, rstats("v1", 1, latency={2: 1}, latency_total=0.02)])
    assert t.requests == 5  # counters still add up
    assert sum(t.latency_seconds.counts) == 1 and t.latency_seconds.counts[2] == 1
    assert t.latency_seconds.bounds == LATENCY_BOUNDS_SECONDS
    assert t.ttft_seconds.counts[1] == 4


def test_sum_revision_stats_of_nothing_is_zero() -> None:
    t = sum_revision_stats([])
    assert (t.requests, t.errors, t.crashes) == (0, 0, 0)
    assert t.latency_seconds.counts == [0] * (len(LATENCY_BOUNDS_SECONDS) + 1)
    assert t.tokens_per_second.bounds == TOKENS_PER_SECOND_BOUNDS


K = ("ml", "chat", "v1")


@pytest.mark.parametrize(("steps", "expected_requests"), [
    # (per-node current stats per scrape) → requests summed at each scrape
    ([{"a": (100.0, 5)}, {"a": (100.0, 9)}], [5, 9]),  # same epoch grows: replaced, not added
    ([{"a": (100.0, 5), "b": (100.0, 7)}, {"a": (100.0, 6)}], [12, 13]),  # b vanished: kept
    ([{"a": (100.0, 5)}, {"a": (200.0, 2)}], [5, 7]),  # a restarted: old epoch kept
    ([{"a": (100.0, 5)}, {"a": (200.0, 2)}, {"a": (100.0, 6)}], [5, 7, 8]),  # epoch returns
    ([{"a": (100.0, 5)}, {}, {"a": (300.0, 1)}], [5, None, 1]),  # revision gone: forgotten
])
def test_counter_epochs(steps, expected_requests) -> None:
    epochs = CounterEpochs()
    got = []
    for step in steps:
        current = {K: {n: rstats("v1", r, started=s) for n, (s, r) in step.items()}} if step else {}
        out = epochs.update(current)
        got.append(sum(s.requests for s in out[K]) if K in out else None)
    assert got == expected_requests


# ---------------------------------------------------------------------------------------------
# Scrapes of a Runtime
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def rt() -> Runtime:
    """mac-a (Healthy) and mac-b (Degraded); ml/chat: v1 Stable on both, v2 Candidate on mac-a
    (downloading); mac-b's v1 report is for an older generation. Stats from both nodes for v1,
    v2 and v0 (an unloaded revision the agents still count), and for ml/gone (deleted)."""
    r = Runtime(None, Keys("/t"), "test")  # the collector never touches the store
    r.views.node_view.items = {
        "mac-a": node("mac-a"),
        "mac-b": node("mac-b", NodeHealth.DEGRADED, total=32 * GiB, simulated=True)}
    r.deployment(("ml", "chat")).placed = {  # as its last reconcile left it
        ("mac-a", "v1"): asg("chat", "v1"), ("mac-b", "v1"): asg("chat", "v1"),
        ("mac-a", "v2"): asg("chat", "v2", Role.CANDIDATE, memory=4 * GiB)}
    r.views.reports = {
        ("ml", "chat"): {
            ("mac-a", "v1"): report("mac-a", "chat", "v1", AssignmentState.READY,
                                    resident_bytes=6 * GiB),
            ("mac-b", "v1"): report("mac-b", "chat", "v1", AssignmentState.READY, generation=1,
                                    resident_bytes=6 * GiB),
            ("mac-a", "v2"): report("mac-a", "chat", "v2", AssignmentState.PREFETCHING,
                                    progress=DownloadProgress(bytes_done=GiB,
                                                              bytes_total=4 * GiB)),
        },
        ("ml", "gone"): {("mac-a", "v1"): report("mac-a", "gone", "v1", AssignmentState.READY)},
    }
    r.views.stats = {
        ("ml", "chat"): {
            "mac-a": StatsReport(node="mac-a", namespace="ml", name="chat", revisions={
                "v0": rstats("v0", 50),
                "v1": rstats("v1", 3, errors=1, latency={0: 1, 5: 2}, latency_total=0.2),
                "v2": rstats("v2", 2, crashes=1, latency={24: 2}, latency_total=300.0)}),
            "mac-b": StatsReport(node="mac-b", namespace="ml", name="chat", guard_tripped=True,
                                 revisions={"v1": rstats("v1", 5, latency={5: 1, 7: 4},
                                                         latency_total=1.5)}),
        },
        ("ml", "gone"): {"mac-a": StatsReport(node="mac-a", namespace="ml", name="gone",
                                              revisions={"v1": rstats("v1", 9)})},
    }
    r.followers = {"etcd follower: nodes": TaskHealth("etcd follower: nodes", alive=True),
                   "assignment gc": TaskHealth("assignment gc", alive=False, restarts=3)}
    return r


def test_node_families(rt: Runtime) -> None:
    s = scrape(FleetCollector(lambda: rt))
    assert of(s, P + "nodes") == {L(health="Healthy"): 1, L(health="Degraded"): 1,
                                  L(health="Draining"): 0}
    assert of(s, P + "node_memory_total_bytes") == {L(node="mac-a"): 64 * GiB,
                                                    L(node="mac-b"): 32 * GiB}
    assert of(s, P + "node_memory_available_bytes") == {L(node="mac-a"): 40 * GiB,
                                                        L(node="mac-b"): 40 * GiB}
    # the placement's budget (floor of total × 0.8), from the same function placement uses
    assert of(s, P + "node_memory_budget_bytes") == {L(node="mac-a"): 54975581388,
                                                     L(node="mac-b"): 27487790694}
    assert 54975581388 == node_budget_bytes(rt.nodes["mac-a"])
    assert of(s, P + "node_memory_reserved_bytes") == {L(node="mac-a"): 12 * GiB,
                                                       L(node="mac-b"): 8 * GiB}
    assigned = of(s, P + "node_assignments")
    assert len(assigned) == 2 * len(AssignmentState)  # every state of every node
    assert {k: v for k, v in assigned.items() if v} == {
        L(node="mac-a", state="Ready"): 1, L(node="mac-a", state="Prefetching"): 1,
        L(node="mac-b", state="Pending"): 1}
    assert of(s, P + "node_info") == {
        L(node="mac-a", chip="Apple M3 Max", agent_version="0.1.0", simulated="false"): 1,
        L(node="mac-b", chip="Apple M3 Max", agent_version="0.1.0", simulated="true"): 1}


def test_assignment_families(rt: Runtime) -> None:
    s = scrape(FleetCollector(lambda: rt))
    states = of(s, P + "assignment_state")
    assert len(states) == 3 * len(AssignmentState)
    ones = {k for k, v in states.items() if v == 1}
    assert ones == {
        L(namespace="ml", deployment="chat", revision="v1", node="mac-a", role="Stable",
          state="Ready"),
        L(namespace="ml", deployment="chat", revision="v1", node="mac-b", role="Stable",
          state="Pending"),  # its report is for generation 1
        L(namespace="ml", deployment="chat", revision="v2", node="mac-a", role="Candidate",
          state="Prefetching")}
    assert set(states.values()) == {0, 1}
    assert of(s, P + "served_model_info") == {
        L(namespace="ml", deployment="chat", model="llama", revision="v1", node="mac-a",
          role="Stable"): 1,
        L(namespace="ml", deployment="chat", model="llama", revision="v1", node="mac-b",
          role="Stable"): 1,
        L(namespace="ml", deployment="chat", model="llama", revision="v2", node="mac-a",
          role="Candidate"): 1}
    a_v1 = dict(namespace="ml", deployment="chat", revision="v1", node="mac-a", role="Stable")
    a_v2 = dict(namespace="ml", deployment="chat", revision="v2", node="mac-a", role="Candidate")
    # mac-b's stale report is not used; ml/gone is not placed: neither appears
    assert of(s, P + "assignment_resident_bytes") == {L(**a_v1): 6 * GiB, L(**a_v2): 0}
    assert of(s, P + "download_completed_bytes") == {L(**a_v2): GiB}
    assert of(s, P + "download_expected_bytes") == {L(**a_v2): 4 * GiB}


def test_download_size_absent_while_unknown(rt: Runtime) -> None:
    rt.reports[("ml", "chat")][("mac-a", "v2")] = report(
        "mac-a", "chat", "v2", AssignmentState.PREFETCHING,
        progress=DownloadProgress(bytes_done=123))
    s = scrape(FleetCollector(lambda: rt))
    assert list(of(s, P + "download_completed_bytes").values()) == [123]
    assert of(s, P + "download_expected_bytes") == {}


def test_revision_families_summed_over_nodes(rt: Runtime) -> None:
    s = scrape(FleetCollector(lambda: rt))
    v1, v2 = (L(namespace="ml", deployment="chat", revision=r) for r in ("v1", "v2"))
    assert of(s, P + "revision_requests_total") == {v1: 8, v2: 2}
    assert of(s, P + "revision_errors_total") == {v1: 1, v2: 0}
    assert of(s, P + "revision_crashes_total") == {v1: 0, v2: 1}

    # latency of v1: mac-a {bucket 0: 1, bucket 5: 2}, mac-b {bucket 5: 1, bucket 7: 4}
    name = P + "revision_request_duration_seconds"
    buckets = {dict(k)["le"]: v for k, v in of(s, name + "_bucket").items()
               if dict(k)["revision"] == "v1"}
    assert len(buckets) == len(LATENCY_BOUNDS_SECONDS) + 1
    b = LATENCY_BOUNDS_SECONDS
    assert buckets["0.005"] == 1  # bounds[0]
    assert buckets[str(b[4])] == 1  # bounds[1..4]: nothing new
    assert buckets[str(b[5])] == 4  # + 2 + 1
    assert buckets[str(b[6])] == 4
    assert buckets[str(b[7])] == 8  # + 4
    assert buckets["120.0"] == 8 and buckets["+Inf"] == 8
    les = [float(le) for le in buckets]
    assert les == sorted(les)
    counts = [buckets[le] for le in buckets]
    assert counts == sorted(counts)  # cumulative: never decreasing
    assert of(s, name + "_count")[v1] == 8
    assert of(s, name + "_sum")[v1] == pytest.approx(1.7)
    # v2: everything above the last bound
    v2_buckets = {dict(k)["le"]: v for k, v in of(s, name + "_bucket").items()
                  if dict(k)["revision"] == "v2"}
    assert v2_buckets["120.0"] == 0 and v2_buckets["+Inf"] == 2
    assert of(s, name + "_sum")[v2] == 300.0

    ttft = of(s, P + "revision_time_to_first_token_seconds_bucket")
    assert ttft[v1 | {("le", "0.005")}] == 8
    tps = P + "revision_decode_tokens_per_second"
    assert of(s, tps + "_bucket")[v1 | {("le", "2000.0")}] == 0
    assert of(s, tps + "_count") == {v1: 2, v2: 1}
    assert of(s, tps + "_sum") == {v1: 10000.0, v2: 5000.0}

    assert of(s, P + "canary_guard_tripped_nodes") == {L(namespace="ml", deployment="chat"): 1}


def test_a_rogue_nodes_stats_are_not_in_the_fleet_sums(rt: Runtime) -> None:
    """Issue 19 review: another Mac's agent credential may write stats/<its node>/ml/chat; a
    node holding no slot of ml/chat adds no requests and no guard trip."""
    rt.views.stats[("ml", "chat")]["rogue"] = StatsReport(
        node="rogue", namespace="ml", name="chat", guard_tripped=True,
        revisions={"v1": rstats("v1", 1000), "v2": rstats("v2", 1000)})
    s = scrape(FleetCollector(lambda: rt))
    v1, v2 = (L(namespace="ml", deployment="chat", revision=r) for r in ("v1", "v2"))
    assert of(s, P + "revision_requests_total") == {v1: 8, v2: 2}
    assert of(s, P + "canary_guard_tripped_nodes") == {L(namespace="ml", deployment="chat"): 1}


def test_unloaded_revision_and_deleted_deployment_are_absent(rt: Runtime) -> None:
    s = scrape(FleetCollector(lambda: rt))
    for (name, labels), _ in s.items():
        d = dict(labels)
        assert d.get("revision") != "v0", name  # counted by the agents, no longer assigned
        assert d.get("deployment") != "gone", name  # reports and stats, no ModelDeployment


def test_series_disappear_with_the_views(rt: Runtime) -> None:
    collector = FleetCollector(lambda: rt)
    before = scrape(collector)
    assert of(before, P + "revision_requests_total")
    # the candidate is unloaded (the reconcile no longer places it) ...
    del rt.deployment(("ml", "chat")).placed[("mac-a", "v2")]
    # ... and mac-b's agent died (its lease took its node record, reports and stats)
    del rt.nodes["mac-b"]
    del rt.stats[("ml", "chat")]["mac-b"]
    s = scrape(collector)
    assert not [k for k in s if dict(k[1]).get("revision") == "v2"]
    assert not [k for k in s if dict(k[1]).get("node") == "mac-b"
                and k[0].startswith(P + "node")]
    assert of(s, P + "nodes")[L(health="Degraded")] == 0
    # mac-b's last v1 counts stay in the sum: the counter does not go down
    assert of(s, P + "revision_requests_total") == {
        L(namespace="ml", deployment="chat", revision="v1"): 8}
    # the deployment is deleted (delete_handler forgets its record): all its series go
    rt.forget(("ml", "chat"))
    s = scrape(collector)
    assert not [k for k in s if dict(k[1]).get("deployment") == "chat"]
    assert of(s, P + "node_memory_reserved_bytes") == {L(node="mac-a"): 0}


def test_agent_restart_does_not_lower_the_sums(rt: Runtime) -> None:
    collector = FleetCollector(lambda: rt)
    v1 = L(namespace="ml", deployment="chat", revision="v1")
    assert of(scrape(collector), P + "revision_requests_total")[v1] == 8
    rt.stats[("ml", "chat")]["mac-b"] = StatsReport(
        node="mac-b", namespace="ml", name="chat",
        revisions={"v1": rstats("v1", 1, started=500.0, latency={0: 1}, latency_total=0.001)})
    s = scrape(collector)
    assert of(s, P + "revision_requests_total")[v1] == 9  # 3 (mac-a) + 5 (old mac-b) + 1
    assert of(s, P + "revision_request_duration_seconds_count")[v1] == 9
    assert of(s, P + "revision_request_duration_seconds_bucket")[v1 | {("le", "0.005")}] == 2


def test_label_sets_are_bounded(rt: Runtime) -> None:
    """Every sample carries exactly its family's documented labels (plus ``le`` on buckets),
    and enum-valued labels only take enum values."""
    s = scrape(FleetCollector(lambda: rt))
    labels_of = {f.name.removesuffix("_total") if f.type == "counter" else f.name: set(f.labels)
                 for f in FAMILIES}
    enums = {"state": {x.value for x in AssignmentState}, "role": {x.value for x in Role},
             "health": {x.value for x in NodeHealth}, "simulated": {"true", "false"}}
    seen = set()
    for (name, labels), _ in s.items():
        base = name
        for suffix in ("_bucket", "_count", "_sum", "_created", "_total"):
            if base.removesuffix(suffix) in labels_of:
                base = base.removesuffix(suffix)
                break
        assert base in labels_of, name
        seen.add(base)
        keys = {k for k, _ in labels}
        expected = labels_of[base] | ({"le"} if name.endswith("_bucket") else set())
        assert keys == expected, name
        for k, v in labels:
            if k in enums:
                assert v in enums[k], (name, k, v)
    assert seen == set(labels_of)  # the fixture exercises every family


def test_no_runtime_yet_exports_empty_families() -> None:
    registry = CollectorRegistry()
    registry.register(FleetCollector(lambda: None))
    fams = list(text_string_to_metric_families(generate_latest(registry).decode()))
    assert {f.name for f in fams} == {
        f.name.removesuffix("_total") if f.type == "counter" else f.name for f in FAMILIES}
    # only "not exporting the fleet (yet)" and the collect-error counter
    assert [(s.name, s.value) for f in fams for s in f.samples] == [
        ("mlxfleet_operator_fleet_exporter", 0), ("mlxfleet_operator_fleet_collect_errors_total", 0)]


def test_a_failing_collect_is_counted_not_raised(rt: Runtime) -> None:
    def broken() -> Runtime:
        raise RuntimeError("boom")

    collector = FleetCollector(broken)
    s = scrape(collector)
    assert of(s, P + "fleet_collect_errors_total") == {frozenset(): 1}
    assert not of(s, P + "nodes")
    collector.runtime_getter = lambda: rt
    s = scrape(collector)
    assert of(s, P + "fleet_collect_errors_total") == {frozenset(): 1}
    assert of(s, P + "nodes")[L(health="Healthy")] == 1


# ---------------------------------------------------------------------------------------------
# metrics.py
# ---------------------------------------------------------------------------------------------

def test_register_fleet_is_idempotent(rt: Runtime) -> None:
    registry = CollectorRegistry()
    first = metrics.register_fleet(lambda: None, registry)
    second = metrics.register_fleet(lambda: rt, registry)  # no DuplicateTimeseries
    assert second is first
    assert registry.get_sample_value(P + "nodes", {"health": "Healthy"}) == 1
    assert metrics.register_fleet(lambda: rt, CollectorRegistry()) is not first


def _value(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_reconcile_duration_by_result() -> None:
    name = P + "reconcile_duration_seconds_count"
    ok, failed = _value(name, {"result": "success"}), _value(name, {"result": "failure"})
    metrics.RECONCILE_DURATION.observe(0.01)  # the handlers' existing call: a success
    metrics.observe_reconcile(0.02, success=True)
    metrics.observe_reconcile(0.5, success=False)
    assert _value(name, {"result": "success"}) == ok + 2
    assert _value(name, {"result": "failure"}) == failed + 1


def test_watch_restarts() -> None:
    name = P + "watch_restarts_total"
    before = {w: _value(name, {"watch": w}) for w in metrics.WATCHES}
    metrics.watch_restarted("reports")
    assert {w: _value(name, {"watch": w}) - before[w] for w in metrics.WATCHES} == {
        "nodes": 0, "reports": 1, "stats": 0, "assignments": 0}
    with pytest.raises(ValueError):
        metrics.watch_restarted("nodes/mac-a")  # labels stay bounded


async def test_relists_counted_counts_every_list_after_the_first() -> None:
    name, seen = P + "watch_restarts_total", []

    async def on_snapshot(snap: object) -> None:
        seen.append(snap)

    before = _value(name, {"watch": "stats"})
    wrapped = metrics.relists_counted("stats", on_snapshot)

    for i in range(3):
        await wrapped(i)
    assert seen == [0, 1, 2]
    assert _value(name, {"watch": "stats"}) == before + 2
    with pytest.raises(ValueError):
        metrics.relists_counted("traffic", on_snapshot)
