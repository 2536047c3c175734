"""The MLX thread's step loop of :class:`ServingCore`: the one thread that calls MLX (through
:class:`~node_agent.serving.engine.Engine`).

Each iteration runs the queued commands (``_t_command``), then one batch step of every revision
with work (``_t_step_all``; an error there resets that revision only), then one stage of the
load at the head of the thread's load queue ``_loads`` (``_t_load_step``: build the lazy model,
read one chunk of its weights, or make it resident; a failure drops that load with
``ModelLoadError("LoadFailed")``, a load called off with ``ModelLoadError("Cancelled")``). It
blocks on the command queue only while no revision has work and no load is queued.
:data:`~node_agent.serving.channel._STOP` ends it; an exception that escapes every guard fails
the core (``_failure``: ``"<ExceptionType>: <message>"``), and ``_run_and_signal`` /
``_t_exit`` then fail every queued load and call with
:class:`~node_agent.serving.errors.GenerationAborted` and tell the loop. :class:`_StepLoop` is
one part of :class:`~node_agent.serving.core.ServingCore` (a mixin; ``ServingCore.__init__``
sets up the state it uses).
"""

from __future__ import annotations

import logging
import queue
import time

from .channel import _STOP
from .errors import LOAD_CANCELLED, GenerationAborted, ModelLoadError
from .loading import Materialization
from .revisions import _CANCELLED

log = logging.getLogger("node_agent.serving.core")  # the name its log lines always had


class _StepLoop:
    """The MLX thread part of :class:`~node_agent.serving.core.ServingCore` (see the module
    docstring)."""

    # -- the MLX thread ------------------------------------------------------------------------
    def _run_and_signal(self) -> None:
        try:
            try:
                self._run()
            except BaseException as e:  # noqa: BLE001 - outside every guard: the core fails
                self._failure = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                log.critical("the MLX serving thread failed; the serving core is unusable",
                             exc_info=True)
            reason = self._failed_message() if self._failure else "the serving core closed"
            while self._loads:
                self._t_drop_load(GenerationAborted(reason))
            self._engine.unload_all(reason, crashed=self._failure is not None)
        finally:
            self._t_exit()

    def _t_exit(self) -> None:
        """Last thing on the thread: fail every queued call, tell the loop, signal the end."""
        try:
            reason = self._failed_message() if self._failure else "the serving core closed"
            with self._cmd_lock:
                self._dead = True
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, tuple) and cmd[0] == "call":
                    self._resolve(cmd[3], error=GenerationAborted(reason))
                elif isinstance(cmd, tuple) and cmd[0] == "load":
                    self._resolve(cmd[1].fut, error=GenerationAborted(reason))
            if self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._on_thread_exit)
                except RuntimeError:  # loop closed
                    pass
        finally:
            self._finished.set()

    def _run(self) -> None:
        """The step loop: run queued commands, then one batch step of every revision with work,
        then one chunk of the load in progress; block on the command queue only while no
        revision has work and no load is queued."""
        import mlx.core as mx

        # Like mlx_lm.server: generate on this thread's default stream, so that model, caches
        # and synchronisation all live on the one thread that owns MLX.
        stream = mx.default_stream(mx.default_device())
        self._engine.stream = stream
        # Weights are read on a CPU stream of their own, so a load's reads never queue behind
        # (or in front of) the generation stream's work (see node_agent.serving.loading).
        self._engine.load_stream = mx.new_stream(mx.cpu)
        with mx.stream(stream):
            while True:
                try:
                    cmd = self._cmds.get(block=not (self._engine.has_work() or self._loads))
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if cmd is _STOP:
                        return
                    self._t_command(cmd)
                    try:
                        cmd = self._cmds.get_nowait()
                    except queue.Empty:
                        cmd = None
                decoding = self._engine.has_work()
                if decoding:
                    self._t_step_all()
                if self._loads:
                    self._t_load_step(decoding)

    def _t_load_step(self, decoding: bool) -> None:
        """Advance the load at the head of the queue by one stage: drop it if it was called
        off, else build its lazy model (cheap) and advance the read of its weights (overlapped
        with decoding when ``decoding``: something decoded this iteration; see
        :class:`~node_agent.serving.loading.Materialization`), and once all is read
        make it resident. A failure of any stage drops the load (``LoadFailed``)."""
        job = self._loads[0]
        if job.cancelled:
            self._t_drop_load(ModelLoadError(LOAD_CANCELLED, _CANCELLED))
            return
        try:
            if job.materialization is None:
                job.started_at = time.perf_counter()
                if self._engine.registry.get(job.info.key) is not None:
                    job.replaced = True
                    self._engine.unload(job.info.key, reason="the model was replaced")
                job.model = self._engine.begin_load(job.info)
                job.materialization = Materialization(job.model, self.load_pacing)
            if not job.materialization.done:
                job.materialization.step(decoding)
            if job.materialization.done:
                self._engine.finish_load(
                    job.info, job.model, job.tokenizer,
                    job.tokenizer_seconds + time.perf_counter() - job.started_at)
                self._loads.popleft()
                job.model = job.tokenizer = None
                job.materialization.release()
                self._resolve(job.fut, None)
        except ModelLoadError as e:
            self._t_drop_load(e)
        except Exception as e:  # noqa: BLE001 - a read error of one chunk fails this load only
            log.exception("loading %s@%s failed", *job.info.key)
            self._t_drop_load(ModelLoadError("LoadFailed", f"{type(e).__name__}: {e}"))

    def _t_drop_load(self, error: BaseException) -> None:
        """Drop the load at the head of the queue, free what it read, fail its caller."""
        job = self._loads.popleft()
        # keep the materialization's ints for progress(); drop every array reference
        job.model = job.tokenizer = None
        if job.materialization is not None:
            job.materialization.release()
        self._engine.release_memory("the load of %s@%s" % job.info.key)
        self._resolve(job.fut, error=error)

    def _t_step_all(self) -> None:
        """One batch step of every revision with work. A function of its own so that no frame
        of the step loop keeps the last revision it looked at (and so its weights) alive after
        that revision is unloaded."""
        for res in self._engine.registry:
            if res.has_work():
                try:
                    self._engine.step(res)
                except Exception as e:  # noqa: BLE001 - contained to this revision
                    log.exception("generation step of %s@%s failed", *res.key)
                    self._engine.reset(res, f"generation failed: {type(e).__name__}: {e}")

    def _t_command(self, cmd: tuple) -> None:
        if cmd[0] == "load":
            self._loads.append(cmd[1])
        elif cmd[0] == "call":
            _, fn, args, fut = cmd
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._resolve(fut, error=e)
            else:
                self._resolve(fut, result)
        elif cmd[0] == "cancel":
            req = cmd[1]
            try:
                self._engine.cancel(req)
            except Exception as e:  # noqa: BLE001 - contained to the request's revision
                log.exception("cancelling a request of %s@%s failed", *req.key)
                res = self._engine.registry.get(req.key)
                if res is not None:
                    self._engine.reset(res, f"generation failed: {type(e).__name__}: {e}")
