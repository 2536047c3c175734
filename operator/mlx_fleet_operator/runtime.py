"""The operator's in-memory state, one object: :class:`Runtime`.

Created by the start-up handler and kept in kopf's operator ``memo`` (``memo.runtime``;
:func:`runtime` reads it back in every handler): no module globals. It holds

* the etcd store and key layout, and the followed views (:class:`~.followers.EtcdViews`);
* one :class:`~.records.DeploymentRecord` per ModelDeployment, forgotten in one place
  (:meth:`Runtime.forget`), and one :class:`~.records.CanaryRecord` per Canary;
* the running Canaries' candidate intents and their daemons' wake-ups;
* the disruption holds (:class:`~.holds.NodeHolds`), the cordoned and draining nodes (read
  from the MacNodes by :mod:`.macnode_mirror`), whether this replica exports the fleet metrics
  (:mod:`.peering_watch`);
* the background tasks it started (each supervised, its health feeding the liveness probe),
  stopped by :meth:`Runtime.close`.

Its state changes only through its own methods (and the records' and views' own); the
background loops live in their own modules (:mod:`.followers`, :mod:`.orphan_gc`,
:mod:`.macnode_mirror`, :mod:`.peering_watch`, :mod:`.status_writer`, :mod:`.holds`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import kopf

from mlx_fleet.contract import Assignment, AssignmentReport, Keys, NodeRecord, StatsReport
from mlx_fleet.source_policy import DEFAULT_POLICY, SourcePolicy
from mlx_fleet.store import CLOSE_TIMEOUT_SECONDS, Snapshot, Store, WatchEvent, follow_prefix
from mlx_fleet.supervise import TaskHealth, supervise

from . import metrics, served_names, status_writer
from .config import GC_SECONDS
from .followers import EtcdViews
from .holds import NodeHolds
from .kube import PLURAL, patch_object
from .placement import affected_by_node
from .records import (CandidateIntent, CanaryRecord, DeploymentKey, DeploymentRecord,
                      ReleasedCandidate, Slot, SyncedSpec)
from .reconcile import ParseMemo
from .rollout import DrainState
from .view import AssignmentsView

if TYPE_CHECKING:
    from kubernetes.client import CustomObjectsApi

__all__ = ["Runtime", "runtime"]

log = logging.getLogger(__name__)

#: Lists the live ModelDeployments ((namespace, name) → uids); blocking (run in a thread).
ListLive = Callable[[], dict[DeploymentKey, set[str]]]


class Runtime:
    """The operator's in-memory state (module docstring).

    ``store``/``keys``: etcd and its key layout; ``writer``: this operator's name on its etcd
    transactions; ``in_scope(namespace)``: whether it watches a namespace (garbage collection
    stays inside); ``gc_interval``: seconds between orphan collections; ``custom_api``: the
    Kubernetes client (None: no MacNode mirror, no status patches through it);
    ``list_live``: lists the live ModelDeployments (None: no garbage collection);
    ``patch_status(key, status)``: patches a ModelDeployment's status (default: through
    ``custom_api``); ``clock``: the disruption rule's clock (seconds, monotonic);
    ``router_url``: the fleet router's base URL shown in each ``status.router`` (None: no
    router)."""

    def __init__(self, store: Store, keys: Keys, writer: str,
                 in_scope: Callable[[str], bool] = lambda ns: True,
                 gc_interval: float = GC_SECONDS, *,
                 custom_api: CustomObjectsApi | None = None, list_live: ListLive | None = None,
                 patch_status: status_writer.PatchStatus | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 router_url: str | None = None,
                 source_policy: SourcePolicy = DEFAULT_POLICY) -> None:
        self.store = store
        #: the fleet's source policy, judging each spec's model source (:mod:`.admission`)
        self.source_policy = source_policy
        self.keys = keys
        self.writer = writer
        self.in_scope = in_scope
        self.gc_interval = gc_interval
        self.router_url = router_url
        self.custom_api = custom_api
        self.list_live = list_live
        self._patch_status = patch_status or self._patch_status_api
        self.holds = NodeHolds(lambda: self.views.nodes.keys(), self._wake_for, clock)
        self.views = EtcdViews(store, keys, self, self.holds)
        self._deployments: dict[DeploymentKey, DeploymentRecord] = {}
        #: target ModelDeployment → the candidate its running Canary keeps resident (set by
        #: the Canary handlers through :meth:`keep_candidate`; read by the reconcile).
        self._candidates: dict[DeploymentKey, CandidateIntent] = {}
        #: target ModelDeployment → wake-up of the Canary daemon following it.
        self._canary_wakeups: dict[DeploymentKey, asyncio.Event] = {}
        #: Canary uid → what its daemon keeps between ticks (:mod:`.canary_handlers`).
        self._canaries: dict[str, CanaryRecord] = {}
        self.tasks: list[asyncio.Task[None]] = []
        #: Task name → its health (the liveness probe and the ``task_up`` metric read it).
        self.followers: dict[str, TaskHealth] = {}
        #: Whether this replica exports the fleet metric families (fleet_metrics): always when
        #: standalone; with peering, while it is the active peer (:mod:`.peering_watch`).
        self.fleet_active = True
        #: Nodes cordoned through their MacNode's ``spec.unschedulable`` (no new replicas).
        self.cordoned: frozenset[str] = frozenset()
        #: Nodes drained through their MacNode's ``spec.drain`` (replicas moved elsewhere).
        self.draining: frozenset[str] = frozenset()
        #: MacNode name → its ``metadata.labels`` (the cluster admin's), which node selectors
        #: match (:mod:`.node_claims`).
        self.node_labels: dict[str, dict[str, str]] = {}
        #: Held by every reconcile's read-plan-write (reconcile.reconcile's ``serialize``).
        self.placement_lock = asyncio.Lock()
        #: Parsed node records and assignments reused between reconciles (reconcile.ParseMemo).
        self.fleet_memo = (ParseMemo(), ParseMemo())
        #: Set when what a MacNode shows may have changed: wakes the mirror.
        self.macnode_wake = asyncio.Event()

    # -- the followed views (read-only here; kept by .followers) ----------------------------
    @property
    def nodes(self) -> dict[str, NodeRecord]:
        return self.views.nodes

    @property
    def reports(self) -> dict[DeploymentKey, dict[Slot, AssignmentReport]]:
        return self.views.reports

    @property
    def stats(self) -> dict[DeploymentKey, dict[str, StatsReport]]:
        return self.views.stats

    @property
    def assignments(self) -> AssignmentsView:
        return self.views.assignments

    def placement_nodes(self) -> dict[str, NodeRecord] | None:
        """The followed node records for placement, None until the follower's first listing
        (a reconcile then lists ``nodes/`` itself)."""
        return self.views.nodes if self.views.node_view.synced.is_set() else None

    def held_nodes(self) -> frozenset[str]:
        """The vanished nodes whose replicas placement keeps (:meth:`.holds.NodeHolds.held`)."""
        return self.holds.held()

    # -- per-deployment records -------------------------------------------------------------
    def deployment(self, key: DeploymentKey) -> DeploymentRecord:
        """``key``'s record, created empty the first time."""
        rec = self._deployments.get(key)
        if rec is None:
            rec = self._deployments[key] = DeploymentRecord()
        return rec

    def existing(self, key: DeploymentKey) -> DeploymentRecord | None:
        """``key``'s record if it has one (never creates it)."""
        return self._deployments.get(key)

    def forget(self, key: DeploymentKey) -> None:
        """The ModelDeployment ``key`` is deleted: drop its record, and stop its status
        writer (a status still queued is dropped: the object is gone). The deployments it
        shared a served name with are woken (their ``ServedNameConflict`` clears)."""
        rivals = served_names.rivals(key, self.placed)
        rec = self._deployments.pop(key, None)
        self.wake(served_names.to_wake(rivals, {}))
        if rec is not None and rec.status.writer is not None:
            rec.status.writer.cancel()

    @property
    def placed(self) -> dict[DeploymentKey, dict[Slot, Assignment]]:
        """ModelDeployment → its (node, revision) assignments as last reconciled (a new dict;
        safe to call from the metrics thread: the records are copied in one C-level call)."""
        return {key: rec.placed for key, rec in dict(self._deployments).items()}

    @property
    def unsettled(self) -> set[DeploymentKey]:
        """The ModelDeployments whose last reconcile left something open."""
        return {key for key, rec in dict(self._deployments).items() if rec.unsettled}

    def drains(self) -> dict[DeploymentKey, DrainState]:
        """ModelDeployment → its replicas on draining nodes, as last reconciled."""
        return {key: rec.drain for key, rec in self._deployments.items()}

    def synced(self, key: DeploymentKey) -> SyncedSpec | None:
        """``key``'s valid spec as last synced (None: never synced, or deleted)."""
        rec = self._deployments.get(key)
        return rec.synced if rec is not None else None

    # -- wake-ups ----------------------------------------------------------------------------
    def wake(self, keys: Iterable[DeploymentKey]) -> None:
        """Wake the daemons of ``keys`` (those that have a record; others are not followed)."""
        for key in keys:
            rec = self._deployments.get(key)
            if rec is not None:
                rec.wake.set()

    def wake_all(self) -> None:
        for rec in list(self._deployments.values()):
            rec.wake.set()

    def rearm(self, key: DeploymentKey, delay: float) -> None:
        """Wake ``key``'s daemon again in ``delay`` seconds (a prompt retry, not the resync)."""
        asyncio.get_running_loop().call_later(delay, self.deployment(key).wake.set)

    def node_changed(self, name: str, what: str) -> None:
        """What placement looks at of node ``name`` changed (``what``: appeared, changed,
        gone): wake the deployments it concerns (placement's ``affected_by_node``)."""
        affected = affected_by_node(name, self.placed, self.unsettled)
        log.info("node %s %s; re-placing the %d deployment(s) it concerns", name, what,
                 len(affected))
        self.wake(affected)

    def _wake_for(self, names: set[str], what: str) -> None:
        """Nodes judged gone or released from a hold: re-place what they concern."""
        if not names:
            return
        placed, unsettled = self.placed, self.unsettled
        affected: set[DeploymentKey] = set()
        for name in names:
            affected |= affected_by_node(name, placed, unsettled)
        log.info("node(s) %s %s; re-placing the %d deployment(s) they concern",
                 ", ".join(sorted(names)), what, len(affected))
        self.wake(affected)
        self.macnode_wake.set()

    def macnodes_changed(self) -> None:
        """Something a MacNode shows may have changed: wake the mirror."""
        self.macnode_wake.set()

    def mark_nodes(self, cordoned: frozenset[str], draining: frozenset[str],
                   labels: dict[str, dict[str, str]] | None = None) -> None:
        """The nodes cordoned and drained through their MacNodes now, and the MacNodes' labels
        (unchanged when None): every deployment is woken (placement honours all three)."""
        self.cordoned, self.draining = cordoned, draining
        if labels is not None:
            self.node_labels = labels
        self.wake_all()

    def set_fleet_active(self, active: bool) -> None:
        """Whether this replica exports the fleet metric families (:mod:`.peering_watch`)."""
        self.fleet_active = active

    # -- Canary intents, wake-ups and records -----------------------------------------------
    def candidate(self, target: DeploymentKey) -> CandidateIntent | None:
        """The candidate a running Canary keeps resident on ``target`` (None: none)."""
        return self._candidates.get(target)

    @property
    def candidates(self) -> dict[DeploymentKey, CandidateIntent]:
        """target → the candidate its running Canary keeps resident (a copy)."""
        return dict(self._candidates)

    def seed_candidates(self, candidates: Mapping[DeploymentKey, CandidateIntent]) -> None:
        """At start-up: the running Canaries' candidates (before any deployment resumes)."""
        self._candidates = dict(candidates)

    def keep_candidate(self, target: DeploymentKey, intent: CandidateIntent) -> None:
        """``intent.canary`` keeps its candidate on ``target``: a change wakes the target."""
        if self._candidates.get(target) != intent:
            self._candidates[target] = intent
            self.deployment(target).released_candidate = None
            self.deployment(target).wake.set()

    def release_candidate(self, target: DeploymentKey, canary: str,
                          now: float | None = None) -> bool:
        """The Canary ``canary`` no longer keeps a candidate on ``target`` (another Canary's
        intent is left alone); call it once the target's traffic split is removed. The
        target's reconcile unloads the candidate the endpoint grace after ``now``
        (``time.monotonic()`` by default; :meth:`.records.DeploymentRecord.resident_candidate`).
        Returns whether it held one."""
        owner = self._candidates.get(target)
        if owner is None or owner.canary != canary:
            return False
        del self._candidates[target]
        rec = self.deployment(target)
        rec.released_candidate = ReleasedCandidate(
            owner, time.monotonic() if now is None else now)
        rec.wake.set()
        return True

    def canary_wakeup(self, target: DeploymentKey) -> asyncio.Event:
        """The wake-up of the Canary daemon following ``target`` (created the first time)."""
        return self._canary_wakeups.setdefault(target, asyncio.Event())

    def wake_canary(self, target: DeploymentKey) -> None:
        ev = self._canary_wakeups.get(target)
        if ev is not None:
            ev.set()

    def canary(self, uid: str) -> CanaryRecord:
        """The record of the Canary ``uid`` (a new, empty one the first time)."""
        return self._canaries.setdefault(uid, CanaryRecord())

    def forget_canary(self, uid: str) -> None:
        """The Canary ``uid`` is gone: drop its record."""
        self._canaries.pop(uid, None)

    # -- status (.status_writer) -------------------------------------------------------------
    async def _patch_status_api(self, key: DeploymentKey, status: dict[str, Any]) -> None:
        if self.custom_api is None:
            raise RuntimeError("no Kubernetes client to patch the status with")
        await patch_object(self.custom_api, PLURAL, key[0], key[1], {"status": status},
                           status=True)

    def queue_status(self, key: DeploymentKey, status: dict[str, Any]) -> None:
        """Queue ``status`` for ``key``'s ModelDeployment (:func:`.status_writer.queue`)."""
        status_writer.queue(key, self.deployment(key).status, status, self._patch_status)

    async def flush_status(self, key: DeploymentKey) -> None:
        """Patch ``key``'s queued status now (:func:`.status_writer.flush`)."""
        rec = self._deployments.get(key)
        if rec is not None:
            await status_writer.flush(key, rec.status, self._patch_status)

    # -- background tasks --------------------------------------------------------------------
    def start_task(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run ``run()`` as a task named ``name`` under :func:`mlx_fleet.supervise.supervise`
        (logged and restarted with backoff if it fails; the liveness probe fails meanwhile)."""
        health = self.followers[name] = TaskHealth(name)
        self.tasks.append(asyncio.create_task(supervise(health, run), name=name))

    def start_followers(self) -> None:
        """Start the etcd followers (:meth:`.followers.EtcdViews.followers`); each re-list
        after the first is counted (``mlxfleet_operator_watch_restarts_total``)."""
        for name, prefix, on_snapshot, on_event in self.views.followers():
            counted = metrics.relists_counted(name.rsplit(" ", 1)[-1], on_snapshot)

            def run(prefix: str = prefix,
                    on_snapshot: Callable[[Snapshot], Awaitable[None]] = counted,
                    on_event: Callable[[WatchEvent], Awaitable[None]] = on_event
                    ) -> Awaitable[None]:
                return follow_prefix(self.store, prefix, on_snapshot, on_event)

            self.start_task(name, run)

    async def close(self) -> None:
        """Cancel the node-judging timers and every task this runtime started (followers,
        collectors, status writers), wait up to :data:`~mlx_fleet.store.CLOSE_TIMEOUT_SECONDS`
        for them to end, then close the store. A task still running then is logged with where
        it waits, and abandoned: closing never hangs (a start-up failure or a shutdown must end
        the process)."""
        self.holds.close()
        tasks = [*self.tasks, *(rec.status.writer for rec in self._deployments.values()
                                if rec.status.writer is not None)]
        for t in tasks:
            t.cancel()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_SECONDS)
            for t in done:
                if not t.cancelled():
                    t.exception()  # retrieved: its failure was logged by its supervisor
            for t in pending:
                frames = t.get_stack(limit=1)
                where = (f"{frames[0].f_code.co_filename}:{frames[0].f_lineno}" if frames
                         else "unknown")
                log.warning("task %r did not stop within %.0f s of being cancelled (waiting "
                            "at %s); abandoned", t.get_name(), CLOSE_TIMEOUT_SECONDS, where)
        await self.store.close()


def runtime(memo: Mapping[str, Any]) -> Runtime:
    """The operator's :class:`Runtime`, kept in kopf's ``memo`` under ``runtime`` by the
    start-up handler (kopf gives each resource object a shallow copy of the operator's memo,
    made after the start-up handlers ran). Raises ``kopf.TemporaryError`` while starting."""
    rt = memo.get("runtime")
    if rt is None:
        raise kopf.TemporaryError("the operator is still starting", delay=1)
    if not isinstance(rt, Runtime):
        raise TypeError(f"memo.runtime is a {type(rt).__name__}, not a Runtime")
    return rt
