"""The fleet router's picker (mlx_fleet_router.picker): the canary split's revision, then
consistent hashing with bounded loads — table tests, and hypothesis properties (deterministic,
load bound respected, minimal disruption when a Mac joins or leaves, a session's revision
sticky through a weight step)."""

from __future__ import annotations

import functools
import hashlib
import math
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mlx_fleet.capabilities import (CHAT_PATH, EMBEDDINGS_PATH, ModelCapabilities,
                                    beyond_task, missing_everywhere, required_capabilities,
                                    satisfies)
from mlx_fleet.contract import SPLIT_BUCKETS, TrafficSplit
from mlx_fleet.routing.split import bucket
from mlx_fleet_router import breaker
from mlx_fleet_router.picker import (LOAD_FACTOR, REPLICATION, Candidate, Pick, Ring, Target,
                                     capacity, key_point, pick)

DEP = "team/chat"
MACS = tuple(f"mac-{i}" for i in range(8))


@functools.lru_cache(maxsize=None)
def ring_of(names: frozenset[str]) -> Ring:
    return Ring.build(names)


def _split(weight: int, stable: str = "r1", candidate: str = "r2") -> TrafficSplit:
    return TrafficSplit(namespace="team", name="chat", served_model_name="chat",
                        stable_revision=stable, candidate_revision=candidate, weight=weight)


def _cands(*names: str, revision: str = "r1", **kw) -> list[Candidate]:
    return [Candidate(n, revision, f"http://{n}:8000", **kw) for n in names]


def _owner(names: tuple[str, ...], key: str) -> str:
    """The key's Mac with no load, by the documented ring formula written out independently."""
    def point(*parts: str) -> int:
        h = hashlib.sha256()
        for p in parts:
            b = p.encode()
            h.update(len(b).to_bytes(8, "big") + b)
        return int.from_bytes(h.digest()[:8], "big")
    kp = point("key", DEP, key)
    vnodes = sorted((point("vnode", n, str(i)), n) for n in names for i in range(REPLICATION))
    after = [v for v in vnodes if v[0] >= kp]
    return (after or vnodes)[0][1]


# --- the load bound --------------------------------------------------------------------------

@pytest.mark.parametrize(("factor", "total", "macs", "expected"), [
    (1.25, 0, 1, 2),      # ceil(1.25 × 1 / 1)
    (1.25, 0, 4, 1),      # an idle fleet: one request each before spilling
    (1.25, 7, 4, 3),      # ceil(1.25 × 8 / 4) = ceil(2.5)
    (1.25, 6, 4, 3),      # ceil(2.1875)
    (1.0, 3, 4, 1),       # exactly the mean
    (1.1, 9, 1, 11),      # 11/10 × 10 = 11 exactly (the binary 1.1 would give 12)
    (2.0, 10, 3, 8),      # ceil(22 / 3)
])
def test_capacity_is_ceil_of_factor_times_mean_with_this_request(
        factor: float, total: int, macs: int, expected: int) -> None:
    assert capacity(factor, total, macs) == expected


@pytest.mark.parametrize(("factor", "total", "macs"), [(0.9, 1, 1), (1.25, 1, 0), (1.25, -1, 2)])
def test_capacity_rejects_nonsense(factor: float, total: int, macs: int) -> None:
    with pytest.raises(ValueError):
        capacity(factor, total, macs)


def test_defaults_are_kubeais() -> None:
    assert (LOAD_FACTOR, REPLICATION) == (1.25, 256)


# --- the ring --------------------------------------------------------------------------------

def test_ring_is_the_documented_sha256_formula() -> None:
    names = ("mac-0", "mac-1", "mac-2")
    ring = Ring.build(names)
    assert len(ring.points) == 3 * REPLICATION and list(ring.points) == sorted(ring.points)
    for key in ("alice", "bob", "", "séssion-☃"):
        first = next(ring.walk(key_point(DEP, key)))
        assert first == _owner(names, key)


def test_ring_walk_visits_each_mac_once_in_ring_order() -> None:
    ring = Ring.build(MACS, replication=4)
    for point in (0, 2**63, 2**64 - 1, ring.points[5], ring.points[5] + 1):
        walked = list(ring.walk(point))
        assert sorted(walked) == sorted(MACS)
        i = next(i for i, p in enumerate(ring.points) if p >= point) if point <= ring.points[-1] \
            else 0
        assert walked[0] == ring.owners[i]


def test_ring_rejects_no_replicas() -> None:
    with pytest.raises(ValueError):
        Ring.build(MACS, replication=0)


# --- table: the choice of Macs ---------------------------------------------------------------

def test_idle_fleet_no_split_goes_to_the_ring_owner_and_pins_nothing() -> None:
    names = MACS[:4]
    p = pick(ring_of(frozenset(names)), DEP, "alice", _cands(*names), now=0.0)
    assert p.targets[0].name == _owner(names, "alice") == p.owner
    assert sorted(t.name for t in p.targets) == sorted(names)
    assert all(t.revision == "" and t.endpoint == f"http://{t.name}:8000" for t in p.targets)
    assert (p.role, p.bucket, p.canary, p.spilled, p.saturated) == ("stable", None, False,
                                                                     False, False)
    assert p.capacity == 1  # ceil(1.25 × 1 / 4)


def test_an_overloaded_owner_spills_to_the_next_mac_on_the_ring() -> None:
    names = MACS[:4]
    ring = ring_of(frozenset(names))
    owner = _owner(names, "alice")
    walk = [n for n in ring.walk(key_point(DEP, "alice"))]
    assert walk[0] == owner
    # owner 3 in flight, the others 1: total 6, bound ceil(1.25 × 7 / 4) = 3, owner needs 4
    cands = [Candidate(n, "r1", in_flight=3 if n == owner else 1) for n in names]
    p = pick(ring, DEP, "alice", cands, now=0.0)
    assert p.capacity == 3 and p.owner == owner and p.spilled
    assert [t.name for t in p.targets] == walk[1:] + [owner]  # over the bound: last


def test_the_owner_within_the_bound_keeps_the_request() -> None:
    names = MACS[:4]
    owner = _owner(names, "alice")
    # owner 2, others 1: total 5, bound ceil(1.25 × 6 / 4) = 2: 2 + 1 > 2 → spills;
    # owner 1, others 2: total 7, bound 3: owner keeps it
    cands = [Candidate(n, "r1", in_flight=1 if n == owner else 2) for n in names]
    p = pick(ring_of(frozenset(names)), DEP, "alice", cands, now=0.0)
    assert p.targets[0].name == owner and not p.spilled


def test_cordoned_and_breaker_blocked_macs_are_left_out() -> None:
    names = MACS[:5]
    cfg = breaker.BreakerConfig()
    opened = breaker.step(cfg, breaker.CLOSED, breaker.Refused(), now=100.0)
    trial_out = breaker.step(cfg, opened, breaker.Sent(), now=100.0 + cfg.cooldown_seconds)
    cands = [Candidate("mac-0", "r1"), Candidate("mac-1", "r1", cordoned=True),
             Candidate("mac-2", "r1", breaker=opened),
             Candidate("mac-3", "r1", breaker=trial_out), Candidate("mac-4", "r1")]
    ring = ring_of(frozenset(names))
    p = pick(ring, DEP, "alice", cands, now=120.0)
    assert sorted(t.name for t in p.targets) == ["mac-0", "mac-4"]
    # after the cooldown mac-2 is half-open with its trial free: eligible; mac-3's trial is out
    p = pick(ring, DEP, "alice", cands, now=100.0 + cfg.cooldown_seconds + 1)
    assert sorted(t.name for t in p.targets) == ["mac-0", "mac-2", "mac-4"]


def test_no_eligible_mac_gives_no_target() -> None:
    names = MACS[:2]
    p = pick(ring_of(frozenset(names)), DEP, "alice", _cands(*names, cordoned=True), now=0.0)
    assert p == Pick(())
    assert not p.spilled


def _key_on(side: str, weight: int) -> str:
    """A session key whose bucket is on ``side`` of a split at ``weight``."""
    for i in range(10_000):
        k = f"s-{i}"
        if (bucket(DEP, k) < weight * (SPLIT_BUCKETS // 100)) == (side == "candidate"):
            return k
    raise AssertionError("no key found")


def test_split_candidate_side_goes_to_candidate_macs_pinned() -> None:
    ring = ring_of(frozenset(MACS[:4]))
    cands = _cands("mac-0", "mac-1", revision="r1") + _cands("mac-2", "mac-3", revision="r2")
    key = _key_on("candidate", 30)
    p = pick(ring, DEP, key, cands, _split(30), now=0.0)
    assert p.role == "candidate" and p.canary and p.bucket == bucket(DEP, key)
    assert {t.name for t in p.targets} == {"mac-2", "mac-3"}
    assert {t.revision for t in p.targets} == {"r2"}
    key = _key_on("stable", 30)
    p = pick(ring, DEP, key, cands, _split(30), now=0.0)
    assert p.role == "stable" and p.canary
    assert {(t.name, t.revision) for t in p.targets} == {("mac-0", "r1"), ("mac-1", "r1")}


def test_one_mac_holding_both_revisions_serves_each_side_with_its_pin() -> None:
    ring = ring_of(frozenset({"mac-0"}))
    cands = [Candidate("mac-0", "r1"), Candidate("mac-0", "r2")]
    for side, rev in (("candidate", "r2"), ("stable", "r1")):
        p = pick(ring, DEP, _key_on(side, 50), cands, _split(50), now=0.0)
        assert p.targets == (Target("mac-0", "", rev),) and p.role == side


@pytest.mark.parametrize(("side", "held", "role", "pins"), [
    # candidate side, no candidate Mac eligible → the stable revision (as an agent's route does)
    ("candidate", {"mac-0": "r1", "mac-1": "r0"}, "stable", {("mac-0", "r1")}),
    # stable side without a stable Mac → another non-candidate revision (a previous one)
    ("stable", {"mac-0": "r0", "mac-1": "r2"}, "stable", {("mac-0", "r0")}),
    # nothing but the candidate → the candidate, as a last resort
    ("stable", {"mac-1": "r2"}, "candidate", {("mac-1", "r2")}),
    ("candidate", {"mac-1": "r2"}, "candidate", {("mac-1", "r2")}),
])
def test_revision_fallbacks(side: str, held: dict[str, str], role: str,
                            pins: set[tuple[str, str]]) -> None:
    ring = ring_of(frozenset(MACS[:2]))
    cands = [Candidate(n, r) for n, r in held.items()]
    p = pick(ring, DEP, _key_on(side, 40), cands, _split(40), now=0.0)
    assert p.role == role and {(t.name, t.revision) for t in p.targets} == pins


def test_weight_zero_or_tripped_guard_keeps_everyone_on_stable() -> None:
    ring = ring_of(frozenset(MACS[:2]))
    cands = [Candidate("mac-0", "r1"), Candidate("mac-1", "r2")]
    key = _key_on("candidate", 100)
    # weight 0: no canary decision, but the candidate-only Mac is the last resort, not a peer
    p0 = pick(ring, DEP, key, cands, _split(0), now=0.0)
    assert p0.canary is False and p0.role == "stable"
    assert p0.targets == (Target("mac-0", "", "r1"),)
    # no split at all: every Mac, nothing pinned (the agent serves its stable revision)
    p_none = pick(ring, DEP, key, cands, None, now=0.0)
    assert {(t.name, t.revision) for t in p_none.targets} == {("mac-0", ""), ("mac-1", "")}
    p = pick(ring, DEP, key, cands, _split(100), now=0.0, guard_tripped=True)
    assert p.role == "stable" and p.targets == (Target("mac-0", "", "r1"),)


def test_saturated_when_every_target_is_at_its_admission_limit() -> None:
    names = MACS[:3]
    ring = ring_of(frozenset(names))
    full = [Candidate(n, "r1", in_flight=4, max_in_flight=4) for n in names]
    p = pick(ring, DEP, "alice", full, now=0.0)
    assert p.saturated and len(p.targets) == 3
    one_free = full[:2] + [Candidate(names[2], "r1", in_flight=3, max_in_flight=4)]
    p = pick(ring, DEP, "alice", one_free, now=0.0)
    assert not p.saturated and p.targets[0].name == names[2]


TOOLS = ModelCapabilities(tool_calling=True, tool_parser="json_tools")
PLAIN = ModelCapabilities()
NEEDS_TOOLS = required_capabilities(CHAT_PATH, {"tools": [{"type": "function",
                                                           "function": {"name": "f"}}]})


@pytest.mark.parametrize(("caps", "needs", "eligible"), [
    # nothing special needed: every Mac, whatever it serves
    ({"mac-0": PLAIN, "mac-1": TOOLS, "mac-2": None}, required_capabilities(CHAT_PATH, {}),
     {"mac-0", "mac-1", "mac-2"}),
    # tools: the Macs that have tool calling, and the one whose capabilities are unknown
    ({"mac-0": PLAIN, "mac-1": TOOLS, "mac-2": None}, NEEDS_TOOLS, {"mac-1", "mac-2"}),
    ({"mac-0": PLAIN, "mac-1": PLAIN}, NEEDS_TOOLS, set()),
    # a bound: n = 3 only where max_n >= 3
    ({"mac-0": ModelCapabilities(max_n=2), "mac-1": ModelCapabilities(max_n=4)},
     required_capabilities(CHAT_PATH, {"n": 3}), {"mac-1"}),
])
def test_macs_lacking_what_the_request_needs_are_left_out(caps, needs, eligible) -> None:
    ring = ring_of(frozenset(caps))
    cands = [Candidate(n, "r1", capabilities=c) for n, c in caps.items()]
    for key in ("alice", "bob", "carol"):
        p = pick(ring, DEP, key, cands, now=0.0, needs=needs)
        assert {t.name for t in p.targets} == eligible


_caps = st.none() | st.builds(ModelCapabilities, tool_calling=st.booleans(),
                              structured_outputs=st.booleans(), logprobs=st.booleans(),
                              max_top_logprobs=st.integers(0, 20), max_n=st.integers(1, 8))
_bodies = st.fixed_dictionaries({}, optional={
    "tools": st.just([{"type": "function", "function": {"name": "f"}}]),
    "response_format": st.just({"type": "json_object"}),
    "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20), "n": st.integers(1, 8)})


@settings(max_examples=150, deadline=None)
@given(caps=st.lists(_caps, min_size=1, max_size=6), body=_bodies, key=st.text(max_size=8))
def test_targets_are_exactly_the_macs_that_may_serve_the_request(caps, body: dict,
                                                                 key: str) -> None:
    """Every target may serve what the request needs (its capabilities satisfy it, or they
    are unknown); every such Mac is a target; none is only when the table's 400 applies."""
    names = MACS[:len(caps)]
    cands = [Candidate(n, "r1", capabilities=c) for n, c in zip(names, caps)]
    needs = required_capabilities(CHAT_PATH, body)
    p = pick(ring_of(frozenset(names)), DEP, key, cands, now=0.0, needs=needs)
    able = {c.name for c in cands if c.capabilities is None
            or satisfies(c.capabilities, needs) is None}
    assert {t.name for t in p.targets} == able
    assert (missing_everywhere(caps, needs) is None) == bool(able)


def test_a_canary_revision_without_the_capability_falls_back_to_stable() -> None:
    ring = ring_of(frozenset(MACS[:2]))
    cands = [Candidate("mac-0", "r1", capabilities=TOOLS),
             Candidate("mac-1", "r2", capabilities=PLAIN)]
    key = _key_on("candidate", 100)
    assert pick(ring, DEP, key, cands, _split(100), now=0.0).targets == (
        Target("mac-1", "", "r2"),)
    p = pick(ring, DEP, key, cands, _split(100), now=0.0, needs=NEEDS_TOOLS)
    assert p.role == "stable" and p.targets == (Target("mac-0", "", "r1"),)


def test_candidates_off_the_ring_are_an_error() -> None:
    with pytest.raises(ValueError, match="mac-9"):
        pick(ring_of(frozenset(MACS[:2])), DEP, "a", _cands("mac-0", "mac-9"), now=0.0)


# --- properties ------------------------------------------------------------------------------

names_st = st.sets(st.sampled_from(MACS), min_size=1, max_size=len(MACS))
keys_st = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=25, unique=True)


@st.composite
def fleets(draw) -> list[Candidate]:
    names = sorted(draw(names_st))
    return [Candidate(n, "r1", f"http://{n}", in_flight=draw(st.integers(0, 20)),
                      cordoned=draw(st.booleans()) and draw(st.booleans()))
            for n in names]


@settings(max_examples=60, deadline=None)
@given(fleet=fleets(), key=st.text(max_size=20), perm=st.randoms(use_true_random=False))
def test_deterministic_whatever_the_candidates_order(fleet: list[Candidate], key: str,
                                                     perm) -> None:
    ring = ring_of(frozenset(c.name for c in fleet))
    shuffled = list(fleet)
    perm.shuffle(shuffled)
    a = pick(ring, DEP, key, fleet, now=1.0)
    assert a == pick(ring, DEP, key, shuffled, now=1.0) == pick(ring, DEP, key, fleet, now=1.0)
    eligible = {c.name for c in fleet if not c.cordoned}
    assert sorted(t.name for t in a.targets) == sorted(eligible)


@settings(max_examples=80, deadline=None)
@given(fleet=fleets(), key=st.text(max_size=20),
       factor=st.sampled_from([1.0, 1.1, 1.25, 1.5, 2.0]))
def test_load_bound_respected_and_chwbl_order(fleet: list[Candidate], key: str,
                                              factor: float) -> None:
    ring = ring_of(frozenset(c.name for c in fleet))
    p = pick(ring, DEP, key, fleet, now=0.0, load_factor=factor)
    eligible = {c.name: c for c in fleet if not c.cordoned}
    assume(eligible)
    total = sum(c.in_flight for c in eligible.values())
    bound = math.ceil(Fraction(str(factor)) * (total + 1) / len(eligible))
    assert p.capacity == bound
    first = eligible[p.targets[0].name]
    assert first.in_flight + 1 <= bound
    # CHWBL: every Mac before the chosen one on the key's walk is over the bound
    walk = [n for n in ring.walk(key_point(DEP, key)) if n in eligible]
    assert walk[0] == p.owner
    for n in walk[:walk.index(first.name)]:
        assert eligible[n].in_flight + 1 > bound
    assert p.spilled == (first.name != walk[0])


@settings(max_examples=40, deadline=None)
@given(names=st.sets(st.sampled_from(MACS), min_size=2, max_size=len(MACS)), keys=keys_st,
       data=st.data())
def test_a_mac_leaving_moves_only_its_own_keys(names: set[str], keys: list[str], data) -> None:
    gone = data.draw(st.sampled_from(sorted(names)))
    before = _cands(*sorted(names))
    after = [c for c in before if c.name != gone]
    ring = ring_of(frozenset(names))
    smaller = ring_of(frozenset(names - {gone}))
    for key in keys:
        b = pick(ring, DEP, key, before, now=0.0).owner
        # the same ring with the Mac out of the candidates, or a ring rebuilt without it
        a1 = pick(ring, DEP, key, after, now=0.0).owner
        a2 = pick(smaller, DEP, key, after, now=0.0).owner
        assert a1 == a2
        assert a1 == b or b == gone


@settings(max_examples=40, deadline=None)
@given(names=st.sets(st.sampled_from(MACS), min_size=1, max_size=len(MACS) - 1), keys=keys_st,
       data=st.data())
def test_a_mac_joining_takes_keys_only_for_itself(names: set[str], keys: list[str],
                                                  data) -> None:
    new = data.draw(st.sampled_from(sorted(set(MACS) - names)))
    before = _cands(*sorted(names))
    after = _cands(*sorted(names | {new}))
    for key in keys:
        b = pick(ring_of(frozenset(names)), DEP, key, before, now=0.0).owner
        a = pick(ring_of(frozenset(names | {new})), DEP, key, after, now=0.0).owner
        assert a in (b, new)


@settings(max_examples=40, deadline=None)
@given(names=st.sets(st.sampled_from(MACS), min_size=2, max_size=len(MACS)), keys=keys_st,
       loads=st.lists(st.integers(0, 6), min_size=len(MACS), max_size=len(MACS)),
       data=st.data())
def test_with_load_only_spilled_keys_move_beyond_the_changed_mac(
        names: set[str], keys: list[str], loads: list[int], data) -> None:
    """Under load, a key whose first Mac changes when one Mac leaves was on that Mac, or the
    bound spilled it before or after (the bound's spill is the only other movement)."""
    gone = data.draw(st.sampled_from(sorted(names)))
    load = dict(zip(MACS, loads))
    before = [Candidate(n, "r1", in_flight=load[n]) for n in sorted(names)]
    after = [c for c in before if c.name != gone]
    ring = ring_of(frozenset(names))
    for key in keys:
        b = pick(ring, DEP, key, before, now=0.0)
        a = pick(ring, DEP, key, after, now=0.0)
        if a.targets[0].name != b.targets[0].name:
            assert b.targets[0].name == gone or b.spilled or a.spilled


@settings(max_examples=60, deadline=None)
@given(keys=keys_st, w=st.integers(0, 99), data=st.data())
def test_a_sessions_revision_is_sticky_through_a_weight_step(keys: list[str], w: int,
                                                             data) -> None:
    w2 = data.draw(st.integers(w + 1, 100))
    ring = ring_of(frozenset(MACS[:4]))
    cands = _cands("mac-0", "mac-1", revision="r1") + _cands("mac-2", "mac-3", revision="r2")
    for key in keys:
        p1 = pick(ring, DEP, key, cands, _split(w), now=0.0)
        p2 = pick(ring, DEP, key, cands, _split(w2), now=0.0)
        if p1.role == "candidate":
            assert p2.role == "candidate"
            # and the same Mac: the candidate Macs' ring and loads did not change
            assert p2.targets[0] == p1.targets[0]
        assert p1.bucket == p2.bucket == bucket(DEP, key)


@settings(max_examples=150, deadline=None)
@given(caps=st.lists(_caps, min_size=1, max_size=6), body=_bodies, key=st.text(max_size=8),
       loads=st.lists(st.integers(0, 4), min_size=6, max_size=6))
def test_known_capable_macs_come_before_unknown_ones(caps, body: dict, key: str,
                                                     loads: list[int]) -> None:
    """Mixed fleets (a rolling upgrade, a standby never loaded): a request that needs more
    than its endpoint's task tries every Mac known to serve it before any whose capabilities
    are unknown (an unknown one may only answer 400, which is not retried), whatever the
    loads; a plain request keeps the CHWBL order over all of them."""
    names = MACS[:len(caps)]
    cands = [Candidate(n, "r1", capabilities=c, in_flight=load)
             for n, c, load in zip(names, caps, loads)]
    needs = required_capabilities(CHAT_PATH, body)
    p = pick(ring_of(frozenset(names)), DEP, key, cands, now=0.0, needs=needs)
    unknown = [c.name for c in cands if c.capabilities is None]
    flags = [t.name in unknown for t in p.targets]
    if beyond_task(needs):
        assert flags == sorted(flags)            # every known Mac before every unknown one
    plain = pick(ring_of(frozenset(names)), DEP, key, cands, now=0.0,
                 needs=required_capabilities(CHAT_PATH, {}))
    assert {t.name for t in plain.targets} == set(names)


def test_an_unknown_mac_is_tried_last_for_tools_but_in_ring_order_for_plain_chat() -> None:
    ring = ring_of(frozenset(MACS[:2]))
    for key in ("alice", "bob", "carol", "dave"):
        ringed = pick(ring, DEP, key, [Candidate("mac-0", "r1"), Candidate("mac-1", "r1")],
                      now=0.0).targets
        unknown = ringed[0].name          # make the ring owner the unknown one
        known = ringed[1].name
        cands = [Candidate(unknown, "r1"), Candidate(known, "r1", capabilities=TOOLS)]
        assert [t.name for t in pick(ring, DEP, key, cands, now=0.0,
                                     needs=NEEDS_TOOLS).targets] == [known, unknown]
        assert [t.name for t in pick(ring, DEP, key, cands, now=0.0,
                                     needs=required_capabilities(CHAT_PATH, {})).targets] == [
            unknown, known]


@pytest.mark.parametrize(("task", "path", "eligible"), [
    ("TextGeneration", CHAT_PATH, True),
    ("TextEmbedding", CHAT_PATH, False),      # an unknown embedding replica takes no chat
    ("TextEmbedding", EMBEDDINGS_PATH, True),
    ("TextGeneration", EMBEDDINGS_PATH, False),
])
def test_an_unknown_mac_is_still_checked_for_its_task(task: str, path: str,
                                                      eligible: bool) -> None:
    ring = ring_of(frozenset(MACS[:1]))
    cands = [Candidate("mac-0", "r1", task=task)]  # type: ignore[arg-type]
    p = pick(ring, DEP, "k", cands, now=0.0, needs=required_capabilities(path, {"input": "x"}))
    assert bool(p.targets) == eligible
