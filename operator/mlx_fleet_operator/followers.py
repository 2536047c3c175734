"""The operator's etcd followers: typed views of ``nodes/``, ``reports/``, ``stats/`` (each a
:class:`mlx_fleet.views.PrefixView`: list, watch from the listing's revision, re-list after a
compaction, parse each value into its contract record) and ``assignments/``, and who to wake
when they change.

* ``nodes/`` → :attr:`EtcdViews.nodes` (node name → record); a change of what placement looks
  at (health, labels, memory, chip, address: not heartbeats) wakes the deployments it concerns,
  a vanished record goes to the disruption rule first (:mod:`.holds`); every change wakes the
  MacNode mirror;
* ``reports/`` → :attr:`EtcdViews.reports` ((namespace, name) → (node, revision) → report),
  an index of the view kept by its change callback; a changed report (not its timestamps or
  resident bytes) wakes its deployment and its Canary;
* ``stats/`` → :attr:`EtcdViews.stats` ((namespace, name) → node → statistics), likewise; a
  newly tripped local guard wakes the Canary at once (routine statistics wait for its next
  tick; a (re-)listing wakes the Canaries whose statistics it changed);
* ``assignments/`` → :attr:`EtcdViews.assignments` (:class:`~.view.AssignmentsView`), which
  reconciles plan from instead of listing etcd; fed by :func:`mlx_fleet.views.follow_prefix`
  directly, since our own commits update it too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol, TypeVar

from mlx_fleet.contract import AssignmentReport, Keys, NodeRecord, StatsReport
from mlx_fleet.store_api import Store, WatchEvent
from mlx_fleet.views import PrefixView, Snapshot, ViewUpdate

from .holds import NodeHolds
from .records import DeploymentKey, Slot
from .view import AssignmentsView

__all__ = ["EtcdViews", "ViewListener", "Follower"]

S = TypeVar("S")
R = TypeVar("R")

#: (task name, key prefix, on_snapshot, on_event) of one follower.
Follower = tuple[str, str, Callable[[Snapshot], Awaitable[None]],
                 Callable[[WatchEvent], Awaitable[None]]]

ReportKey = tuple[str, str, str, str]  #: (node, namespace, name, revision): Keys.parse_report
StatsKey = tuple[str, str, str]  #: (node, namespace, name): Keys.parse_stats


class ViewListener(Protocol):
    """Who the views wake (the operator's :class:`~.runtime.Runtime`)."""

    def wake(self, keys: Iterable[DeploymentKey]) -> None: ...
    def wake_all(self) -> None: ...
    def wake_canary(self, target: DeploymentKey) -> None: ...
    def node_changed(self, name: str, what: str) -> None: ...
    def macnodes_changed(self) -> None: ...


def _placement_view(rec: NodeRecord | None) -> tuple[object, ...] | None:
    """The node fields placement looks at (heartbeats alone must not wake anyone)."""
    if rec is None:
        return None
    return (rec.health, tuple(sorted(rec.labels.items())), rec.capacity.memory_total_bytes,
            rec.capacity.chip_generation, rec.address)


def _report_view(r: AssignmentReport | None) -> dict[str, object] | None:
    """A report's fields that matter to its deployment (not its timestamps or resident bytes)."""
    return None if r is None else r.model_dump(exclude={"updated_unix", "resident_bytes"})


def _index(index: dict[DeploymentKey, dict[S, R]], deployment: DeploymentKey, sub: S,
           record: R | None) -> None:
    """Set (``record``) or drop (None) ``index[deployment][sub]``; a deployment left without
    entries is dropped (readers use ``index.get(deployment, {})``)."""
    if record is not None:
        index.setdefault(deployment, {})[sub] = record
        return
    per = index.get(deployment)
    if per is not None:
        per.pop(sub, None)
        if not per:
            del index[deployment]


class EtcdViews:
    """The followed views (module docstring) and their callbacks. ``store``: what the views
    follow (:meth:`followers` lists how); ``keys``: its key layout; ``listener``: who is woken;
    ``holds``: the disruption rule's state, fed with vanished and seen nodes."""

    def __init__(self, store: Store, keys: Keys, listener: ViewListener,
                 holds: NodeHolds) -> None:
        self.keys = keys
        self._listener = listener
        self._holds = holds
        self.node_view: PrefixView[str, NodeRecord] = PrefixView(
            store, keys.nodes_prefix, parse_key=keys.parse_node,
            parse_value=lambda _, v: NodeRecord.from_json(v), on_change=self._on_nodes,
            name="nodes")
        self.report_view: PrefixView[ReportKey, AssignmentReport] = PrefixView(
            store, keys.reports_prefix, parse_key=keys.parse_report,
            parse_value=lambda _, v: AssignmentReport.from_json(v), on_change=self._on_reports,
            name="reports")
        self.stats_view: PrefixView[StatsKey, StatsReport] = PrefixView(
            store, keys.stats_prefix, parse_key=keys.parse_stats,
            parse_value=lambda _, v: StatsReport.from_json(v), on_change=self._on_stats,
            name="stats")
        #: (namespace, name) → (node, revision) → report: ``report_view`` by deployment.
        self.reports: dict[DeploymentKey, dict[Slot, AssignmentReport]] = {}
        #: (namespace, name) → node → statistics: ``stats_view`` by deployment.
        self.stats: dict[DeploymentKey, dict[str, StatsReport]] = {}
        #: The stored assignments, kept by the assignments follower and by our own commits;
        #: reconciles plan from it (and from ``nodes``) instead of listing etcd (view.py).
        self.assignments = AssignmentsView()

    @property
    def nodes(self) -> dict[str, NodeRecord]:
        """Node name → its record (``node_view.items``)."""
        return self.node_view.items

    def followers(self) -> list[Follower]:
        """What to follow: one entry per prefix (the ``watch`` label of the metrics is the
        last word of the name), each run by :func:`mlx_fleet.views.follow_prefix`."""
        k = self.keys
        return [("etcd follower: nodes", k.nodes_prefix, self.node_view.apply_snapshot,
                 self.node_view.apply_event),
                ("etcd follower: reports", k.reports_prefix, self.report_view.apply_snapshot,
                 self.report_view.apply_event),
                ("etcd follower: stats", k.stats_prefix, self.stats_view.apply_snapshot,
                 self.stats_view.apply_event),
                ("etcd follower: assignments", k.assignments_prefix,
                 self.on_assignments_snapshot, self.on_assignments_event)]

    # -- nodes/ ------------------------------------------------------------------------------
    def _on_nodes(self, update: ViewUpdate[str, NodeRecord]) -> None:
        listener, holds = self._listener, self._holds
        if update.listing:
            if self.node_view.listings == 1:  # the nodes seen at start-up: what a later mass
                holds.start(self.nodes)         # loss is measured against
            else:  # a re-list: what vanished meanwhile is judged like vanished records
                for c in update.changes:
                    if c.new is None:
                        holds.vanished(c.key)
                holds.seen(self.nodes)
            listener.macnodes_changed()
            if any(_placement_view(c.old) != _placement_view(c.new) for c in update.changes):
                listener.wake_all()
            return
        for c in update.changes:
            if c.new is None:
                holds.vanished(c.key)
                listener.macnodes_changed()
                continue  # judged (and its deployments woken) after the window: holds.judge
            holds.seen((c.key,))
            listener.macnodes_changed()
            if _placement_view(c.old) != _placement_view(c.new):
                listener.node_changed(c.key, "changed" if c.old is not None else "appeared")

    # -- reports/ ----------------------------------------------------------------------------
    def _on_reports(self, update: ViewUpdate[ReportKey, AssignmentReport]) -> None:
        woken: set[DeploymentKey] = set()
        for c in update.changes:
            node, namespace, name, revision = c.key
            _index(self.reports, (namespace, name), (node, revision), c.new)
            if _report_view(c.old) != _report_view(c.new):
                woken.add((namespace, name))
        self._listener.wake(woken)
        for key in woken:
            self._listener.wake_canary(key)

    # -- stats/ ------------------------------------------------------------------------------
    def _on_stats(self, update: ViewUpdate[StatsKey, StatsReport]) -> None:
        for c in update.changes:
            node, namespace, name = c.key
            _index(self.stats, (namespace, name), node, c.new)
            if update.listing or (c.new is not None and c.new.guard_tripped
                                  and not (c.old is not None and c.old.guard_tripped)):
                self._listener.wake_canary((namespace, name))  # a local guard tripped: now

    # -- assignments/ ------------------------------------------------------------------------
    async def on_assignments_snapshot(self, snap: Snapshot) -> None:
        self.assignments.reset(snap.items, snap.revision)

    async def on_assignments_event(self, ev: WatchEvent) -> None:
        self.assignments.apply(ev)

