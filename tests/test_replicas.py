"""When a replica serves, and the endpoints of a set of replicas (mlx_fleet.routing.replicas):
the one predicate behind reconcile's ready slots, the status's readyReplicas/endpoints, the
canary's candidate-Ready and the split's candidate endpoints."""

from __future__ import annotations

import pytest

from mlx_fleet.contract import (AWAITING_REQUEST, EVICTED, IDLE_UNLOADED, PREDICTIVE_PREFETCH,
                                RELOADING_ON_DEMAND, AssignmentState)
from mlx_fleet.routing.replicas import endpoints, serves

S = AssignmentState

SERVING = [
    (S.READY, "ModelLoaded"),
    (S.READY, ""),
    (S.UNLOADED, IDLE_UNLOADED),       # standby: the next request reloads it
    (S.UNLOADED, EVICTED),
    (S.UNLOADED, AWAITING_REQUEST),
    (S.LOADING, RELOADING_ON_DEMAND),  # coming back from standby
    (S.LOADING, PREDICTIVE_PREFETCH),
]
NOT_SERVING = [
    (S.PENDING, "AwaitingAgent"),
    (S.PREFETCHING, "Downloading"),
    (S.LOADING, "Loading"),            # a first load: not yet serving
    (S.LOADING, ""),
    (S.UNLOADED, "Unassigned"),        # unloaded for good
    (S.UNLOADED, RELOADING_ON_DEMAND),  # a loading reason on an unloaded replica
    (S.LOADING, IDLE_UNLOADED),        # an unloaded reason on a loading one
    (S.FAILED, "LoadFailed"),
    (S.FAILED, IDLE_UNLOADED),
]


@pytest.mark.parametrize(("state", "reason"), SERVING)
def test_ready_and_standby_replicas_serve(state: AssignmentState, reason: str) -> None:
    assert serves(state, reason)
    assert serves(state.value, reason)  # the status's entries hold the plain string


@pytest.mark.parametrize(("state", "reason"), NOT_SERVING)
def test_other_replicas_do_not_serve(state: AssignmentState, reason: str) -> None:
    assert not serves(state, reason)
    assert not serves(state.value, reason)


def test_every_state_is_covered_by_the_tables() -> None:
    assert {s for s, _ in SERVING + NOT_SERVING} == set(AssignmentState)


def test_endpoints_of_the_serving_replicas_sorted_each_once() -> None:
    replicas = [
        (S.READY, "ModelLoaded", "http://mac-2:8000"),
        (S.UNLOADED, IDLE_UNLOADED, "http://mac-1:8000"),
        (S.READY, "ModelLoaded", "http://mac-2:8000"),      # a second revision on one Mac
        (S.FAILED, "LoadFailed", "http://mac-3:8000"),
        (S.LOADING, "Loading", "http://mac-4:8000"),
        (S.READY, "ModelLoaded", ""),                        # no endpoint known yet
    ]
    assert endpoints(replicas) == ["http://mac-1:8000", "http://mac-2:8000"]
    assert endpoints(iter(replicas)) == ["http://mac-1:8000", "http://mac-2:8000"]  # any iterable
    assert endpoints([]) == []
    assert endpoints([(S.FAILED, "LoadFailed", "http://mac-3:8000")]) == []
