"""Whose word the operator takes (mlx_fleet_operator.holders, issue 19 review): an agent's
report, memory estimate or statistics count only for a slot its node holds. Table tests over
plain data, and the reviewer's forged report: per-replica memory stays the honest estimate."""

from __future__ import annotations

import pytest

from mlx_fleet.contract import Assignment, AssignmentReport, AssignmentState, ModelSource
from mlx_fleet_operator.holders import current_report, held_reports, held_stats
from mlx_fleet_operator.placement import resolve_memory, revision_estimates

GiB = 2**30


def report(node: str, revision: str = "r1", *, generation: int = 1, est: int = 0,
           state: AssignmentState = AssignmentState.READY) -> AssignmentReport:
    return AssignmentReport(node=node, namespace="team-a", name="chat", generation=generation,
                            revision=revision, state=state, estimated_bytes=est)


def assignment(revision: str = "r1", generation: int = 1) -> Assignment:
    return Assignment(namespace="team-a", name="chat", uid="u", generation=generation,
                      served_model_name="chat", memory_bytes=8 * GiB,
                      source=ModelSource(uri="https://models.example/chat", revision=revision))


REPORTS = {("studio-1", "r1"): report("studio-1"), ("studio-1", "r2"): report("studio-1", "r2"),
           ("studio-2", "r1"): report("studio-2"), ("rogue", "r1"): report("rogue")}


@pytest.mark.parametrize("placed, kept", [
    ({}, set()),
    ({("studio-1", "r1")}, {("studio-1", "r1")}),
    ({("studio-1", "r1"), ("studio-2", "r1")}, {("studio-1", "r1"), ("studio-2", "r1")}),
    # holding r1 does not vouch for the same node's r2 report
    ({("studio-1", "r1"), ("rogue", "r2")}, {("studio-1", "r1")}),
    # a slot held without a report yet: nothing to keep
    ({("studio-3", "r1")}, set()),
])
def test_held_reports(placed: set, kept: set) -> None:
    assert set(held_reports(REPORTS, placed)) == kept
    assert set(held_reports(REPORTS, dict.fromkeys(placed, assignment()))) == kept


@pytest.mark.parametrize("slot, placed, generation, current", [
    (("studio-1", "r1"), {("studio-1", "r1"): assignment(generation=1)}, 1, True),
    (("studio-1", "r1"), {("studio-1", "r1"): assignment(generation=2)}, 1, False),  # older
    (("studio-1", "r1"), {("studio-1", "r1"): None}, 1, False),  # malformed stored record
    (("rogue", "r1"), {("studio-1", "r1"): assignment()}, 1, False),  # not held
    (("studio-2", "r1"), {("studio-2", "r1"): assignment()}, None, False),  # no report
])
def test_current_report(slot, placed, generation, current: bool) -> None:
    reports = {} if generation is None else {slot: report(slot[0], slot[1],
                                                          generation=generation)}
    assert (current_report(slot, reports, placed) is not None) is current


@pytest.mark.parametrize("placed, nodes", [
    ({}, set()),
    ({("studio-1", "r1")}, {"studio-1"}),
    ({("studio-1", "r1"), ("studio-2", "r2")}, {"studio-1", "studio-2"}),  # a candidate's node
])
def test_held_stats(placed: set, nodes: set) -> None:
    stats = {"studio-1": "s1", "studio-2": "s2", "rogue": "forged"}
    assert set(held_stats(stats, placed)) == nodes


def test_a_forged_report_no_longer_moves_per_replica_memory() -> None:
    """The reviewer's probe: a rogue agent writes reports/<its node>/team-a/chat/r1 with a
    1 TiB estimate for a deployment never assigned to it."""
    honest = {("studio-1", "r1"): report("studio-1", est=8 * GiB,
                                         state=AssignmentState.FAILED)}
    forged = {**honest, ("rogue", "r1"): report("rogue", est=2**40,
                                                state=AssignmentState.FAILED)}
    placed = {("studio-1", "r1"): assignment()}
    assert resolve_memory(None, revision_estimates(forged, placed).values()) == 8 * GiB
    # the rogue's report counts only if its node held the slot
    assert resolve_memory(None, revision_estimates(
        forged, {**placed, ("rogue", "r1"): assignment()}).values()) == 2**40
