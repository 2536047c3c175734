"""The router's per-Mac view (mlx_fleet_router.fleet.view, pure): breaker phase, in-flight,
seconds until a half-open trial — table-driven over breaker states and in-flight counts."""

from __future__ import annotations

import pytest

from mlx_fleet.routing.fleet import FleetRouting, RoutedMac
from mlx_fleet_router import breaker
from mlx_fleet_router.fleet import view
from mlx_fleet_router.table import Replica, Served, Table

CFG = breaker.BreakerConfig(cooldown_seconds=60.0, slow_seconds=10.0)
TABLE = Table(models={
    "chat": Served("chat", "team/chat", (Replica("mac-a", "r1", "http://a"),
                                         Replica("mac-b", "r1", "http://b"))),
    "code": Served("code", "team/code", (Replica("mac-a", "r1", "http://a"),)),
})
OPENED = breaker.State(phase=breaker.Phase.OPEN, since=100.0, reason="ConnectionRefused")
TRIAL = breaker.State(phase=breaker.Phase.HALF_OPEN, since=160.0, reason="ErrorRate",
                      trial_since=165.0)


@pytest.mark.parametrize("state, now, expected", [
    (None, 0.0, RoutedMac(node="mac-b", deployments=("team/chat",))),
    (OPENED, 115.0, RoutedMac(node="mac-b", state="open", reason="ConnectionRefused",
                              half_open_in_seconds=45.0, deployments=("team/chat",))),
    # the cooldown elapsed: half-open, no trial out yet (the stored phase is still open)
    (OPENED, 160.0, RoutedMac(node="mac-b", state="half-open", reason="ConnectionRefused",
                              deployments=("team/chat",))),
    (TRIAL, 170.0, RoutedMac(node="mac-b", state="half-open", reason="ErrorRate",
                             trial_in_flight=True, deployments=("team/chat",))),
    # a trial older than slow_seconds no longer holds the slot
    (TRIAL, 175.0, RoutedMac(node="mac-b", state="half-open", reason="ErrorRate",
                             deployments=("team/chat",))),
    (breaker.State(phase=breaker.Phase.CLOSED, since=200.0, reason="TrialFailed"), 210.0,
     RoutedMac(node="mac-b", reason="TrialFailed", deployments=("team/chat",))),
])
def test_breaker_of_a_mac(state, now, expected) -> None:
    breakers = {} if state is None else {"mac-b": state}
    got = view(TABLE, breakers, {}, CFG, now)
    assert [m.node for m in got.macs] == ["mac-a", "mac-b"]
    assert got.macs[1] == expected
    assert got.macs[0] == RoutedMac(node="mac-a", deployments=("team/chat", "team/code"))


def test_in_flight_summed_over_deployments_and_macs_that_left_the_table() -> None:
    got = view(TABLE, {"mac-gone": OPENED}, {("team/chat", "mac-a"): 2, ("team/code", "mac-a"): 3,
                                             ("team/chat", "mac-z"): 1}, CFG, 100.0)
    assert got == FleetRouting(macs=(
        RoutedMac(node="mac-a", in_flight=5, deployments=("team/chat", "team/code")),
        RoutedMac(node="mac-b", deployments=("team/chat",)),
        RoutedMac(node="mac-gone", state="open", reason="ConnectionRefused",
                  half_open_in_seconds=60.0),
        RoutedMac(node="mac-z", in_flight=1),
    ))


def test_the_document_round_trips_through_json() -> None:
    doc = view(TABLE, {"mac-b": OPENED}, {}, CFG, 130.0)
    assert FleetRouting.model_validate_json(doc.model_dump_json()) == doc
    assert doc.model_dump(mode="json")["macs"][1] == {
        "node": "mac-b", "state": "open", "reason": "ConnectionRefused", "in_flight": 0,
        "half_open_in_seconds": 30.0, "trial_in_flight": False, "deployments": ["team/chat"]}
    assert view(Table(models={}), {}, {}, CFG, 0.0) == FleetRouting()
