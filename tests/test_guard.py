"""The candidate's local guard (node_agent.guard) over an injected clock."""

from __future__ import annotations

import pytest

from mlx_fleet.contract import LocalGuard
from node_agent.guard import MAX_EVENTS, CandidateGuard

G = LocalGuard(window_seconds=5.0, min_failures=3, failure_ratio=0.5)
F, OK = True, False


def _feed(guard: CandidateGuard, events: list[tuple[float, bool]]) -> list[str | None]:
    """Record each event then check at its time, as the agent does; every check's result."""
    out = []
    for t, failed in events:
        guard.record(t, failed)
        out.append(guard.check(t))
    return out


CASES = [
    # name, guard, events (time, failed), check time, trips
    ("below min_failures", G, [(0, F), (1, F)], 1.0, False),
    ("ratio below threshold", G, [(0, F), (0, F), (0, F)] + [(1, OK)] * 4, 1.0, False),
    ("exactly min_failures and ratio", G, [(0, F), (0, F), (0, F)] + [(1, OK)] * 3, 1.0, True),
    ("all failed", G, [(0, F), (0, F), (0, F)], 0.0, True),
    # 0.28 * 25 == 7.000000000000001 in floating point, 7 / 25 == 0.28.
    ("ratio exact in float terms", LocalGuard(min_failures=3, failure_ratio=0.28),
     [(0, F)] * 7 + [(0, OK)] * 18, 0.0, True),
    ("old failures expire", G, [(0, F), (1, F), (5.5, F), (5.5, F)], 6.0, False),
    ("exactly window old has expired", G, [(0, F), (2, F), (3, F)], 5.0, False),
    ("just inside the window", G, [(0, F), (2, F), (3, F)], 4.999, True),
    ("old successes expire too", G, [(0, OK)] * 10 + [(6, F), (6, F), (6, F)], 6.0, True),
    ("disabled", LocalGuard(enabled=False), [(0, F)] * 10, 0.0, False),
]


@pytest.mark.parametrize(("guard", "events", "at", "trips"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_trip_table(guard: LocalGuard, events: list[tuple[float, bool]], at: float,
                    trips: bool) -> None:
    g = CandidateGuard(guard, "r2")
    for t, failed in events:
        g.record(t, failed)
    reason = g.check(at)
    assert (reason is not None) is trips
    assert g.tripped is trips
    assert g.reason == (reason or "")


def test_reason_has_the_numbers() -> None:
    g = CandidateGuard(G, "r2")
    results = _feed(g, [(0, OK), (1, F), (2, F), (3, F), (4, F)])
    assert results[:3] == [None, None, None]
    assert results[3] == ("candidate r2: 3 of 4 requests failed in the last 5s "
                          "(threshold 3 failures and 50%)")
    assert results[4] is None  # reported only the first time


def test_stays_tripped_until_reset() -> None:
    g = CandidateGuard(G, "r2")
    reason = _feed(g, [(0, F), (0, F), (0, F)])[-1]
    assert reason
    assert _feed(g, [(100 + i, OK) for i in range(20)]) == [None] * 20
    assert g.tripped and g.reason == reason
    g.reset(LocalGuard(min_failures=5), "r3")
    assert not g.tripped and g.reason == "" and g.guard.min_failures == 5
    # Pre-reset failures are gone: four new ones stay below the new min_failures of 5.
    assert _feed(g, [(200, F)] * 4) == [None] * 4
    assert _feed(g, [(200, F)])[0].startswith("candidate r3: 5 of 5 requests failed")


def test_reset_without_candidate_keeps_the_name() -> None:
    g = CandidateGuard(G, "r2")
    g.reset(G)
    assert _feed(g, [(0, F)] * 3)[-1].startswith("candidate r2:")


def test_window_remembers_at_most_max_events() -> None:
    g = CandidateGuard(LocalGuard(min_failures=1, failure_ratio=1.0, window_seconds=60))
    g.record(0, OK)  # pushed out by the failures below, else the ratio would be < 100%
    for _ in range(MAX_EVENTS):
        g.record(1, F)
    assert g.check(1) == (f"candidate: {MAX_EVENTS} of {MAX_EVENTS} requests failed in the "
                          "last 60s (threshold 1 failures and 100%)")


def test_a_failure_pushed_out_of_the_window_no_longer_counts() -> None:
    g = CandidateGuard(LocalGuard(min_failures=1, failure_ratio=1 / MAX_EVENTS,
                                  window_seconds=60))
    g.record(0, F)
    for _ in range(MAX_EVENTS):
        g.record(1, OK)
    assert g.check(1) is None
    g.record(2, F)
    assert g.check(2).startswith(f"candidate: 1 of {MAX_EVENTS} requests failed")
