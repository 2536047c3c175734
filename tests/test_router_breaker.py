"""The fleet router's per-Mac circuit breaker (mlx_fleet_router.breaker): seed 004's triggers,
the cooldown, the half-open trial — table tests over the pure step."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_fleet_router.breaker import (CLOSED, BreakerConfig, Event, Finished, Phase, Probed,
                                      Refused, Sent, State, admits, phase, step)

CFG = BreakerConfig()


def run(events: Sequence[tuple[float, Event]], state: State = CLOSED,
        config: BreakerConfig = CFG) -> State:
    for now, event in events:
        state = step(config, state, event, now)
    return state


def requests(t0: float, ok: int, failed: int, *, dt: float = 0.1) -> list[tuple[float, Event]]:
    """``ok`` successes then ``failed`` failures from ``t0``, ``dt`` apart."""
    evs: list[tuple[float, Event]] = []
    for i in range(ok + failed):
        evs.append((t0 + i * dt, Finished(ok=i < ok, seconds=0.2)))
    return evs


def test_defaults_are_seed_004s() -> None:
    assert (CFG.window_seconds, CFG.error_ratio, CFG.slow_seconds, CFG.probe_failures,
            CFG.cooldown_seconds) == (30.0, 0.10, 10.0, 3, 60.0)


@pytest.mark.parametrize(("ok", "failed", "expected"), [
    (0, 9, Phase.CLOSED),    # 9 < min_requests (10): never opens, even at 100 %
    (9, 1, Phase.CLOSED),    # 10 % is not above 10 %
    (8, 2, Phase.OPEN),      # 20 %
    (27, 3, Phase.CLOSED),   # 10 % of 30 exactly (0.1 × 30 > 3 in binary floating point)
    (26, 4, Phase.OPEN),
    (0, 10, Phase.OPEN),
])
def test_error_rate_trigger(ok: int, failed: int, expected: Phase) -> None:
    s = run(requests(0.0, ok, failed))
    assert s.phase is expected
    if expected is Phase.OPEN:
        assert s.reason == "ErrorRate" and not admits(CFG, s, s.since)
    else:
        assert admits(CFG, s, 5.0)


def test_slow_responses_count_as_failures() -> None:
    evs = requests(0.0, 8, 0) + [(1.0, Finished(ok=True, seconds=10.5)),
                                 (1.1, Finished(ok=True, seconds=12.0))]
    s = run(evs)
    assert s.phase is Phase.OPEN and s.reason == "ErrorRate"
    at_limit = requests(0.0, 8, 0) + [(1.0, Finished(ok=True, seconds=10.0))] * 2
    assert run(at_limit).phase is Phase.CLOSED  # "> 10 s"


def test_failures_leave_the_window_after_window_seconds() -> None:
    s = run(requests(0.0, 0, 9))                 # 9 failures, no trip yet
    assert s.phase is Phase.CLOSED
    assert run(requests(31.0, 10, 0), s).phase is Phase.CLOSED   # they left: 0 %
    assert run(requests(20.0, 1, 0), s).phase is Phase.OPEN      # 9 of 10 in the window


def test_three_consecutive_failed_probes_open_it() -> None:
    s = run([(0.0, Probed(False)), (1.0, Probed(False)), (2.0, Probed(True)),
             (3.0, Probed(False)), (4.0, Probed(False))])
    assert s.phase is Phase.CLOSED and s.probe_failures == 2
    s = step(CFG, s, Probed(False), 5.0)
    assert (s.phase, s.reason, s.since) == (Phase.OPEN, "HealthProbes", 5.0)


def test_a_refused_connection_opens_it_at_once() -> None:
    s = step(CFG, CLOSED, Refused(), 7.0)
    assert (s.phase, s.reason, s.since) == (Phase.OPEN, "ConnectionRefused", 7.0)
    assert not admits(CFG, s, 7.0)


def test_cooldown_then_one_trial_then_closed() -> None:
    s = step(CFG, CLOSED, Refused(), 100.0)
    assert phase(CFG, s, 159.9) is Phase.OPEN and not admits(CFG, s, 159.9)
    assert phase(CFG, s, 160.0) is Phase.HALF_OPEN and admits(CFG, s, 160.0)
    # events while open are ignored (a late answer of a request sent before it opened)
    assert step(CFG, s, Finished(ok=True), 120.0) == s
    assert step(CFG, s, Probed(True), 120.0) == s
    s = step(CFG, s, Sent(), 165.0)                    # the trial goes out
    assert s.phase is Phase.HALF_OPEN and s.trial_since == 165.0
    assert not admits(CFG, s, 166.0)                   # one at a time
    assert step(CFG, s, Sent(), 166.0) == s            # a second send takes no slot
    closed = step(CFG, s, Finished(ok=True, seconds=0.5), 167.0)
    assert closed.phase is Phase.CLOSED and closed.window == () and admits(CFG, closed, 167.0)


@pytest.mark.parametrize("outcome", [Finished(ok=False), Finished(ok=True, seconds=11.0),
                                     Probed(False), Refused()])
def test_a_failed_trial_opens_it_again_for_a_new_cooldown(outcome: Event) -> None:
    s = run([(0.0, Refused()), (60.0, Sent())])
    s = step(CFG, s, outcome, 61.0)
    assert s.phase is Phase.OPEN and s.since == 61.0
    assert s.reason == ("ConnectionRefused" if isinstance(outcome, Refused) else "TrialFailed")
    assert not admits(CFG, s, 120.9) and admits(CFG, s, 121.0)


def test_a_healthy_probe_closes_a_half_open_breaker() -> None:
    s = run([(0.0, Refused()), (60.0, Probed(True))])
    assert s.phase is Phase.CLOSED and s.reason == "ConnectionRefused"  # the last opening's


def test_a_trial_that_never_comes_back_frees_the_slot_after_slow_seconds() -> None:
    s = run([(0.0, Refused()), (60.0, Sent())])
    assert not admits(CFG, s, 69.9)
    assert admits(CFG, s, 70.0)
    assert step(CFG, s, Sent(), 70.0).trial_since == 70.0


@pytest.mark.parametrize("kw", [dict(window_seconds=0), dict(error_ratio=1.0),
                                dict(min_requests=0), dict(probe_failures=0),
                                dict(cooldown_seconds=-1), dict(slow_seconds=0)])
def test_config_rejects_nonsense(kw: dict) -> None:
    with pytest.raises(ValueError):
        BreakerConfig(**kw)


@settings(max_examples=100, deadline=None)
@given(outcomes=st.lists(st.booleans(), max_size=60),
       dt=st.floats(min_value=0.01, max_value=2.0))
def test_error_rate_opens_exactly_when_the_window_says_so(outcomes: list[bool],
                                                          dt: float) -> None:
    """Against a brute-force recount of the slotted window: the breaker opens at the first
    request after which the window holds >= min_requests and > 10 % failures."""
    s = CLOSED
    history: list[tuple[float, bool]] = []
    width = CFG.window_seconds / 10
    for i, ok in enumerate(outcomes):
        now = i * dt
        history.append((now, not ok))
        s = step(CFG, s, Finished(ok=ok), now)
        oldest = math.floor(now / width) - 9
        inside = [f for t, f in history if math.floor(t / width) >= oldest]
        trips = len(inside) >= CFG.min_requests and 10 * sum(inside) > len(inside)
        assert (s.phase is Phase.OPEN) == trips
        if trips:
            break
