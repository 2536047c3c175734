"""The Canary step machine, tick-stepped with an injected clock (like Flagger's scheduler tests)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_fleet_operator.analysis import AnalysisResult, CheckResult, Verdict
from mlx_fleet_operator.canary import (CanaryState, Decision, Observation, Phase, step)
from mlx_fleet_operator.canary_spec import CanarySpec, parse_canary_spec

T0 = 1_700_000_000.0
FAIL_MSG = "errorRate: candidate 5% vs stable 0.5%, fails above 2% (2 × max(stable, floor 1%))"
PASS = AnalysisResult(Verdict.PASS, (), 100, 100, "all 6 checks passed")
FAIL = AnalysisResult(Verdict.FAIL, (CheckResult("errorRate", Verdict.FAIL, 0.005, 0.05, 0.02,
                                                 FAIL_MSG),), 100, 100, FAIL_MSG)
INCONCLUSIVE = AnalysisResult(Verdict.INCONCLUSIVE, (), 3, 1, "inconclusive: too few requests")


def canary_spec(**spec: Any) -> CanarySpec:
    return parse_canary_spec({"targetRef": {"name": "llm"}, "candidate": {"revision": "v2"},
                              **spec})


class Sim:
    """Ticks the machine: each :meth:`tick` advances the clock by ``dt`` and steps with an
    observation (defaults: target at v1, candidate and stable Ready, nothing else)."""

    def __init__(self, spec: CanarySpec | None = None, *, through_status: bool = False,
                 **defaults: Any) -> None:
        self.spec = spec or canary_spec()
        self.state = CanaryState()
        self.now = T0
        self.through_status = through_status
        self.defaults = {"target_revision": "v1", "candidate_ready": True, **defaults}

    def tick(self, dt: float = 0.0, **obs: Any) -> Decision:
        self.now += dt
        state = (CanaryState.from_status(self.state.to_status()) if self.through_status
                 else self.state)
        d = step(self.spec, state, Observation(**{**self.defaults, **obs}), self.now)
        self.state = d.state
        return d

    def to_first_step(self) -> Decision:
        d = self.tick()
        assert (d.state.phase, d.weight) == (Phase.PROGRESSING, self.spec.steps[0].set_weight)
        return d


def reasons(d: Decision) -> list[str]:
    return [r for _, r, _ in d.events]


# --- the happy path -----------------------------------------------------------------------------

def test_default_steps_walk_to_success():
    sim = Sim()
    d = sim.tick()
    assert reasons(d) == ["Started", "StepStarted"]
    assert (d.weight, d.state.stable_revision, d.state.candidate_revision) == (1, "v1", "v2")
    assert (d.state.started, d.requeue_after, d.keep_candidate) == (T0, 10.0, True)
    weights = [sim.tick(10, analysis=PASS).weight for _ in range(3)]
    assert weights == [10, 50, 100]
    d = sim.tick(10, analysis=PASS)
    assert (d.state.phase, d.weight, d.promote_revision, reasons(d)) == (
        Phase.PROMOTING, 100, "v2", ["Promoting"])
    # the operator patched the target; its rollout is under way
    d = sim.tick(5, target_revision="v2")
    assert (d.state.phase, d.weight, d.promote_revision, d.events) == (
        Phase.PROMOTING, 100, None, [])
    assert d.requeue_after == 5.0
    d = sim.tick(5, target_revision="v2", rollout_complete=True)
    assert (d.state.phase, reasons(d), d.keep_candidate, d.requeue_after) == (
        Phase.SUCCEEDED, ["Succeeded"], False, None)


def test_pending_until_the_candidate_is_ready():
    sim = Sim(candidate_ready=False)
    for _ in range(5):
        d = sim.tick(5, analysis=PASS, promote_token=f"p{_}")  # a plain promote can't skip it
        assert (d.state.phase, d.weight, d.keep_candidate, d.requeue_after) == (
            Phase.PENDING, 0, True, 5.0)
    d = sim.tick(5, candidate_ready=True)
    assert (d.state.phase, d.weight, reasons(d), d.state.started) == (
        Phase.PROGRESSING, 1, ["StepStarted"], sim.now)


def test_a_pass_needs_one_full_interval_at_the_step():
    sim = Sim()
    sim.to_first_step()
    assert sim.tick(9.9, analysis=PASS).weight == 1  # too early: the window saw the old weight
    assert sim.tick(0.1, analysis=PASS).weight == 10


def test_inconclusive_windows_never_promote():
    sim = Sim()
    sim.to_first_step()
    for _ in range(200):
        d = sim.tick(10, analysis=INCONCLUSIVE)
        assert (d.state.phase, d.weight, d.events, d.promote_revision) == (
            Phase.PROGRESSING, 1, [], None)
    assert d.state.last_analysis == INCONCLUSIVE.to_dict()
    assert sim.tick(10).weight == 1  # nor does the absence of a window


def test_memory_baseline_is_the_first_candidate_memory_seen_while_progressing():
    sim = Sim(candidate_ready=False)
    assert sim.tick(candidate_memory_bytes=5).state.memory_baseline_bytes == 0  # Pending
    assert sim.tick(candidate_ready=True).state.memory_baseline_bytes == 0      # unknown yet
    assert sim.tick(10, candidate_ready=True,
                    candidate_memory_bytes=7).state.memory_baseline_bytes == 7
    assert sim.tick(10, candidate_ready=True,
                    candidate_memory_bytes=9).state.memory_baseline_bytes == 7


# --- failures -----------------------------------------------------------------------------------

def test_a_failed_window_rolls_back_naming_the_check_and_both_values():
    sim = Sim()
    sim.to_first_step()
    sim.tick(10, analysis=PASS)
    d = sim.tick(3, analysis=FAIL)  # failures count at once, no interval needed
    assert (d.state.phase, d.weight, d.keep_candidate, d.requeue_after) == (
        Phase.ROLLED_BACK, 0, False, None)
    assert reasons(d) == ["AnalysisFailed", "RolledBack"]
    assert [t for t, _, _ in d.events] == ["Warning", "Warning"]
    assert "errorRate: candidate 5% vs stable 0.5%" in d.state.message
    assert d.state.message.startswith("rolled back to v1: 1 failed analysis window(s)")


def test_failure_limit_counts_failed_windows_in_a_row():
    sim = Sim(canary_spec(analysis={"failureLimit": 3}))
    sim.to_first_step()
    for verdict, failed, phase in [(FAIL, 1, Phase.PROGRESSING), (FAIL, 2, Phase.PROGRESSING),
                                   (INCONCLUSIVE, 2, Phase.PROGRESSING),
                                   (PASS, 0, Phase.PROGRESSING),  # resets, and advances
                                   (FAIL, 1, Phase.PROGRESSING), (FAIL, 2, Phase.PROGRESSING),
                                   (FAIL, 3, Phase.ROLLED_BACK)]:
        d = sim.tick(10, analysis=verdict)
        assert (d.state.failed_windows, d.state.phase) == (failed, phase)
    assert d.weight == 0


def test_never_rolls_back_onto_an_unhealthy_stable():
    sim = Sim()
    sim.to_first_step()
    sim.tick(10, analysis=PASS)
    d = sim.tick(10, analysis=FAIL, stable_ready=False)
    assert (d.state.phase, d.state.reason, d.weight, d.keep_candidate) == (
        Phase.PAUSED, "StableUnhealthy", 10, True)
    assert reasons(d) == ["AnalysisFailed", "StableUnhealthy"]
    assert "not rolling back onto unhealthy stable v1" in d.state.message
    for _ in range(5):  # held, reported once; windows meanwhile neither advance nor count
        d = sim.tick(10, analysis=PASS, stable_ready=False)
        assert (d.state.phase, d.weight, d.events) == (Phase.PAUSED, 10, [])
    assert d.state.last_analysis == FAIL.to_dict()
    d = sim.tick(10, stable_ready=True)
    assert (d.state.phase, d.weight, reasons(d)) == (Phase.ROLLED_BACK, 0, ["RolledBack"])
    assert FAIL_MSG in d.state.message


def test_the_local_guard_rolls_back_at_once():
    sim = Sim(canary_spec(analysis={"failureLimit": 5}))
    sim.to_first_step()
    d = sim.tick(1, guard_tripped="4 of 6 requests failed in 5s")
    assert (d.state.phase, d.weight, reasons(d)) == (Phase.ROLLED_BACK, 0, ["RolledBack"])
    assert "local guard tripped: 4 of 6 requests failed in 5s" in d.state.message


def test_a_tripped_guard_with_an_unhealthy_stable_holds_until_it_clears():
    sim = Sim()
    sim.to_first_step()
    d = sim.tick(1, guard_tripped="boom", stable_ready=False)
    assert (d.state.phase, d.state.reason, d.weight) == (Phase.PAUSED, "StableUnhealthy", 1)
    d = sim.tick(10, stable_ready=False)  # the guard cleared: nothing to roll back any more
    assert (d.state.phase, reasons(d), d.weight) == (Phase.PROGRESSING, ["Resumed"], 1)
    assert sim.tick(10, analysis=PASS).weight == 10


def test_a_failed_candidate_fails_the_canary():
    sim = Sim()
    sim.to_first_step()
    d = sim.tick(1, candidate_failed="LoadFailed: out of memory", stable_ready=False)
    assert (d.state.phase, d.weight, reasons(d), d.keep_candidate) == (
        Phase.FAILED, 0, ["CandidateFailed"], False)
    assert "LoadFailed: out of memory" in d.state.message


def test_a_missing_target_fails_the_canary():
    d = Sim().tick(target_exists=False, target_revision="")
    assert (d.state.phase, d.weight, d.keep_candidate) == (Phase.FAILED, 0, False)
    assert reasons(d) == ["Started", "TargetNotFound"]
    assert d.state.message == "target ModelDeployment llm not found"


# --- pauses and tokens --------------------------------------------------------------------------

PAUSES = canary_spec(steps=[{"setWeight": 20}, {"pause": {"duration": "1m"}}, {"setWeight": 50},
                            {"pause": {}}, {"setWeight": 100}])


def test_a_timed_pause_advances_after_its_duration():
    sim = Sim(PAUSES)
    sim.to_first_step()
    d = sim.tick(10, analysis=PASS)
    assert (d.state.phase, d.weight, reasons(d), d.requeue_after) == (
        Phase.PAUSED, 20, ["Paused"], 10.0)
    d = sim.tick(55, analysis=PASS)
    assert (d.state.phase, d.requeue_after) == (Phase.PAUSED, 5.0)
    d = sim.tick(5)
    assert (d.state.phase, d.weight, reasons(d)) == (
        Phase.PROGRESSING, 50, ["Resumed", "StepStarted"])


def test_a_pause_without_duration_waits_for_a_promote():
    sim = Sim(PAUSES)
    sim.to_first_step()
    sim.tick(10, analysis=PASS)
    sim.tick(60)
    d = sim.tick(10, analysis=PASS)
    assert (d.state.phase, d.state.step_index, d.weight) == (Phase.PAUSED, 3, 50)
    for _ in range(100):
        d = sim.tick(3600, analysis=PASS)
        assert (d.state.phase, d.events) == (Phase.PAUSED, [])
    d = sim.tick(1, promote_token="go")
    assert (d.state.phase, d.weight, reasons(d)) == (
        Phase.PROGRESSING, 100, ["Resumed", "StepStarted"])
    assert sim.tick(1, promote_token="go").weight == 100  # the same token again: nothing
    assert sim.tick(10, promote_token="go", analysis=PASS).state.phase is Phase.PROMOTING


def test_a_failed_window_during_a_pause_still_rolls_back():
    sim = Sim(PAUSES)
    sim.to_first_step()
    sim.tick(10, analysis=PASS)
    d = sim.tick(10, analysis=FAIL)
    assert (d.state.phase, d.weight) == (Phase.ROLLED_BACK, 0)


def test_promote_skips_the_analysis_of_the_current_step():
    sim = Sim()
    sim.to_first_step()
    d = sim.tick(1, promote_token="t1", analysis=INCONCLUSIVE)
    assert (d.weight, reasons(d), d.state.last_promote_token) == (10, ["StepStarted"], "t1")
    assert sim.tick(1, promote_token="t2").weight == 50


def test_full_promote_jumps_to_promoting():
    sim = Sim()
    sim.to_first_step()
    d = sim.tick(1, promote_full_token="now")
    assert (d.state.phase, d.weight, d.promote_revision, reasons(d)) == (
        Phase.PROMOTING, 100, "v2", ["Promoting"])
    d = sim.tick(1, promote_full_token="now", target_revision="v2")
    assert (d.state.phase, d.promote_revision) == (Phase.PROMOTING, None)


def test_full_promote_of_an_unready_candidate_keeps_weight_until_it_is_ready():
    sim = Sim(candidate_ready=False)
    sim.tick()
    d = sim.tick(1, promote_full_token="now")
    assert (d.state.phase, d.weight, d.promote_revision) == (Phase.PROMOTING, 0, "v2")
    d = sim.tick(5, target_revision="v2", candidate_ready=True)
    assert (d.weight, reasons(d)) == (100, ["WeightChanged"])


def test_a_target_already_at_the_candidate_is_promoting_without_a_patch():
    sim = Sim(target_revision="v2")
    d = sim.tick()
    assert (d.state.phase, d.promote_revision) == (Phase.PROMOTING, None)
    assert sim.tick(5, rollout_complete=True).state.phase is Phase.SUCCEEDED


def test_abort_sends_all_traffic_to_stable():
    sim = Sim()
    sim.to_first_step()
    sim.tick(10, analysis=PASS)
    d = sim.tick(1, abort_token="stop", stable_ready=False)  # an explicit abort is obeyed
    assert (d.state.phase, d.weight, d.keep_candidate, reasons(d)) == (
        Phase.ABORTED, 0, False, ["Aborted"])


@pytest.mark.parametrize("ending", ["rollback", "success", "abort"])
def test_abort_or_promote_when_nothing_is_in_progress_is_a_no_op(ending):
    sim = Sim()
    sim.to_first_step()
    if ending == "rollback":
        sim.tick(10, analysis=FAIL)
    elif ending == "success":
        sim.tick(1, promote_full_token="x")
        sim.tick(1, target_revision="v2", rollout_complete=True, promote_full_token="x")
    else:
        sim.tick(1, abort_token="a0")
    before = sim.state
    assert before.phase in {Phase.ROLLED_BACK, Phase.SUCCEEDED, Phase.ABORTED}
    for obs in [dict(abort_token="a1"), dict(promote_token="p1"), dict(promote_full_token="f1"),
                dict(target_revision="v9"), dict(target_exists=False), dict(analysis=PASS),
                dict(candidate_failed="x"), dict(guard_tripped="x")]:
        d = sim.tick(10, **obs)
        assert (d.events, d.promote_revision, d.keep_candidate, d.requeue_after) == (
            [], None, False, None)
        assert replace(d.state, last_abort_token="", last_promote_token="",
                       last_promote_full_token="") == replace(
            before, last_abort_token="", last_promote_token="", last_promote_full_token="")
    assert sim.state.last_abort_token == ""  # recorded on every tick (the last had none)
    assert sim.tick(1, abort_token="a2").state.last_abort_token == "a2"


# --- restarts -----------------------------------------------------------------------------------

def test_tokens_set_before_the_canary_started_do_nothing():
    d = Sim(abort_token="old", promote_full_token="old", promote_token="old").tick()
    assert (d.state.phase, d.weight, reasons(d)) == (
        Phase.PROGRESSING, 1, ["Started", "StepStarted"])


def test_editing_the_target_revision_restarts_with_the_new_stable():
    sim = Sim()
    sim.to_first_step()
    sim.tick(10, analysis=PASS)
    d = sim.tick(10, target_revision="v3")
    assert reasons(d) == ["Restarted", "StepStarted"]
    assert (d.state.stable_revision, d.state.step_index, d.weight, d.state.phase) == (
        "v3", 0, 1, Phase.PROGRESSING)
    assert sim.tick(10, target_revision="v3", analysis=PASS).weight == 10


def test_a_new_candidate_revision_restarts_even_a_finished_canary():
    sim = Sim()
    sim.to_first_step()
    sim.tick(10, analysis=FAIL, abort_token="a")
    assert sim.state.phase is Phase.ABORTED
    sim.spec = canary_spec(candidate={"revision": "v3"})
    d = sim.tick(1, candidate_ready=False, abort_token="a")  # the old abort does not apply
    assert (d.state.phase, d.state.candidate_revision, d.weight, d.keep_candidate) == (
        Phase.PENDING, "v3", 0, True)
    assert reasons(d) == ["Restarted"]
    assert (d.state.failed_windows, d.state.last_analysis) == (0, None)
    assert sim.tick(1, abort_token="a").weight == 1


def test_steps_edited_under_a_running_canary():
    sim = Sim()
    sim.to_first_step()
    sim.tick(10, analysis=PASS)  # step 2: 10 %
    sim.spec = canary_spec(steps=[{"setWeight": 1}, {"setWeight": 20}])
    d = sim.tick(1)
    assert (d.weight, reasons(d), d.state.step_index) == (20, ["WeightChanged"], 1)
    sim.spec = canary_spec(steps=[{"setWeight": 5}])  # step 2 no longer exists: all passed
    d = sim.tick(1)
    assert (d.state.phase, d.promote_revision) == (Phase.PROMOTING, "v2")


def test_status_round_trip():
    sim = Sim(canary_spec(analysis={"failureLimit": 2}))
    sim.to_first_step()
    sim.tick(10, analysis=FAIL, promote_token="p", candidate_memory_bytes=123)
    status = sim.state.to_status()
    assert status["phase"] == "Progressing" and status["failedWindows"] == 0
    assert set(status) == {
        "phase", "currentStepIndex", "currentWeight", "stepStarted", "stableRevision", "candidateRevision",
        "failedWindows", "lastAnalysis", "message", "reason", "lastPromoteToken",
        "lastPromoteFullToken", "lastAbortToken", "started", "memoryBaselineBytes"}
    assert CanaryState.from_status(status) == sim.state
    assert CanaryState.from_status({}) == CanaryState.from_status(None) == CanaryState()
    odd = CanaryState.from_status({"phase": "Bogus", "currentWeight": "x", "currentStepIndex": 2.0,
                                   "stepStarted": 5, "lastAnalysis": None, "conditions": []})
    assert (odd.phase, odd.weight, odd.step_index, odd.step_started) == (
        Phase.PENDING, 0, 2, 5.0)


# --- properties over random tick sequences ------------------------------------------------------

OBSERVATIONS = st.fixed_dictionaries({}, optional={
    "analysis": st.sampled_from([PASS, FAIL, INCONCLUSIVE]),
    "candidate_ready": st.booleans(),
    "stable_ready": st.booleans(),
    "guard_tripped": st.just("tripped"),
    "candidate_failed": st.just("LoadFailed"),
    "promote_token": st.sampled_from(["p1", "p2"]),
    "promote_full_token": st.sampled_from(["f1", "f2"]),
    "abort_token": st.sampled_from(["a1", "a2"]),
    "target_revision": st.sampled_from(["v1", "v2", "v3"]),
    "rollout_complete": st.booleans(),
    "candidate_memory_bytes": st.integers(0, 10),
})
TICKS = st.lists(st.tuples(st.sampled_from([0.0, 1.0, 10.0, 60.0]), OBSERVATIONS), max_size=40)
SPECS = st.sampled_from([canary_spec(), PAUSES, canary_spec(analysis={"failureLimit": 2})])


@settings(max_examples=300, deadline=None)
@given(SPECS, TICKS)
def test_restarting_the_operator_mid_canary_changes_nothing(spec, ticks):
    direct, restarted = Sim(spec), Sim(spec, through_status=True)
    for dt, obs in ticks:
        assert direct.tick(dt, **obs) == restarted.tick(dt, **obs)


@settings(max_examples=300, deadline=None)
@given(SPECS, TICKS)
def test_invariants_over_any_tick_sequence(spec, ticks):
    sim = Sim(spec)
    promoted = 0
    for dt, obs in ticks:
        before = sim.state
        d = sim.tick(dt, **obs)
        s, o = d.state, Observation(**{**sim.defaults, **obs})
        assert 0 <= d.weight <= 100 and d.weight == s.weight
        assert d.keep_candidate == (s.phase not in {Phase.SUCCEEDED, Phase.ROLLED_BACK,
                                                    Phase.ABORTED, Phase.FAILED})
        assert (d.requeue_after is None) == (not d.keep_candidate)
        if s.phase in {Phase.ROLLED_BACK, Phase.ABORTED, Phase.FAILED}:
            assert d.weight == 0
        if before.phase in {Phase.SUCCEEDED, Phase.ROLLED_BACK, Phase.ABORTED, Phase.FAILED}:
            assert (s.phase, d.events) == (before.phase, [])  # terminal stays terminal
        if s.phase is Phase.ROLLED_BACK and before.phase is not Phase.ROLLED_BACK:
            assert o.stable_ready  # never onto an unhealthy stable
        if (before.phase is s.phase is Phase.PROGRESSING and s.step_index > before.step_index
                and s.stable_revision == before.stable_revision):
            # a setWeight step is left only by a passing window or a new promote token
            assert o.analysis is PASS or o.promote_token not in ("", before.last_promote_token)
        promoted += d.promote_revision is not None
        if d.promote_revision is not None:
            assert d.promote_revision == "v2" and s.phase is Phase.PROMOTING
        if any(r in ("Started", "Restarted") for r in reasons(d)):
            promoted = int(d.promote_revision is not None)
        assert promoted <= 1  # patched once per run
