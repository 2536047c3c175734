"""Follow the fleet in etcd and keep the routing table current: the thin I/O around
:func:`mlx_fleet_router.table.build`.

Five typed views (:class:`mlx_fleet.views.PrefixView`: list, then watch, resuming after a
disconnect and re-listing after a compaction) over the contract's node records, assignments,
reports, traffic splits and stats reports (:class:`mlx_fleet.contract.Keys`). A step that
changed a record marks the table stale; the next read rebuilds it from the views' records (a
pure function of them) and replaces the previous one in a single assignment, so a request reads
one consistent table and a burst of etcd events costs one rebuild, not one each. Stats reports
are written every few seconds by every agent; only a change of their guard verdict (the one
fact the table takes from them) marks the table stale.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any

from mlx_fleet.contract import (Assignment, AssignmentReport, Keys, NodeRecord, StatsReport,
                                TrafficSplit)
from mlx_fleet.store_api import Store
from mlx_fleet.views import PrefixView, ViewUpdate

from .table import Table, build

__all__ = ["Follower"]

log = logging.getLogger(__name__)


class Follower:
    """The routing table of ``store``'s fleet under ``keys``, for the ``namespaces`` in scope
    (None: all). :attr:`table` is the current :class:`~mlx_fleet_router.table.Table` (empty
    until the views synced, :attr:`synced`); :meth:`run` follows etcd until cancelled;
    :meth:`wait_until` waits for a table that satisfies a predicate (tests, start-up).
    ``builds``: how many times the table was built (a rebuild happens on the first read after a
    change)."""

    def __init__(self, store: Store, keys: Keys, *,
                 namespaces: Collection[str] | None = None) -> None:
        self.namespaces = frozenset(namespaces) if namespaces is not None else None
        self._table = Table()
        self._stale = True
        self.builds = 0
        self._changed = asyncio.Event()

        def view(prefix: str, parse_key: Callable[[str], Any], record: Any, name: str,
                 on_change: Callable[[ViewUpdate[Any, Any]], None] | None = None
                 ) -> PrefixView[Any, Any]:
            return PrefixView(store, prefix, parse_key=parse_key,
                              parse_value=lambda _k, v: record.from_json(v),
                              on_change=on_change or self._mark_stale, name=f"router {name}")

        self.nodes = view(keys.nodes_prefix, keys.parse_node, NodeRecord, "nodes")
        self.assignments = view(keys.assignments_prefix, keys.parse_assignment, Assignment,
                                "assignments")
        self.reports = view(keys.reports_prefix, keys.parse_report, AssignmentReport, "reports")
        self.splits = view(keys.traffic_prefix, keys.parse_traffic, TrafficSplit, "traffic")
        self.stats = view(keys.stats_prefix, keys.parse_stats, StatsReport, "stats",
                          self._stats_changed)
        self._views = (self.nodes, self.assignments, self.reports, self.splits, self.stats)

    @property
    def synced(self) -> bool:
        """Every view has applied its first listing."""
        return all(v.synced.is_set() for v in self._views)

    @property
    def table(self) -> Table:
        """The routing table of the views' records now (rebuilt here when stale)."""
        if self._stale:
            self._table = build(nodes=self.nodes.items, assignments=self.assignments.items,
                                reports=self.reports.items, splits=self.splits.items,
                                stats=self.stats.items, namespaces=self.namespaces)
            self._stale = False
            self.builds += 1
        return self._table

    def _mark_stale(self, _update: object = None) -> None:
        self._stale = True
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _stats_changed(self, update: ViewUpdate[Any, StatsReport]) -> None:
        def verdict(s: StatsReport | None) -> tuple[bool, str]:
            return (True, s.canary_uid) if s is not None and s.guard_tripped else (False, "")

        if update.listing or any(verdict(c.old) != verdict(c.new) for c in update.changes):
            self._mark_stale(update)

    async def run(self) -> None:
        """Follow the five prefixes until cancelled (an error in one view cancels the others
        and propagates: a bug, not a transport failure — those the views retry)."""
        async with asyncio.TaskGroup() as tg:
            for v in self._views:
                tg.create_task(v.run(), name=v.name)

    async def wait_until(self, predicate: Callable[[Table], bool]) -> Table:
        """The first table (now or after a rebuild) for which ``predicate`` holds."""
        await asyncio.gather(*(v.synced.wait() for v in self._views))
        while not predicate(self.table):
            await self._changed.wait()
        return self.table
