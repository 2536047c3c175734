"""The agent's per-request routing between a deployment's loaded revisions (pure, no agent)."""

from __future__ import annotations

import pytest

from mlx_fleet.contract import Role, TrafficSplit
from mlx_fleet.routing.route import Route, route
from mlx_fleet.routing.split import bucket

S, C, P = Role.STABLE, Role.CANDIDATE, Role.PREVIOUS


def split(weight: int, endpoints: tuple[str, ...] = ()) -> TrafficSplit:
    return TrafficSplit(namespace="ns", name="d", served_model_name="m", stable_revision="v1",
                        candidate_revision="v2", weight=weight,
                        candidate_endpoints=list(endpoints))


def key_in(side: str, weight: int) -> str:
    """A session key whose bucket falls on ``side`` of ``weight`` for deployment ns/d."""
    for i in range(100_000):
        k = f"session-{i}"
        if (bucket("ns/d", k) < weight * 100) == (side == "candidate"):
            return k
    raise AssertionError("no key found")


@pytest.mark.parametrize("loaded, want", [
    ({}, None),
    ({"v1": S}, "v1"),
    ({"v1": S, "v0": P}, "v1"),          # rolling update: the stable one once it is loaded
    ({"v0": P}, "v0"),                   # ... and the previous one until then: no gap
    ({"v2": C}, "v2"),                   # candidate-only node still answers
    ({"v1": S, "v2": C}, "v1"),          # no split: never the candidate
])
def test_without_a_split(loaded, want):
    r = route(loaded, None, "k")
    assert (r.revision if r else None) == want
    assert r is None or (not r.canary and not r.forward)


def test_split_sends_candidate_buckets_to_the_candidate_and_the_rest_to_stable():
    loaded = {"v1": S, "v2": C}
    assert route(loaded, split(30), key_in("candidate", 30)) == Route("v2", canary=True,
                                                                      role="candidate")
    assert route(loaded, split(30), key_in("stable", 30)) == Route("v1", canary=True,
                                                                   role="stable")


def test_weight_zero_and_tripped_guard_send_everything_to_stable():
    loaded = {"v1": S, "v2": C}
    k = key_in("candidate", 50)
    assert route(loaded, split(0), k).revision == "v1"
    r = route(loaded, split(50), k, guard_tripped=True)
    assert (r.revision, r.role) == ("v1", "stable")


def test_candidate_not_held_here_is_forwarded_by_bucket_else_stable():
    k = key_in("candidate", 100)
    eps = ("http://a:1", "http://b:2")
    r = route({"v1": S}, split(100, eps), k)
    assert (r.revision, r.forward) == ("v2", eps[bucket("ns/d", k) % 2])
    assert route({"v1": S}, split(100), k) == Route("v1", canary=True, role="stable")


def test_a_pinned_revision_is_served_as_is_and_never_forwarded():
    assert route({"v1": S, "v2": C}, split(0, ("http://x:1",)), "k", pinned="v2") == Route(
        "v2", canary=True)
    assert route({"v1": S}, split(100, ("http://x:1",)), "k", pinned="v2") is None


def test_stable_side_falls_back_to_previous_then_candidate():
    k = key_in("stable", 10)
    assert route({"v0": P, "v2": C}, split(10), k).revision == "v0"
    r = route({"v2": C}, split(10), k)
    assert (r.revision, r.role) == ("v2", "candidate")
