"""Only the active kopf peer exports the fleet metric families: the pure rule
(:func:`mlx_fleet_operator.peering.peering_active`, kopf's own pausing rule) table-tested, and
the collector's behaviour when its Runtime says it is not the active replica."""

from __future__ import annotations

import datetime as dt
import types

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from mlx_fleet_operator.fleet_metrics import FleetCollector
from mlx_fleet_operator.peering import peering_active

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def peer(priority: int, seconds_ago: float = 1, lifetime: int = 60) -> dict:
    seen = (NOW - dt.timedelta(seconds=seconds_ago)).isoformat()
    return {"priority": priority, "lastseen": seen, "lifetime": lifetime}


@pytest.mark.parametrize("statuses, active", [
    ([], True),                                                  # no peering object read yet
    ([None], True),                                              # object without status
    ([{"me": peer(10)}], True),                                  # alone
    ([{"me": peer(10), "other": peer(5)}], True),                # highest priority
    ([{"me": peer(10), "other": peer(20)}], False),              # a higher live peer
    ([{"me": peer(10), "other": peer(10)}], False),              # same priority: kopf pauses all
    ([{"me": peer(10), "other": peer(20, seconds_ago=61)}], True),   # the higher one is dead
    ([{"me": peer(10), "other": peer(20, seconds_ago=5, lifetime=4)}], True),
    ([{"me": peer(10)}, {"other": peer(20)}], False),            # paused in one namespace
    ([{"me": peer(10), "other": {"priority": 99}}], True),       # unreadable record: not live
    ([{"me": peer(10), "other": "garbage"}], True),
])
def test_peering_active(statuses: list, active: bool) -> None:
    assert peering_active(statuses, "me", 10, NOW) is active


def _runtime(active: bool) -> types.SimpleNamespace:
    from mlx_fleet.contract import NodeCapacity, NodeHealth, NodeRecord

    cap = NodeCapacity(chip="Apple M3 Max", chip_generation=3, memory_total_bytes=64 * 2**30,
                       memory_available_bytes=60 * 2**30, simulated=True)
    rec = NodeRecord(name="mac-1", address="http://mac-1:8000", capacity=cap,
                     health=NodeHealth.HEALTHY, agent_version="0.1.0")
    health = types.SimpleNamespace(alive=True, restarts=0)
    return types.SimpleNamespace(nodes={"mac-1": rec}, placed={}, reports={}, stats={},
                                 followers={"etcd follower: nodes": health},
                                 fleet_active=active)


@pytest.mark.parametrize("active", [True, False])
def test_only_the_active_replica_exports_fleet_families(active: bool) -> None:
    registry = CollectorRegistry()
    registry.register(FleetCollector(lambda: _runtime(active)))
    text = generate_latest(registry).decode()
    fleet_sample = 'mlxfleet_operator_node_memory_total_bytes{node="mac-1"}'
    assert (fleet_sample in text) is active
    assert ('mlxfleet_operator_nodes{health="Healthy"} 1.0' in text) is active
    # per-process families stay on every replica (they differ by Prometheus' instance label)
    assert 'mlxfleet_operator_task_up{task="etcd follower: nodes"} 1.0' in text
    assert f"mlxfleet_operator_fleet_exporter {1.0 if active else 0.0}" in text
