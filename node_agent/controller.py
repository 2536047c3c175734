"""Converge the serving core onto this node's assignments, and report per-assignment state.

Desired state: every key under ``keys.node_assignments_prefix(node)``, followed into one
:class:`~.convergence.state.Record` per assignment key (:mod:`.convergence.follow`). Actual
state: the revisions loaded into the :class:`~node_agent.serving.ServingCore`, one per key —
that is per (deployment, revision): two revisions of one served model (a rolling update's
surge, a canary's stable and candidate) are both resident. :meth:`Controller.served` tells the
HTTP layer which revisions of each served model are loaded (or in standby) and in which role.

Converging is concurrent per key: each key gets a task of its own (download → check → load →
report), so a slow download never holds up another assignment. The converge worker only plans
(:func:`.convergence.step.plan`) and cancels and starts the keys' tasks; it never waits for a
download or a load. A task whose target changes (source URI, serving limits, served name) or
that is unassigned is cancelled (a download stops at once, its partial files stay for a
resume; a load the core was reading is called off) and a new task takes over once it has
ended: it loads the new target, or *retires* the key — a revision no longer assigned is
*drained* in the background (no new requests, running ones finish, up to
:data:`DRAIN_SECONDS`, then unloaded) and its report deleted. A change of ``generation`` or
``role`` is reported after the running task (a changed role is never a reload). One lock per
key: a key's tasks, its idle unload and its reload on demand never interleave.

Reports (``Prefetching`` → ``Loading`` → ``Ready``, ``Failed``, ``Unloaded``;
:mod:`.convergence.reports`) are written under the node's lease; each carries the memory
estimate once known. A failed load is retried with a capped exponential back-off
(:data:`RETRY_INITIAL_BACKOFF` doubling to :data:`RETRY_MAX_BACKOFF`,
:func:`.convergence.step.failed`), the report staying ``Failed`` meanwhile; failures no retry
can fix (:data:`PERMANENT_REASONS`) wait for a spec change. A served name another deployment
holds is refused ``ModelNameConflict`` until it is freed.

Idle unload, eviction, prefetch and reload on demand (:mod:`.convergence.demand`,
:mod:`.lifecycle`): every request calls :meth:`Controller.touch`; each lifecycle pass
(:meth:`Controller.tick`) unloads revisions idle for their ``idle_unload_seconds`` to
*standby* (still served: :meth:`Controller.ensure_loaded` reloads on the next request, once
however many wait), runs the predictive prefetch and sets the gauges. A *pinned* revision is
never unloaded. Before every load, :func:`.convergence.step.room` checks the estimate against
``budget_bytes`` and the count against ``max_loaded_models``: idle, unpinned revisions with
nothing in flight are evicted least recently used first, else the load fails
:data:`INSUFFICIENT_MEMORY` or :data:`MODEL_LIMIT` with the numbers (retried).
``lifecycle.prefetch: OnDemand`` loads nothing until the first request.

Layout (state + pure step + thin executor, :mod:`node_agent.convergence`): the records and the
rules' constants in :mod:`~.convergence.state`, every decision in :mod:`~.convergence.step`
(pure, table-tested), the executor parts :mod:`~.convergence.reports`,
:mod:`~.convergence.unload`, :mod:`~.convergence.load` and :mod:`~.convergence.demand` over a
shared :class:`~.convergence.runtime.Runtime`; this module wires them — the converge worker,
each key's task, the public surface. One injected clock (``clock``) drives every decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

from mlx_fleet.contract import Keys
from mlx_fleet.source_policy import DEFAULT_POLICY, SourcePolicy
from mlx_fleet.store import Store
from mlx_fleet.supervise import Supervised

from .convergence import step
from .convergence.demand import Demand
from .convergence.follow import Follower
from .convergence.keytask import KeyTasks
from .convergence.load import Loader
from .convergence.reports import Reports
from .convergence.runtime import Runtime
from .convergence.state import (DRAIN_SECONDS, INSUFFICIENT_MEMORY, LIFECYCLE_INTERVAL_SECONDS,
                                LOAD_ASSIGNED, MAX_RELOAD_WAITERS, MODEL_LIMIT,
                                PERMANENT_REASONS, RETRY_INITIAL_BACKOFF, RETRY_MAX_BACKOFF,
                                UNLOAD_UNASSIGNED, Ident, IdleUnload, Invalid, ServedModel,
                                StandbyModel)
from .convergence.unload import Unloader
from .fetch import DownloadLimits, default_model_cache
from .lifecycle import DEFAULT_MAX_PREFETCHES, DEFAULT_PREFETCH_WINDOW_SECONDS, UsageHistory
from .registration import Registration
from .serving import ServingCore
from .sources import resolve_source

log = logging.getLogger(__name__)

__all__ = ["Controller", "ServedModel", "IdleUnload", "StandbyModel", "RETRY_INITIAL_BACKOFF",
           "RETRY_MAX_BACKOFF", "PERMANENT_REASONS", "DRAIN_SECONDS",
           "LIFECYCLE_INTERVAL_SECONDS", "MAX_RELOAD_WAITERS", "INSUFFICIENT_MEMORY",
           "MODEL_LIMIT", "LOAD_ASSIGNED", "UNLOAD_UNASSIGNED"]


class Controller:
    """Keeps ``core`` serving exactly ``node_name``'s assignments.

    ``store``/``keys``: the etcd store and contract layout; ``registration``: writes the reports
    under the node's lease; ``advertise_url``: the ``endpoint`` put into Ready reports;
    ``resolve``: local source URI → local path (default
    :func:`~node_agent.sources.resolve_source` under ``source_policy``; ``hf://`` and
    ``https://`` sources are fetched with :func:`~node_agent.fetch.fetch`).
    ``source_policy``: the fleet's source policy every source is checked against (default
    the secure :data:`~mlx_fleet.source_policy.DEFAULT_POLICY`: no local directory, no
    private address; a dev fleet passes
    :data:`~mlx_fleet.source_policy.DEV_POLICY` or its own).
    ``retry_backoff``: ``(initial, maximum)`` delay in seconds between retries of a failed load
    (default :data:`RETRY_INITIAL_BACKOFF`, :data:`RETRY_MAX_BACKOFF`). ``model_cache``: where
    ``https://`` sources are downloaded (default :func:`~node_agent.fetch.default_model_cache`,
    ``$MLX_FLEET_CACHE/models``); ``hf://`` ones use the Hugging Face cache.
    ``lifecycle_interval``: seconds between two looks for idle revisions (default
    :data:`LIFECYCLE_INTERVAL_SECONDS`); ``max_reload_waiters``: requests that may wait for one
    reload (default :data:`MAX_RELOAD_WAITERS`); ``clock``: monotonic seconds, the one clock of
    every decision — idle times, the usage history, retry times (injectable for tests).
    ``budget_bytes``: memory the node's resident revisions may take (the agent passes its
    capacity's :meth:`~mlx_fleet.contract.NodeCapacity.budget_bytes`, with its
    ``--memory-watermark``; None: no check, no eviction). ``prefetch_window_seconds`` /
    ``max_prefetches``: the predictive prefetch's window and the most reloads it runs at once
    (:mod:`.lifecycle`, seed 001: 30 s, 2). ``max_loaded_models``: the most revisions resident
    at once (seed 004: "Per-worker max loaded models: 2"; default 0 = no limit but memory);
    raises ``ValueError`` when negative. ``download_limits``: what a download may take and the
    model cache's garbage collection (:class:`~node_agent.fetch.DownloadLimits`; default: 10 %
    of the disk kept free, no cap, ``hf://`` commits only). The cache is collected once the
    first list of assignments is applied, after each unassignment, and when a download needs
    the space (:meth:`.convergence.load.Loader.collect_garbage`).
    """

    def __init__(self, store: Store, keys: Keys, *, node_name: str, core: ServingCore,
                 registration: Registration, advertise_url: str,
                 resolve: Callable[[str], Path] | None = None,
                 retry_backoff: tuple[float, float] = (RETRY_INITIAL_BACKOFF,
                                                       RETRY_MAX_BACKOFF),
                 model_cache: Path | None = None,
                 lifecycle_interval: float = LIFECYCLE_INTERVAL_SECONDS,
                 max_reload_waiters: int = MAX_RELOAD_WAITERS,
                 clock: Callable[[], float] = time.monotonic,
                 budget_bytes: int | None = None,
                 prefetch_window_seconds: float = DEFAULT_PREFETCH_WINDOW_SECONDS,
                 max_prefetches: int = DEFAULT_MAX_PREFETCHES,
                 max_loaded_models: int = 0,
                 download_limits: DownloadLimits | None = None,
                 source_policy: SourcePolicy = DEFAULT_POLICY) -> None:
        if max_loaded_models < 0:
            raise ValueError(f"max_loaded_models must be >= 0 (0 = no limit), "
                             f"got {max_loaded_models}")
        self.node_name = node_name
        self.advertise_url = advertise_url
        self._reg = registration
        self._rt = rt = Runtime(keys, node_name=node_name, core=core, clock=clock,
                                budget_bytes=budget_bytes, max_loaded_models=max_loaded_models)
        rt.signal = self._signal
        self._reports = Reports(rt, registration, advertise_url)
        self._unloader = Unloader(rt, self._reports)
        if resolve is None:
            resolve = functools.partial(resolve_source, policy=source_policy)
        self._loader = Loader(rt, self._reports, self._unloader, resolve=resolve,
                              policy=source_policy,
                              model_cache=(model_cache if model_cache is not None
                                           else default_model_cache()),
                              backoff=retry_backoff, limits=download_limits)
        self._gc_started = False  # the first collection waits for the assignments
        self._demand = Demand(rt, self._loader, self._unloader,
                              max_reload_waiters=max_reload_waiters,
                              prefetch_window=prefetch_window_seconds,
                              max_prefetches=max_prefetches)
        #: The assignment follower (etcd → the records' desired values).
        self.follower = Follower(store, rt)
        self.prefix = self.follower.prefix
        self._changed = asyncio.Event()
        self._quiet = asyncio.Event()  # set while no key's task runs and nothing is pending
        self._keys_tasks = KeyTasks(rt, self._reports, self._loader, self._unloader)
        # All run under supervision: a bug (e.g. in a watch callback) is logged and the task
        # restarts after a back-off; a restarted follower re-lists, so nothing is missed.
        self._tasks = [
            Supervised("controller:follow", lambda: self.follower.run()),
            Supervised("controller:converge", self._worker),
            Supervised("controller:lifecycle", lambda: self._demand.run(lifecycle_interval)),
        ]

    # -- what the agent reads and sets -------------------------------------------------------
    @property
    def budget_bytes(self) -> int | None:
        return self._rt.budget_bytes

    @property
    def max_loaded_models(self) -> int:
        return self._rt.max_loaded_models

    @property
    def max_reload_waiters(self) -> int:
        return self._demand.max_reload_waiters

    @property
    def cache_collected(self) -> asyncio.Event:
        """Set when the model cache's last scheduled garbage collection (at start, after an
        unassignment) has ended."""
        return self._loader.collected

    @property
    def history(self) -> UsageHistory:
        """Request arrivals per served (model id, revision), for the predictive prefetch."""
        return self._rt.history

    @property
    def snapshots(self) -> int:
        """Snapshots (initial list + re-lists after compaction) applied."""
        return self.follower.snapshots

    @property
    def lifecycle_passes(self) -> int:
        """Passes of the lifecycle task (idle checks) completed."""
        return self._demand.passes

    @property
    def reloads(self) -> int:
        """Reloads on demand started (single-flight: one per standby period)."""
        return self._demand.reloads

    @property
    def prefetches(self) -> int:
        """Predictive prefetches (reloads ahead of a predicted request) started."""
        return self._demand.prefetches

    @property
    def idle_unloaded(self) -> dict[Ident, IdleUnload]:
        """The latest idle unload of each (model id, revision)."""
        return self._rt.idle_unloaded

    @property
    def evicted(self) -> dict[Ident, IdleUnload]:
        """The latest eviction (unload under memory pressure) of each (model id, revision)."""
        return self._rt.evicted

    @property
    def tasks(self) -> list[Supervised]:
        """The supervised background tasks (follower, converge worker, lifecycle), for
        ``/health``."""
        return list(self._tasks)

    async def start(self) -> None:
        """Start following assignments and the converge worker (returns at once)."""
        for t in self._tasks:
            t.start()

    async def stop(self) -> None:
        """Stop following and converging. Loaded models stay loaded (the core owns them)."""
        for t in self._tasks:
            await t.stop()
        running = [r.task for r in self._rt.records.values() if r.task is not None]
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for t in self._rt.draining.values():
            t.cancel()
        self._demand.stop()
        await self._loader.stop()

    async def converged(self) -> None:
        """Return once every assignment's task has ended and the converge worker has planned
        over the desired state it has seen and waits for a change (failed loads may be
        waiting for their retry). A change that arrives later starts new tasks."""
        await self._quiet.wait()

    def served(self) -> dict[str, ServedModel]:
        """served model name → its deployment and the revisions it serves: those loaded now
        (not draining) and those unloaded for idleness (``standby``: reloaded on demand)."""
        return step.served(self._rt.records)

    def standby_models(self) -> list[StandbyModel]:
        """The revisions assigned here that are not resident (idle-unloaded, evicted, or
        ``OnDemand`` and not loaded yet), ordered by model id and revision: a request loads
        them (``GET /v1/models`` lists them with ``status: standby``)."""
        return step.standby_models(self._rt.records)

    def touch(self, model_id: str, revision: str) -> None:
        """A request for ``model_id`` revision ``revision`` is being served: it is not idle, and
        its arrival goes into the usage history (:meth:`prefetch`). Called once per request."""
        if self._rt.mark_used((model_id, revision)):
            self._rt.history.record((model_id, revision), self._rt.clock())

    def states(self) -> dict[str, dict]:
        """Per-assignment state for ``/health``: ``{"ns/name/revision": {model, revision, role,
        state, reason}}`` from the latest reports (:attr:`~.convergence.state.Record.phase`)."""
        out: dict[str, dict] = {}
        records = self._rt.records
        for key in sorted(k for k, r in records.items() if r.desired is not None):
            parsed = self._rt.keys.parse_assignment(key)
            rec = records[key]
            a = rec.desired if not isinstance(rec.desired, Invalid) else None
            out[f"{parsed[1]}/{parsed[2]}/{parsed[3]}" if parsed else key] = {
                "model": a.served_model_name if a is not None else "",
                "revision": parsed[3] if parsed else "",
                "role": a.role.value if a is not None else "",
                "state": rec.phase.value,
                "reason": rec.report.reason if rec.report is not None else "",
            }
        return out

    async def unload_idle(self) -> list[Ident]:
        """Unload every loaded revision idle for its ``idle_unload_seconds`` (0 = never), with
        none in flight, not pinned, not being loaded. Returns the ``(model id, revision)``
        unloaded."""
        return await self._demand.unload_idle()

    async def tick(self) -> list[asyncio.Task]:
        """One lifecycle pass (idle unload, predictive prefetch, gauges); returns the prefetch
        reloads started."""
        return await self._demand.tick()

    def prefetch(self) -> list[asyncio.Task]:
        """Start the predictive prefetches due now; returns their reloads."""
        return self._demand.prefetch()

    async def observe(self) -> None:
        """Set the memory and idle-time gauges."""
        await self._demand.observe()

    async def ensure_loaded(self, model_id: str, revision: str) -> None:
        """Make sure ``model_id`` revision ``revision`` is resident before a request uses it:
        a revision in standby is reloaded — once, however many requests wait for it (single
        flight) — and this returns when it is Ready. Counts as a use.

        Raises :class:`~node_agent.serving.ModelNotLoaded` when the revision is not served
        here (or its assignment went away meanwhile), :class:`~node_agent.serving.Overloaded`
        when ``max_reload_waiters`` requests already wait for its reload (``retry_after_seconds``:
        the last load's duration, at least 1), :class:`~node_agent.serving.ModelLoadError` when
        the reload failed (the report says ``Failed``; it is retried like any failed load)."""
        await self._demand.ensure_loaded(model_id, revision)

    # -- the converge worker -----------------------------------------------------------------
    def _signal(self) -> None:
        """Something changed (desired state, a key's task ended, a drain ended): the converge
        worker plans again; :meth:`converged` waits for that pass."""
        self._quiet.clear()
        self._changed.set()

    async def _worker(self) -> None:
        """Plan whenever something changes, or when a failed load's retry is due. A pass that
        raises is a bug: it ends this run, and the supervisor restarts it (with a back-off),
        which plans again; the keys' tasks keep running meanwhile."""
        self._changed.set()  # (re)started: a pass may have been cut short
        while True:
            self._changed.clear()
            wake_at = await self._converge()
            self._loader.hold_sources()  # before the keys' tasks started just now run
            if not self._gc_started and self.follower.snapshots:
                # only now is it known what is assigned here: nothing assigned is collected
                self._gc_started = True
                self._loader.schedule_gc()
            if not self._changed.is_set() and not any(
                    r.busy for r in self._rt.records.values()):
                self._quiet.set()
            if wake_at is None:
                await self._changed.wait()
            elif (retry_in := wake_at - self._rt.clock()) > 0:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a
                # cancellation that arrives as the event is set, and stop() would hang
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(retry_in):
                        await self._changed.wait()

    async def _converge(self) -> float | None:
        """One pass of the converge worker: :func:`.convergence.step.plan` at the clock's now,
        then cancel and start the keys' tasks it names (nothing here waits for a download or a
        load), and forget the keys nothing is left of. Returns the clock time of the next
        retry (None: none). Re-raises the exception of a key's task that failed with a bug."""
        if self._keys_tasks.bug is not None:
            bug, self._keys_tasks.bug = self._keys_tasks.bug, None
            raise bug
        rt = self._rt
        plan = step.plan(rt.records, rt.clock())
        for key in plan.cancel:
            task = rt.records[key].task
            assert task is not None
            task.cancel()
        for key in plan.start:
            self._keys_tasks.start(key)
            self._quiet.clear()
        rt.sweep()
        return plan.wake_at
