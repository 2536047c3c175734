"""Garbage collection of orphaned assignments: every ``gc_interval`` seconds (``--gc-interval``,
default :data:`~.config.GC_SECONDS`), from start-up whether or not any ModelDeployment exists,
delete the assignments whose ModelDeployment is gone (finalizer removed by hand, operator down
during a delete ...), judged against a listing of the live objects from the API server
(:func:`list_live_deployments`); the decision is :func:`.reconcile.collect_garbage`'s."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from mlx_fleet.store import StoreError

from .config import listed_namespaces
from .kube import GROUP, PLURAL, VERSION
from .records import DeploymentKey
from .reconcile import collect_garbage
from .runtime import Runtime

if TYPE_CHECKING:
    from kubernetes.client import CustomObjectsApi

__all__ = ["ListingError", "list_live_deployments", "collect_orphans", "start"]

log = logging.getLogger(__name__)
#: The task's name (its health is in ``Runtime.followers`` under it).
TASK = "assignment gc"


class ListingError(Exception):
    """The live ModelDeployments could not be listed (so nothing may be collected)."""


def list_live_deployments(api: CustomObjectsApi, namespaces: tuple[str, ...]
                          ) -> dict[DeploymentKey, set[str]]:
    """(namespace, name) → uids of the ModelDeployments that exist, straight from the API
    server (a complete listing, unlike an index a watch is still filling). Exact namespace
    names are listed one by one; with no ``--namespace`` or a glob pattern, cluster-wide (the
    caller filters by scope). Blocking; raises :class:`ListingError`."""
    listed = listed_namespaces(namespaces)
    try:
        if listed is not None:
            items = [o for ns in listed for o in api.list_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, _request_timeout=30)["items"]]
        else:
            items = api.list_cluster_custom_object(GROUP, VERSION, PLURAL,
                                                   _request_timeout=30)["items"]
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise ListingError(f"{type(e).__name__}: {first_line}") from e
    live: dict[DeploymentKey, set[str]] = {}
    for o in items:
        meta = o.get("metadata") or {}
        live.setdefault((meta["namespace"], meta["name"]), set()).add(meta.get("uid", ""))
    return live


async def collect_orphans(rt: Runtime) -> list[str]:
    """Delete assignments whose ModelDeployment is gone (finalizer removed by hand, operator
    down during a delete ...), in watched namespaces only, judged against a listing of the
    live objects from the API server (taken after etcd is read; see
    :func:`.reconcile.collect_garbage`). No listing, no collection. The object is gone, so
    there is nothing to post an event on: the deletion is only logged."""
    if rt.list_live is None:
        return []
    list_live = rt.list_live

    async def live() -> dict[DeploymentKey, set[str]]:
        return await asyncio.to_thread(list_live)

    try:
        return await collect_garbage(rt.store, rt.keys, live, rt.in_scope, writer=rt.writer)
    except StoreError as e:
        log.warning("garbage collection skipped: etcd: %s", e)
    except ListingError as e:
        log.warning("garbage collection skipped: cannot list ModelDeployments: %s", e)
    return []



def start(rt: Runtime) -> None:
    """Start the collector: :func:`collect_orphans` every ``rt.gc_interval`` seconds."""

    async def loop() -> None:
        while True:
            await collect_orphans(rt)
            await asyncio.sleep(rt.gc_interval)

    rt.start_task(TASK, loop)
