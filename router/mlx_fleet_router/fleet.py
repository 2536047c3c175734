"""The router's view of what it routes to (``GET /fleet``): a pure function of the routing
table, the Macs' breakers and this router's in-flight counts.

:func:`view` → :class:`mlx_fleet.routing.fleet.FleetRouting` (the shape ``mlx-fleet status
--router`` reads). Pure: :mod:`~mlx_fleet_router.breaker`, :mod:`~mlx_fleet_router.table` and
the shared model only; ``now`` is seconds of the breakers' monotonic clock.
"""

from __future__ import annotations

from collections.abc import Mapping

from mlx_fleet.routing.fleet import FleetRouting, RoutedMac

from . import breaker
from .table import Table

__all__ = ["view"]


def view(table: Table, breakers: Mapping[str, breaker.State],
         in_flight: Mapping[tuple[str, str], int], config: breaker.BreakerConfig,
         now: float) -> FleetRouting:
    """One :class:`~mlx_fleet.routing.fleet.RoutedMac` per Mac in ``table`` (a Ready replica of
    a served name), in ``breakers`` or with requests in ``in_flight`` (``(deployment, node)`` →
    count), sorted by node. A Mac without a breaker record is ``closed``. An open breaker's
    ``half_open_in_seconds`` is ``cooldown_seconds`` minus the time since it opened
    (:func:`~mlx_fleet_router.breaker.phase` decides when it is half-open, so the two agree);
    a half-open breaker's ``trial_in_flight`` is ``not admits(...)`` (a trial out and not yet
    stale)."""
    deployments: dict[str, set[str]] = {}
    for served in table.models.values():
        for r in served.replicas:
            deployments.setdefault(r.node, set()).add(served.deployment)
    counts: dict[str, int] = {}
    for (_, node), n in in_flight.items():
        counts[node] = counts.get(node, 0) + n
    macs = []
    for node in sorted(set(deployments) | set(breakers) | set(counts)):
        st = breakers.get(node, breaker.CLOSED)
        p = breaker.phase(config, st, now)
        macs.append(RoutedMac(
            node=node, state=p.value, reason=st.reason, in_flight=counts.get(node, 0),
            half_open_in_seconds=(max(0.0, config.cooldown_seconds - (now - st.since))
                                  if p is breaker.Phase.OPEN else None),
            trial_in_flight=(p is breaker.Phase.HALF_OPEN
                             and not breaker.admits(config, st, now)),
            deployments=tuple(sorted(deployments.get(node, ())))))
    return FleetRouting(macs=tuple(macs))
