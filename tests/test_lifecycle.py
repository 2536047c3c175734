"""Idle-unload, LRU eviction, predictive prefetch and the convergence plan, table-driven over an
injected clock."""

from __future__ import annotations

import pytest

from mlx_fleet.contract import LifecyclePolicy
from node_agent import lifecycle
from node_agent.lifecycle import (
    ConvergePlan, KeyState, ModelUse, UsageHistory, evictions, expected_arrival, idle_unloads,
    plan_convergence, predict_prefetch)

GB = 10**9


def use(key: str, last_used: float, **kw) -> ModelUse:
    return ModelUse(key=key, last_used=last_used, **kw)


def test_defaults_follow_the_contract_and_seed_001() -> None:
    assert lifecycle.DEFAULT_IDLE_UNLOAD_SECONDS == 300
    assert LifecyclePolicy().idle_unload_seconds == lifecycle.DEFAULT_IDLE_UNLOAD_SECONDS
    assert use("a", 0).idle_unload_seconds == 300
    assert lifecycle.DEFAULT_PREFETCH_WINDOW_SECONDS == 30
    assert lifecycle.DEFAULT_MAX_PREFETCHES == 2


# ---------------------------------------------------------------------------------------------
# idle_unloads
# ---------------------------------------------------------------------------------------------

IDLE_CASES = [
    # (name, models, now, expected)
    ("idle exactly the timeout", [use("a", 100, idle_unload_seconds=300)], 400, ["a"]),
    ("idle longer", [use("a", 100, idle_unload_seconds=300)], 10_000, ["a"]),
    ("just under the timeout", [use("a", 100, idle_unload_seconds=300)], 399.999, []),
    ("a request in flight", [use("a", 0, idle_unload_seconds=60, in_flight=1)], 10_000, []),
    ("pinned", [use("a", 0, idle_unload_seconds=60, pinned=True)], 10_000, []),
    ("0 = never", [use("a", 0, idle_unload_seconds=0)], 10**9, []),
    ("not loaded", [use("a", 0, idle_unload_seconds=60, loaded=False)], 10_000, []),
    ("used after now (clock skew)", [use("a", 500, idle_unload_seconds=60)], 400, []),
    ("fractional timeout", [use("a", 10, idle_unload_seconds=0.5)], 10.5, ["a"]),
    ("least recently used first, ties by key", [
        use("c", 50, idle_unload_seconds=10), use("b", 20, idle_unload_seconds=10),
        use("a", 50, idle_unload_seconds=10), use("d", 95, idle_unload_seconds=10)],
     100, ["b", "a", "c"]),
    ("each model its own timeout", [
        use("short", 0, idle_unload_seconds=60), use("long", 0, idle_unload_seconds=600),
        use("never", 0, idle_unload_seconds=0)], 300, ["short"]),
    ("mixed", [
        use("busy", 0, idle_unload_seconds=1, in_flight=3),
        use("hot", 0, idle_unload_seconds=1, pinned=True),
        use("gone", 0, idle_unload_seconds=1, loaded=False),
        use("idle", 0, idle_unload_seconds=1),
        use("fresh", 99.5, idle_unload_seconds=1)], 100, ["idle"]),
    ("no models", [], 100, []),
]


@pytest.mark.parametrize("models, now, expected", [c[1:] for c in IDLE_CASES],
                         ids=[c[0] for c in IDLE_CASES])
def test_idle_unloads(models: list[ModelUse], now: float, expected: list[str]) -> None:
    assert idle_unloads(models, now) == expected


def test_idle_unloads_over_a_moving_clock() -> None:
    """One model's request history on an injected clock: unloaded exactly when idle for
    idle_unload_seconds after its last request, never while a request is in flight."""
    clock = 1000.0
    m = use("m", clock, idle_unload_seconds=300)
    for step, (advance, expected) in enumerate([(299, []), (1, ["m"]), (50, ["m"])]):
        clock += advance
        assert idle_unloads([m], clock) == expected, step
    m = use("m", clock, idle_unload_seconds=300, in_flight=1)  # a new request arrives
    clock += 10_000
    assert idle_unloads([m], clock) == []
    m = use("m", clock, idle_unload_seconds=300)  # it ends: the idle time counts from here
    assert idle_unloads([m], clock + 299) == []
    assert idle_unloads([m], clock + 300) == ["m"]


def test_duplicate_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        idle_unloads([use("a", 0), use("a", 1)], 10)
    with pytest.raises(ValueError, match="listed twice"):
        evictions([use("a", 0), use("a", 1)], 1, 0, 10)


@pytest.mark.parametrize("kw", [{"in_flight": -1}, {"idle_unload_seconds": -1},
                                {"resident_bytes": -1}])
def test_model_use_refuses_negative_values(kw: dict) -> None:
    with pytest.raises(ValueError):
        use("a", 0, **kw)


def test_tuple_keys_work() -> None:
    models = [ModelUse(("ns", "m", "r2"), 5, idle_unload_seconds=1),
              ModelUse(("ns", "m", "r1"), 5, idle_unload_seconds=1)]
    assert idle_unloads(models, 10) == [("ns", "m", "r1"), ("ns", "m", "r2")]


# ---------------------------------------------------------------------------------------------
# evictions
# ---------------------------------------------------------------------------------------------

A = use("a", 10, resident_bytes=4 * GB)
B = use("b", 5, resident_bytes=2 * GB)
C = use("c", 20, resident_bytes=8 * GB)

EVICTION_CASES = [
    # (name, models, need, free, now, expected)
    ("already fits", [A, B, C], 4 * GB, 4 * GB, 100, []),
    ("nothing needed", [A, B, C], 0, 0, 100, []),
    ("least recently used first, stops when it fits", [A, B, C], 6 * GB, 1 * GB, 100,
     ["b", "a"]),
    ("exact fit stops", [A, B, C], 7 * GB, 1 * GB, 100, ["b", "a"]),
    ("one byte more takes the next", [A, B, C], 7 * GB + 1, 1 * GB, 100, ["b", "a", "c"]),
    ("all of them", [A, B, C], 15 * GB, 1 * GB, 100, ["b", "a", "c"]),
    ("insufficient even after evicting all", [A, B, C], 15 * GB + 1, 1 * GB, 100, None),
    ("pinned is never evicted", [A, use("b", 5, resident_bytes=2 * GB, pinned=True), C],
     6 * GB, 1 * GB, 100, ["a", "c"]),
    ("pinned makes it insufficient", [use("a", 1, resident_bytes=9 * GB, pinned=True)],
     2 * GB, 1 * GB, 100, None),
    ("in flight is never evicted", [A, use("b", 5, resident_bytes=2 * GB, in_flight=2), C],
     4 * GB, 1 * GB, 100, ["a"]),
    ("not loaded frees nothing", [use("b", 5, resident_bytes=2 * GB, loaded=False), A],
     4 * GB, 1 * GB, 100, ["a"]),
    ("0 = never does not protect against pressure",
     [use("a", 10, resident_bytes=4 * GB, idle_unload_seconds=0)], 4 * GB, 1 * GB, 100, ["a"]),
    ("ties on last use are broken by key", [
        use("y", 7, resident_bytes=GB), use("x", 7, resident_bytes=GB),
        use("z", 7, resident_bytes=GB)], 2 * GB, 0, 100, ["x", "y"]),
    ("zero-byte models do not help", [use("a", 1), use("b", 2)], 1, 0, 100, None),
    ("negative free (over budget) needs more", [A, B, C], 0, -3 * GB, 100, ["b", "a"]),
]


@pytest.mark.parametrize("models, need, free, now, expected", [c[1:] for c in EVICTION_CASES],
                         ids=[c[0] for c in EVICTION_CASES])
def test_evictions(models: list[ModelUse], need: int, free: int, now: float,
                   expected: list[str] | None) -> None:
    assert evictions(models, need, free, now) == expected


def test_evictions_min_idle_keeps_just_used_models() -> None:
    models = [use("old", 10, resident_bytes=GB), use("recent", 95, resident_bytes=GB)]
    assert evictions(models, 2 * GB, 0, 100) == ["old", "recent"]
    assert evictions(models, 1 * GB, 0, 100, min_idle_seconds=10) == ["old"]
    assert evictions(models, 2 * GB, 0, 100, min_idle_seconds=10) is None
    assert evictions(models, 2 * GB, 0, 105, min_idle_seconds=10) == ["old", "recent"]


def test_evictions_refuse_negative_need() -> None:
    with pytest.raises(ValueError):
        evictions([A], -1, 0, 100)


# The count constraint (seed 004: "Per-worker max loaded models: 2"): the load must leave at
# most max_loaded_models resident, itself included. Memory is plentiful in these rows unless
# the row says otherwise (need 0, free 0).
LIMIT_CASES = [
    # (name, models, need, free, limit, resident, expected)
    ("no limit: nothing to evict", [A, B, C], 0, 0, 0, None, []),
    ("below the limit: nothing to evict", [A, B], 0, 0, 3, None, []),
    ("at the limit: the least recently used goes", [A, B], 0, 0, 2, None, ["b"]),
    ("limit 1 with one resident evicts it", [A], 0, 0, 1, None, ["a"]),
    ("over the limit (an older, larger limit): as many as needed, LRU first", [A, B, C],
     0, 0, 1, None, ["b", "a", "c"]),
    ("residents not listed (draining, loading) count", [A, B, C], 0, 0, 3, 4, ["b", "a"]),
    ("not-listed residents can make it impossible", [A], 0, 0, 2, 3, None),
    ("pinned is never evicted: the next one goes",
     [A, use("b", 5, resident_bytes=2 * GB, pinned=True)], 0, 0, 2, None, ["a"]),
    ("pinned only: refused", [use("a", 1, pinned=True)], 0, 0, 1, None, None),
    ("in flight only: refused", [use("a", 1, in_flight=1)], 0, 0, 1, None, None),
    ("not loaded does not count", [use("b", 5, loaded=False), A], 0, 0, 2, None, []),
    ("memory needs more than the count", [A, B, C], 5 * GB, 0, 3, None, ["b", "a"]),
    ("the count needs more than memory", [A, B, C], 1 * GB, 0, 2, None, ["b", "a"]),
    ("the count holds but memory does not", [A, B], 7 * GB, 0, 3, None, None),
    ("memory holds but the count does not",
     [A, use("b", 5, resident_bytes=2 * GB, in_flight=1)], 1 * GB, 0, 1, None, None),
]


@pytest.mark.parametrize("models, need, free, limit, resident, expected",
                         [c[1:] for c in LIMIT_CASES], ids=[c[0] for c in LIMIT_CASES])
def test_evictions_with_a_model_limit(models: list[ModelUse], need: int, free: int, limit: int,
                                      resident: int | None,
                                      expected: list[str] | None) -> None:
    assert evictions(models, need, free, 100, max_loaded_models=limit,
                     resident=resident) == expected


def test_evictions_tell_which_constraint_failed() -> None:
    busy = [A, use("b", 5, resident_bytes=2 * GB, in_flight=1)]
    # refused with the limit, fine without it: the count is what failed
    assert evictions(busy, 1 * GB, 0, 100, max_loaded_models=1) is None
    assert evictions(busy, 1 * GB, 0, 100) == ["a"]


@pytest.mark.parametrize("kw", [{"max_loaded_models": -1}, {"resident": -1}])
def test_evictions_refuse_a_negative_limit_or_count(kw: dict) -> None:
    with pytest.raises(ValueError):
        evictions([A], 0, 0, 100, **kw)


# ---------------------------------------------------------------------------------------------
# UsageHistory
# ---------------------------------------------------------------------------------------------


def test_history_is_bounded_ordered_and_per_model() -> None:
    h = UsageHistory(max_events=4)
    for t in range(10):
        h.record("a", float(t))
    h.record("b", 3.0)
    assert h.times("a") == (6.0, 7.0, 8.0, 9.0)
    assert h.times("b") == (3.0,)
    assert h.times("unknown") == ()
    h.record("a", 7.5)  # recorded late by a concurrent handler: kept in order
    assert h.times("a") == (7.0, 7.5, 8.0, 9.0)
    h.record("a", 1.0)  # older than everything kept: it is the one dropped
    assert h.times("a") == (7.0, 7.5, 8.0, 9.0)
    assert sorted(h) == ["a", "b"] and len(h) == 2
    h.forget("b")
    h.forget("never-seen")
    assert list(h) == ["a"]


def test_history_refuses_a_tiny_bound() -> None:
    with pytest.raises(ValueError):
        UsageHistory(max_events=1)


# ---------------------------------------------------------------------------------------------
# Prediction
# ---------------------------------------------------------------------------------------------


def history_of(**series: list[float]) -> UsageHistory:
    h = UsageHistory()
    for key, times in series.items():
        for t in times:
            h.record(key, t)
    return h


EVERY_60 = [0.0, 60.0, 120.0, 180.0]  # next expected at 240


@pytest.mark.parametrize("times, expected", [
    (EVERY_60, (240.0, 60.0)),
    ([0, 60, 120], None),                                   # too few arrivals
    ([0, 10, 70, 80], None),                                # irregular
    ([0, 55, 120, 178], (178 + 178 / 3, 178 / 3)),          # jitter within ±20 %
    ([0, 45, 120, 180], None),                              # a gap 25 % off the mean
    ([0, 0.2, 0.5, 60, 60.3, 120, 120.9, 180], (240.0, 60.0)),  # bursts are one arrival each
    ([5, 6, 500, 560, 620, 680], (740.0, 60.0)),            # only the latest arrivals count
    ([100, 100, 100, 100], None),                           # one burst: no period
    ([0, 0.4, 0.8, 1.2, 1.6, 2.0, 2.4], None),              # a chain of quick requests
])
def test_expected_arrival(times: list[float], expected: tuple[float, float] | None) -> None:
    got = expected_arrival(times)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)


def test_expected_arrival_refuses_bad_parameters() -> None:
    with pytest.raises(ValueError):
        expected_arrival(EVERY_60, min_arrivals=2)
    with pytest.raises(ValueError):
        expected_arrival(EVERY_60, tolerance=-0.1)


PREDICT_CASES = [
    # (name, now, expected) for a model called every 60 s, last at 180 (next at 240),
    # window 30 s, tolerance 20 % (12 s late at most)
    ("too early: outside the window", 209.0, []),
    ("window reached", 210.0, ["m"]),
    ("due now", 240.0, ["m"]),
    ("a little late", 252.0, ["m"]),
    ("too late: the pattern is broken", 252.5, []),
]


@pytest.mark.parametrize("now, expected", [c[1:] for c in PREDICT_CASES],
                         ids=[c[0] for c in PREDICT_CASES])
def test_prediction_within_and_outside_the_window(now: float, expected: list[str]) -> None:
    assert predict_prefetch(history_of(m=EVERY_60), now, unloaded={"m"}) == expected


def test_prediction_over_a_moving_clock() -> None:
    """A job every 60 s: after each arrival the model is unloaded; the rule prefetches it 30 s
    ahead of each next arrival once four arrivals have shown the period."""
    h = UsageHistory()
    predicted_at: list[float] = []
    for arrival in range(8):
        t0 = arrival * 60.0
        h.record("job", t0)
        for now in range(int(t0) + 1, int(t0) + 60):
            if predict_prefetch(h, float(now), unloaded={"job"}):
                predicted_at.append(float(now))
                break
    assert predicted_at == [t * 60.0 + 30.0 for t in range(3, 8)]


def test_only_unloaded_models_are_prefetched() -> None:
    h = history_of(a=EVERY_60, b=EVERY_60)
    assert predict_prefetch(h, 230.0, unloaded={"b", "not-in-history"}) == ["b"]
    assert predict_prefetch(h, 230.0, unloaded=set()) == []


def test_irregular_usage_is_not_predicted() -> None:
    h = history_of(irregular=[0, 7, 90, 100, 200], regular=EVERY_60)
    assert predict_prefetch(h, 230.0, unloaded={"irregular", "regular"}) == ["regular"]


def test_max_prefetches_caps_and_orders_by_expected_arrival() -> None:
    h = history_of(
        late=[0, 60, 120, 180],         # expected 240
        soon=[5, 60 + 5, 120 + 5, 175],  # period 56.67: expected 231.67
        tie_b=[10, 70, 130, 190],       # expected 250
        tie_a=[10, 70, 130, 190],       # expected 250, same as tie_b: key order
    )
    everything = {"late", "soon", "tie_a", "tie_b"}
    assert predict_prefetch(h, 225.0, unloaded=everything, max_prefetches=10) == [
        "soon", "late", "tie_a", "tie_b"]
    assert predict_prefetch(h, 225.0, unloaded=everything) == ["soon", "late"]  # default 2
    assert predict_prefetch(h, 225.0, unloaded=everything, max_prefetches=1) == ["soon"]
    assert predict_prefetch(h, 225.0, unloaded=everything, max_prefetches=0) == []
    # deterministic whatever the order of the unloaded set
    assert predict_prefetch(h, 225.0, unloaded=["tie_b", "tie_a", "late", "soon"],
                            max_prefetches=4) == ["soon", "late", "tie_a", "tie_b"]


def test_window_parameter() -> None:
    h = history_of(m=EVERY_60)
    assert predict_prefetch(h, 200.0, unloaded={"m"}) == []
    assert predict_prefetch(h, 200.0, unloaded={"m"}, window_s=40) == ["m"]


def test_predict_refuses_bad_parameters() -> None:
    with pytest.raises(ValueError):
        predict_prefetch(UsageHistory(), 0, unloaded=set(), window_s=-1)
    with pytest.raises(ValueError):
        predict_prefetch(UsageHistory(), 0, unloaded=set(), max_prefetches=-1)


# ---------------------------------------------------------------------------------------------
# plan_convergence: one task per assignment key
# ---------------------------------------------------------------------------------------------

# desired values are (spec, generation); the target is the spec
def key(spec: str | None, generation: int = 1, **kw) -> KeyState:
    desired = (spec, generation) if spec is not None else None
    return KeyState(desired=desired, target=spec, **kw)


PLAN_CASES = [
    # (name, keys, now, expected cancel, expected start, expected wake_at)
    ("new assignment: start", {"a": key("A")}, 0, [], ["a"], None),
    ("converged: nothing", {"a": key("A", done=("A", 1))}, 0, [], [], None),
    ("new generation, same spec: start (re-report)", {"a": key("A", 2, done=("A", 1))}, 0,
     [], ["a"], None),
    ("unassigned after converging: start (retire)", {"a": key(None, done=("A", 1))}, 0,
     [], ["a"], None),
    ("unassigned, nothing left: nothing", {"a": key(None)}, 0, [], [], None),
    ("loading the current spec: leave it", {"a": key("A", busy=True, running="A")}, 0,
     [], [], None),
    ("loading, generation moved on: leave it (picked up after)",
     {"a": key("A", 3, busy=True, running="A", done=("A", 1))}, 0, [], [], None),
    ("loading a spec that changed: cancel and restart",
     {"a": key("B", busy=True, running="A")}, 0, ["a"], ["a"], None),
    ("loading, then unassigned: cancel and retire",
     {"a": key(None, busy=True, running="A")}, 0, ["a"], ["a"], None),
    ("retiring, assigned again: leave it (loads after)",
     {"a": key("A", busy=True, running=None)}, 0, [], [], None),
    ("retry due", {"a": key("A", done=("A", 1), retry_at=10)}, 10, [], ["a"], None),
    ("retry to come: wake then", {"a": key("A", done=("A", 1), retry_at=10)}, 9.5, [], [], 10),
    ("retry of a task that runs: not started twice",
     {"a": key("A", busy=True, running="A", retry_at=1)}, 10, [], [], None),
    ("one slow key never holds up the others", {
        "slow": key("S", busy=True, running="S"),           # downloading
        "new": key("N"),                                    # assigned meanwhile
        "gone": key(None, done=("G", 1)),                   # unassigned meanwhile
        "wait": key("W", done=("W", 1), retry_at=30),       # failed, retry to come
        "soon": key("X", done=("X", 1), retry_at=20)},
     5, [], ["gone", "new"], 20),
]


@pytest.mark.parametrize("keys, now, cancel, start, wake_at", [c[1:] for c in PLAN_CASES],
                         ids=[c[0] for c in PLAN_CASES])
def test_plan_convergence(keys: dict[str, KeyState], now: float, cancel: list[str],
                          start: list[str], wake_at: float | None) -> None:
    assert plan_convergence(keys, now) == ConvergePlan(tuple(cancel), tuple(start), wake_at)


def test_plan_convergence_over_a_key_s_life() -> None:
    """A key downloading A is changed to B (cancel + start), B fails (retry later), is retried
    when due, then unassigned while retrying (cancel + retire)."""
    k = key("A", busy=True, running="A")
    assert plan_convergence({"k": k}, 0).start == ()
    k = key("B", busy=True, running="A")
    assert plan_convergence({"k": k}, 1) == ConvergePlan(("k",), ("k",))
    k = key("B", done=("B", 1), retry_at=3)  # B's task ended Failed: retry in 2 s
    assert plan_convergence({"k": k}, 2) == ConvergePlan(wake_at=3)
    assert plan_convergence({"k": k}, 3) == ConvergePlan(start=("k",))
    k = key(None, busy=True, running="B", done=("B", 1))
    assert plan_convergence({"k": k}, 4) == ConvergePlan(("k",), ("k",))
    assert plan_convergence({"k": key(None)}, 5) == ConvergePlan()


def test_plan_convergence_refuses_a_non_finite_retry() -> None:
    with pytest.raises(ValueError, match="retry_at"):
        plan_convergence({"a": key("A", retry_at=float("nan"))}, 0)
