"""kopf handlers for ``modeldeployments.mlx-fleet.io/v1alpha1``: gather inputs, apply outputs.

Every decision is made by the pure modules (:mod:`.spec`, :mod:`.placement`, :mod:`.status`);
this module only moves data between the Kubernetes API, etcd and them.

* ``on.startup``: kopf settings, the etcd store, etcd followers (``nodes/``, ``reports/``,
  ``stats/`` and ``assignments/``, via :func:`mlx_fleet.store.follow_prefix`) that keep
  in-memory views — reconciles plan from the node and assignment views instead of listing etcd
  (:mod:`.view`) — and wake the affected deployments — supervised (:mod:`mlx_fleet.supervise`: logged, restarted with backoff,
  liveness fails while one is down) — the Kubernetes client for status patches, the metrics
  server.
* ``on.create`` / ``on.update`` / ``on.resume``: :func:`sync` — parse the spec, reconcile
  (placement → one fenced etcd transaction), compute and patch ``status``, post events.
  An invalid spec becomes a permanent error plus a Warning event and ``InvalidSpec``
  conditions, never a crash.
* ``daemon`` (one per ModelDeployment): waits on the deployment's wake-up event (set by the
  followers, by a spec change, or ~:data:`CONFLICT_RETRY_SECONDS` after a reconcile gave up on
  etcd conflicts) or a periodic resync (:data:`RESYNC_SECONDS`) and runs
  :func:`sync` again, so node churn re-places replicas and agents' reports reach ``status``.
* MacNode mirror (supervised, like the GC): every :data:`MACNODE_SECONDS`, on node events and
  when a MacNode's cordon or drain changes (``on.event``, :func:`macnode_event`) — at most one
  round per :data:`MACNODE_MIN_SECONDS` —
  each node record becomes a cluster-scoped ``MacNode`` (status only, :mod:`.macnodes`); the
  MacNodes' ``spec.unschedulable`` (cordons) and ``spec.drain`` (drains) are read back into
  ``Runtime.cordoned`` / ``Runtime.draining``, which placement honours: no new replica on a
  cordoned node, every replica of a draining one replaced elsewhere (:mod:`.rollout`, *Drain*).
  A drained replica whose replacement is Ready is first withdrawn from ``status.endpoints``; its
  assignment goes :data:`ENDPOINT_GRACE_SECONDS` after that status is published.
* ``on.delete``: removes the deployment's assignments (fenced), then kopf drops the finalizer.

Why status is patched with the ``kubernetes`` client: kopf 1.45 applies a daemon's ``patch``
only when the daemon function returns (``_core/engines/daemons.py``), and this daemon runs
forever; so :func:`sync` patches the ``status`` subresource itself (JSON merge patch, in a
worker thread) — and only when the computed status differs from the last one, coalesced: a
writer task per deployment patches the latest status :data:`STATUS_COALESCE_SECONDS` after a
change (statuses computed meanwhile replace it), so the reconcile does not wait for the API
server and a burst of changes is one patch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fnmatch
import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import kopf

from mlx_fleet.contract import ROOT, Assignment, AssignmentReport, Keys, NodeRecord, Role, StatsReport
from mlx_fleet.etcd_credentials import EtcdCredentials
from mlx_fleet.store import (CLOSE_TIMEOUT_SECONDS, EtcdStore, Snapshot, StoreError, WatchEvent,
                             follow_prefix)
from mlx_fleet.supervise import TaskHealth, dead, supervise, wait_event

from . import macnodes, metrics, peering
from .disruption import DISRUPTION_WINDOW_SECONDS, Disruption
from .disruption import HOLD_SECONDS as DISRUPTION_HOLD_SECONDS
from .disruption import observe as observe_disruption
from .placement import PlacementRequest, affected_by_node, resolve_memory, revision_estimates
from .records import (CandidateIntent, CanaryRecord, DeploymentKey, DeploymentRecord, Slot,
                      StatusQueue, SyncedSpec)
from .reconcile import (DEFAULT_WRITER, ConflictError, Intent, ParseMemo, collect_garbage,
                        read_fleet, reconcile, remove_deployment)
from .rollout import DrainState, RevisionTarget
from .spec import SpecError, parse_spec, to_assignment
from .status import Event, StatusInput, compute_status, status_changed
from .view import AssignmentsView

GROUP, VERSION, PLURAL = "mlx-fleet.io", "v1alpha1", "modeldeployments"
FINALIZER = "mlx-fleet.io/finalizer"
#: Seconds between unconditional re-syncs of a deployment (a safety net under the watches).
RESYNC_SECONDS = 30.0
#: Default seconds between garbage collections of orphaned assignments (``--gc-interval``;
#: see :func:`collect_orphans`).
GC_SECONDS = 60.0
#: After a reconcile gave up on etcd conflicts, its daemon is woken again after a delay
#: uniform in [0.5, 1.5] × this (jittered, so the losers do not collide again in lockstep).
CONFLICT_RETRY_SECONDS = 1.0
#: Seconds between MacNode mirror rounds (node events wake it sooner).
MACNODE_SECONDS = 5.0
#: Seconds at least between two MacNode mirror rounds: each lists every MacNode, and while
#: placements land back to back every write would wake another round (measured: 37 rounds
#: listing 1 000 MacNodes while 500 deployments converged); changes meanwhile are coalesced.
MACNODE_MIN_SECONDS = 1.0
MACNODE_PLURAL = "macnodes"
#: Seconds a drained replica stays assigned after the status that withdraws it from
#: ``status.endpoints`` is published, so that clients following the endpoints stop sending to
#: it before its agent stops taking requests (the role of a Pod's preStop delay in Kubernetes).
ENDPOINT_GRACE_SECONDS = 2.0
#: Seconds a ModelDeployment's changed status waits before it is patched, so that statuses
#: computed in quick succession (a replica placed, then Ready a moment later; a burst of node
#: changes) reach the API server as one patch of the latest (:meth:`Runtime.queue_status`).
#: A status that withdraws endpoints is patched at once: the grace above counts from its patch.
STATUS_COALESCE_SECONDS = 0.25
#: Seconds before a failed status patch is tried again (with the latest status by then).
STATUS_RETRY_SECONDS = 2.0

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PeeringConfig:
    """kopf peering of this replica (``--peering``): the peering object's ``name``, this
    replica's ``identity`` and ``priority`` as given to kopf, and whether the operator is
    cluster-wide (one ClusterKopfPeering) or namespaced (a KopfPeering per watched namespace)."""

    name: str
    identity: str
    priority: int
    clusterwide: bool


@dataclasses.dataclass
class OperatorConfig:
    """Runtime configuration, set by :func:`mlx_fleet_operator.main.main` (or read from the
    environment when the module is loaded by ``kopf run``)."""

    etcd_endpoint: str = "http://127.0.0.1:2379"
    etcd_prefix: str = ROOT
    etcd_credentials: EtcdCredentials | None = None  # TLS / auth (docs/security.md)
    metrics_port: int = 8080  # 0 = do not serve metrics
    writer: str = DEFAULT_WRITER
    namespaces: tuple[str, ...] = ()  # watched namespaces (globs); empty = cluster-wide
    gc_interval: float = GC_SECONDS  # seconds between orphan collections
    peering: PeeringConfig | None = None  # None: standalone
    #: Whether ``/metrics`` is already served on ``metrics_port`` (main()'s pre-flight check
    #: binds it); else the start-up handler serves it.
    metrics_served: bool = False

    def in_scope(self, namespace: str) -> bool:
        """Whether this operator watches ``namespace`` (garbage collection stays inside)."""
        return not self.namespaces or any(fnmatch.fnmatchcase(namespace, p)
                                          for p in self.namespaces)

    @classmethod
    def from_env(cls) -> OperatorConfig:
        return cls(etcd_endpoint=os.environ.get("MLX_FLEET_ETCD_ENDPOINT", cls.etcd_endpoint),
                   etcd_prefix=os.environ.get("MLX_FLEET_ETCD_PREFIX", ROOT),
                   metrics_port=int(os.environ.get("MLX_FLEET_METRICS_PORT", "8080")))


class Runtime:
    """The operator's in-memory state: etcd store, followed views, wake-ups, locks."""

    def __init__(self, store: EtcdStore, keys: Keys, writer: str,
                 in_scope: Callable[[str], bool] = lambda ns: True,
                 gc_interval: float = GC_SECONDS) -> None:
        self.store = store
        self.in_scope = in_scope
        #: Lists the live ModelDeployments ((namespace, name) → uids), blocking (run in a
        #: thread); None: no garbage collection. Set at start-up (:func:`list_live_deployments`).
        self.list_live: Callable[[], dict[DeploymentKey, set[str]]] | None = None
        self.gc_interval = gc_interval
        self.keys = keys
        self.writer = writer
        self.nodes: dict[str, NodeRecord] = {}
        self.reports: dict[DeploymentKey, dict[Slot, AssignmentReport]] = {}
        #: target ModelDeployment → the candidate its running Canary keeps resident (set by
        #: the Canary handlers through :meth:`keep_candidate`; read by :func:`sync`).
        self._candidates: dict[DeploymentKey, CandidateIntent] = {}
        #: ModelDeployment → everything kept about it (:class:`~.records.DeploymentRecord`).
        self._deployments: dict[DeploymentKey, DeploymentRecord] = {}
        #: ModelDeployment → node → the agents' per-revision statistics (``stats/``).
        self.stats: dict[DeploymentKey, dict[str, StatsReport]] = {}
        #: target ModelDeployment → wake-up of the Canary daemon following it.
        self._canary_wakeups: dict[DeploymentKey, asyncio.Event] = {}
        self.tasks: list[asyncio.Task] = []
        self.followers: dict[str, TaskHealth] = {}
        #: Whether this replica exports the fleet metric families (fleet_metrics): always when
        #: standalone; with peering, while it is the active peer (:meth:`start_peering`).
        self.fleet_active = True
        self.nodes_synced = asyncio.Event()
        self.reports_synced = asyncio.Event()
        self.custom_api: Any = None
        #: Nodes cordoned through their MacNode's ``spec.unschedulable`` (no new replicas).
        self.cordoned: frozenset[str] = frozenset()
        #: Nodes drained through their MacNode's ``spec.drain`` (replicas moved elsewhere).
        self.draining: frozenset[str] = frozenset()
        #: Held by every reconcile's read-plan-write (reconcile.reconcile's ``serialize``).
        self.placement_lock = asyncio.Lock()
        #: Parsed node records and assignments reused between reconciles (reconcile.ParseMemo).
        self.fleet_memo = (ParseMemo(), ParseMemo())
        #: The stored assignments, kept by the assignments follower and by our own commits;
        #: reconciles plan from it (and from ``nodes``) instead of listing etcd (view.py).
        self.assignments = AssignmentsView()
        #: MacNode name → the status last written (or read); wakes the mirror on node events.
        self.macnode_status: dict[str, dict[str, Any]] = {}
        self.macnode_wake = asyncio.Event()
        #: Nodes that vanished together (:mod:`.disruption`): whose replicas are held.
        self.disruption = Disruption()
        #: Nodes whose record vanished less than ``DISRUPTION_WINDOW_SECONDS`` ago, not yet
        #: judged (node loss or part of a disruption): their replicas are held meanwhile.
        self.vanishing: set[str] = set()
        self._judge_timer: asyncio.TimerHandle | None = None
        self._hold_timer: asyncio.TimerHandle | None = None
        #: The disruption rule's clock (seconds; tests replace it).
        self.clock: Callable[[], float] = time.monotonic
        #: Canary uid → what its daemon keeps between ticks (:mod:`.canary_handlers`).
        self._canaries: dict[str, CanaryRecord] = {}

    def canary(self, uid: str) -> CanaryRecord:
        """The record of the Canary ``uid`` (a new, empty one the first time)."""
        return self._canaries.setdefault(uid, CanaryRecord())

    def forget_canary(self, uid: str) -> None:
        """The Canary ``uid`` is gone: drop its record."""
        self._canaries.pop(uid, None)

    # -- per-deployment records -----------------------------------------------------------
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
        writer (a status still queued is dropped: the object is gone)."""
        rec = self._deployments.pop(key, None)
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

    def synced(self, key: DeploymentKey) -> SyncedSpec | None:
        """``key``'s valid spec as last synced (None: never synced, or deleted)."""
        rec = self._deployments.get(key)
        return rec.synced if rec is not None else None

    def wake(self, keys: Iterable[DeploymentKey]) -> None:
        """Wake the daemons of ``keys`` (those that have a record; others are not followed)."""
        for key in keys:
            rec = self._deployments.get(key)
            if rec is not None:
                rec.wake.set()

    def rearm(self, key: DeploymentKey, delay: float) -> None:
        """Wake ``key``'s daemon again in ``delay`` seconds (a prompt retry, not the resync)."""
        asyncio.get_running_loop().call_later(delay, self.deployment(key).wake.set)

    # -- Canary intents and wake-ups ------------------------------------------------------------
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
            self.deployment(target).wake.set()

    def release_candidate(self, target: DeploymentKey, canary: str) -> bool:
        """The Canary ``canary`` no longer keeps a candidate on ``target`` (the target's
        reconcile unloads it; another Canary's intent is left alone). Returns whether it held
        one."""
        owner = self._candidates.get(target)
        if owner is None or owner.canary != canary:
            return False
        del self._candidates[target]
        self.deployment(target).wake.set()
        return True

    def canary_wakeup(self, target: DeploymentKey) -> asyncio.Event:
        """The wake-up of the Canary daemon following ``target`` (created the first time)."""
        return self._canary_wakeups.setdefault(target, asyncio.Event())

    # -- status writer -----------------------------------------------------------------------
    def queue_status(self, key: DeploymentKey, status: dict[str, Any]) -> None:
        """Patch ``status`` onto ``key``'s ModelDeployment :data:`STATUS_COALESCE_SECONDS` from
        now, unless a later one is queued meanwhile (then that one). Failed patches are logged
        and retried after :data:`STATUS_RETRY_SECONDS`."""
        queue = self.deployment(key).status
        queue.last = queue.pending = status
        if queue.writer is None or queue.writer.done():
            queue.writer = asyncio.create_task(self._write_status(key, queue),
                                               name=f"status {key[0]}/{key[1]}")

    async def _write_status(self, key: DeploymentKey, queue: StatusQueue) -> None:
        delay = STATUS_COALESCE_SECONDS
        while queue.pending is not None:
            await asyncio.sleep(delay)  # the coalescing window (or the retry delay)
            try:
                await self._flush(key, queue)
                delay = STATUS_COALESCE_SECONDS
            except Exception as e:
                log.warning("status of %s/%s not patched (%s: %s); retrying in %.0f s", *key,
                            type(e).__name__, (str(e).splitlines() or [""])[0],
                            STATUS_RETRY_SECONDS)
                delay = STATUS_RETRY_SECONDS

    async def flush_status(self, key: DeploymentKey) -> None:
        """Patch ``key``'s queued status now (nothing when none is queued). Raises what the
        patch raised; the status then stays queued."""
        rec = self._deployments.get(key)
        if rec is not None:
            await self._flush(key, rec.status)

    async def _flush(self, key: DeploymentKey, queue: StatusQueue) -> None:
        async with queue.lock:
            status, queue.pending = queue.pending, None
            if status is None:
                return
            try:
                await _patch_status(self, key[0], key[1], status)
            except BaseException:
                if queue.pending is None:  # unless a newer one came
                    queue.pending = status
                raise

    def mark_nodes(self, cordoned: frozenset[str], draining: frozenset[str]) -> None:
        """The nodes cordoned and drained through their MacNodes now: every deployment is
        woken (placement honours both)."""
        self.cordoned, self.draining = cordoned, draining
        self.wake_all()

    def wake_all(self) -> None:
        for rec in list(self._deployments.values()):
            rec.wake.set()

    def wake_canary(self, target: DeploymentKey) -> None:
        ev = self._canary_wakeups.get(target)
        if ev is not None:
            ev.set()

    # -- stats follower ------------------------------------------------------------------------
    def _parse_stats(self, key: str, value: bytes) -> tuple[tuple[str, str, str] | None,
                                                           StatsReport | None]:
        return self._parse_keyed(key, value, self.keys.parse_stats, StatsReport, "stats report")

    async def on_stats_snapshot(self, snap: Snapshot) -> None:
        stats: dict[DeploymentKey, dict[str, StatsReport]] = {}
        for kv in snap.items:
            parsed, rep = self._parse_stats(kv.key, kv.value)
            if parsed and rep:
                stats.setdefault((parsed[1], parsed[2]), {})[parsed[0]] = rep
        self.stats = stats
        for key in stats:
            self.wake_canary(key)

    async def on_stats_event(self, ev: WatchEvent) -> None:
        parsed, rep = self._parse_stats(ev.kv.key, ev.kv.value if ev.type == "PUT" else b"")
        if parsed is None:
            return
        key = (parsed[1], parsed[2])
        per = self.stats.setdefault(key, {})
        if rep is None:
            per.pop(parsed[0], None)
        else:
            before = per.get(parsed[0])
            per[parsed[0]] = rep
            if rep.guard_tripped and not (before and before.guard_tripped):
                self.wake_canary(key)  # a local guard tripped: roll back fleet-wide now

    # -- etcd followers ------------------------------------------------------------------------
    @staticmethod
    def _placement_view(rec: NodeRecord | None) -> tuple | None:
        """The node fields placement looks at (heartbeats alone must not wake anyone)."""
        if rec is None:
            return None
        return (rec.health, tuple(sorted(rec.labels.items())), rec.capacity.memory_total_bytes,
                rec.capacity.chip_generation, rec.address)

    def _parse_node(self, key: str, value: bytes) -> NodeRecord | None:
        name = self.keys.parse_node(key)
        if name is None:
            return None
        try:
            return NodeRecord.from_json(value)
        except ValueError as e:
            log.warning("ignoring malformed node record %s: %s", key, e)
            return None

    async def on_nodes_snapshot(self, snap: Snapshot) -> None:
        nodes = {}
        for kv in snap.items:
            rec = self._parse_node(kv.key, kv.value)
            if rec is not None:
                nodes[self.keys.parse_node(kv.key)] = rec
        old = {n: self._placement_view(r) for n, r in self.nodes.items()}
        first = not self.nodes_synced.is_set()
        self.nodes = nodes
        if first:  # the nodes seen at start-up: what a later mass loss is measured against
            self.disruption = observe_disruption(self.disruption, set(nodes), self.clock())
        else:  # a re-list: what vanished meanwhile is judged like vanished records
            for name in set(old) - set(nodes):
                self._node_vanished(name)
            self._node_seen(nodes)
        self.nodes_synced.set()
        self.macnode_wake.set()
        if old != {n: self._placement_view(r) for n, r in nodes.items()}:
            self.wake_all()

    async def on_nodes_event(self, ev: WatchEvent) -> None:
        name = self.keys.parse_node(ev.kv.key)
        if name is None:
            return
        before = self._placement_view(self.nodes.get(name))
        rec = self._parse_node(ev.kv.key, ev.kv.value) if ev.type == "PUT" else None
        if rec is None:
            if self.nodes.pop(name, None) is not None:
                self._node_vanished(name)
                self.macnode_wake.set()
                return  # judged (and its deployments woken) after the window: _judge_nodes
        else:
            self.nodes[name] = rec
            self._node_seen((name,))
        self.macnode_wake.set()
        if before != self._placement_view(rec):
            affected = affected_by_node(name, self.placed, self.unsettled)
            log.info("node %s %s; re-placing the %d deployment(s) it concerns", name,
                     "gone" if rec is None else "changed" if before else "appeared",
                     len(affected))
            self.wake(affected)

    # -- vanished nodes: node loss or a control-plane disruption (disruption.py) ------------
    def held_nodes(self) -> frozenset[str]:
        """The vanished nodes whose replicas placement keeps (``place(held=...)``): those of a
        disruption, and those that vanished within the last window and are not judged yet."""
        return (self.disruption.held | self.vanishing) - self.nodes.keys()

    def _node_vanished(self, name: str) -> None:
        """A node record went away: judge it with whatever else vanishes within
        :data:`~.disruption.DISRUPTION_WINDOW_SECONDS` (etcd deletes the records of expired
        leases one by one, a few milliseconds apart)."""
        self.vanishing.add(name)
        if self._judge_timer is None:
            self._judge_timer = asyncio.get_running_loop().call_later(
                DISRUPTION_WINDOW_SECONDS, self._judge_nodes)

    def _node_seen(self, names: Iterable[str]) -> None:
        """Node records ``names`` (present now) appeared or changed: outside a window, update the
        nodes seen (and release held nodes that are back); inside one, the judgement at its end
        does. Costs O(len(names)): a heartbeat of one of a thousand Macs touches one name."""
        names = set(names)
        self.vanishing -= names
        if self._judge_timer is None and (names - self.disruption.seen
                                          or names & self.disruption.held):
            self._observe_nodes()

    def _judge_nodes(self) -> None:
        self._judge_timer = None
        gone = self.vanishing - self.nodes.keys()
        self.vanishing = set()
        before = self.disruption.held
        known = len(self.disruption.seen - before)
        self._observe_nodes()
        held = self.disruption.held - before
        if held:
            log.warning("%d of %d nodes vanished within %.0f s (%s): treating it as a control-"
                        "plane disruption, not node failures; their replicas are held for up "
                        "to %.0f s while the agents re-register", len(held), known,
                        DISRUPTION_WINDOW_SECONDS,
                        ", ".join(sorted(held)), DISRUPTION_HOLD_SECONDS)
        self._wake_for(gone - self.disruption.held, "gone")

    def _observe_nodes(self) -> None:
        """:func:`~.disruption.observe` the live nodes now; wake what a released hold
        concerns and arm the timer of the hold's end."""
        now = self.clock()
        before = self.disruption.held
        self.disruption = observe_disruption(self.disruption, set(self.nodes), now,
                                             hold_seconds=DISRUPTION_HOLD_SECONDS)
        released = before - self.disruption.held
        if released:
            back = released & self.nodes.keys()
            if back:
                log.info("held node(s) back: %s", ", ".join(sorted(back)))
            if released - back:
                log.warning("held node(s) not back after %.0f s: %s; re-placing their "
                            "replicas", DISRUPTION_HOLD_SECONDS,
                            ", ".join(sorted(released - back)))
            self._wake_for(released, "released")
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if self.disruption.held:
            self._hold_timer = asyncio.get_running_loop().call_later(
                max(self.disruption.until - now, 0.0) + 0.01, self._observe_nodes)

    def _wake_for(self, names: set[str] | frozenset[str], what: str) -> None:
        affected: set[DeploymentKey] = set()
        for name in names:
            affected |= affected_by_node(name, self.placed, self.unsettled)
        if names:
            log.info("node(s) %s %s; re-placing the %d deployment(s) they concern",
                     ", ".join(sorted(names)), what, len(affected))
        self.wake(affected)
        if names:
            self.macnode_wake.set()

    def _parse_report(self, key: str, value: bytes) -> tuple[tuple[str, str, str, str] | None,
                                                            AssignmentReport | None]:
        return self._parse_keyed(key, value, self.keys.parse_report, AssignmentReport, "report")

    @staticmethod
    def _parse_keyed(key: str, value: bytes, parse_key: Callable[[str], Any], record: Any,
                     what: str) -> tuple[Any, Any]:
        """``(parsed key, record)`` of an agent-written value; ``(parsed, None)`` for a DELETE
        (empty value) or a malformed record (logged and skipped), ``(None, None)`` for a key
        outside the layout."""
        parsed = parse_key(key)
        if parsed is None or not value:
            return parsed, None
        try:
            return parsed, record.from_json(value)
        except ValueError as e:
            log.warning("ignoring malformed %s %s: %s", what, key, e)
            return parsed, None

    @staticmethod
    def _report_view(r: AssignmentReport | None) -> Any:
        return None if r is None else r.model_dump(exclude={"updated_unix", "resident_bytes"})

    async def on_reports_snapshot(self, snap: Snapshot) -> None:
        reports: dict[DeploymentKey, dict[Slot, AssignmentReport]] = {}
        for kv in snap.items:
            parsed, rep = self._parse_report(kv.key, kv.value)
            if parsed and rep:
                reports.setdefault((parsed[1], parsed[2]), {})[(parsed[0], parsed[3])] = rep
        changed = set(reports) | set(self.reports)
        self.reports = reports
        self.reports_synced.set()
        self.wake(changed)

    async def on_reports_event(self, ev: WatchEvent) -> None:
        parsed, rep = self._parse_report(ev.kv.key, ev.kv.value if ev.type == "PUT" else b"")
        if parsed is None:
            return
        slot, key = (parsed[0], parsed[3]), (parsed[1], parsed[2])
        per = self.reports.setdefault(key, {})
        before = self._report_view(per.get(slot))
        if rep is None:
            per.pop(slot, None)
        else:
            per[slot] = rep
        if before != self._report_view(rep):
            self.wake((key,))
            self.wake_canary(key)

    async def on_assignments_snapshot(self, snap: Snapshot) -> None:
        self.assignments.reset(snap.items, snap.revision)

    async def on_assignments_event(self, ev: WatchEvent) -> None:
        self.assignments.apply(ev)

    def drains(self) -> dict[DeploymentKey, DrainState]:
        """ModelDeployment → its replicas on draining nodes, as last reconciled."""
        return {key: rec.drain for key, rec in self._deployments.items()}

    def placement_nodes(self) -> dict[str, NodeRecord] | None:
        """The followed node records for placement, None until the follower's first listing
        (a reconcile then lists ``nodes/`` itself)."""
        return self.nodes if self.nodes_synced.is_set() else None

    def start_followers(self) -> None:
        """Start the etcd followers, each under :func:`mlx_fleet.supervise.supervise` (logged and
        restarted with backoff if it fails; :func:`probe_followers` fails meanwhile)."""
        for name, prefix, on_snapshot, on_event in (
                ("etcd follower: nodes", self.keys.nodes_prefix, self.on_nodes_snapshot,
                 self.on_nodes_event),
                ("etcd follower: reports", self.keys.reports_prefix, self.on_reports_snapshot,
                 self.on_reports_event),
                ("etcd follower: stats", self.keys.stats_prefix, self.on_stats_snapshot,
                 self.on_stats_event),
                ("etcd follower: assignments", self.keys.assignments_prefix,
                 self.on_assignments_snapshot, self.on_assignments_event)):
            health = self.followers[name] = TaskHealth(name)
            on_snapshot = metrics.relists_counted(name.rsplit(" ", 1)[-1], on_snapshot)

            def run(prefix=prefix, on_snapshot=on_snapshot, on_event=on_event):
                return follow_prefix(self.store, prefix, on_snapshot, on_event)

            self.tasks.append(asyncio.create_task(supervise(health, run), name=name))

    # -- garbage collection ----------------------------------------------------------------
    def start_gc(self) -> None:
        """Start the orphan collector (at start-up, whether or not any ModelDeployment exists):
        every ``gc_interval`` seconds, :func:`collect_orphans`."""
        health = self.followers["assignment gc"] = TaskHealth("assignment gc")
        self.tasks.append(asyncio.create_task(supervise(health, self._gc_loop),
                                              name="assignment gc"))

    async def _gc_loop(self) -> None:
        while True:
            await collect_orphans(self)
            await asyncio.sleep(self.gc_interval)

    # -- kopf peering: which replica exports the fleet metrics --------------------------------
    def start_peering(self, api: Any, cfg: PeeringConfig, namespaces: tuple[str, ...]) -> None:
        """Follow kopf's peering objects (every :data:`.peering.POLL_SECONDS`) and keep
        ``fleet_active`` to :func:`.peering.peering_active` (False until first read). With
        watched namespaces, the KopfPeering of each one that is not a glob pattern is read."""
        self.fleet_active = False
        concrete = [ns for ns in namespaces if not any(c in ns for c in "*?[")]

        def read() -> list[Any]:
            if cfg.clusterwide:
                return [api.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings",
                                                      cfg.name).get("status")]
            return [api.get_namespaced_custom_object("kopf.dev", "v1", ns, "kopfpeerings",
                                                     cfg.name).get("status") for ns in concrete]

        async def loop() -> None:
            import datetime as dt

            while True:
                statuses = await asyncio.to_thread(read)
                self.fleet_active = peering.peering_active(
                    statuses, cfg.identity, cfg.priority, dt.datetime.now(dt.timezone.utc))
                await asyncio.sleep(peering.POLL_SECONDS)

        health = self.followers["peering"] = TaskHealth("peering")
        self.tasks.append(asyncio.create_task(supervise(health, loop), name="peering"))

    # -- MacNode mirror ----------------------------------------------------------------------
    def start_macnodes(self) -> None:
        """Start the MacNode mirror (:func:`mirror_macnodes`) once the node view is loaded."""
        health = self.followers["macnode mirror"] = TaskHealth("macnode mirror")
        self.tasks.append(asyncio.create_task(supervise(health, self._macnode_loop),
                                              name="macnode mirror"))

    async def _macnode_loop(self) -> None:
        await self.nodes_synced.wait()  # never mark every MacNode Gone before etcd was read
        while True:
            self.macnode_wake.clear()
            await mirror_macnodes(self)
            await asyncio.sleep(MACNODE_MIN_SECONDS)  # rate limit (wake-ups meanwhile count)
            await wait_event(self.macnode_wake, MACNODE_SECONDS - MACNODE_MIN_SECONDS)

    async def close(self) -> None:
        """Cancel the node-judging timers and every task this runtime started (followers,
        collectors, status writers), wait up to :data:`~mlx_fleet.store.CLOSE_TIMEOUT_SECONDS`
        for them to end, then close the store. A task still running then is logged with where
        it waits, and abandoned: closing never hangs (a start-up failure or a shutdown must end
        the process)."""
        for timer in (self._judge_timer, self._hold_timer):
            if timer is not None:
                timer.cancel()
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


class ListingError(Exception):
    """The live ModelDeployments could not be listed (so nothing may be collected)."""


def list_live_deployments(api: Any, namespaces: tuple[str, ...]) -> dict[DeploymentKey, set[str]]:
    """(namespace, name) → uids of the ModelDeployments that exist, straight from the API
    server (a complete listing, unlike an index a watch is still filling). Exact namespace
    names are listed one by one; with no ``--namespace`` or a glob pattern, cluster-wide (the
    caller filters by scope). Blocking; raises :class:`ListingError`."""
    exact = bool(namespaces) and not any(set(p) & set("*?[!,") for p in namespaces)
    try:
        if exact:
            items = [o for ns in namespaces for o in api.list_namespaced_custom_object(
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


def _macnode_round(api: Any, nodes: Mapping[str, NodeRecord],
                   on_node: Mapping[str, list[Any]], cache: dict[str, dict[str, Any]],
                   blocked: Mapping[str, str]) -> tuple[frozenset[str], frozenset[str]]:
    """One blocking mirror round: list the MacNodes, create the missing ones, patch changed
    statuses (``cache`` is updated); returns the cordoned and the draining node names.
    ``blocked``: node → why replicas on it cannot move (drain)."""
    import kubernetes

    from .status import now_rfc3339

    items = api.list_cluster_custom_object(GROUP, VERSION, MACNODE_PLURAL,
                                           _request_timeout=30)["items"]
    cordoned = macnodes.cordoned(items)
    draining = macnodes.draining(items)
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
    return cordoned, draining


async def mirror_macnodes(rt: Runtime) -> None:
    """Mirror ``rt.nodes`` (and ``rt.placed`` for reserved memory and models, ``rt.drains`` for
    a drain's progress) into MacNodes and read their cordons and drains into ``rt.cordoned`` /
    ``rt.draining`` (a change wakes every deployment). API errors (no MacNode CRD, no
    permission ...) are logged and retried next round, never fatal."""
    if rt.custom_api is None:
        return
    on_node: dict[str, list[Any]] = {}
    for placed in rt.placed.values():
        for (node, _rev), a in placed.items():
            on_node.setdefault(node, []).append(a)
    why: dict[str, list[str]] = {}
    for (ns, name), drain in sorted(rt.drains().items()):
        for node in sorted({n for n, _ in drain.moving}) if drain.blocked else ():
            why.setdefault(node, []).append(f"{ns}/{name}: {drain.blocked}")
    blocked = {node: "; ".join(texts) for node, texts in why.items()}
    try:
        cordoned, draining = await asyncio.to_thread(_macnode_round, rt.custom_api,
                                                     dict(rt.nodes), on_node, rt.macnode_status,
                                                     blocked)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [""])[0]
        log.warning("MacNode mirror round failed: %s: %s", type(e).__name__, first_line)
        return
    if cordoned != rt.cordoned or draining != rt.draining:
        log.info("cordoned nodes: %s; draining: %s", ", ".join(sorted(cordoned)) or "none",
                 ", ".join(sorted(draining)) or "none")
        rt.mark_nodes(cordoned, draining)


@kopf.on.event(GROUP, VERSION, MACNODE_PLURAL)
async def macnode_event(name: str, spec: Mapping[str, Any], memo: kopf.Memo, **_: Any) -> None:
    """A MacNode changed: when its cordon or drain is not what the operator applies, wake the
    mirror at once (``mlx-fleet drain`` should not wait for the next round). A silent watch:
    kopf stores nothing on the object for event handlers."""
    rt = memo.get("runtime")
    if rt is None:
        return
    spec = spec or {}
    cordon, drain = spec.get("unschedulable") is True, spec.get("drain") is True
    if (cordon, cordon and drain) != (name in rt.cordoned, name in rt.draining):
        rt.macnode_wake.set()


def runtime(memo: Mapping[str, Any]) -> Runtime:
    """The operator's :class:`Runtime`, kept in kopf's ``memo`` under ``runtime`` by
    :func:`startup` (kopf gives each resource object a shallow copy of the operator's memo,
    made after the start-up handlers ran). Raises ``kopf.TemporaryError`` while starting."""
    rt = memo.get("runtime")
    if rt is None:
        raise kopf.TemporaryError("the operator is still starting", delay=1)
    return rt


# ---------------------------------------------------------------------------------------------
# Startup / cleanup
# ---------------------------------------------------------------------------------------------


def _kubernetes_api() -> Any:
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient())


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, logger: logging.Logger, memo: kopf.Memo,
                  **_: Any) -> None:
    """Configure kopf, connect etcd, start the followers and background loops; the
    :class:`Runtime` goes into ``memo.runtime``. The configuration is ``memo.config`` (set by
    :func:`~.main.main` through ``kopf.run(memo=...)``), else read from the environment
    (``kopf run``)."""
    cfg = memo.get("config") or OperatorConfig.from_env()
    # Watches: ask the server to end each watch after 60 s and give up on a silent connection
    # after 90 s, so a half-dead connection never freezes the operator (kopf's default: none).
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    settings.watching.connect_timeout = 10
    settings.networking.connect_timeout = 10
    settings.networking.request_timeout = 60
    # Only warnings and errors of handler logs become Kubernetes events; our own transitions
    # are posted explicitly with kopf.event().
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = FINALIZER
    # Progress and diff-base in annotations: the CRD's status schema prunes unknown fields,
    # so kopf's default status.kopf storage would be silently dropped.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="mlx-fleet.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="mlx-fleet.io", key="last-handled-configuration")

    # A failure here is permanent: kopf would otherwise retry this handler every 60 s forever
    # (the process never exits). Whatever was started is stopped first, so nothing leaks.
    store = EtcdStore(cfg.etcd_endpoint, credentials=cfg.etcd_credentials)
    rt: Runtime | None = None
    try:
        await store.connect()
        rt = Runtime(store, Keys(cfg.etcd_prefix), cfg.writer, in_scope=cfg.in_scope,
                     gc_interval=cfg.gc_interval)
        rt.custom_api = api = await asyncio.to_thread(_kubernetes_api)
        rt.list_live = lambda: list_live_deployments(api, cfg.namespaces)
        # Running Canaries' candidates, before any ModelDeployment resumes: a restart
        # mid-canary must never unload a warm candidate.
        from .canary_handlers import seed_candidates

        try:
            rt.seed_candidates(await asyncio.to_thread(seed_candidates, api))
        except Exception as e:  # e.g. the Canary CRD is not installed: no canaries to keep
            logger.warning("cannot list Canaries at start-up (%s: %s); none resumed",
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        rt.start_followers()
        rt.start_gc()
        rt.start_macnodes()
        if cfg.peering is not None:
            rt.start_peering(api, cfg.peering, cfg.namespaces)
        try:  # resume handlers should see the agents' reports; don't hang if etcd is slow
            await asyncio.wait_for(asyncio.gather(rt.nodes_synced.wait(),
                                                  rt.reports_synced.wait()), timeout=30)
        except asyncio.TimeoutError:
            logger.warning("etcd views not loaded after 30s; continuing, watches will catch up")
        metrics.register_fleet(lambda: memo.get("runtime"))  # fleet state, at scrape time
        if not cfg.metrics_served:
            metrics.serve(cfg.metrics_port)
    except BaseException as e:  # also on cancellation (SIGTERM during start-up)
        with contextlib.suppress(Exception):
            if rt is not None:
                await rt.close()  # stops the followers, closes the store
            else:
                await store.close()
        if not isinstance(e, Exception):
            raise
        raise kopf.PermanentError(f"start-up failed: {type(e).__name__}: {e}") from e
    memo.runtime = rt
    logger.info("mlx-fleet operator started: etcd %s, prefix %s, metrics port %s",
                cfg.etcd_endpoint, cfg.etcd_prefix, cfg.metrics_port or "off")


@kopf.on.cleanup()
async def cleanup(logger: logging.Logger, memo: kopf.Memo, **_: Any) -> None:
    rt = memo.pop("runtime", None)
    if rt is not None:
        await rt.close()
    logger.info("mlx-fleet operator stopped")


@kopf.on.probe(id="etcd_nodes")
async def probe_nodes(memo: kopf.Memo, **_: Any) -> int:
    """Liveness probe payload: the number of node records seen in etcd."""
    return len(runtime(memo).nodes)


@kopf.on.probe(id="etcd_followers")
async def probe_followers(memo: kopf.Memo, **_: Any) -> dict[str, int]:
    """Liveness: follower → restarts so far. Raises (the liveness endpoint then answers 500)
    while a follower is dead and backing off; a permanent error so kopf does not retry it."""
    rt = runtime(memo)
    down = dead(rt.followers.values())
    if down:
        raise kopf.PermanentError("etcd follower(s) down: " + "; ".join(
            f"{h.name} ({h.last_error}, {h.restarts} restarts)" for h in down))
    return {name: h.restarts for name, h in rt.followers.items()}


# ---------------------------------------------------------------------------------------------
# Reconcile
# ---------------------------------------------------------------------------------------------


async def _patch_status(rt: Runtime, namespace: str, name: str, status: Mapping[str, Any]) -> None:
    import kubernetes

    def call() -> None:
        try:
            rt.custom_api.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status)},
                _content_type="application/merge-patch+json")
        except kubernetes.client.ApiException as e:
            if e.status != 404:  # deleted meanwhile: nothing to report on
                raise

    await asyncio.to_thread(call)


def _post(body: Mapping[str, Any], events: list[Event]) -> None:
    for e in events:
        kopf.event(body, type=e.type, reason=e.reason, message=e.message[:1024])


async def _publish(rt: Runtime, body: Mapping[str, Any], key: DeploymentKey,
                   status: dict[str, Any], events: list[Event], desired: int, *,
                   at_once: bool = False) -> None:
    """Queue ``status`` when it differs from the last one (coalesced, :meth:`Runtime.queue_status`),
    post ``events``, set the replica gauges. ``at_once``: patch before returning (raises what
    the patch raises)."""
    previous = rt.deployment(key).status.last or body.get("status") or {}
    if status_changed(previous, status):
        rt.queue_status(key, status)
    if at_once:
        await rt.flush_status(key)
    _post(body, events)
    metrics.set_replicas(key[0], key[1], desired, status["readyReplicas"])


async def sync(rt: Runtime, body: Mapping[str, Any], logger: logging.Logger) -> None:
    """Converge one ModelDeployment: placement → fenced etcd txn → status → events.

    Safe to run concurrently with itself (a per-deployment lock) and after a crash at any
    point (every step is idempotent). Raises ``kopf.PermanentError`` for an invalid spec and
    ``kopf.TemporaryError`` for etcd conflicts or outages.
    """
    meta = body.get("metadata", {})
    key: DeploymentKey = (meta["namespace"], meta["name"])
    rec = rt.deployment(key)
    async with rec.lock:
        if meta.get("deletionTimestamp"):
            return
        started = time.perf_counter()
        generation = int(meta.get("generation") or 0)
        previous = rec.status.last or body.get("status") or {}
        spec_dict = dict(body.get("spec") or {})
        try:
            spec = parse_spec(spec_dict)
        except SpecError as e:
            metrics.RECONCILE_TOTAL.labels(result="invalid").inc()
            replicas = spec_dict.get("replicas")
            replicas = replicas if isinstance(replicas, int) else 0
            # Nothing is re-placed, but what was placed for the last valid spec stays in etcd
            # and keeps being served: the status shows those replicas (and their reports).
            try:
                placed = {slot: s.assignment for slot, s in
                          (await read_fleet(rt.store, rt.keys)).of(*key).items()
                          if s.assignment is not None}
            except StoreError as se:
                metrics.RECONCILE_TOTAL.labels(result="error").inc()
                metrics.observe_reconcile(time.perf_counter() - started, success=False)
                raise kopf.TemporaryError(f"etcd: {se}", delay=5) from se
            reports = {n: r for n, r in rt.reports.get(key, {}).items() if n in placed}
            status, events = compute_status(StatusInput(
                generation=generation, replicas=replicas, assignments=placed, reports=reports,
                nodes=dict(rt.nodes), spec_error=str(e)), previous)
            # The InvalidSpec Warning event is among ``events`` (posted on the transition only).
            await _publish(rt, body, key, status, events, replicas)
            metrics.observe_reconcile(time.perf_counter() - started, success=False)
            raise kopf.PermanentError(str(e)) from None

        rec.observe_spec(SyncedSpec(spec, generation, meta.get("uid", "")))
        intent = deployment_intent(spec, key, uid=meta.get("uid", ""), generation=generation,
                                   candidate=rt.candidate(key), cordoned=rt.cordoned,
                                   draining=rt.draining,
                                   estimates=revision_estimates(rt.reports.get(key, {})))
        released = rec.released(time.monotonic(), ENDPOINT_GRACE_SECONDS)
        try:
            result = await reconcile(rt.store, rt.keys, intent, rt.reports.get(key, {}),
                                     writer=rt.writer, released=released,
                                     serialize=rt.placement_lock, memo=rt.fleet_memo,
                                     nodes=rt.placement_nodes(), assignments=rt.assignments,
                                     held=rt.held_nodes)
        except ConflictError as e:
            metrics.TXN_CONFLICTS.inc(e.conflicts)
            metrics.RECONCILE_TOTAL.labels(result="conflict").inc()
            metrics.observe_reconcile(time.perf_counter() - started, success=False)
            # Retry soon from the daemon instead of waiting for the next resync.
            rt.rearm(key, CONFLICT_RETRY_SECONDS * random.uniform(0.5, 1.5))
            raise kopf.TemporaryError(str(e), delay=1) from e
        except StoreError as e:
            metrics.RECONCILE_TOTAL.labels(result="error").inc()
            metrics.observe_reconcile(time.perf_counter() - started, success=False)
            raise kopf.TemporaryError(f"etcd: {e}", delay=5) from e
        metrics.TXN_CONFLICTS.inc(result.conflicts)
        drain_changed = rec.reconciled(result.assignments, unsettled=bool(
            result.decision.unplaced or result.decision.waiting
            or (result.candidate is not None and result.candidate.unplaced)
            or result.rollout.reason != "Complete" or result.drain != DrainState()),
            drain=result.drain)
        if result.written or drain_changed:
            rt.macnode_wake.set()  # reserved memory / models / drain progress changed
        rt.wake_canary(key)

        reports = {n: r for n, r in rt.reports.get(key, {}).items() if n in result.assignments}
        status, events = compute_status(StatusInput(
            generation=generation, replicas=spec.replicas, assignments=result.assignments,
            reports=reports, nodes=dict(rt.nodes), unplaced=result.decision.unplaced,
            placement_message=result.decision.message, revision=spec.model.revision,
            rollout_reason=result.rollout.reason, rollout_message=result.rollout.message,
            withdrawn=frozenset(result.drain.withdraw), waiting=result.decision.waiting),
            previous)
        # a status that withdraws endpoints is patched now: the grace counts from its patch
        await _publish(rt, body, key, status, events, spec.replicas,
                       at_once=bool(result.drain.withdraw))
        # withdrawn from the endpoints now that this status is published: removed after the grace
        now = time.monotonic()
        first = rec.withdraw(result.drain.withdraw, now)
        if first is not None:
            due = first + ENDPOINT_GRACE_SECONDS - now
            rt.rearm(key, max(due, 0.0) + 0.05)
        metrics.RECONCILE_TOTAL.labels(result="changed" if result.written else "unchanged").inc()
        metrics.RECONCILE_DURATION.observe(time.perf_counter() - started)


def deployment_intent(spec: Any, key: DeploymentKey, *, uid: str, generation: int,
                      candidate: CandidateIntent | None,
                      cordoned: frozenset[str] = frozenset(),
                      draining: frozenset[str] = frozenset(),
                      estimates: Mapping[str, int] | None = None) -> Intent:
    """The :class:`~.reconcile.Intent` of a parsed ModelDeployment spec: its stable revision,
    and the candidate a running Canary keeps resident (ignored when it names the stable
    revision itself — the moment of a promotion). ``estimates``: revision → the agents'
    largest memory estimate (:func:`~.placement.revision_estimates`), used where
    ``spec.resources.memory`` is unset (:func:`~.placement.resolve_memory`)."""
    estimates = estimates or {}
    served = spec.model.served_model_name or key[1]
    memory = resolve_memory(spec.resources.memory_bytes,
                            [estimates.get(spec.model.revision, 0)])
    request = PlacementRequest(
        namespace=key[0], name=key[1], replicas=spec.replicas, revision=spec.model.revision,
        memory_bytes=memory or 0, estimate_pending=memory is None,
        node_selector=spec.placement.node_selector,
        min_chip_generation=spec.placement.min_chip_generation,
        strategy=spec.placement.strategy, served_model_name=served, cordoned=frozenset(cordoned),
        draining=frozenset(draining))
    stable = RevisionTarget(request, to_assignment(spec, namespace=key[0], name=key[1], uid=uid,
                                                   generation=generation, memory_bytes=memory))
    cand = None
    if candidate is not None and candidate.revision != spec.model.revision:
        memory = candidate.memory_bytes or resolve_memory(
            spec.resources.memory_bytes, [estimates.get(candidate.revision, 0)])
        cand = RevisionTarget(
            dataclasses.replace(request, revision=candidate.revision, memory_bytes=memory or 0,
                                estimate_pending=memory is None),
            to_assignment(spec, namespace=key[0], name=key[1], uid=uid, generation=generation,
                          role=Role.CANDIDATE, source=candidate.source,
                          revision=candidate.revision, memory_bytes=memory))
    surge, unavailable = spec.surge_limits()
    return Intent(stable=stable, candidate=cand, max_surge=surge, max_unavailable=unavailable,
                  min_ready=spec.lifecycle.min_ready)


_RESOURCE = dict(group=GROUP, version=VERSION, plural=PLURAL)


@kopf.on.resume(**_RESOURCE)
@kopf.on.create(**_RESOURCE)
@kopf.on.update(**_RESOURCE)
async def reconcile_handler(body: kopf.Body, logger: logging.Logger, namespace: str, name: str,
                            memo: kopf.Memo, **_: Any) -> None:
    rt = runtime(memo)
    await sync(rt, body, logger)  # an invalid spec: sync() posted the InvalidSpec event already
    rt.deployment((namespace, name))  # make sure the daemon's record exists


@kopf.daemon(**_RESOURCE, cancellation_timeout=10.0)
async def follow_deployment(stopped: kopf.DaemonStopped, body: kopf.Body, logger: logging.Logger,
                            namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Re-sync on etcd changes (node churn, agent reports) and every RESYNC_SECONDS."""
    rt = runtime(memo)
    key = (namespace, name)
    wake = rt.deployment(key).wake

    async def relay_stop() -> None:
        await stopped.wait()
        wake.set()

    relay = asyncio.create_task(relay_stop())
    try:
        while not stopped:
            await wait_event(wake, RESYNC_SECONDS)
            wake.clear()
            if stopped:
                break
            try:
                await sync(rt, body, logger)
            except (kopf.PermanentError, kopf.TemporaryError) as e:
                logger.debug("re-sync of %s/%s deferred: %s", namespace, name, e)
            except Exception:  # keep following; the next wake-up or resync retries
                logger.exception("re-sync of %s/%s failed", namespace, name)
                await asyncio.sleep(1)
    finally:
        relay.cancel()


@kopf.on.delete(**_RESOURCE)
async def delete_handler(namespace: str, name: str, logger: logging.Logger, memo: kopf.Memo,
                         **_: Any) -> None:
    rt = runtime(memo)
    key = (namespace, name)
    async with rt.deployment(key).lock:
        try:
            result = await remove_deployment(rt.store, rt.keys, namespace, name, writer=rt.writer,
                                             serialize=rt.placement_lock, memo=rt.fleet_memo,
                                             nodes=rt.placement_nodes(),
                                             assignments=rt.assignments)
        except ConflictError as e:
            metrics.TXN_CONFLICTS.inc(e.conflicts)
            raise kopf.TemporaryError(str(e), delay=1) from e
        except StoreError as e:
            raise kopf.TemporaryError(f"etcd: {e}", delay=5) from e
        metrics.TXN_CONFLICTS.inc(result.conflicts)
        logger.info("removed assignments of %s/%s from %s", namespace, name,
                    list(result.decision.removed))
    rt.forget(key)
    rt.wake_canary(key)  # a Canary of a deleted target fails
    metrics.forget_deployment(namespace, name)
