"""The executor's shared state: the records of every assignment key, the serving core, the
clock, the metrics and the usage history, handed to each executor part (:mod:`.reports`,
:mod:`.unload`, :mod:`.load`, :mod:`.demand`) and to the controller. Nothing here decides:
it gathers observations for :mod:`.step` (:meth:`Runtime.core_view`, :meth:`Runtime.uses`) and
applies the small bookkeeping every part shares (forgetting a revision's series, converging the
keys refused for their name again once a name is freed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from mlx_fleet.contract import Keys

from ..lifecycle import ModelUse, UsageHistory
from ..serving import ServingCore
from . import step
from .state import Ident, IdleUnload, Record, Spec

log = logging.getLogger("node_agent.controller")

__all__ = ["Runtime"]


class Runtime:
    """What every executor part of one controller shares.

    ``records``: assignment key → :class:`~.state.Record` (the one place a key's state lives;
    :meth:`sweep` forgets the keys nothing is left of); ``draining``: (model id, revision) →
    its drain task; ``idle_unloaded`` / ``evicted``: the latest unload to standby of each
    revision, by reason; ``clock``: monotonic seconds, the one clock of every decision;
    ``signal``: called when something changed that the converge worker must plan over (set by
    the controller). ``budget_bytes`` (None: no budget) and ``max_loaded_models`` (0: no
    limit): the node's memory budget and its limit on resident revisions."""

    def __init__(self, keys: Keys, *, node_name: str, core: ServingCore,
                 clock: Callable[[], float], budget_bytes: int | None,
                 max_loaded_models: int) -> None:
        self.keys = keys
        self.node_name = node_name
        self.core = core
        self.metrics = core.metrics
        self.clock = clock
        self.budget_bytes = budget_bytes
        self.max_loaded_models = max_loaded_models
        self.records: dict[str, Record] = {}
        self.draining: dict[Ident, asyncio.Task] = {}
        self.history = UsageHistory()
        self.idle_unloaded: dict[Ident, IdleUnload] = {}
        self.evicted: dict[Ident, IdleUnload] = {}
        self.signal: Callable[[], None] = lambda: None

    def record(self, key: str) -> Record:
        """``key``'s record, created (empty) if it has none."""
        rec = self.records.get(key)
        if rec is None:
            parsed = self.keys.parse_assignment(key)
            rec = self.records[key] = Record(deployment=(parsed[1], parsed[2]) if parsed
                                             else ("", ""))
        return rec

    def sweep(self) -> None:
        """Forget every key nothing is left of (:meth:`~.state.Record.forgettable`)."""
        for key in [k for k, r in self.records.items() if r.forgettable()]:
            del self.records[key]

    def core_view(self) -> step.CoreView:
        """The serving core now: every revision it holds with its memory, and those serving."""
        memory = {(m.model_id, m.revision): self.core.memory_bytes(m.model_id, m.revision)
                  for m in self.core.models()}
        return step.CoreView(memory, frozenset(i for i in memory if self.core.is_loaded(*i)))

    def in_use(self, exclude: str | None = None) -> tuple[int, dict[str, int]]:
        """:func:`.step.in_use` now."""
        return step.in_use(self.records, self.core_view(), exclude)

    def resident_count(self, spec: Spec) -> int:
        """:func:`.step.resident_count` now, ``spec``'s revision left out."""
        return step.resident_count(self.records, self.core_view(), spec.ident)

    def uses(self, now: float) -> dict[str, ModelUse]:
        """:func:`.step.model_uses` now; a revision with requests in flight is marked used at
        ``now`` (so its idleness counts from its last request's end)."""
        _, held = self.in_use()
        in_flight: dict[Ident, int] = {}
        for key in held:
            loaded = self.records[key].loaded
            assert loaded is not None
            n = self.core.inflight_requests(*loaded.spec.ident)
            if n:
                in_flight[loaded.spec.ident] = n
                loaded.last_used = now
        return step.model_uses(self.records, held, in_flight, now)

    def mark_used(self, ident: Ident) -> bool:
        """A request uses ``ident`` now: its idleness starts over. False: not served here."""
        now = self.clock()
        found = False
        for rec in self.records.values():
            if rec.loaded is not None and rec.loaded.spec.ident == ident:
                rec.loaded.last_used = now
                found = True
        return found

    def forget(self, spec: Spec) -> None:
        """``spec``'s revision is no longer assigned here: drop its usage history and every
        metric series labelled with it (none is left behind), unless a key still holds it."""
        if step.holds(self.records, spec.ident):
            return
        self.history.forget(spec.ident)
        self.metrics.remove_revision(*spec.ident)

    def recheck_conflicts(self) -> None:
        """A served name may have been freed: converge the keys refused with
        ``ModelNameConflict`` again."""
        refused = [r for r in self.records.values() if r.conflict]
        if refused:
            for rec in refused:
                rec.done = None
                rec.conflict = False
            self.signal()

    def report_key(self, key: str) -> str:
        parsed = self.keys.parse_assignment(key)
        assert parsed is not None
        return self.keys.report(*parsed)
