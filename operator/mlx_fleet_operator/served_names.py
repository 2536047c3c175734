"""Served-name conflicts among the ModelDeployments this operator knows: the pure decision
behind the ``ServedNameConflict`` condition (:func:`.status.compute_status`).

The rule is the fleet router's (:mod:`mlx_fleet.routing.names`): a deployment claims the served
names its assignments carry; a name claimed by two deployments is refused by the router. Here
the deployments are those with a record in the operator's :class:`~.runtime.Runtime` — its
watched namespaces, its scope — and their assignments as last reconciled (``Runtime.placed``).

:func:`rivals` gives one deployment's conflicts; :func:`to_wake` the other deployments whose
condition changes when that deployment's claims change (the executor, :func:`.sync.sync` and
``Runtime.forget``, wakes them so both sides show it and both clear it).

Pure: :mod:`mlx_fleet.contract`, :mod:`mlx_fleet.routing.names` and :mod:`.records` only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from mlx_fleet.contract import Assignment
from mlx_fleet.routing import names

from .records import DeploymentKey, Slot

__all__ = ["claims", "rivals", "to_wake", "deployment_id"]

#: Each deployment's assignments: ``Runtime.placed``.
Placed = Mapping[DeploymentKey, Mapping[Slot, Assignment]]


def deployment_id(key: DeploymentKey) -> str:
    """``"namespace/name"``: how a condition message (and the router's 409) names a
    deployment."""
    return f"{key[0]}/{key[1]}"


def claims(placed: Placed) -> Iterator[tuple[str, str]]:
    """``(served name, "namespace/name")`` for every assignment of every deployment."""
    for key, slots in placed.items():
        did = deployment_id(key)
        for a in slots.values():
            yield a.served_model_name, did


def rivals(key: DeploymentKey, placed: Placed) -> dict[str, tuple[str, ...]]:
    """``key``'s served names that another deployment of ``placed`` claims too → those
    deployments (``"namespace/name"``, sorted); empty when none."""
    return names.rivals(deployment_id(key), claims(placed))


def to_wake(before: Mapping[str, tuple[str, ...]],
            after: Mapping[str, tuple[str, ...]]) -> set[DeploymentKey]:
    """One deployment's :func:`rivals` before and after its claims changed → the other
    deployments to re-sync: every rival on either side when they differ (a rival gained must
    show the conflict, a rival lost must clear it), none otherwise."""
    if before == after:
        return set()
    out: set[DeploymentKey] = set()
    for others in (*before.values(), *after.values()):
        for did in others:
            ns, _, name = did.partition("/")
            out.add((ns, name))
    return out
