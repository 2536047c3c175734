"""The etcd contract: key building/parsing and record round-trips (pure, no etcd)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mlx_fleet.contract import (
    Assignment,
    AssignmentReport,
    AssignmentState,
    Keys,
    ModelSource,
    NodeCapacity,
    NodeRecord,
)


@pytest.mark.parametrize(
    ("method", "args", "key"),
    [
        ("node", ("mac-a",), "/r/nodes/mac-a"),
        ("assignment", ("mac-a", "default", "llama"), "/r/assignments/mac-a/default/llama"),
        ("report", ("mac-a", "ns", "m"), "/r/reports/mac-a/ns/m"),
        ("node_assignments_prefix", ("mac-a",), "/r/assignments/mac-a/"),
    ],
)
def test_keys_build(method: str, args: tuple[str, ...], key: str) -> None:
    assert getattr(Keys("/r/"), method)(*args) == key


@pytest.mark.parametrize("bad", ["", "a/b", ".", ".."])
def test_keys_refuse_bad_segments(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid"):
        Keys("/r").node(bad)
    with pytest.raises(ValueError, match="invalid"):
        Keys("/r").assignment("n", "default", bad)


@pytest.mark.parametrize(
    ("key", "parsed"),
    [
        ("/r/assignments/mac-a/default/llama", ("mac-a", "default", "llama")),
        ("/r/assignments/mac-a/default", None),
        ("/r/assignments/mac-a/default/llama/extra", None),
        ("/r/reports/mac-a/default/llama", None),
        ("/other/assignments/mac-a/default/llama", None),
    ],
)
def test_parse_assignment(key: str, parsed: tuple[str, str, str] | None) -> None:
    assert Keys("/r").parse_assignment(key) == parsed


def test_parse_node_round_trip() -> None:
    k = Keys("/r")
    assert k.parse_node(k.node("mac-7")) == "mac-7"
    assert k.parse_node("/r/nodes/a/b") is None
    assert k.parse_report(k.report("n", "ns", "d")) == ("n", "ns", "d")


def test_records_round_trip_and_reject_garbage() -> None:
    rec = NodeRecord(name="mac-a", address="http://127.0.0.1:1",
                     capacity=NodeCapacity(memory_total_bytes=64 << 30, memory_available_bytes=60 << 30,
                                           chip="Apple M3 Max", chip_generation=3, simulated=True))
    assert NodeRecord.from_json(rec.to_json()) == rec
    a = Assignment(namespace="default", name="m", served_model_name="m",
                   source=ModelSource(uri="file:///x", revision="v1"), memory_bytes=1 << 30)
    assert Assignment.from_json(a.to_json()) == a
    rep = AssignmentReport(node="n", namespace="default", name="m", state=AssignmentState.READY)
    assert AssignmentReport.from_json(rep.to_json()).state is AssignmentState.READY
    with pytest.raises(ValidationError):
        Assignment.from_json(b'{"namespace": "x"}')
    with pytest.raises(ValidationError):
        NodeRecord.from_json(b"not json")
    with pytest.raises(ValidationError):
        Assignment.from_json(a.model_copy(update={"memory_bytes": -1}).model_dump_json())
