"""Loading one assignment's revision: download a remote source (``Prefetching`` with its
progress), read and check its headers (the memory estimate), make room under the node's budget
and model limit (:func:`.step.room`: fits, evict first, or refuse), load it into the core, and
report ``Ready`` — or ``Failed`` with the back-off of :func:`.step.failed`.

Downloads are bounded by the agent's :class:`~node_agent.fetch.DownloadLimits` (disk reserve,
cache cap, pinned ``hf://`` commits); when one does not fit, the model cache's garbage
collector runs first (:meth:`Loader.collect_garbage`, which never deletes a source assigned
here, loaded, or downloading). The downloaded files' digest
(:func:`~node_agent.fetch.digest_of`) goes into the reports from ``Loading`` on."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from mlx_fleet.contract import (EVICTED, IDLE_UNLOADED, PREDICTIVE_PREFETCH,
                                RELOADING_ON_DEMAND, Assignment, AssignmentState,
                                DownloadProgress)

from mlx_fleet.source_policy import DEFAULT_POLICY, SourcePolicy

from .. import memory_estimate
from ..fetch import (DownloadLimits, cache_bytes, cache_entry_name, collect_garbage, digest_of,
                     fetch, hub_cache_dir, touch_entry)
from ..fetch.cache import SourceHolds
from ..fetch.gc import Deletion
from ..serving import ModelLoadError
from ..serving.capabilities import model_capabilities
from ..serving.errors import LOAD_CANCELLED, LOAD_FAILURE_TEXT
from ..model_dir import SourceError, status_message
from ..sources import is_remote
from . import step
from .reports import Reports
from .runtime import Runtime
from .state import LOAD_ASSIGNED, PROGRESS_REPORT_SECONDS, Failure, Loaded, Spec
from .unload import Unloader

log = logging.getLogger("node_agent.controller")

__all__ = ["Loader"]


class Loader:
    """Loads revisions for ``rt``'s keys. ``resolve``: local source URI → local path;
    ``model_cache``: where ``https://`` sources are downloaded; ``backoff``: ``(initial,
    maximum)`` retry delay of a failed load, seconds (:func:`.step.failed`); ``limits``: what
    a download may take (:class:`~node_agent.fetch.DownloadLimits`; ``hf://`` sources go to
    :func:`~node_agent.fetch.hub_cache_dir`, the agent's own ``model_cache/hf`` unless
    ``$HF_HUB_CACHE`` is set, capped and collected like the rest); ``policy``: the source
    policy remote sources are fetched under (local ones: ``resolve`` applies it).

    A source that fails is reported with :func:`~node_agent.model_dir.status_message` (the
    kind of failure, no network or file-system detail: a status is no probe of the Mac's
    network); the detail goes to the agent's log."""

    def __init__(self, rt: Runtime, reports: Reports, unloader: Unloader, *,
                 resolve: Callable[[str], Path], model_cache: Path,
                 backoff: tuple[float, float],
                 limits: DownloadLimits | None = None,
                 policy: SourcePolicy = DEFAULT_POLICY) -> None:
        self._rt = rt
        self._policy = policy
        self._reports = reports
        self._unloader = unloader
        self._resolve = resolve
        self._model_cache = model_cache
        self.backoff = backoff
        self.limits = limits or DownloadLimits()
        self._gc: set[asyncio.Task] = set()
        self._holds = SourceHolds(model_cache)  # our sources, kept from other agents' GC
        #: Set when a scheduled garbage collection has ended; cleared when one is scheduled
        #: to run at once.
        self.collected = asyncio.Event()

    # -- the model cache's garbage collection ------------------------------------------------
    def _cache_entry(self, spec: Spec | None) -> tuple[str, Path | None] | None:
        """``spec``'s source's name in the model cache and the path marking its last use
        (:func:`~node_agent.fetch.cache_entry_name`; None: a local or malformed source)."""
        return None if spec is None else cache_entry_name(spec.uri, self._model_cache)

    def _cache_names(self) -> tuple[set[str], set[str]]:
        """The model cache's names of the remote sources (``https://`` directories,
        ``hf://`` revisions or repositories) ``(assigned here — desired, attempted or being
        worked on —, loaded or being loaded)``."""
        assigned: set[str] = set()
        loaded: set[str] = set()

        def name(spec: Spec | None) -> str | None:
            entry = self._cache_entry(spec)
            return entry[0] if entry is not None else None

        for rec in self._rt.records.values():
            running = rec.running if isinstance(rec.running, Spec) else None
            for spec in (rec.spec, rec.attempted, running):
                if (n := name(spec)) is not None:
                    assigned.add(n)
            for spec in (rec.loaded.spec if rec.loaded is not None else None,
                         rec.loading[0] if rec.loading is not None else None):
                if (n := name(spec)) is not None:
                    loaded.add(n)
        return assigned, loaded

    def hold_sources(self) -> None:
        """Mark the downloads assigned here or loaded as in use (:class:`SourceHolds`), for
        another agent's collector on a shared cache; called after every converge pass."""
        assigned, loaded = self._cache_names()
        self._holds.hold(assigned | loaded)

    async def collect_garbage(self, need: int = 0, shortfall: int = 0) -> list[Deletion]:
        """Delete from the model cache what :func:`~node_agent.fetch.gc.gc_plan` names (stale
        ``.part`` files, sources no longer assigned here, least recently used first; never one
        assigned, loaded or downloading); ``need`` / ``shortfall``: bytes a download is about
        to add / the disk lacks for it. Returns the deletions; an error is logged, never
        raised."""
        assigned, loaded = self._cache_names()
        self._holds.hold(assigned | loaded)

        def collect() -> tuple[list[Deletion], int]:
            done = collect_garbage(self._model_cache, assigned=assigned, loaded=loaded,
                                   limits=self.limits, now=time.time(), need=need,
                                   shortfall=shortfall)
            return done, cache_bytes(self._model_cache)

        try:
            done, held = await asyncio.to_thread(collect)
        except Exception:  # noqa: BLE001 - the cache's upkeep must not fail a load
            log.exception("model cache garbage collection failed")
            return []
        metrics = self._rt.metrics
        for d in done:
            metrics.model_cache_deleted_bytes.labels(d.reason).inc(d.bytes)
        metrics.model_cache_bytes.set(held)
        return done

    def schedule_gc(self, delay: float = 0.0) -> None:
        """Run :meth:`collect_garbage` in the background after ``delay`` seconds (at start once
        the assignments are known: 0; after an unassignment: now and once its source's
        ``unused_max_age_s`` has passed)."""
        async def later() -> None:
            if delay > 0:
                await asyncio.sleep(delay)
            await self.collect_garbage()
            self.collected.set()

        if delay <= 0:
            self.collected.clear()
        self._gc = {t for t in self._gc if not t.done()}
        self._gc.add(asyncio.ensure_future(later()))

    def released(self, *specs: Spec | None) -> None:
        """``specs`` are no longer assigned to a key: their downloads count as used now (the
        garbage collector keeps them ``unused_max_age_s`` from here, for a re-assignment or a
        rollback, unless the space is needed) and a collection is scheduled now and then."""
        for spec in specs:
            if (entry := self._cache_entry(spec)) is not None:
                touch_entry(entry[1])
        self.schedule_gc()
        self.schedule_gc(self.limits.unused_max_age_s + 1.0)

    async def stop(self) -> None:
        """Cancel the scheduled garbage collections (one deleting in its thread finishes)."""
        for t in self._gc:
            t.cancel()
        await asyncio.gather(*self._gc, return_exceptions=True)
        self._gc.clear()
        self._holds.close()

    async def load(self, key: str, a: Assignment, spec: Spec, *, retry: Failure | None = None,
                   on_demand: bool = False, reason: str = RELOADING_ON_DEMAND) -> bool:
        """Load ``spec`` for ``key``; ``retry``: the failure this attempt retries (the report
        then stays Failed until the load succeeds, unless a download shows progress).
        A remote source (``hf://``, ``https://``) is downloaded first: ``Prefetching`` with
        ``progress`` (written at most every :data:`~.state.PROGRESS_REPORT_SECONDS`), then
        ``Loading``, then ``Ready``. ``on_demand``: a reload of a standby revision for a
        waiting request: ``Loading`` at once; ``reason``: its ``Loading`` reason
        (:data:`~mlx_fleet.contract.RELOADING_ON_DEMAND`,
        :data:`~mlx_fleet.contract.PREDICTIVE_PREFETCH`). Before the core loads anything,
        :func:`.step.room` checks the estimate against the node's budget and the revision count
        against ``max_loaded_models``, evicting idle revisions if needed (a prefetch never
        evicts). Every report carries the memory estimate once the agent knows it.

        Returns True when it is done (Ready, or Failed and reported), False when it was called
        off (the assignment changed or went away during the download, an unload called the
        load off). Cancellable at any point: the download stops (its partial files stay for a
        resume), a load the core completed regardless is unloaded again."""
        rt = self._rt
        rec = rt.record(key)
        common = dict(namespace=a.namespace, name=a.name, generation=a.generation,
                      revision=spec.revision)
        remote = is_remote(spec.uri)
        t0 = rt.clock()
        known = step.known_estimate(rec, spec)
        opening = step.opening(on_demand=on_demand, retried=retry is not None, remote=remote)
        if opening is step.Opening.RELOADING:
            before = rec.loaded
            why = ("a request is expected soon (predictive prefetch)"
                   if reason == PREDICTIVE_PREFETCH else "on demand")
            was = before.reason if before is not None else IDLE_UNLOADED
            await self._reports.put(key, AssignmentState.LOADING, reason=reason,
                                    message=f"loading {spec.model_id} from {spec.uri} {why} "
                                            f"(standby: {was})", estimated_bytes=known, **common)
        elif opening is step.Opening.QUIET:
            assert retry is not None
            log.info("retrying load of %s revision %s from %s (assignment %s, attempt %d)",
                     spec.model_id, spec.revision, spec.uri, key, retry.attempts + 1)
        else:
            if opening is step.Opening.PREFETCHING:
                await self._reports.prefetching(key, spec, DownloadProgress(), common, known)
            else:
                await self._reports.put(key, AssignmentState.LOADING, reason="LoadingModel",
                                        message=f"loading {spec.model_id} from {spec.uri}",
                                        estimated_bytes=known, **common)
            log.info("%s %s revision %s from %s (assignment %s)",
                     "fetching" if remote else "loading", spec.model_id, spec.revision,
                     spec.uri, key)
        draining = rt.draining.get(spec.ident)
        if draining is not None:  # assigned again while it drains: let the unload finish first
            await asyncio.shield(draining)
        est: memory_estimate.MemoryEstimate | None = None

        async def fail(reason: str, message: str) -> bool:
            await self._fail(key, spec, reason, message, common,
                             estimated_bytes=est.total_bytes if est is not None else known)
            return True

        path: Path | str = spec.uri  # the local directory, once resolved (for the log)
        try:
            shown = False
            if remote:
                fetched = await self._download(
                    key, spec, common, shown=opening is step.Opening.PREFETCHING)
                if fetched is None:
                    return False  # the assignment changed or went away; its new task takes over
                path, shown = fetched
                digest = await asyncio.to_thread(digest_of, path)
            else:
                path = await asyncio.to_thread(self._resolve, spec.uri)
                digest = ""  # a local directory is not content-addressed
            # Read and check the headers before anything is loaded: a hostile or malformed
            # safetensors header or config.json is refused here with its reason, and the
            # estimate (weights + KV cache at the assignment's limits) goes into the reports.
            est = await asyncio.to_thread(
                memory_estimate.estimate, path, max_context_tokens=spec.max_context_tokens,
                max_concurrent_sequences=spec.max_concurrent_sequences)
            if shown:
                await self._reports.put(key, AssignmentState.LOADING, reason="LoadingModel",
                                        message=f"loading {spec.model_id} from {spec.uri}",
                                        estimated_bytes=est.total_bytes, digest=digest,
                                        **common)
            await self._make_room(key, spec, est.total_bytes,
                                  evict=not (on_demand and reason == PREDICTIVE_PREFETCH))
            # reserved until it is resident, so a concurrent load (another assignment's, a
            # reload on demand) counts it and cannot over-commit the budget
            rec.loading = (spec, est.total_bytes)
            try:
                info = await rt.core.load_model(
                    spec.model_id, path, revision=spec.revision,
                    max_concurrent_sequences=spec.max_concurrent_sequences,
                    max_context_tokens=spec.max_context_tokens, task=spec.task)
            except asyncio.CancelledError:
                # the core calls the load off, unless it completed just now: then nothing may
                # stay resident that no assignment tracks
                held = rec.loaded
                if (rt.core.is_loaded(*spec.ident)
                        and (held is None or held.spec.ident != spec.ident)):
                    self._unloader.drain(spec)
                raise
            finally:
                rec.loading = None
            resident = est.weights_bytes
        except memory_estimate.ModelFileError as e:  # the message names files, not the path
            log.warning("model files of %s revision %s at %s refused: %s: %s", spec.model_id,
                        spec.revision, path, e.reason, e.message)
            return await fail(e.reason, e.message)
        except ModelLoadError as e:
            if e.reason == LOAD_CANCELLED:  # an unload (the assignment changed or went) called
                log.info("loading %s revision %s called off: %s", spec.model_id,  # it off
                         spec.revision, e.message)
                return False                # not a failure: the key's next task takes over
            log.warning("loading %s revision %s from %s failed: %s: %s", spec.model_id,
                        spec.revision, path, e.reason, e.message)
            return await fail(e.reason, e.public)  # no path or exception text in a status
        except SourceError as e:
            log.warning("source %s of %s revision %s (assignment %s): %s: %s", spec.uri,
                        spec.model_id, spec.revision, key, e.reason, e.message)
            return await fail(e.reason, status_message(e, spec.uri))
        except ValueError as e:
            return await fail("InvalidAssignment", str(e))
        except Exception as e:  # MLX or anything else: the assignment fails, the agent lives
            log.exception("loading %s failed", spec.model_id)  # the detail: the log only
            return await fail("LoadFailed", LOAD_FAILURE_TEXT["LoadFailed"])
        rec.failure = None
        now = rt.clock()
        rec.loaded = loaded = Loaded(spec, resident, last_used=now, load_seconds=now - t0,
                                     estimated_bytes=est.total_bytes, created_unix=time.time(),
                                     digest=digest,
                                     capabilities=model_capabilities(
                                         info, max_choices=rt.core.max_choices))
        rt.metrics.model_loads.labels(reason if on_demand else LOAD_ASSIGNED).inc()
        log.info("model %s revision %s ready (assignment %s)", spec.model_id, spec.revision, key)
        await self._reports.ready(key, a, loaded)
        return True

    async def _make_room(self, key: str, spec: Spec, need: int, *, evict: bool) -> None:
        """Before loading ``spec`` (estimate ``need`` bytes) for ``key``: :func:`.step.room`
        over the node now; evict what it names to standby (``Unloaded``/``Evicted``, shielded:
        the load being called off must not leave a victim half unloaded) and look again.
        Raises :class:`ModelLoadError` with the numbers when it refuses."""
        rt = self._rt

        def observe() -> step.RoomObservation:
            used, held = rt.in_use(exclude=key)
            uses = (tuple(u for k, u in rt.uses(rt.clock()).items() if k != key) if evict
                    else ())
            return step.RoomObservation(rt.budget_bytes, rt.max_loaded_models, need, used,
                                        held, rt.resident_count(spec), uses)

        if rt.budget_bytes is None and not rt.max_loaded_models:
            return
        decision = step.room(spec, observe(), rt.clock(), evict=evict)
        if decision.evict:
            for victim in decision.evict:
                await asyncio.shield(self._unloader.to_standby(victim, EVICTED,
                                                               cause=decision.cause))
            decision = step.room(spec, observe(), rt.clock(), evict=evict, evicted=True)
        if decision.refuse is not None:
            raise ModelLoadError(decision.refuse, decision.message)

    async def _download(self, key: str, spec: Spec, common: dict, *,
                        shown: bool) -> tuple[Path, bool] | None:
        """Download ``spec``'s remote source, reporting ``Prefetching`` with its progress at
        most every :data:`~.state.PROGRESS_REPORT_SECONDS` (and once complete). ``shown``:
        Prefetching was reported already; otherwise (a retry) it is only once bytes arrive.
        Returns ``(local path, whether Prefetching was reported)``, or None when the assignment
        changed or went away meanwhile (the download is cancelled; the partial files stay for
        a resume). Raises :class:`SourceError`."""
        rt = self._rt
        rec = rt.record(key)
        latest: list[DownloadProgress] = []
        arrived = asyncio.Event()
        labels = spec.ident
        counted = [0]  # bytes_done already added to the download counter

        def on_progress(p: DownloadProgress) -> None:
            latest[:] = [p]
            arrived.set()
            if p.bytes_done > counted[0]:
                rt.metrics.download_bytes.labels(*labels).inc(p.bytes_done - counted[0])
            counted[0] = p.bytes_done
            rt.metrics.download_rate.labels(*labels).set(p.rate_bytes_per_second)

        task = asyncio.ensure_future(fetch(spec.uri, self._model_cache, progress=on_progress,
                                           hf_cache_dir=hub_cache_dir(self._model_cache),
                                           limits=self.limits, make_room=self.collect_garbage,
                                           policy=self._policy))
        written: DownloadProgress | None = None
        last_write = -PROGRESS_REPORT_SECONDS

        async def report(p: DownloadProgress) -> None:
            await self._reports.prefetching(key, spec, p, common, step.known_estimate(rec, spec))

        try:
            while not task.done():
                if not arrived.is_set():
                    waiter = asyncio.ensure_future(arrived.wait())
                    try:  # wakes up at least every interval to look at the assignment
                        await asyncio.wait({task, waiter}, timeout=PROGRESS_REPORT_SECONDS,
                                           return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()
                now = rec.assigned(spec)
                if now is None:
                    log.info("assignment %s changed while fetching %s; download stopped", key,
                             spec.uri)
                    return None
                common = {**common, "generation": now.generation}  # reports follow it
                if task.done() or not arrived.is_set():
                    continue
                wait = last_write + PROGRESS_REPORT_SECONDS - rt.clock()
                if wait > 0:
                    await asyncio.wait({task}, timeout=wait)
                    if task.done():
                        break
                arrived.clear()
                p = latest[0]
                if not step.shows_progress(shown, p):
                    continue  # a retry stays Failed until bytes flow
                await report(p)
                shown, written, last_write = True, p, rt.clock()
            path = task.result()
            if shown and latest and latest[0] != written:
                await report(latest[0])  # complete
            return path, shown
        finally:
            rt.metrics.download_rate.labels(*labels).set(0)  # not downloading now
            if not task.done():
                task.cancel()
                try:
                    await task  # an https download stops between chunks
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                        raise  # we are being cancelled ourselves
                except Exception:  # noqa: BLE001 - superseded; its error no longer matters
                    pass

    async def _fail(self, key: str, spec: Spec, reason: str, message: str, common: dict, *,
                    estimated_bytes: int = 0) -> None:
        """Report ``key``'s load of ``spec`` ``Failed`` with ``reason``/``message`` and
        ``estimated_bytes`` (0: not known), with the back-off of :func:`.step.failed`; what is
        served must be what is assigned, so an older copy of the revision is unloaded."""
        rt = self._rt
        rec = rt.record(key)
        previous, rec.loaded = rec.loaded, None
        if previous is not None or rt.core.is_loaded(*spec.ident):
            await rt.core.unload_model(spec.model_id, spec.revision)
        if previous is not None:
            rt.recheck_conflicts()
        failure = step.failed(rec.failure, spec, reason, message, rt.clock(),
                              backoff=self.backoff, estimated_bytes=estimated_bytes)
        log.error("assignment %s failed: %s: %s", key, reason, failure.message)
        rec.failure = failure
        await self._reports.put(key, AssignmentState.FAILED, reason=reason,
                                message=failure.message, estimated_bytes=estimated_bytes,
                                **common)
