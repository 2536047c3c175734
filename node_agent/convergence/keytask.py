"""Each assignment key's task: bring the key to its desired value under its lock — report it,
wait for a request (``OnDemand``), or load it, as :func:`.step.converge` decides — or retire
it once unassigned (:func:`.step.retire`: drain what it loaded, forget its failure, delete its
report). One task per key at a time, started by the converge worker after the previous one
has ended."""

from __future__ import annotations

import asyncio
import logging
import time

from mlx_fleet.contract import AWAITING_REQUEST, AssignmentState

from . import step
from .load import Loader
from .reports import Reports
from .runtime import Runtime
from .state import Desired, Invalid, Loaded, Spec
from .unload import Unloader

log = logging.getLogger("node_agent.controller")

__all__ = ["KeyTasks"]


class KeyTasks:
    """Starts and runs the keys' tasks of ``rt``. ``bug``: the exception of a task that failed
    unexpectedly (the converge worker raises it, so the supervisor shows and restarts it)."""

    def __init__(self, rt: Runtime, reports: Reports, loader: Loader,
                 unloader: Unloader) -> None:
        self._rt = rt
        self._reports = reports
        self._loader = loader
        self._unloader = unloader
        self.bug: BaseException | None = None

    def start(self, key: str) -> None:
        """Start ``key``'s task towards its desired state now (after its previous task, if
        one runs: that one has just been cancelled, or is retiring the key)."""
        rec = self._rt.record(key)
        d = rec.desired
        task = asyncio.create_task(self._run(key, d, rec.task), name=f"converge {key}")
        rec.task, rec.running = task, step.target(d)

        def ended(t: asyncio.Task) -> None:
            r = self._rt.records.get(key)
            if r is not None and r.task is t:
                r.task = r.running = None
            if not t.cancelled() and (e := t.exception()) is not None:
                log.error("converging assignment %s failed", key, exc_info=e)
                self.bug = self.bug or e
            self._rt.signal()

        task.add_done_callback(ended)

    async def _run(self, key: str, d: Desired | None, previous: asyncio.Task | None) -> None:
        """``key``'s task: bring it to ``d`` (None: retire it) under its lock, once its
        previous task has ended; record what it converged to."""
        if previous is not None:
            await asyncio.wait({previous})
        rec = self._rt.record(key)
        async with rec.lock:
            if d is None:
                await self.retire(key)
                rec.done = None
            elif await self.converge_one(key, d):
                rec.done = d
            else:
                rec.done = None  # called off: the next pass starts it again

    async def retire(self, key: str) -> None:
        """``key`` is no longer assigned: drain what it has loaded (in the background), forget
        its failure and delete its report (:func:`.step.retire`)."""
        rt = self._rt
        rec = rt.record(key)
        retire = step.retire(rec, rt.draining)
        self._loader.released(rec.loaded.spec if rec.loaded is not None else None,
                              rec.attempted)
        rec.loaded = rec.attempted = None
        if retire.let_go is not None:
            self._unloader.let_go(key, retire.let_go, "removed")
        if retire.forget is not None:
            rt.forget(retire.forget)  # e.g. a cancelled download's series (unless loaded)
        rec.failure, rec.conflict = None, False
        if retire.delete_report:
            await self._reports.delete(key)
        rec.reported = False

    async def converge_one(self, key: str, d: Desired) -> bool:
        """Bring one assignment to ``d`` (under its key's lock) as :func:`.step.converge`
        decides: False when that was called off (the assignment changed meanwhile, an unload
        called the load off), True when it is done — loaded, in standby, or failed with its
        report written."""
        rt, A = self._rt, step.Action
        rec = rt.record(key)
        rec.reported, rec.conflict = True, False
        decision = step.converge(key, d, rt.records, rt.clock(), draining=rt.draining)
        if isinstance(d, Invalid):
            rec.failure = None
            await self._reports.put(key, AssignmentState.FAILED, namespace=d.namespace,
                                    name=d.name, generation=d.generation,
                                    reason="InvalidAssignment", message=d.message)
            return True
        spec = Spec.of(d)
        common = dict(namespace=d.namespace, name=d.name, generation=d.generation,
                      revision=spec.revision)
        if decision.let_go:
            loaded, rec.loaded = rec.loaded, None  # now served under another name: it goes
            assert loaded is not None
            self._unloader.let_go(key, loaded, "changed")
        if decision.action is A.REPORT_LOADED:  # no-op unless e.g. the generation moved
            assert rec.loaded is not None
            report = self._reports.standby if rec.loaded.standby else self._reports.ready
            await report(key, d, rec.loaded)
        elif decision.action is A.REPORT_FAILED:  # waiting to retry (or not retried)
            f = decision.failure
            assert f is not None
            await self._reports.put(key, AssignmentState.FAILED, reason=f.reason,
                                    message=f.message, estimated_bytes=f.estimated_bytes,
                                    **common)
        elif decision.action is A.REPORT_CONFLICT:
            rec.failure, rec.conflict = None, True  # converged again once a name is freed
            await self._reports.put(key, AssignmentState.FAILED, reason="ModelNameConflict",
                                    message=f"model name {spec.model_id!r} is already served "
                                            f"for assignment {decision.owner}", **common)
        elif decision.action is A.AWAIT_REQUEST:
            # OnDemand: nothing is fetched or loaded before the first request (ensure_loaded)
            rec.loaded = waiting = Loaded(spec, 0, last_used=rt.clock(), standby=True,
                                          standby_reason=AWAITING_REQUEST,
                                          created_unix=time.time())
            log.info("%s revision %s (assignment %s) is OnDemand: standby until the first "
                     "request", spec.model_id, spec.revision, key)
            await self._reports.standby(key, d, waiting)
        else:
            rec.claim, rec.attempted = spec.model_id, spec  # no await since the name check
            if decision.forget is not None:
                rt.forget(decision.forget)  # an earlier attempt under another name
            try:
                return await self._loader.load(key, d, spec, retry=decision.failure)
            finally:
                rec.claim = None
                if rec.loaded is None:
                    rt.recheck_conflicts()
        return True
