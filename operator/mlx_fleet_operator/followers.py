"""The operator's etcd followers: in-memory views of ``nodes/``, ``reports/``, ``stats/`` and
``assignments/``, kept by :func:`mlx_fleet.store.follow_prefix` (list, then watch from the
listing's revision; re-list after a compaction), and who to wake when they change.

* ``nodes/`` → :attr:`EtcdViews.nodes`; a change of what placement looks at (health, labels,
  memory, chip, address: not heartbeats) wakes the deployments it concerns, a vanished record
  goes to the disruption rule first (:mod:`.holds`); every change wakes the MacNode mirror;
* ``reports/`` → :attr:`EtcdViews.reports` ((namespace, name) → (node, revision) → report); a
  changed report (not its timestamps or resident bytes) wakes its deployment and its Canary;
* ``stats/`` → :attr:`EtcdViews.stats` ((namespace, name) → node → statistics); a newly
  tripped local guard wakes the Canary at once (routine statistics wait for its next tick);
* ``assignments/`` → :attr:`EtcdViews.assignments` (:class:`~.view.AssignmentsView`), which
  reconciles plan from instead of listing etcd.

Kept in this one module on purpose: a shared typed etcd view (``mlx_fleet``) is to replace
these followers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol, TypeVar

from mlx_fleet.contract import AssignmentReport, Keys, NodeRecord, StatsReport
from mlx_fleet.store import Snapshot, WatchEvent

from .holds import NodeHolds
from .records import DeploymentKey, Slot
from .view import AssignmentsView

__all__ = ["EtcdViews", "ViewListener", "Follower"]

log = logging.getLogger(__name__)

K = TypeVar("K")
R = TypeVar("R", AssignmentReport, StatsReport)

#: (task name, key prefix, on_snapshot, on_event) of one follower.
Follower = tuple[str, str, Callable[[Snapshot], Awaitable[None]],
                 Callable[[WatchEvent], Awaitable[None]]]


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
    return None if r is None else r.model_dump(exclude={"updated_unix", "resident_bytes"})


def _parse_keyed(key: str, value: bytes, parse_key: Callable[[str], K | None], record: type[R],
                 what: str) -> tuple[K | None, R | None]:
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


class EtcdViews:
    """The followed views (module docstring) and their callbacks."""

    def __init__(self, keys: Keys, listener: ViewListener, holds: NodeHolds) -> None:
        self.keys = keys
        self._listener = listener
        self._holds = holds
        self.nodes: dict[str, NodeRecord] = {}
        self.reports: dict[DeploymentKey, dict[Slot, AssignmentReport]] = {}
        self.stats: dict[DeploymentKey, dict[str, StatsReport]] = {}
        #: The stored assignments, kept by the assignments follower and by our own commits;
        #: reconciles plan from it (and from ``nodes``) instead of listing etcd (view.py).
        self.assignments = AssignmentsView()
        self.nodes_synced = asyncio.Event()
        self.reports_synced = asyncio.Event()

    def followers(self) -> list[Follower]:
        """What to follow: one entry per prefix (the ``watch`` label of the metrics is the
        last word of the name)."""
        k = self.keys
        return [("etcd follower: nodes", k.nodes_prefix, self.on_nodes_snapshot,
                 self.on_nodes_event),
                ("etcd follower: reports", k.reports_prefix, self.on_reports_snapshot,
                 self.on_reports_event),
                ("etcd follower: stats", k.stats_prefix, self.on_stats_snapshot,
                 self.on_stats_event),
                ("etcd follower: assignments", k.assignments_prefix,
                 self.on_assignments_snapshot, self.on_assignments_event)]

    # -- nodes/ ------------------------------------------------------------------------------
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
            name = self.keys.parse_node(kv.key)
            if rec is not None and name is not None:
                nodes[name] = rec
        old = {n: _placement_view(r) for n, r in self.nodes.items()}
        first = not self.nodes_synced.is_set()
        self.nodes = nodes
        if first:  # the nodes seen at start-up: what a later mass loss is measured against
            self._holds.start(nodes)
        else:  # a re-list: what vanished meanwhile is judged like vanished records
            for name in set(old) - set(nodes):
                self._holds.vanished(name)
            self._holds.seen(nodes)
        self.nodes_synced.set()
        self._listener.macnodes_changed()
        if old != {n: _placement_view(r) for n, r in nodes.items()}:
            self._listener.wake_all()

    async def on_nodes_event(self, ev: WatchEvent) -> None:
        name = self.keys.parse_node(ev.kv.key)
        if name is None:
            return
        before = _placement_view(self.nodes.get(name))
        rec = self._parse_node(ev.kv.key, ev.kv.value) if ev.type == "PUT" else None
        if rec is None:
            if self.nodes.pop(name, None) is not None:
                self._holds.vanished(name)
                self._listener.macnodes_changed()
                return  # judged (and its deployments woken) after the window: holds.judge
        else:
            self.nodes[name] = rec
            self._holds.seen((name,))
        self._listener.macnodes_changed()
        if before != _placement_view(rec):
            self._listener.node_changed(
                name, "gone" if rec is None else "changed" if before else "appeared")

    # -- reports/ ----------------------------------------------------------------------------
    def _parse_report(self, key: str, value: bytes
                      ) -> tuple[tuple[str, str, str, str] | None, AssignmentReport | None]:
        return _parse_keyed(key, value, self.keys.parse_report, AssignmentReport, "report")

    async def on_reports_snapshot(self, snap: Snapshot) -> None:
        reports: dict[DeploymentKey, dict[Slot, AssignmentReport]] = {}
        for kv in snap.items:
            parsed, rep = self._parse_report(kv.key, kv.value)
            if parsed and rep:
                reports.setdefault((parsed[1], parsed[2]), {})[(parsed[0], parsed[3])] = rep
        changed = set(reports) | set(self.reports)
        self.reports = reports
        self.reports_synced.set()
        self._listener.wake(changed)

    async def on_reports_event(self, ev: WatchEvent) -> None:
        parsed, rep = self._parse_report(ev.kv.key, ev.kv.value if ev.type == "PUT" else b"")
        if parsed is None:
            return
        slot, key = (parsed[0], parsed[3]), (parsed[1], parsed[2])
        per = self.reports.setdefault(key, {})
        before = _report_view(per.get(slot))
        if rep is None:
            per.pop(slot, None)
        else:
            per[slot] = rep
        if before != _report_view(rep):
            self._listener.wake((key,))
            self._listener.wake_canary(key)

    # -- stats/ ------------------------------------------------------------------------------
    def _parse_stats(self, key: str, value: bytes
                     ) -> tuple[tuple[str, str, str] | None, StatsReport | None]:
        return _parse_keyed(key, value, self.keys.parse_stats, StatsReport, "stats report")

    async def on_stats_snapshot(self, snap: Snapshot) -> None:
        stats: dict[DeploymentKey, dict[str, StatsReport]] = {}
        for kv in snap.items:
            parsed, rep = self._parse_stats(kv.key, kv.value)
            if parsed and rep:
                stats.setdefault((parsed[1], parsed[2]), {})[parsed[0]] = rep
        self.stats = stats
        for key in stats:
            self._listener.wake_canary(key)

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
                self._listener.wake_canary(key)  # a local guard tripped: roll back now

    # -- assignments/ ------------------------------------------------------------------------
    async def on_assignments_snapshot(self, snap: Snapshot) -> None:
        self.assignments.reset(snap.items, snap.revision)

    async def on_assignments_event(self, ev: WatchEvent) -> None:
        self.assignments.apply(ev)
