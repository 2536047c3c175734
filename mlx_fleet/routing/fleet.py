"""What a fleet router routes to, per Mac: the document of the router's ``GET /fleet``.

One definition of the shape, shared by the router (:mod:`mlx_fleet_router.fleet` builds it)
and ``mlx-fleet status --router`` (:mod:`mlx_fleet.fleetstatus` reads it), so neither keeps a
second copy of a field name. Pure (pydantic only).

Shape (JSON)::

    {"object": "fleet",
     "macs": [{"node": "mac-1", "state": "open", "reason": "ConnectionRefused",
               "in_flight": 0, "half_open_in_seconds": 41.5, "trial_in_flight": false,
               "deployments": ["team/chat"]}, ...]}

``state`` is the breaker's phase at the time of the answer (an open breaker past its cooldown is
``half-open``; :func:`mlx_fleet_router.breaker.phase`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["BreakerState", "RoutedMac", "FleetRouting"]

#: The circuit breaker's phases, as :class:`mlx_fleet_router.breaker.Phase` spells them.
BreakerState = Literal["closed", "open", "half-open"]


class RoutedMac(BaseModel):
    """One Mac as one router process sees it.

    ``node``: the Mac's node name. ``state``: its breaker's phase. ``reason``: why the breaker
    last opened (``ErrorRate``, ``HealthProbes``, ``ConnectionRefused``, ``TrialFailed``; ``""``
    if never). ``in_flight``: this router's requests to it now (all deployments).
    ``half_open_in_seconds``: while ``open``, seconds until the cooldown ends and one trial may
    go (≥ 0); None otherwise. ``trial_in_flight``: while ``half-open``, the one trial request or
    probe is out. ``deployments``: the ``namespace/name`` of the deployments the router may send
    to this Mac (its Ready replicas in the routing table), sorted; empty for a Mac that left the
    table with requests still in flight."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    node: str
    state: BreakerState = "closed"
    reason: str = ""
    in_flight: int = Field(default=0, ge=0)
    half_open_in_seconds: float | None = Field(default=None, ge=0)
    trial_in_flight: bool = False
    deployments: tuple[str, ...] = ()


class FleetRouting(BaseModel):
    """The router's ``GET /fleet`` answer: ``macs`` sorted by node."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    object: Literal["fleet"] = "fleet"
    macs: tuple[RoutedMac, ...] = ()
