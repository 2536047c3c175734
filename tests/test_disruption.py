"""Nodes that vanish together are held, not re-placed (operator/mlx_fleet_operator/disruption.py):
the pure rule, table-tested over an injected clock, and placement keeping held replicas."""

from __future__ import annotations

import pytest

from mlx_fleet_operator.disruption import HOLD_SECONDS, Disruption, observe

AB = frozenset({"a", "b"})
ABC = frozenset({"a", "b", "c"})


def run(steps: list[tuple[float, set[str]]], start: Disruption = Disruption()) -> list[Disruption]:
    out, d = [], start
    for now, live in steps:
        d = observe(d, frozenset(live), now)
        out.append(d)
    return out


@pytest.mark.parametrize("steps, held_after", [
    # every Mac vanishes at once (etcd resumed and revoked their leases): held
    ([(0, AB), (1, set())], {"a", "b"}),
    # ... and released one by one as they re-register
    ([(0, AB), (1, set()), (1.05, {"a"})], {"b"}),
    ([(0, AB), (1, set()), (1.05, {"a"}), (1.1, AB)], set()),
    # one Mac of two is node loss, re-placed at once
    ([(0, AB), (1, {"a"})], set()),
    # two of three vanish together (67 % > 55 %): held
    ([(0, ABC), (1, {"c"})], {"a", "b"}),
    # one of three (33 %): node loss
    ([(0, ABC), (1, {"a", "b"})], set()),
    # a lone Mac vanishing: nothing else could serve it, not a disruption
    ([(0, {"a"}), (1, set())], set()),
    # nodes lost one at a time are ordinary losses, however many in the end
    ([(0, ABC), (1, {"a", "b"}), (2, {"a"}), (3, set())], set()),
    # a held Mac that never returns is released after the hold
    ([(0, AB), (1, set()), (1 + HOLD_SECONDS - 0.1, {"a"})], {"b"}),
    ([(0, AB), (1, set()), (1 + HOLD_SECONDS, {"a"})], set()),
    # the first observation has nothing to compare with
    ([(0, set())], set()),
    ([(0, AB)], set()),
])
def test_held(steps: list[tuple[float, set[str]]], held_after: set[str]) -> None:
    assert run(steps)[-1].held == held_after


def test_a_released_mac_that_vanishes_alone_later_is_node_loss() -> None:
    d = run([(0, AB), (1, set()), (1.1, AB), (5, {"a"})])[-1]
    assert d.held == frozenset() and d.seen == {"a"}


def test_held_macs_stay_seen_so_a_second_wave_is_measured_against_all() -> None:
    # a, b vanish (held); then c and d vanish while a, b are still away: c, d held too
    d = run([(0, {"a", "b", "c", "d", "e"}), (1, {"c", "d", "e"})])[-1]
    assert d.held == frozenset()          # 2 of 5 = 40 %: node loss
    d = run([(0, {"a", "b", "c"}), (1, {"c"}), (2, set())])[-1]
    assert d.held == {"a", "b"}           # c alone vanishing later is node loss
    assert d.seen == {"a", "b"}


# -- placement keeps held replicas -----------------------------------------------------------

from test_placement import asg, node, req  # noqa: E402

from mlx_fleet_operator.placement import place  # noqa: E402


@pytest.mark.parametrize("nodes, assigned, held, want, removed", [
    # every node vanished: held replicas stay, nothing removed
    ([], {"a": [asg("llm", 2)], "b": [asg("llm", 2)]}, {"a", "b"}, ("a", "b"), ()),
    # a came back, b still held: both kept
    ([node("a")], {"a": [asg("llm", 2)], "b": [asg("llm", 2)]}, {"b"}, ("a", "b"), ()),
    # the same without the hold: b's replica moves (node loss)
    ([node("a"), node("c")], {"a": [asg("llm", 2)], "b": [asg("llm", 2)]}, set(), ("a", "c"),
     ("b",)),
    # a held node gets no new replica
    ([node("a")], {"a": [asg("llm", 2)]}, {"b"}, ("a",), ()),
])
def test_placement_keeps_held_replicas(nodes, assigned, held, want, removed) -> None:
    d = place(req(replicas=2), nodes, assigned, frozenset(held))
    assert d.nodes == want and d.removed == removed
