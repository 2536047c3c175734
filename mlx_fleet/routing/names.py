"""Served-name conflicts: two deployments claiming one served model name (the OpenAI ``model``
id) in one scope. One rule for the fleet router, which refuses such a name (409
``model_name_conflict``), and the operator, which marks both ModelDeployments with a
``ServedNameConflict`` condition.

A deployment *claims* a name as soon as any of its assignments names it
(``Assignment.served_model_name``: ``spec.model.servedModelName``, else ``metadata.name`` —
:meth:`mlx_fleet_operator.spec.DeploymentSpec.served_name`), Ready or not; a deployment with no
assignment (0 replicas) claims nothing. The scope (which deployments count) is the caller's:
the router's ``--namespace`` flags, the operator's watched namespaces.

Pure: the standard library only.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TypeVar

__all__ = ["conflicts", "rivals"]

D = TypeVar("D", bound=Hashable)


def conflicts(claims: Iterable[tuple[str, D]]) -> dict[str, tuple[D, ...]]:
    """``(served name, deployment)`` pairs (a deployment may appear many times, e.g. once per
    assignment) → served name → the deployments claiming it, sorted, for each name claimed by
    two deployments or more. Deployments are any sortable ids (``"namespace/name"`` or a
    ``(namespace, name)`` tuple)."""
    by_name: dict[str, set[D]] = {}
    for name, deployment in claims:
        by_name.setdefault(name, set()).add(deployment)
    return {name: tuple(sorted(ds)) for name, ds in by_name.items()  # type: ignore[type-var]
            if len(ds) > 1}


def rivals(deployment: D, claims: Iterable[tuple[str, D]]) -> dict[str, tuple[D, ...]]:
    """The conflicts ``deployment`` is part of: each of its served names claimed by another
    deployment too → those other deployments, sorted (empty: no conflict)."""
    return {name: tuple(d for d in ds if d != deployment)
            for name, ds in conflicts(claims).items() if deployment in ds}
