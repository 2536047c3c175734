"""The MacNode mirror: every :data:`MACNODE_SECONDS`, on node events and when a MacNode's
cordon or drain changes — at most one round per :data:`MACNODE_MIN_SECONDS` — each node record
in etcd becomes a cluster-scoped ``MacNode`` (status only; what it says is :mod:`.macnodes`'s
pure functions), and the MacNodes' ``spec.unschedulable`` (cordons), ``spec.drain``
(drains) and ``metadata.labels`` (the cluster admin's labels) are read back into
``Runtime.cordoned`` / ``Runtime.draining`` / ``Runtime.node_labels``, which placement
honours: no new replica on a cordoned node, every replica of a draining one replaced
elsewhere (:mod:`.rollout`, *Drain*), node selectors matched against the admin's labels
(:mod:`.node_claims`). A record whose claims placement ignores or clamps is logged once per
change (and shown in the MacNode's ``ClaimsAccepted`` condition). The mirror starts once the node view is loaded (never
mark every MacNode Gone before etcd was read). API errors (no MacNode CRD, no permission ...)
are logged and retried next round, never fatal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from mlx_fleet.contract import Assignment, NodeRecord
from mlx_fleet.supervise import wait_event

from . import macnodes
from .node_claims import CLAIMS_CONDITION
from .kube import GROUP, MACNODE_PLURAL, VERSION
from .runtime import Runtime

if TYPE_CHECKING:
    from kubernetes.client import CustomObjectsApi

__all__ = ["MACNODE_SECONDS", "MACNODE_MIN_SECONDS", "MacNodeMirror", "macnode_round", "start"]

log = logging.getLogger(__name__)

#: Seconds between MacNode mirror rounds (node events wake it sooner).
MACNODE_SECONDS = 5.0
#: Seconds at least between two MacNode mirror rounds: each lists every MacNode, and while
#: placements land back to back every write would wake another round (measured: 37 rounds
#: listing 1 000 MacNodes while 500 deployments converged); changes meanwhile are coalesced.
MACNODE_MIN_SECONDS = 1.0
#: The task's name (its health is in ``Runtime.followers`` under it).
TASK = "macnode mirror"


def macnode_round(api: CustomObjectsApi, nodes: Mapping[str, NodeRecord],
                  on_node: Mapping[str, Iterable[Assignment]], cache: dict[str, dict[str, Any]],
                  blocked: Mapping[str, str]
                  ) -> tuple[frozenset[str], frozenset[str], dict[str, dict[str, str]]]:
    """One blocking mirror round: list the MacNodes, create the missing ones, patch changed
    statuses (``cache`` is updated); returns the cordoned and the draining node names and each
    MacNode's labels. ``blocked``: node → why replicas on it cannot move (drain)."""
    import kubernetes

    from .status import now_rfc3339

    items = api.list_cluster_custom_object(GROUP, VERSION, MACNODE_PLURAL,
                                           _request_timeout=30)["items"]
    cordoned = macnodes.cordoned(items)
    draining = macnodes.draining(items)
    labels_of = macnodes.operator_labels(items)
    existing = {o["metadata"]["name"]: o for o in items}
    now = now_rfc3339()

    def generation(name: str) -> int:
        return int(((existing.get(name) or {}).get("metadata") or {}).get("generation") or 0)

    def patch(name: str, status: dict[str, Any]) -> None:
        try:
            api.patch_cluster_custom_object_status(
                GROUP, VERSION, MACNODE_PLURAL, name, {"status": status},
                _content_type="application/merge-patch+json", _request_timeout=30)
        except kubernetes.client.ApiException as e:
            if e.status != 404:  # deleted meanwhile: recreated next round
                raise
            cache.pop(name, None)
            return
        cache[name] = status

    for name, rec in sorted(nodes.items()):
        if name not in existing:
            try:
                # the created object (its metadata.generation, 1): the status patched below
                # then carries the right observedGeneration at once, not 0 and again 1 the
                # next round (measured: a second patch of every new MacNode)
                existing[name] = api.create_cluster_custom_object(
                    GROUP, VERSION, MACNODE_PLURAL, macnodes.new_macnode(name),
                    _request_timeout=30)
                log.info("MacNode %s created", name)
            except kubernetes.client.ApiException as e:
                if e.status != 409:
                    raise
            cache.pop(name, None)
        previous = cache.get(name) or (existing.get(name) or {}).get("status")
        status = macnodes.macnode_status(rec, on_node.get(name, ()),
                                         unschedulable=name in cordoned,
                                         draining=name in draining, blocked=blocked.get(name, ""),
                                         generation=generation(name), previous=previous, now=now)
        if macnodes.status_changed(previous, status):
            _log_claims(name, previous, status)
            patch(name, status)
    for name, obj in sorted(existing.items()):
        labels = obj["metadata"].get("labels") or {}
        if name in nodes or labels.get(macnodes.MANAGED_LABEL) != macnodes.MANAGED_VALUE:
            continue
        previous = cache.get(name) or obj.get("status") or {}
        status = macnodes.gone_status(previous, unschedulable=name in cordoned,
                                      draining=name in draining, generation=generation(name),
                                      now=now)
        if macnodes.status_changed(previous, status):
            if previous.get("health") != macnodes.GONE:
                log.info("MacNode %s: node record gone; health Gone (kept for its cordon)", name)
            patch(name, status)
    for name in set(cache) - set(existing) - set(nodes):
        cache.pop(name, None)
    return cordoned, draining, labels_of


def _claims(status: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return next((c for c in (status or {}).get("conditions") or []
                 if isinstance(c, Mapping) and c.get("type") == CLAIMS_CONDITION), {})


def _log_claims(name: str, previous: Mapping[str, Any] | None,
                status: Mapping[str, Any]) -> None:
    """A warning when node ``name``'s claims turn (or stay, with another message) not
    accepted."""
    new, old = _claims(status), _claims(previous)
    if new.get("status") == "False" and new.get("message") != old.get("message"):
        log.warning("node %s: %s", name, new.get("message"))


class MacNodeMirror:
    """The mirror's rounds over ``rt`` (module docstring); ``cache``: MacNode name → the
    status last written (or read), so unchanged statuses are not patched again."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.cache: dict[str, dict[str, Any]] = {}

    async def mirror(self) -> None:
        """One round: ``rt.nodes`` (with ``rt.placed`` for reserved memory and models,
        ``rt.drains()`` for a drain's progress) into MacNodes, their cordons and drains into
        ``rt.mark_nodes`` when they changed (which wakes every deployment)."""
        rt = self.rt
        if rt.custom_api is None:
            return
        on_node: dict[str, list[Assignment]] = {}
        for placed in rt.placed.values():
            for (node, _rev), a in placed.items():
                on_node.setdefault(node, []).append(a)
        why: dict[str, list[str]] = {}
        for (ns, name), drain in sorted(rt.drains().items()):
            for node in sorted({n for n, _ in drain.moving}) if drain.blocked else ():
                why.setdefault(node, []).append(f"{ns}/{name}: {drain.blocked}")
        blocked = {node: "; ".join(texts) for node, texts in why.items()}
        try:
            cordoned, draining, labels = await asyncio.to_thread(
                macnode_round, rt.custom_api, dict(rt.nodes), on_node, self.cache, blocked)
        except Exception as e:
            first_line = (str(e).strip().splitlines() or [""])[0]
            log.warning("MacNode mirror round failed: %s: %s", type(e).__name__, first_line)
            return
        if cordoned != rt.cordoned or draining != rt.draining or labels != rt.node_labels:
            log.info("cordoned nodes: %s; draining: %s", ", ".join(sorted(cordoned)) or "none",
                     ", ".join(sorted(draining)) or "none")
            rt.mark_nodes(cordoned, draining, labels)

    async def run(self) -> None:
        """The rounds, rate-limited, woken by ``rt.macnode_wake``."""
        rt = self.rt
        await rt.views.node_view.synced.wait()  # never mark every MacNode Gone before etcd was read
        while True:
            rt.macnode_wake.clear()
            await self.mirror()
            await asyncio.sleep(MACNODE_MIN_SECONDS)  # rate limit (wake-ups meanwhile count)
            await wait_event(rt.macnode_wake, MACNODE_SECONDS - MACNODE_MIN_SECONDS)


def start(rt: Runtime) -> None:
    """Start the mirror (module docstring)."""
    rt.start_task(TASK, MacNodeMirror(rt).run)


def spec_differs(rt: Runtime, name: str, spec: Mapping[str, Any] | None) -> bool:
    """Whether MacNode ``name``'s ``spec`` asks for another cordon or drain than the operator
    applies now (then a round should run at once)."""
    spec = spec or {}
    cordon, drain = spec.get("unschedulable") is True, spec.get("drain") is True
    return (cordon, cordon and drain) != (name in rt.cordoned, name in rt.draining)
