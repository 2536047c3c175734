"""MacNode mirror: what ``status`` of a ``macnodes.mlx-fleet.io`` object says. Pure functions.

The operator mirrors every node agent's etcd record into a cluster-scoped MacNode (the I/O
lives in :mod:`.macnode_mirror`). The agent stays the source of
truth: the status is informational, and only ``spec.unschedulable`` (a cordon) and
``spec.drain`` (a drain; the CRD requires ``unschedulable`` with it) are read back.
When a record is gone (its lease expired), the MacNode is kept with ``health: Gone`` so a cordon
survives an agent restart.

The ``ClaimsAccepted`` condition (:func:`.node_claims.claims_condition`) says whether placement
uses the agent's labels and capacity as reported, or which it ignores or clamps (issue 19); the
MacNode's own ``metadata.labels``, set by the cluster admin, are the labels a node selector
matches (:func:`operator_labels`).

The ``Drained`` condition (:func:`drained_condition`) tells how a drain stands: False
``DrainNotRequested`` without ``spec.drain``; False ``Draining`` while replicas are still
assigned (their replacements load elsewhere); False ``DrainBlocked`` when some cannot move
(nowhere else fits: they keep serving, the message says why with placement's numbers); True
``Drained`` once nothing is assigned to the Mac. ``observedGeneration`` is the MacNode's
``metadata.generation`` the operator acted on, so ``mlx-fleet drain`` waits for its own request.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from mlx_fleet.contract import Assignment, NodeRecord
from mlx_fleet.quantity import format_bytes

from .node_claims import CLAIMS_CONDITION, claims_condition
from .placement import node_budget_bytes
from .status import condition

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


def _models(assignments: Iterable[Assignment]) -> list[str]:
    return sorted({f"{a.namespace}/{a.name}@{a.revision}" for a in assignments})


def drained_condition(draining: bool, models: Iterable[str], blocked: str = "", *,
                      generation: int = 0, previous: Mapping[str, Any] | None = None,
                      now: str = "") -> dict[str, Any]:
    """The ``Drained`` condition (module docstring). ``models``: what is still assigned to the
    Mac (``ns/name@revision``); ``blocked``: why some of it cannot move ("" when it can);
    ``previous``: the MacNode's current status (keeps ``lastTransitionTime``); ``now``:
    RFC 3339 time of this observation."""
    left = sorted(models)
    if not draining:
        args = ("False", "DrainNotRequested", "spec.drain is not set")
    elif not left:
        args = ("True", "Drained", "no replica is assigned to the Mac")
    elif blocked:
        args = ("False", "DrainBlocked",
                f"{len(left)} replica(s) left ({', '.join(left)}): {blocked}")
    else:
        args = ("False", "Draining", f"{len(left)} replica(s) left ({', '.join(left)}); "
                "each is removed once its replacement is Ready elsewhere")
    prev = {c.get("type"): c for c in (previous or {}).get("conditions") or []
            if isinstance(c, Mapping)}
    return condition("Drained", *args, generation, prev, now or _rfc3339(0))


def macnode_status(record: NodeRecord, assignments: Iterable[Assignment], *,
                   unschedulable: bool = False, draining: bool = False, blocked: str = "",
                   generation: int = 0, previous: Mapping[str, Any] | None = None,
                   now: str = "") -> dict[str, Any]:
    """The MacNode ``status`` of a live node ``record`` with the ``assignments`` on it
    (``maxLoadedModels``: the agent's limit on loaded models, 0 = none; placement counts
    ``modelCount`` against it; ``memoryBudgetBytes``: the node's budget as placement counts it,
    :func:`.placement.node_budget_bytes`, from ``memoryWatermark``, the agent's
    ``--memory-watermark``, and the memory the chip can have; conditions ``Drained`` and
    ``ClaimsAccepted``). ``draining``/``blocked``/``generation``/``previous``/``now``: see
    :func:`drained_condition`."""
    asg = list(assignments)
    c = record.capacity
    models = _models(asg)
    budget, reserved = node_budget_bytes(record), sum(a.memory_bytes for a in asg)
    return {
        "chip": c.chip, "chipGeneration": c.chip_generation,
        "memoryTotalBytes": c.memory_total_bytes,
        "memoryWatermark": c.memory_watermark,
        "memoryBudgetBytes": budget,
        "memoryReservedBytes": reserved,
        "memory": memory_summary(reserved, budget),
        "health": record.health.value, "simulated": c.simulated, "address": record.address,
        "loadedModels": models, "modelCount": len(models),
        "maxLoadedModels": c.max_loaded_models, "unschedulable": unschedulable,
        "draining": draining, "lastSeen": _rfc3339(record.heartbeat_unix),
        "conditions": [drained_condition(draining, models, blocked, generation=generation,
                                         previous=previous, now=now),
                       claims_condition(record, generation=generation, previous=previous,
                                        now=now)],
    }


def memory_summary(reserved: int, budget: int) -> str:
    """``status.memory``, for people (``kubectl get macnodes``): ``"<reserved> / <budget>"`` in
    binary units (:func:`mlx_fleet.quantity.format_bytes`); the byte fields stay the source."""
    return f"{format_bytes(reserved)} / {format_bytes(budget)}"


def gone_status(previous: Mapping[str, Any], *, unschedulable: bool = False,
                draining: bool = False, generation: int = 0, now: str = "") -> dict[str, Any]:
    """The status of a MacNode whose record is gone: the last one, ``health: Gone``, nothing
    reserved or loaded (the operator drops a gone node's assignments)."""
    return {**previous, "health": GONE, "memoryReservedBytes": 0,
            "memory": memory_summary(0, int(previous.get("memoryBudgetBytes") or 0)),
            "loadedModels": [],
            "modelCount": 0, "unschedulable": unschedulable, "draining": draining,
            "conditions": [drained_condition(draining, (), generation=generation,
                                             previous=previous, now=now),
                           *[c for c in previous.get("conditions") or []
                             if isinstance(c, Mapping) and c.get("type") == CLAIMS_CONDITION]]}


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


def draining(macnodes: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """Names of the MacNodes (API objects) with ``spec.drain: true`` (and the cordon the CRD
    requires with it: an object that somehow lacks it is not drained)."""
    return frozenset(o["metadata"]["name"] for o in macnodes
                     if (o.get("spec") or {}).get("drain") is True
                     and (o.get("spec") or {}).get("unschedulable") is True)


def operator_labels(macnodes: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """MacNode name → its ``metadata.labels`` (API objects): the labels a cluster admin set,
    which ``placement.nodeSelector`` matches (:func:`.node_claims.node_label`)."""
    return {o["metadata"]["name"]: dict(o["metadata"].get("labels") or {}) for o in macnodes}


def new_macnode(name: str) -> dict[str, Any]:
    """The body the operator creates for a newly registered node (status is patched after)."""
    return {"apiVersion": "mlx-fleet.io/v1alpha1", "kind": "MacNode",
            "metadata": {"name": name, "labels": {MANAGED_LABEL: MANAGED_VALUE}},
            "spec": {"unschedulable": False, "drain": False}}
