"""Following the node's assignments: every key under ``keys.node_assignments_prefix(node)``,
through the shared typed view :class:`mlx_fleet.views.PrefixView` (list, then watch from the
listing's revision; resume after a disconnect; re-list after a compaction, diffed so only real
changes are reported), parsed into the records' ``desired`` values. The one module that reads
the store."""

from __future__ import annotations

import contextlib
import json
import logging

from pydantic import ValidationError

from mlx_fleet.contract import Assignment
from mlx_fleet.store_api import Store
from mlx_fleet.views import PrefixView, ViewUpdate

from .runtime import Runtime
from .state import Desired, Invalid

log = logging.getLogger("node_agent.controller")

__all__ = ["Follower"]


class Follower:
    """Keeps ``rt``'s records' ``desired`` equal to the node's assignment keys in ``store``;
    calls ``rt.signal()`` after every change. A malformed value becomes an
    :class:`~.state.Invalid` (reported ``Failed``/``InvalidAssignment``), never an error; a key
    that is not an assignment key of this node is logged and ignored."""

    def __init__(self, store: Store, rt: Runtime) -> None:
        self._store = store
        self._rt = rt
        self.prefix = rt.keys.node_assignments_prefix(rt.node_name)
        #: The typed view of the current run (raw key → assignment or Invalid).
        self.view: PrefixView[str, Desired] | None = None
        self._past_listings = 0

    @property
    def snapshots(self) -> int:
        """Listings (each run's first, and every re-list after a compaction) applied."""
        return self._past_listings + (self.view.listings if self.view is not None else 0)

    async def run(self) -> None:
        """Follow the prefix until cancelled (raises what the store raises). Each run starts a
        fresh view, so a run restarted after a bug re-lists and replaces every desired value
        (nothing a failed callback left half applied stays)."""
        if self.view is not None:
            self._past_listings += self.view.listings
        self.view = PrefixView(self._store, self.prefix, parse_key=self._key,
                               parse_value=self.parse, on_change=lambda u: self.apply(u),
                               name=f"assignments of {self._rt.node_name}")
        await self.view.run()

    def _key(self, raw: str) -> str | None:
        parsed = self._rt.keys.parse_assignment(raw)
        return raw if parsed is not None and parsed[0] == self._rt.node_name else None

    def parse(self, key: str, value: bytes) -> Desired:
        """The assignment at ``key``, or an :class:`~.state.Invalid` saying why it is not one
        (unparsable, body naming another key, empty served model name)."""
        parsed = self._rt.keys.parse_assignment(key)
        assert parsed is not None  # _key let only this node's assignment keys through
        _, ns, name, revision = parsed
        try:
            a = Assignment.from_json(value)
        except (ValidationError, ValueError) as e:
            generation = 0
            with contextlib.suppress(Exception):
                g = json.loads(value).get("generation", 0)
                generation = g if isinstance(g, int) and g >= 0 else 0
            msg = f"cannot parse assignment {key}: {e}".replace("\n", "; ")
            log.error("%s", msg)
            return Invalid(ns, name, generation, msg[:1000])
        if (a.namespace, a.name, a.revision) != (ns, name, revision):
            msg = (f"assignment {key} names {a.namespace}/{a.name} revision {a.revision} in "
                   f"its body, but {ns}/{name} revision {revision} in its key")
            log.error("%s", msg)
            return Invalid(ns, name, a.generation, msg)
        if not a.served_model_name:
            return Invalid(ns, name, a.generation, f"assignment {key}: empty served_model_name")
        return a

    def apply(self, update: ViewUpdate[str, Desired]) -> None:
        """Carry one step of the view into the records: a listing replaces every desired
        value, an event changes one; then the converge worker plans again."""
        assert self.view is not None
        if update.listing:
            items = self.view.items
            for key, rec in self._rt.records.items():
                rec.desired = items.get(key)
            for key, value in items.items():
                self._rt.record(key).desired = value
            log.info("assignments of %s at revision %d: %d", self._rt.node_name,
                     update.revision, len(items))
        for change in () if update.listing else update.changes:
            if change.new is None:
                rec = self._rt.records.get(change.key)
                if rec is not None:
                    rec.desired = None
                log.info("assignment %s removed", change.key)
            else:
                self._rt.record(change.key).desired = change.new
                log.info("assignment %s changed (revision %d)", change.key, update.revision)
        self._rt.signal()
