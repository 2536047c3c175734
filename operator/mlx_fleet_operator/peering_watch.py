"""Which replica exports the fleet metrics, with kopf peering (``--peering``): every
:data:`.peering.POLL_SECONDS`, read kopf's peering objects and keep ``Runtime.fleet_active``
to :func:`.peering.peering_active` (the pure rule; False until the first read)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import peering
from .config import PeeringConfig
from .runtime import Runtime

if TYPE_CHECKING:
    from kubernetes.client import CustomObjectsApi

__all__ = ["start", "read_statuses"]

#: The task's name (its health is in ``Runtime.followers`` under it).
TASK = "peering"


def read_statuses(api: CustomObjectsApi, cfg: PeeringConfig, namespaces: tuple[str, ...]
                  ) -> list[Mapping[str, Any] | None]:
    """The ``status`` of each peering object this replica takes part in (None where it has
    none): the ClusterKopfPeering when cluster-wide, else the KopfPeering of each watched
    namespace that is not a glob pattern. Blocking; raises the client's ``ApiException``."""
    if cfg.clusterwide:
        return [api.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings",
                                              cfg.name).get("status")]
    concrete = [ns for ns in namespaces if not any(c in ns for c in "*?[")]
    return [api.get_namespaced_custom_object("kopf.dev", "v1", ns, "kopfpeerings",
                                             cfg.name).get("status") for ns in concrete]


def start(rt: Runtime, api: CustomObjectsApi, cfg: PeeringConfig,
          namespaces: tuple[str, ...]) -> None:
    """Follow the peering objects (module docstring)."""
    rt.set_fleet_active(False)

    async def loop() -> None:
        while True:
            statuses = await asyncio.to_thread(read_statuses, api, cfg, namespaces)
            rt.set_fleet_active(peering.peering_active(
                statuses, cfg.identity, cfg.priority, dt.datetime.now(dt.timezone.utc)))
            await asyncio.sleep(peering.POLL_SECONDS)

    rt.start_task(TASK, loop)
