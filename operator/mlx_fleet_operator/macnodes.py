"""MacNode mirror: what ``status`` of a ``macnodes.mlx-fleet.io`` object says. Pure functions.

The operator mirrors every node agent's etcd record into a cluster-scoped MacNode (the I/O
lives in :mod:`.handlers`, :func:`~.handlers.mirror_macnodes`). The agent stays the source of
truth: the status is informational, and only ``spec.unschedulable`` (a cordon) is read back.
When a record is gone (its lease expired), the MacNode is kept with ``health: Gone`` so a cordon
survives an agent restart.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from mlx_fleet.contract import Assignment, NodeRecord, node_budget_bytes

GONE = "Gone"
#: Label on every MacNode the operator creates (no ownerReference: a MacNode outlives nothing).
MANAGED_LABEL = "app.kubernetes.io/managed-by"
MANAGED_VALUE = "mlx-fleet-operator"
#: ``lastSeen`` alone changing does not cause a patch more often than this (seconds).
LAST_SEEN_REFRESH_SECONDS = 60.0


def _rfc3339(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(ts: str) -> float:
    return dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=dt.timezone.utc).timestamp()


def macnode_status(record: NodeRecord, assignments: Iterable[Assignment], *,
                   unschedulable: bool = False) -> dict[str, Any]:
    """The MacNode ``status`` of a live node ``record`` with the ``assignments`` on it."""
    asg = list(assignments)
    c = record.capacity
    models = sorted({f"{a.namespace}/{a.name}@{a.revision}" for a in asg})
    return {
        "chip": c.chip, "chipGeneration": c.chip_generation,
        "memoryTotalBytes": c.memory_total_bytes,
        "memoryBudgetBytes": node_budget_bytes(c.memory_total_bytes, c.wired_limit_bytes),
        "memoryReservedBytes": sum(a.memory_bytes for a in asg),
        "health": record.health.value, "simulated": c.simulated, "address": record.address,
        "loadedModels": models, "modelCount": len(models), "unschedulable": unschedulable,
        "lastSeen": _rfc3339(record.heartbeat_unix),
    }


def gone_status(previous: Mapping[str, Any], *, unschedulable: bool = False) -> dict[str, Any]:
    """The status of a MacNode whose record is gone: the last one, ``health: Gone``, nothing
    reserved or loaded (the operator drops a gone node's assignments)."""
    return {**previous, "health": GONE, "memoryReservedBytes": 0, "loadedModels": [],
            "modelCount": 0, "unschedulable": unschedulable}


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether ``new`` is worth a patch: anything but ``lastSeen`` differs, or ``lastSeen``
    advanced by at least :data:`LAST_SEEN_REFRESH_SECONDS` (heartbeats alone patch rarely)."""
    if not old:
        return True
    if {k: v for k, v in old.items() if k != "lastSeen"} != \
            {k: v for k, v in new.items() if k != "lastSeen"}:
        return True
    a, b = old.get("lastSeen"), new.get("lastSeen")
    if a == b:
        return False
    if not a or not b:
        return True
    try:
        return abs(_parse(b) - _parse(a)) >= LAST_SEEN_REFRESH_SECONDS
    except ValueError:
        return True


def cordoned(macnodes: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """Names of the MacNodes (API objects) with ``spec.unschedulable: true``."""
    return frozenset(o["metadata"]["name"] for o in macnodes
                     if (o.get("spec") or {}).get("unschedulable") is True)


def new_macnode(name: str) -> dict[str, Any]:
    """The body the operator creates for a newly registered node (status is patched after)."""
    return {"apiVersion": "mlx-fleet.io/v1alpha1", "kind": "MacNode",
            "metadata": {"name": name, "labels": {MANAGED_LABEL: MANAGED_VALUE}},
            "spec": {"unschedulable": False}}
