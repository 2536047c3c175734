"""The command channel between the event loop and the MLX thread of :class:`ServingCore`.

The loop queues commands on ``ServingCore._cmds`` (a ``queue.Queue``): ``("call", fn, args,
future)`` (:meth:`~_CommandChannel._call`, :meth:`~_CommandChannel._call_soon`,
:meth:`~_CommandChannel._post`), ``("load", _Load)``, ``("cancel", Request)`` and
:data:`_STOP`; once the thread has ended (``_dead``, set and read under ``_cmd_lock``) no call
is queued and :class:`~node_agent.serving.errors.GenerationAborted` is raised instead. The
thread hands everything back with ``loop.call_soon_threadsafe`` (never waiting for the loop;
a closed loop is ignored): a call's result or error into its future
(:meth:`~_CommandChannel._resolve`), a batch of request events to ``_deliver``
(:meth:`~_CommandChannel._send`), a revision it dropped on its own
(:meth:`~_CommandChannel._forget_threadsafe`), its own end
(:meth:`~_CommandChannel._on_thread_exit`). :class:`_CommandChannel` is one part of
:class:`~node_agent.serving.core.ServingCore` (a mixin; ``ServingCore.__init__`` sets up the
state it uses).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from .engine import Events
from .errors import GenerationAborted
from .types import ModelInfo

#: The command that ends the MLX thread's step loop (queued by ``ServingCore.close``).
_STOP = object()


class _CommandChannel:
    """The command channel part of :class:`~node_agent.serving.core.ServingCore` (see the
    module docstring)."""

    # -- the command channel -------------------------------------------------------------------
    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the MLX thread and return its result (or raise its error).
        Raises :class:`GenerationAborted` when the thread has ended (closed or failed)."""
        return await self._call_soon(fn, *args)

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Queue ``fn(*args)`` on the MLX thread now; the future of its result (or error).
        Raises :class:`GenerationAborted` when the thread has ended (closed or failed)."""
        assert self._loop is not None
        fut = self._loop.create_future()
        with self._cmd_lock:
            if self._dead:
                raise GenerationAborted(self._failed_message() if self._failure
                                        else "the serving core closed")
            self._cmds.put(("call", fn, args, fut))
        return fut

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` on the MLX thread without waiting for it (``fn`` must not raise;
        nothing is queued once the thread has ended)."""
        assert self._loop is not None
        with self._cmd_lock:
            if not self._dead:
                self._cmds.put(("call", fn, args, self._loop.create_future()))

    def _on_thread_exit(self) -> None:
        """Loop side, after the MLX thread ended: a failed core serves no model any more."""
        if self._failure is None:
            return
        self._drop_all()
        self._failed.set()

    def _forget(self, info: ModelInfo) -> None:
        """Loop side: the thread dropped ``info``'s revision on its own (it could not recover)."""
        if self._infos.get(info.key) is info:
            self._drop(info.key)

    def _forget_threadsafe(self, info: ModelInfo) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._forget, info)
        except RuntimeError:  # loop closed
            pass

    def _resolve(self, fut: asyncio.Future, result: Any = None,
                 error: BaseException | None = None) -> None:
        def done() -> None:
            if fut.cancelled():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(done)
        except RuntimeError:  # loop closed
            pass

    def _send(self, events: Events) -> None:
        if not events:
            return
        try:
            events[0][0].loop.call_soon_threadsafe(self._deliver, events)
        except RuntimeError:
            pass
