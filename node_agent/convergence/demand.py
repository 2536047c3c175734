"""Idle unload, predictive prefetch, the lifecycle metrics and reload on demand: the lifecycle
pass (:meth:`Demand.tick`, every ``lifecycle_interval`` seconds) and the request side
(:meth:`Demand.ensure_loaded`, a single-flight reload per standby revision). The decisions are
:func:`node_agent.lifecycle.idle_unloads`, :func:`.step.prefetches` and :func:`.step.admit`."""

from __future__ import annotations

import asyncio
import logging

from mlx_fleet.contract import IDLE_UNLOADED, PREDICTIVE_PREFETCH, RELOADING_ON_DEMAND

from ..lifecycle import idle_unloads
from ..serving import ModelLoadError, ModelNotLoaded, Overloaded
from . import step
from .load import Loader
from .runtime import Runtime
from .state import Ident, Spec
from .unload import Unloader

log = logging.getLogger("node_agent.controller")

__all__ = ["Demand"]


class Demand:
    """The lifecycle of ``rt``'s resident and standby revisions. ``max_reload_waiters``:
    requests that may wait for one reload; ``prefetch_window`` / ``max_prefetches``: the
    predictive prefetch's window (seconds) and the most reloads it runs at once."""

    def __init__(self, rt: Runtime, loader: Loader, unloader: Unloader, *,
                 max_reload_waiters: int, prefetch_window: float, max_prefetches: int) -> None:
        self._rt = rt
        self._loader = loader
        self._unloader = unloader
        self.max_reload_waiters = max_reload_waiters
        self.prefetch_window = prefetch_window
        self.max_prefetches = max_prefetches
        self.reload_tasks: dict[Ident, asyncio.Task] = {}
        self.reload_waiters: dict[Ident, int] = {}
        self._prefetching: set[asyncio.Task] = set()
        self._observing: asyncio.Task | None = None
        #: Number of reloads on demand started (single-flight: one per standby period).
        self.reloads = 0
        #: Number of predictive prefetches (reloads ahead of a predicted request) started.
        self.prefetches = 0
        #: Number of lifecycle passes completed by :meth:`run`.
        self.passes = 0

    def stop(self) -> None:
        """Cancel the reloads, prefetches and measurement running now."""
        for t in [*self.reload_tasks.values(), *self._prefetching, self._observing]:
            if t is not None:
                t.cancel()

    async def run(self, interval: float) -> None:
        """Every ``interval`` seconds, one :meth:`tick`."""
        while True:
            await asyncio.sleep(interval)
            await self.tick()
            self.passes += 1

    async def tick(self) -> list[asyncio.Task]:
        """One lifecycle pass: :meth:`unload_idle`, then :meth:`prefetch`, then the memory and
        idle-time gauges (:meth:`observe`, in the background: measuring MLX memory waits for
        the MLX thread, which must never hold up the pass). Returns the prefetch reloads
        started (tasks; await them to wait until the revisions are resident)."""
        await self.unload_idle()
        started = self.prefetch()
        if self._observing is None or self._observing.done():
            self._observing = asyncio.create_task(self.observe(), name="controller:observe")
        return started

    async def unload_idle(self) -> list[Ident]:
        """Unload every loaded revision that has had no request for its assignment's
        ``idle_unload_seconds`` (0 = never), has none in flight, is not pinned and is not
        being loaded or reloaded. Returns the ``(model id, revision)`` unloaded."""
        now = self._rt.clock()
        done: list[Ident] = []
        for key in idle_unloads(self._rt.uses(now).values(), now):
            unload = await self._unloader.to_standby(key, IDLE_UNLOADED)  # type: ignore[arg-type]
            if unload is not None:
                done.append((unload.model_id, unload.revision))
        return done

    def prefetch(self) -> list[asyncio.Task]:
        """Predictive prefetch (:func:`.step.prefetches`): reload the standby revisions whose
        next request is expected within the window, as far as the node's budget and model
        limit allow without evicting. Reported ``Loading``/``PredictivePrefetch`` then
        ``Ready``. Returns the reloads started (a request arriving meanwhile waits for the
        same reload)."""
        rt = self._rt
        start, skipped = step.prefetches(
            rt.records, rt.history, rt.clock(), core=rt.core_view(),
            reloading=self.reload_tasks, allowance=self.max_prefetches - len(self._prefetching),
            window_s=self.prefetch_window, budget_bytes=rt.budget_bytes,
            max_loaded_models=rt.max_loaded_models)
        for ident, why in skipped:
            log.info("not prefetching %s revision %s: %s", *ident, why)
        started: list[asyncio.Task] = []
        for key, ident in start:
            log.info("prefetching %s revision %s (assignment %s): a request is expected within "
                     "%gs", *ident, key, self.prefetch_window)
            loaded = rt.records[key].loaded
            assert loaded is not None
            task = self._start_reload(key, loaded.spec, PREDICTIVE_PREFETCH)
            self._prefetching.add(task)
            task.add_done_callback(self._prefetching.discard)
            self.prefetches += 1
            started.append(task)
        return started

    async def observe(self) -> None:
        """Set the memory gauges (``mlxfleet_agent_memory_bytes`` by kind: ``weights`` of the
        resident revisions from their safetensors headers, ``kv_cache`` = what the core
        accounts beyond the weights (prompt/KV caches), ``mlx_cache`` = MLX's buffer cache,
        ``free`` = budget − :func:`.step.in_use`) and each assigned revision's idle seconds."""
        rt = self._rt
        now = rt.clock()
        weights = kv_cache = 0
        for rec in rt.records.values():
            loaded = rec.loaded
            if loaded is None or rec.spec is None:
                continue
            ident = loaded.spec.ident
            rt.metrics.model_idle_seconds.labels(*ident).set(max(now - loaded.last_used, 0))
            if not loaded.standby and rt.core.is_loaded(*ident):
                weights += loaded.resident_bytes
                kv_cache += max(rt.core.memory_bytes(*ident) - loaded.resident_bytes, 0)
        rt.metrics.memory_bytes.labels("weights").set(weights)
        rt.metrics.memory_bytes.labels("kv_cache").set(kv_cache)
        try:
            usage = await rt.core.memory_usage()
            rt.metrics.memory_bytes.labels("mlx_cache").set(usage.cache_bytes)
        except Exception as e:  # noqa: BLE001 - a measurement
            log.debug("cannot measure memory: %s", e)
        if rt.budget_bytes is not None:
            rt.metrics.memory_bytes.labels("free").set(max(rt.budget_bytes - rt.in_use()[0], 0))

    async def ensure_loaded(self, model_id: str, revision: str) -> None:
        """Make sure ``model_id`` revision ``revision`` is resident before a request uses it
        (see :meth:`node_agent.controller.Controller.ensure_loaded`; :func:`.step.admit`)."""
        rt, ident = self._rt, (model_id, revision)
        waiting = self.reload_waiters.get(ident, 0)
        decision = step.admit(rt.records, ident, serving=rt.core.is_loaded(*ident),
                              reloading=ident in self.reload_tasks, waiting=waiting,
                              max_waiters=self.max_reload_waiters)
        if decision.admission is step.Admission.READY:
            rt.mark_used(ident)  # a use; touch() records the arrival
            return
        if decision.admission is step.Admission.NOT_SERVED:
            raise ModelNotLoaded(model_id, revision)
        if decision.admission is step.Admission.OVERLOADED:
            raise Overloaded(f"{waiting} requests are already waiting for revision {revision} "
                             f"of {model_id} to reload (limit {self.max_reload_waiters})",
                             retry_after_seconds=decision.retry_after)
        if decision.admission is step.Admission.START:
            self.reloads += 1
            loaded = rt.records[decision.key].loaded
            assert loaded is not None
            task = self._start_reload(decision.key, loaded.spec, RELOADING_ON_DEMAND)
        else:
            task = self.reload_tasks[ident]
        self.reload_waiters[ident] = waiting + 1
        try:
            await asyncio.shield(task)  # a waiter that leaves does not cancel the reload
        finally:
            n = self.reload_waiters[ident] - 1
            if n:
                self.reload_waiters[ident] = n
            else:
                del self.reload_waiters[ident]
        rt.mark_used(ident)

    def _start_reload(self, key: str, spec: Spec, reason: str) -> asyncio.Task:
        """Start the single-flight reload of ``key``'s standby revision (registered so that
        every request for it waits for this one)."""
        ident = spec.ident
        task = asyncio.create_task(self._reload(key, spec, reason),
                                   name=f"reload {spec.model_id}@{spec.revision}")
        self.reload_tasks[ident] = task

        def done(t: asyncio.Task) -> None:
            if self.reload_tasks.get(ident) is t:
                del self.reload_tasks[ident]
            if not t.cancelled():
                t.exception()  # retrieved: the waiters got it (or left)

        task.add_done_callback(done)
        return task

    async def _reload(self, key: str, spec: Spec, reason: str) -> None:
        """Load a standby revision again (under its key's lock): ``Loading`` with ``reason``
        (:data:`~mlx_fleet.contract.RELOADING_ON_DEMAND`,
        :data:`~mlx_fleet.contract.PREDICTIVE_PREFETCH`), then ``Ready``; raises if it did not
        come back."""
        rt = self._rt
        rec = rt.record(key)
        async with rec.lock:
            loaded = rec.loaded
            if (loaded is not None and not loaded.standby and rt.core.is_loaded(*spec.ident)):
                return  # loaded meanwhile
            d = rec.assigned(spec)
            if loaded is None or d is None:
                raise ModelNotLoaded(spec.model_id, spec.revision)  # reassigned meanwhile
            log.info("reloading %s revision %s (%s, assignment %s)", spec.model_id,
                     spec.revision, reason, key)
            await self._loader.load(key, d, spec, on_demand=True, reason=reason)
            now = rec.loaded
            if now is not None and not now.standby and rt.core.is_loaded(*spec.ident):
                return
            rt.signal()  # the converge worker schedules the retry (or what replaced it)
            if rec.failure is not None:
                raise ModelLoadError(rec.failure.reason, rec.failure.message)
            raise ModelLoadError("LoadFailed", f"revision {spec.revision} of {spec.model_id} "
                                 "could not be reloaded")
