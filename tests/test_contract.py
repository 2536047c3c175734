"""The etcd contract: key building/parsing and record round-trips (pure, no etcd)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from mlx_fleet.contract import (
    LATENCY_BOUNDS_SECONDS,
    ROOT,
    Assignment,
    AssignmentReport,
    AssignmentState,
    Histogram,
    Keys,
    LocalGuard,
    ModelSource,
    NodeCapacity,
    NodeRecord,
    RevisionStats,
    Role,
    StatsReport,
    TrafficSplit,
    WATERMARK,
    check_watermark,
    node_budget_bytes,
)


def test_root_is_contract_v2() -> None:
    assert ROOT == "/mlx-fleet/v2"
    assert Keys().assignment("n", "ns", "m", "r1") == "/mlx-fleet/v2/assignments/n/ns/m/r1"


@pytest.mark.parametrize(
    ("method", "args", "key"),
    [
        ("node", ("mac-a",), "/r/nodes/mac-a"),
        ("assignment", ("mac-a", "default", "llama", "v1"),
         "/r/assignments/mac-a/default/llama/v1"),
        ("report", ("mac-a", "ns", "m", "v2"), "/r/reports/mac-a/ns/m/v2"),
        ("traffic", ("ns", "m"), "/r/traffic/ns/m"),
        ("stats", ("mac-a", "ns", "m"), "/r/stats/mac-a/ns/m"),
        ("node_assignments_prefix", ("mac-a",), "/r/assignments/mac-a/"),
        ("node_reports_prefix", ("mac-a",), "/r/reports/mac-a/"),
    ],
)
def test_keys_build(method: str, args: tuple[str, ...], key: str) -> None:
    assert getattr(Keys("/r/"), method)(*args) == key


def test_prefixes() -> None:
    k = Keys("/r")
    assert (k.nodes_prefix, k.assignments_prefix, k.reports_prefix, k.traffic_prefix,
            k.stats_prefix, k.placement_epoch) == (
        "/r/nodes/", "/r/assignments/", "/r/reports/", "/r/traffic/", "/r/stats/",
        "/r/placement-epoch")


@pytest.mark.parametrize("bad", ["", "a/b", ".", ".."])
def test_keys_refuse_bad_segments(bad: str) -> None:
    k = Keys("/r")
    with pytest.raises(ValueError, match="invalid"):
        k.node(bad)
    with pytest.raises(ValueError, match="invalid"):
        k.assignment("n", "default", bad, "v1")
    with pytest.raises(ValueError, match="invalid revision"):
        k.assignment("n", "default", "m", bad)
    with pytest.raises(ValueError, match="invalid revision"):
        k.report("n", "default", "m", bad)
    with pytest.raises(ValueError, match="invalid"):
        k.traffic("default", bad)
    with pytest.raises(ValueError, match="invalid node name"):
        k.stats(bad, "default", "m")


@pytest.mark.parametrize(
    ("key", "parsed"),
    [
        ("/r/assignments/mac-a/default/llama/v1", ("mac-a", "default", "llama", "v1")),
        ("/r/assignments/mac-a/default/llama", None),  # a v1-contract key: no revision
        ("/r/assignments/mac-a/default", None),
        ("/r/assignments/mac-a/default/llama/v1/extra", None),
        ("/r/assignments/mac-a/default//v1", None),
        ("/r/reports/mac-a/default/llama/v1", None),
        ("/other/assignments/mac-a/default/llama/v1", None),
    ],
)
def test_parse_assignment(key: str, parsed: tuple[str, str, str, str] | None) -> None:
    assert Keys("/r").parse_assignment(key) == parsed


def test_parse_round_trips() -> None:
    k = Keys("/r")
    assert k.parse_node(k.node("mac-7")) == "mac-7"
    assert k.parse_node("/r/nodes/a/b") is None
    assert k.parse_report(k.report("n", "ns", "d", "rev-2")) == ("n", "ns", "d", "rev-2")
    assert k.parse_report("/r/reports/n/ns/d") is None
    assert k.parse_assignment(k.assignment("n", "ns", "d", "a.b_c")) == ("n", "ns", "d", "a.b_c")
    assert k.parse_traffic(k.traffic("ns", "d")) == ("ns", "d")
    assert k.parse_traffic("/r/traffic/ns/d/x") is None
    assert k.parse_stats(k.stats("n", "ns", "d")) == ("n", "ns", "d")
    assert k.parse_stats("/r/stats/n/ns") is None
    assert k.parse_stats(k.traffic("ns", "d")) is None


def _assignment(**kw) -> Assignment:
    return Assignment(namespace="default", name="m", served_model_name="m",
                      source=ModelSource(uri="file:///x", revision="v1"), memory_bytes=1 << 30,
                      **kw)


def test_records_round_trip_and_reject_garbage() -> None:
    rec = NodeRecord(name="mac-a", address="http://127.0.0.1:1",
                     capacity=NodeCapacity(memory_total_bytes=64 << 30, memory_available_bytes=60 << 30,
                                           chip="Apple M3 Max", chip_generation=3, simulated=True))
    assert NodeRecord.from_json(rec.to_json()) == rec
    with_options = rec.model_copy(update={"serving_options": {"prompt_cache": "off"}})
    assert NodeRecord.from_json(with_options.to_json()) == with_options
    # a record written before serving_options existed still parses
    old = rec.model_dump(mode="json")
    del old["serving_options"]
    assert NodeRecord.model_validate(old).serving_options == {}
    a = _assignment()
    assert Assignment.from_json(a.to_json()) == a
    rep = AssignmentReport(node="n", namespace="default", name="m", state=AssignmentState.READY,
                           revision="v1")
    back = AssignmentReport.from_json(rep.to_json())
    assert back.state is AssignmentState.READY and back.revision == "v1"
    with pytest.raises(ValidationError):
        Assignment.from_json(b'{"namespace": "x"}')
    with pytest.raises(ValidationError):
        NodeRecord.from_json(b"not json")
    with pytest.raises(ValidationError):
        Assignment.from_json(a.model_copy(update={"memory_bytes": -1}).model_dump_json())


NODE_CAPACITY = {"memory_total_bytes": 10 * 2**30, "memory_available_bytes": 9 * 2**30,
                 "chip": "Apple M4 Max", "chip_generation": 4}


@pytest.mark.parametrize("capacity, watermark, budget", [
    # a record written before memory_watermark existed: the default, 80 % (seed 004)
    (NODE_CAPACITY, WATERMARK, 8 * 2**30),
    ({**NODE_CAPACITY, "memory_watermark": 0.5}, 0.5, 5 * 2**30),
    ({**NODE_CAPACITY, "memory_watermark": 1}, 1.0, 10 * 2**30),
    ({**NODE_CAPACITY, "memory_watermark": 0.29, "memory_total_bytes": 100}, 0.29, 29),
    # the GPU wired limit still caps it
    ({**NODE_CAPACITY, "memory_watermark": 0.9, "wired_limit_bytes": 6 * 2**30}, 0.9, 6 * 2**30),
    ({**NODE_CAPACITY, "memory_watermark": 0.5, "wired_limit_bytes": 6 * 2**30}, 0.5, 5 * 2**30),
])
def test_node_capacity_carries_its_watermark(capacity: dict, watermark: float,
                                             budget: int) -> None:
    cap = NodeCapacity.from_json(json.dumps(capacity))
    assert cap.memory_watermark == watermark and cap.budget_bytes() == budget
    assert cap.budget_bytes() == node_budget_bytes(cap.memory_total_bytes, cap.wired_limit_bytes,
                                                   watermark)
    assert NodeCapacity.from_json(cap.to_json()) == cap


@pytest.mark.parametrize("watermark", [0, 0.0, -0.5, 1.01, 80, True, "0.8", None,
                                       float("nan"), float("inf")])
def test_node_capacity_refuses_a_bad_watermark(watermark: object) -> None:
    with pytest.raises(ValidationError) as e:
        NodeCapacity.model_validate({**NODE_CAPACITY, "memory_watermark": watermark})
    assert e.value.errors()[0]["loc"] == ("memory_watermark",)
    assert "watermark must be a number in (0, 1]" in str(e.value)
    with pytest.raises(ValueError, match=r"watermark must be a number in \(0, 1\]"):
        check_watermark(watermark)


def test_assignment_role_and_revision() -> None:
    a = _assignment()
    assert a.role is Role.STABLE and a.revision == "v1"  # default role: Stable
    c = _assignment(role=Role.CANDIDATE)
    assert Assignment.from_json(c.to_json()).role is Role.CANDIDATE
    assert b'"role":"Candidate"' in c.to_json()
    assert Assignment.from_json(_assignment(role=Role.PREVIOUS).to_json()).role is Role.PREVIOUS
    # A record written before roles existed reads as Stable.
    legacy = a.model_dump(mode="json")
    del legacy["role"]
    assert Assignment.model_validate(legacy).role is Role.STABLE
    with pytest.raises(ValidationError):
        Assignment.model_validate({**legacy, "role": "Shadow"})


def test_traffic_split_round_trip_and_bounds() -> None:
    t = TrafficSplit(namespace="ns", name="m", served_model_name="m", stable_revision="v1",
                     candidate_revision="v2", weight=25, canary="c", canary_uid="u",
                     candidate_endpoints=["http://b:8000"],
                     guard=LocalGuard(min_failures=5, failure_ratio=0.2))
    assert TrafficSplit.from_json(t.to_json()) == t
    assert TrafficSplit(namespace="ns", name="m", served_model_name="m", stable_revision="v1",
                        candidate_revision="v2").guard == LocalGuard()
    for bad in ({"weight": 101}, {"weight": -1}, {"stats_interval_seconds": 0}):
        with pytest.raises(ValidationError):
            TrafficSplit.model_validate({**t.model_dump(mode="json"), **bad})
    with pytest.raises(ValidationError):
        LocalGuard(failure_ratio=1.5)
    with pytest.raises(ValidationError):
        LocalGuard(min_failures=0)


def test_stats_report_round_trip() -> None:
    def hist() -> Histogram:
        return Histogram(bounds=LATENCY_BOUNDS_SECONDS,
                         counts=[0] * (len(LATENCY_BOUNDS_SECONDS) + 1), total=0.0)

    s = StatsReport(node="n", namespace="ns", name="m", canary_uid="u", revisions={
        "v2": RevisionStats(revision="v2", started_unix=1.0, requests=10, errors=2, crashes=1,
                            latency_seconds=hist(), ttft_seconds=hist(),
                            tokens_per_second=hist(), memory_bytes=5)},
        guard_tripped=True, guard_reason="3/4 failed")
    back = StatsReport.from_json(s.to_json())
    assert back == s and back.revisions["v2"].errors == 2
    with pytest.raises(ValidationError):
        RevisionStats.model_validate({**s.revisions["v2"].model_dump(mode="json"),
                                      "requests": -1})
