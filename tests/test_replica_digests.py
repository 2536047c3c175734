"""Content addressing in the ModelDeployment status (issue 19, finding 4): each replica's
digest from its agent's report, and ``ReplicasConsistent`` False (``DigestMismatch``) when
replicas of one revision hold different bytes — pure, table-driven."""

from __future__ import annotations

import json

import pytest

from mlx_fleet.contract import AssignmentReport, AssignmentState, Role
from mlx_fleet_operator.status import StatusInput, compute_status, digest_consistency
from test_operator_status import T0, T1, asg, conds, rep

D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64
H1 = "hf-commit:" + "a" * 40
R, L = AssignmentState.READY, AssignmentState.LOADING


@pytest.mark.parametrize(("replicas", "status", "reason", "words"), [
    ([], "Unknown", "NoDigests", ["file://"]),
    ([("a", "v1", ""), ("b", "v1", "")], "Unknown", "NoDigests", []),
    ([("a", "v1", D1), ("b", "v1", D1)], "True", "DigestsMatch", ["2 replica(s) hold " + D1]),
    # a replica not fetched yet (no digest) is no mismatch
    ([("a", "v1", D1), ("b", "v1", "")], "True", "DigestsMatch", ["1 replica(s)"]),
    # two revisions may differ: that is a rollout or a canary, not drift
    ([("a", "v1", D1), ("a", "v2", D2), ("b", "v1", D1)], "True", "DigestsMatch",
     ["revision v1", "revision v2"]),
    ([("a", "v1", D1), ("b", "v1", D2)], "False", "DigestMismatch",
     [f"revision v1: a hold {D1}; b hold {D2}", "pin a hub commit"]),
    ([("a", "v1", H1), ("b", "v1", D1), ("c", "v1", D1), ("c", "v2", D2)], "False",
     "DigestMismatch", [f"b, c hold {D1}", f"a hold {H1}"]),
])
def test_digest_consistency_table(replicas, status, reason, words) -> None:
    got = digest_consistency(replicas)
    assert got[:2] == (status, reason)
    for w in words:
        assert w in got[2], got[2]


def test_two_replicas_with_different_digests_set_the_condition_and_an_event() -> None:
    SA, SB = ("a", "v1"), ("b", "v1")
    same = StatusInput(generation=2, replicas=2, assignments={SA: asg(), SB: asg()},
                       reports={SA: rep("a", R, digest=D1), SB: rep("b", R, digest=D1)})
    status, events = compute_status(same, None, T0)
    assert conds(status)["ReplicasConsistent"] == ("True", "DigestsMatch")
    assert [n.get("digest") for n in status["nodes"]] == [D1, D1]
    assert not [e for e in events if e.reason == "DigestMismatch"]

    drifted = StatusInput(generation=2, replicas=2, assignments={SA: asg(), SB: asg()},
                          reports={SA: rep("a", R, digest=D1), SB: rep("b", R, digest=D2)})
    status2, events2 = compute_status(drifted, status, T1)
    [c] = [c for c in status2["conditions"] if c["type"] == "ReplicasConsistent"]
    assert (c["status"], c["reason"]) == ("False", "DigestMismatch")
    assert D1 in c["message"] and D2 in c["message"] and c["lastTransitionTime"]
    [e] = [e for e in events2 if e.reason == "DigestMismatch"]
    assert e.type == "Warning" and "revision v1" in e.message
    # still ready: serving is unchanged, the mismatch is its own condition
    assert conds(status2)["Ready"] == ("True", "ReplicasReady")
    # no second event while nothing changes
    _, events3 = compute_status(drifted, status2, T1)
    assert not [e for e in events3 if e.reason == "DigestMismatch"]


def test_candidate_and_stable_revisions_are_compared_per_revision() -> None:
    SA, SB = ("a", "v1"), ("b", "v2")
    inp = StatusInput(generation=2, replicas=1,
                      assignments={SA: asg(), SB: asg(revision="v2", role=Role.CANDIDATE)},
                      reports={SA: rep("a", R, digest=D1),
                               SB: rep("b", L, revision="v2", digest=D2)})
    status, _ = compute_status(inp, None, T0)
    assert conds(status)["ReplicasConsistent"] == ("True", "DigestsMatch")


def test_a_stale_report_digest_does_not_count() -> None:
    SA, SB = ("a", "v1"), ("b", "v1")
    inp = StatusInput(generation=3, replicas=2, assignments={SA: asg(3), SB: asg(3)},
                      reports={SA: rep("a", R, gen=3, digest=D1),
                               SB: rep("b", R, gen=2, digest=D2)})  # an older generation's
    status, _ = compute_status(inp, None, T0)
    assert conds(status)["ReplicasConsistent"] == ("True", "DigestsMatch")
    assert "digest" not in [n for n in status["nodes"] if n["name"] == "b"][0]


def test_reports_without_a_digest_still_parse() -> None:
    old = {"node": "a", "namespace": "ns", "name": "llm", "generation": 2, "revision": "v1",
           "state": "Ready", "reason": "ModelLoaded", "endpoint": "http://a:8000"}
    r = AssignmentReport.from_json(json.dumps(old))
    assert r.digest == ""
    assert AssignmentReport.from_json(r.to_json()) == r
