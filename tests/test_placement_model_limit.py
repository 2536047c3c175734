"""Placement with the nodes' limits on loaded models (``NodeCapacity.max_loaded_models``, the
agent's ``--max-loaded-models``; seed 004): table-driven over plain data."""

from __future__ import annotations

import pytest

from mlx_fleet.contract import NodeRecord
from mlx_fleet_operator.placement import at_model_limit, others_count, place
from test_placement import asg, node, req


def limited(name: str, limit: int, mem_gib: float = 64, gen: int = 4) -> NodeRecord:
    n = node(name, mem_gib, gen=gen)
    return n.model_copy(update={"capacity": n.capacity.model_copy(
        update={"max_loaded_models": limit})})


CASES = [
    # id, request, nodes, assignments, expected nodes, expected unplaced, message
    ("below the limit", req(), [limited("a", 2)], {"a": [asg("x", 1)]}, ("a",), 0, ""),
    ("at the limit", req(), [limited("a", 2)], {"a": [asg("x", 1), asg("y", 1)]}, (), 1,
     "0/1 nodes fit: 1 at its model limit (a 2 of 2 models)"),
    ("0 = no limit", req(), [limited("a", 0)], {"a": [asg(f"m{i}", 1) for i in range(6)]},
     ("a",), 0, ""),
    ("a canary's other revision counts", req(revision="v2"), [limited("a", 2)],
     {"a": [asg("llm", 2, revision="v1"), asg("x", 1)]}, (), 1,
     "0/1 nodes fit: 1 at its model limit (a 2 of 2 models)"),
    ("room for both sides of a canary", req(revision="v2"), [limited("a", 3)],
     {"a": [asg("llm", 2, revision="v1"), asg("x", 1)]}, ("a",), 0, ""),
    ("the revision placed does not count against itself", req(revision="v1"),
     [limited("a", 2), limited("b", 2)], {"a": [asg("llm", 2, revision="v1"), asg("x", 1)]},
     ("a",), 0, ""),
    ("over the limit (lowered since): the replica moves", req(revision="v1"),
     [limited("a", 1), limited("b", 1)], {"a": [asg("llm", 2, revision="v1"), asg("x", 1)]},
     ("b",), 0, ""),
    ("placed below its limit instead", req(), [limited("a", 1), limited("b", 1, mem_gib=16)],
     {"a": [asg("x", 1)]}, ("b",), 0, ""),
    ("every node at its limit, with the numbers", req(),
     [limited("a", 1), limited("b", 2)],
     {"a": [asg("x", 1)], "b": [asg("x", 1, ns="p"), asg("y", 1)]}, (), 1,
     "0/2 nodes fit: 2 at their model limit (a 1 of 1 models, b 2 of 2 models)"),
    ("memory is the reason given first", req(mem_gib=9), [limited("a", 1, mem_gib=10)],
     {"a": [asg("x", 1)]}, (), 1, "0/1 nodes fit: 1 insufficient memory"),
    ("scale up short", req(replicas=2), [limited("a", 1), limited("b", 1)],
     {"a": [asg("x", 1)]}, ("b",), 1,
     "1/2 nodes fit: 1 at its model limit (a 1 of 1 models); 1 of 2 replicas unplaced"),
    ("next to other reasons", req(min_chip_generation=4),
     [node("a", gen=3), limited("b", 1)], {"b": [asg("x", 1)]}, (), 1,
     "0/2 nodes fit: 1 below chip generation M4, 1 at its model limit (b 1 of 1 models)"),
]


@pytest.mark.parametrize("request_, nodes, assignments, want, unplaced, message",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_place_with_model_limits(request_, nodes, assignments, want, unplaced, message):
    d = place(request_, nodes, assignments)
    assert d.nodes == want and d.unplaced == unplaced
    assert d.message.startswith(message) if message else d.message == ""
    limited_reason = any("model limit" in r for r in d.reasons)
    assert limited_reason == ("model limit" in message)


def test_many_nodes_at_their_limit_name_five():
    nodes = [limited(f"m{i}", 1) for i in range(7)]
    used = {f"m{i}": [asg(f"o{i}", 1)] for i in range(7)}
    d = place(req(), nodes, used)
    assert d.message == ("0/7 nodes fit: 7 at their model limit (m0 1 of 1 models, "
                         "m1 1 of 1 models, m2 1 of 1 models, m3 1 of 1 models, "
                         "m4 1 of 1 models, 2 more)")


def test_counting_helpers():
    r = req(revision="v2")
    on_a = [asg("llm", 2, revision="v1"), asg("llm", 2, revision="v2"), asg("x", 1)]
    assert others_count(r, on_a) == 2  # both other revisions, not the one placed
    assert at_model_limit(r, limited("a", 2), on_a)
    assert not at_model_limit(r, limited("a", 3), on_a)
    assert not at_model_limit(r, limited("a", 0), on_a * 5)
