"""The agent's side of a canary: follow the traffic splits, route, guard, report statistics.

:class:`TrafficManager` is the thin I/O around the pure pieces (:mod:`.routing`, :mod:`.split`,
:mod:`.guard`, :mod:`.window_stats`):

* it follows ``<root>/traffic/`` in etcd (a :class:`mlx_fleet.views.PrefixView`: resumes from
  the last revision, re-lists after a compaction, leaves a malformed split out as if absent),
  so a node that joins mid-canary gets the current split at once;
* :meth:`TrafficManager.route` picks the revision for one request (or the node to forward to);
* :meth:`TrafficManager.record` counts each request's outcome per revision — always: the
  operator re-exports the counts as the fleet's request metrics — and, while a split exists,
  feeds the candidate's outcomes to the **local guard**: when
  the candidate fails hard, the guard trips, every later request of that deployment goes to the
  stable revision, and a :class:`~mlx_fleet.contract.StatsReport` with ``guard_tripped`` is
  written at once (the operator rolls back fleet-wide on it);
* a writer task writes each deployment's cumulative :class:`StatsReport` under the agent's
  lease: during a canary at most once per the split's ``stats_interval_seconds`` (the analysis
  interval); otherwise at most once per :data:`IDLE_STATS_INTERVAL_SECONDS` and only when
  something was counted since the last write (an idle fleet writes nothing); the key is
  deleted once this node neither serves the deployment nor runs a split of it;
* :meth:`TrafficManager.touch` and :meth:`TrafficManager.ensure_loaded` pass a served request on
  to the controller's idle tracking and reload on demand: a route to a revision in standby
  (unloaded for idleness) says so (:attr:`Routed.standby`), and the HTTP layer awaits
  ``ensure_loaded`` before generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from mlx_fleet.contract import IDLE_STATS_INTERVAL_SECONDS, Keys, TrafficSplit
from mlx_fleet.routing.route import Route, route
from mlx_fleet.routing.session import session_key
from mlx_fleet.store import Store
from mlx_fleet.supervise import Supervised
from mlx_fleet.views import PrefixView, ViewUpdate

from .controller import ServedModel
from .guard import CandidateGuard
from .registration import Registration
from .serving import ModelNotLoaded
from .window_stats import DeploymentStats

log = logging.getLogger(__name__)

__all__ = ["TrafficManager", "Routed"]

DeploymentKey = tuple[str, str]
#: How often the writer checks whether a deployment's statistics are due (seconds); the write
#: rate itself is bounded by the split's ``stats_interval_seconds``.
WRITER_TICK_SECONDS = 0.5


class Routed:
    """One routed request: where it goes (``route``), its deployment and model name.
    ``standby``: the revision it goes to here was unloaded for idleness; it must be reloaded
    (:meth:`TrafficManager.ensure_loaded`) before generating."""

    __slots__ = ("route", "deployment", "model", "standby")

    def __init__(self, r: Route, deployment: DeploymentKey, model: str,
                 standby: bool = False) -> None:
        self.route = r
        self.deployment = deployment
        self.model = model
        self.standby = standby


class TrafficManager:
    """Routes requests by the canary splits in etcd and reports per-revision statistics.

    ``served()``: served model name → :class:`~.controller.ServedModel` (the controller's view
    of loaded revisions). ``crashes(model, revision)`` / ``memory_bytes(model, revision)``:
    the serving core's cumulative crash count and resident-bytes estimate of a revision.
    ``clock``: unix seconds (injectable for tests). ``touch(model, revision)``: a request is
    served by that revision here (the controller's :meth:`~.controller.Controller.touch`);
    ``ensure_loaded(model, revision)``: reload a standby revision and wait for it
    (:meth:`~.controller.Controller.ensure_loaded`). Without them nothing is tracked and a
    standby revision cannot be reloaded (:class:`~node_agent.serving.ModelNotLoaded`).
    ``stats_interval``: seconds between statistics writes outside a canary
    (:data:`IDLE_STATS_INTERVAL_SECONDS` by default; the agent's ``--stats-interval-seconds``).
    """

    def __init__(self, store: Store, keys: Keys, *, node_name: str,
                 registration: Registration, served: Callable[[], dict[str, ServedModel]],
                 crashes: Callable[[str, str], int], memory_bytes: Callable[[str, str], int],
                 clock: Callable[[], float] = time.time,
                 touch: Callable[[str, str], None] | None = None,
                 ensure_loaded: Callable[[str, str], Awaitable[None]] | None = None,
                 stats_interval: float = IDLE_STATS_INTERVAL_SECONDS) -> None:
        self._stats_interval = stats_interval
        self._keys = keys
        self.node_name = node_name
        self._reg = registration
        self._served = served
        self._crashes = crashes
        self._memory = memory_bytes
        self._clock = clock
        self._touch = touch
        self._ensure_loaded = ensure_loaded
        self._splits: PrefixView[DeploymentKey, TrafficSplit] = PrefixView(
            store, keys.traffic_prefix, parse_key=keys.parse_traffic,
            parse_value=lambda _dep, raw: TrafficSplit.from_json(raw),
            on_change=self._on_splits, name="traffic splits")
        self._guards: dict[DeploymentKey, CandidateGuard] = {}
        self._stats: dict[DeploymentKey, DeploymentStats] = {}
        self._crash_seen: dict[tuple[DeploymentKey, str], int] = {}
        self._gone: set[DeploymentKey] = set()  # stats keys to delete at the next pass
        self._models: dict[DeploymentKey, str] = {}  # served model name per counted deployment
        self._dirty: set[DeploymentKey] = set()  # counted since the last write
        self._urgent = asyncio.Event()
        self._tasks = [
            Supervised("traffic:follow", self._splits.run),
            Supervised("traffic:stats", self._writer),
        ]

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        for t in self._tasks:
            t.start()

    async def stop(self) -> None:
        for t in self._tasks:
            await t.stop()

    @property
    def tasks(self) -> list[Supervised]:
        return list(self._tasks)

    # -- the splits --------------------------------------------------------------------------
    @property
    def splits(self) -> Mapping[DeploymentKey, TrafficSplit]:
        """The traffic split of each deployment that has one (read-only: the view's)."""
        return self._splits.items

    @property
    def synced(self) -> asyncio.Event:
        """Set once the splits have been listed (and applied) for the first time."""
        return self._splits.synced

    def _on_splits(self, update: ViewUpdate[DeploymentKey, TrafficSplit]) -> None:
        for change in update.changes:
            self._apply(change.key, change.old, change.new)

    def _apply(self, dep: DeploymentKey, before: TrafficSplit | None,
               split: TrafficSplit | None) -> None:
        """The split of ``dep`` went from ``before`` to ``split`` (None: none)."""
        if split is None:
            if before is not None:
                log.info("traffic split of %s/%s removed: all traffic to its stable revision",
                         *dep)
            self._guards.pop(dep, None)
            if self._stats.pop(dep, None) is not None:  # the canary's epoch ends
                self._gone.add(dep)
                self._dirty.discard(dep)
                self._urgent.set()
            return
        self._gone.discard(dep)
        new_canary = before is None or (before.canary_uid, before.candidate_revision) != (
            split.canary_uid, split.candidate_revision)
        guard = self._guards.get(dep)
        if guard is None or new_canary:
            self._guards[dep] = CandidateGuard(split.guard, split.candidate_revision)
            self._new_stats(dep, split.served_model_name)  # a canary's counts start afresh
        elif guard.guard != split.guard and not guard.tripped:
            guard.reset(split.guard, split.candidate_revision)
        if before is None or before.weight != split.weight or new_canary:
            log.info("traffic split of %s/%s: %d%% to candidate %s (stable %s)", *dep,
                     split.weight, split.candidate_revision, split.stable_revision)

    def _new_stats(self, dep: DeploymentKey, model: str) -> DeploymentStats:
        """Fresh counters for ``dep`` (a new counting epoch). The core's crash counts are
        cumulative since each revision was loaded: only crashes from now on count."""
        stats = self._stats[dep] = DeploymentStats()
        self._models[dep] = model
        served = self._served().get(model)
        if served is not None and (served.namespace, served.name) == dep:
            for rev in served.revisions:
                self._crash_seen[(dep, rev)] = self._crashes(model, rev)
        return stats

    # -- per request -------------------------------------------------------------------------
    def route(self, model: str, *, session_header: str | None = None, user: str | None = None,
              pinned: str = "", stable: bool = False) -> Routed | None:
        """Where a request for ``model`` goes; None when no revision of it is served here and
        none can be forwarded to (→ 404). ``stable``: the stable side of a split whatever the
        session's bucket (as with a tripped guard; never forwarded)."""
        served = self._served().get(model)
        if served is None:
            return None
        dep = (served.namespace, served.name)
        split = self.splits.get(dep)
        guard = self._guards.get(dep)
        key, _ = session_key(session_header, user)
        r = route(dict(served.revisions), split, key,
                  guard_tripped=stable or (guard is not None and guard.tripped), pinned=pinned)
        if r is None:
            return None
        return Routed(r, dep, model, standby=not r.forward and r.revision in served.standby)

    def touch(self, model: str, revision: str) -> None:
        """A request is being served by ``model`` revision ``revision`` here (not idle)."""
        if self._touch is not None:
            self._touch(model, revision)

    async def ensure_loaded(self, model: str, revision: str) -> None:
        """Reload ``model`` revision ``revision`` if it is in standby and wait until it is
        Ready. Raises as :meth:`~.controller.Controller.ensure_loaded`
        (:class:`~node_agent.serving.Overloaded`, ``ModelLoadError``, ``ModelNotLoaded``)."""
        if self._ensure_loaded is None:
            raise ModelNotLoaded(model, revision)
        await self._ensure_loaded(model, revision)

    def record(self, routed: Routed, *, latency_s: float, ttft_s: float | None,
               completion_tokens: int, decode_seconds: float | None, failed: bool) -> None:
        """Count one finished request (server-side failure or not) of its deployment; during a
        canary, feed the candidate's outcome to the local guard (a trip is written at once)."""
        dep = routed.deployment
        split = self.splits.get(dep)
        if routed.route.canary != (split is not None):
            return  # routed under a split that has changed since: its epoch is gone
        stats = self._stats.get(dep) or self._new_stats(dep, routed.model)
        now = self._clock()
        stats.counters(routed.route.revision, now).observe(
            latency_s, ttft_s, completion_tokens, decode_seconds, failed)
        self._dirty.add(dep)
        if split is None:
            return
        guard = self._guards.get(dep)
        if guard is not None and routed.route.revision == split.candidate_revision:
            guard.record(time.monotonic(), failed)
            reason = guard.check(time.monotonic())
            if reason is not None:
                log.warning("local guard of %s/%s tripped: %s; all traffic to stable "
                            "revision %s", *dep, reason, split.stable_revision)
                self._urgent.set()

    # -- statistics writer -------------------------------------------------------------------
    async def _writer(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
            # that arrives as the event is set, and stop() would hang
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WRITER_TICK_SECONDS):
                    await self._urgent.wait()
            urgent = self._urgent.is_set()
            self._urgent.clear()
            await self.write_due(force_tripped=urgent)

    async def write_due(self, *, force_tripped: bool = False) -> int:
        """Write every deployment's statistics that are due (and, with ``force_tripped``,
        those whose guard tripped since the last write). Returns how many were written."""
        for dep in list(self._gone):
            self._gone.discard(dep)
            await self._reg.delete_report(self._keys.stats(self.node_name, *dep))
        now = self._clock()
        served = self._served()
        served_here = {(m.namespace, m.name) for m in served.values()}
        written = 0
        for dep, stats in list(self._stats.items()):
            split = self.splits.get(dep)
            guard = self._guards.get(dep)
            if split is None and dep not in served_here:
                # neither served here nor split any more: the report goes (its last counts
                # stay in the operator's sums as an ended epoch)
                del self._stats[dep]
                self._dirty.discard(dep)
                await self._reg.delete_report(self._keys.stats(self.node_name, *dep))
                continue
            tripped = guard is not None and guard.tripped
            if split is None:
                if dep not in self._dirty or not stats.due(now, self._stats_interval):
                    continue  # nothing new, or not yet due
            elif not (stats.due(now, split.stats_interval_seconds) or (force_tripped and tripped)):
                continue
            model = split.served_model_name if split is not None else self._models[dep]
            loaded = served.get(model)
            revisions = set(loaded.revisions) if loaded and (loaded.namespace, loaded.name) == dep \
                else set()
            if not revisions and not stats.has_counts():
                continue  # this node neither serves nor forwarded for it: nothing to report
            for rev in revisions:
                count = self._crashes(model, rev)
                seen = self._crash_seen.get((dep, rev), 0)
                for _ in range(max(count - seen, 0)):
                    stats.counters(rev, now).crash()
                self._crash_seen[(dep, rev)] = count
            report = stats.report(self.node_name, dep[0], dep[1],
                                  split.canary_uid if split is not None else "",
                                  {rev: self._memory(model, rev) for rev in revisions},
                                  tripped, guard.reason if guard is not None and tripped else "",
                                  now)
            await self._reg.put_report(self._keys.stats(self.node_name, *dep), report)
            stats.mark_written(now)
            self._dirty.discard(dep)
            written += 1
        return written
