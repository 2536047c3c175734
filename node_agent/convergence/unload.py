"""Unloading revisions: draining one that is no longer assigned (in the background, its running
requests finish first, up to :data:`~.state.DRAIN_SECONDS`), and unloading one to standby —
idle (``IdleUnloaded``) or evicted to make room (``Evicted``) — with the memory measured before
and after and reported (:func:`.step.may_unload` decides whether it still qualifies)."""

from __future__ import annotations

import asyncio
import logging
import time

from mlx_fleet.contract import EVICTED

from ..serving import MemoryUsage
from . import step
from .reports import Reports
from .runtime import Runtime
from .state import DRAIN_SECONDS, UNLOAD_UNASSIGNED, IdleUnload, Loaded, Spec

log = logging.getLogger("node_agent.controller")

__all__ = ["Unloader"]


class Unloader:
    """Drains and unloads revisions of ``rt``'s core, reporting through ``reports``."""

    def __init__(self, rt: Runtime, reports: Reports) -> None:
        self._rt = rt
        self._reports = reports

    def drain(self, spec: Spec) -> None:
        """Unload ``spec``'s revision after its running requests finish (in the background, so a
        long drain never holds up other assignments). A revision assigned again meanwhile is
        loaded anew once the drain is over (see :meth:`.load.Loader.load`)."""
        rt, ident = self._rt, spec.ident

        async def run() -> None:
            try:
                t0 = time.perf_counter()  # a duration for the histogram, not a decision
                await rt.core.unload_model(spec.model_id, spec.revision,
                                           drain_seconds=DRAIN_SECONDS)
                rt.metrics.model_unload_seconds.labels(UNLOAD_UNASSIGNED).observe(
                    time.perf_counter() - t0)
                rt.metrics.model_unloads.labels(UNLOAD_UNASSIGNED).inc()
            except Exception:  # noqa: BLE001 - logged; the core stays usable
                log.exception("unloading %s revision %s failed", *ident)
            finally:
                rt.forget(spec)  # after the core's last write to its series
                if rt.draining.get(ident) is task:
                    del rt.draining[ident]
                    rt.signal()

        task = asyncio.create_task(run(), name=f"drain {spec.model_id}@{spec.revision}")
        rt.draining[ident] = task

    def let_go(self, key: str, loaded: Loaded, why: str) -> None:
        """``key`` no longer serves ``loaded`` (already taken off its record): drain it, or
        forget it if it is in standby; an assignment refused for its name may now load."""
        if loaded.standby:  # unloaded already
            log.info("forgetting standby %s revision %s (assignment %s %s)",
                     loaded.spec.model_id, loaded.spec.revision, key, why)
            self._rt.forget(loaded.spec)
        else:
            log.info("draining %s revision %s (assignment %s %s)", loaded.spec.model_id,
                     loaded.spec.revision, key, why)
            self.drain(loaded.spec)
        self._rt.recheck_conflicts()

    async def to_standby(self, key: str, reason: str, *, cause: str = "") -> IdleUnload | None:
        """Unload ``key``'s revision to standby — ``reason``
        :data:`~mlx_fleet.contract.IDLE_UNLOADED` (it must still be idle for its policy) or
        :data:`~mlx_fleet.contract.EVICTED` (``cause``: the load it makes room for) —
        measuring memory before and after, and report it ``Unloaded`` with that reason and the
        freed bytes. None when it no longer qualifies (used meanwhile, pinned, reassigned,
        busy: :func:`.step.may_unload`)."""
        rt = self._rt
        rec = rt.records.get(key)
        if rec is None or rec.lock.locked():
            return None
        async with rec.lock:
            loaded = rec.loaded
            if loaded is None or loaded.standby:
                return None
            spec = loaded.spec
            before: MemoryUsage | None = None
            try:
                before = await rt.core.memory_usage()
            except Exception as e:  # noqa: BLE001 - a measurement: unload anyway
                log.warning("cannot measure memory before unloading %s revision %s: %s",
                            spec.model_id, spec.revision, e)
            # checked again after the await, and nothing awaits from here to the unload: no
            # request can be admitted in between (it would see the revision in standby and
            # wait for this lock to reload it)
            now = rt.clock()
            d = step.may_unload(rec, loaded, reason, rt.core.inflight_requests(*spec.ident), now)
            if d is None:
                return None
            loaded.standby = True
            try:
                t0 = time.perf_counter()  # a duration for the histogram, not a decision
                # nothing is in flight: the drain ends at once; it is only a safety net
                await rt.core.unload_model(spec.model_id, spec.revision,
                                           drain_seconds=DRAIN_SECONDS)
                rt.metrics.model_unload_seconds.labels(reason).observe(time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 - logged; the core stays usable
                log.exception("unloading %s revision %s (%s) failed", spec.model_id,
                              spec.revision, reason)
            after: MemoryUsage | None = None
            try:
                after = await rt.core.memory_usage()
            except Exception as e:  # noqa: BLE001
                log.warning("cannot measure memory after unloading %s revision %s: %s",
                            spec.model_id, spec.revision, e)
            freed = (max(before.mlx_bytes - after.mlx_bytes, 0)
                     if before is not None and after is not None else 0)
            unload = IdleUnload(spec.model_id, spec.revision, now - loaded.last_used,
                                d.lifecycle.idle_unload_seconds, before, after, freed,
                                reason=reason, cause=cause)
            loaded.unload = unload
            (rt.evicted if reason == EVICTED else rt.idle_unloaded)[spec.ident] = unload
            rt.metrics.model_unloads.labels(reason).inc()
            rt.metrics.unload_freed_bytes.labels(reason).inc(freed)
            log.info("%s revision %s (assignment %s): %s", spec.model_id, spec.revision, key,
                     unload.message())
            await self._reports.standby(key, d, loaded)
            return unload
