"""Following the node's assignments: every key under ``keys.node_assignments_prefix(node)``,
with :func:`mlx_fleet.store.follow_prefix` (a snapshot *replaces* the desired set, events update
it; the watch resumes from the last revision seen and re-lists after a compaction, so no change
is ever skipped), parsed into the records' ``desired`` values. The one module that reads the
store: a shared typed view of the prefix can replace it here alone."""

from __future__ import annotations

import contextlib
import json
import logging

from pydantic import ValidationError

from mlx_fleet.contract import Assignment
from mlx_fleet.store import KV, Snapshot, Store, WatchEvent, follow_prefix

from .runtime import Runtime
from .state import Desired, Invalid

log = logging.getLogger("node_agent.controller")

__all__ = ["Follower"]


class Follower:
    """Keeps ``rt``'s records' ``desired`` equal to the node's assignment keys in ``store``;
    calls ``rt.signal()`` after every change. A malformed value becomes an
    :class:`~.state.Invalid` (reported ``Failed``/``InvalidAssignment``), never an error."""

    def __init__(self, store: Store, rt: Runtime) -> None:
        self._store = store
        self._rt = rt
        self.prefix = rt.keys.node_assignments_prefix(rt.node_name)
        #: Number of snapshots (initial list + re-lists after compaction) applied.
        self.snapshots = 0

    async def run(self) -> None:
        """Follow the prefix until cancelled (raises what the store raises)."""
        await follow_prefix(self._store, self.prefix, self.on_snapshot, self.on_event)

    def parse(self, kv: KV) -> Desired | None:
        """``kv``'s assignment, an :class:`~.state.Invalid` saying why it is not one, or None
        for a key that is not an assignment key of this node."""
        keys, node = self._rt.keys, self._rt.node_name
        parsed = keys.parse_assignment(kv.key)
        if parsed is None or parsed[0] != node:
            log.warning("ignoring key %s: not an assignment key of node %s", kv.key, node)
            return None
        _, ns, name, revision = parsed
        try:
            a = Assignment.from_json(kv.value)
        except (ValidationError, ValueError) as e:
            generation = 0
            with contextlib.suppress(Exception):
                g = json.loads(kv.value).get("generation", 0)
                generation = g if isinstance(g, int) and g >= 0 else 0
            msg = f"cannot parse assignment {kv.key}: {e}".replace("\n", "; ")
            log.error("%s", msg)
            return Invalid(ns, name, generation, msg[:1000])
        if (a.namespace, a.name, a.revision) != (ns, name, revision):
            msg = (f"assignment {kv.key} names {a.namespace}/{a.name} revision {a.revision} in "
                   f"its body, but {ns}/{name} revision {revision} in its key")
            log.error("%s", msg)
            return Invalid(ns, name, a.generation, msg)
        if not a.served_model_name:
            return Invalid(ns, name, a.generation, f"assignment {kv.key}: empty served_model_name")
        return a

    async def on_snapshot(self, snap: Snapshot) -> None:
        desired: dict[str, Desired] = {}
        for kv in snap.items:
            value = self.parse(kv)
            if value is not None:
                desired[kv.key] = value
        for key, rec in self._rt.records.items():
            rec.desired = desired.get(key)
        for key, value in desired.items():
            self._rt.record(key).desired = value
        self.snapshots += 1
        log.info("assignments of %s at revision %d: %d", self._rt.node_name, snap.revision,
                 len(desired))
        self._rt.signal()

    async def on_event(self, ev: WatchEvent) -> None:
        if ev.type == "DELETE":
            rec = self._rt.records.get(ev.kv.key)
            if rec is not None and rec.desired is not None:
                rec.desired = None
                log.info("assignment %s removed", ev.kv.key)
        else:
            value = self.parse(ev.kv)
            if value is None:
                return
            self._rt.record(ev.kv.key).desired = value
            log.info("assignment %s changed (revision %d)", ev.kv.key, ev.kv.mod_revision)
        self._rt.signal()
