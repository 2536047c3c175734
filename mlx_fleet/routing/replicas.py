"""When a replica serves, and the endpoints of a set of replicas: one definition for the
operator's placement (``reconcile``), its status (``status.readyReplicas``, ``status.endpoints``),
the canary (candidate Ready, the split's ``candidate_endpoints``) and the fleet router's
candidates.

A replica *serves* when its agent reports it ``Ready``, or in standby
(:func:`mlx_fleet.contract.is_standby`: unloaded for idleness, evicted, awaiting its first
request, or reloading on demand — a request loads it, so it counts as serving). Whether the
report is current (its ``generation`` that of the stored assignment) and whether the replica is
withdrawn (a drained Mac's) are the caller's filters: they differ between callers.

Pure: :mod:`mlx_fleet.contract` only.
"""

from __future__ import annotations

from collections.abc import Iterable

from mlx_fleet.contract import AssignmentState, is_standby

__all__ = ["serves", "endpoints"]


def serves(state: str, reason: str) -> bool:
    """True when a replica whose report says ``state`` (an :class:`AssignmentState` value, or the
    member itself) with ``reason`` answers requests: ``Ready``, or standby."""
    return state == AssignmentState.READY.value or is_standby(state, reason)


def endpoints(replicas: Iterable[tuple[str, str, str]]) -> list[str]:
    """The endpoints (base URLs) of the replicas that :func:`serves`: sorted, each once, empty
    ones left out. ``replicas``: ``(state, reason, endpoint)`` per replica."""
    return sorted({endpoint for state, reason, endpoint in replicas
                   if endpoint and serves(state, reason)})
