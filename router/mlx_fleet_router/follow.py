"""Follow the fleet in etcd and keep the routing table current: the thin I/O around
:func:`mlx_fleet_router.table.build`.

Five typed views (:class:`mlx_fleet.views.PrefixView`: list, then watch, resuming after a
disconnect and re-listing after a compaction) over the contract's node records, assignments,
reports, traffic splits and stats reports (:class:`mlx_fleet.contract.Keys`). After every step
that changed a record, the table is rebuilt from the views' records (a pure function of them)
and replaces the previous one in a single assignment, so a request reads one consistent table.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any

from mlx_fleet.contract import (Assignment, AssignmentReport, Keys, NodeRecord, StatsReport,
                                TrafficSplit)
from mlx_fleet.store_api import Store
from mlx_fleet.views import PrefixView

from .table import Table, build

__all__ = ["Follower"]

log = logging.getLogger(__name__)


class Follower:
    """The routing table of ``store``'s fleet under ``keys``, for the ``namespaces`` in scope
    (None: all). :attr:`table` is the current :class:`~mlx_fleet_router.table.Table` (empty
    until the views synced, :attr:`synced`); :meth:`run` follows etcd until cancelled;
    :meth:`wait_until` waits for a table that satisfies a predicate (tests, start-up)."""

    def __init__(self, store: Store, keys: Keys, *,
                 namespaces: Collection[str] | None = None) -> None:
        self.namespaces = frozenset(namespaces) if namespaces is not None else None
        self.table = Table()
        self._changed = asyncio.Event()

        def view(prefix: str, parse_key: Callable[[str], Any], record: Any,
                 name: str) -> PrefixView[Any, Any]:
            return PrefixView(store, prefix, parse_key=parse_key,
                              parse_value=lambda _k, v: record.from_json(v),
                              on_change=self._rebuild, name=f"router {name}")

        self.nodes = view(keys.nodes_prefix, keys.parse_node, NodeRecord, "nodes")
        self.assignments = view(keys.assignments_prefix, keys.parse_assignment, Assignment,
                                "assignments")
        self.reports = view(keys.reports_prefix, keys.parse_report, AssignmentReport, "reports")
        self.splits = view(keys.traffic_prefix, keys.parse_traffic, TrafficSplit, "traffic")
        self.stats = view(keys.stats_prefix, keys.parse_stats, StatsReport, "stats")
        self._views = (self.nodes, self.assignments, self.reports, self.splits, self.stats)

    @property
    def synced(self) -> bool:
        """Every view has applied its first listing."""
        return all(v.synced.is_set() for v in self._views)

    def _rebuild(self, _update: object = None) -> None:
        self.table = build(nodes=self.nodes.items, assignments=self.assignments.items,
                           reports=self.reports.items, splits=self.splits.items,
                           stats=self.stats.items, namespaces=self.namespaces)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

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
