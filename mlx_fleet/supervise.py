"""Keep long-running background coroutines alive, for the operator and the agent alike.

A watch follower, a heartbeat or a converge worker that dies from an unexpected exception
must neither vanish silently nor spin: :func:`supervise` logs the failure with its traceback,
marks it in a :class:`TaskHealth` (which liveness probes and ``/health`` read), waits a
backoff (``base`` doubling up to ``cap``, starting over once a run had lasted ``reset_after``
seconds, i.e. had worked) and starts a fresh run. Cancellation (shutdown) is never swallowed.
:class:`Supervised` owns the asyncio task around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

log = logging.getLogger(__name__)

#: First restart delay after a failure (seconds); doubles per consecutive failure.
SUPERVISOR_INITIAL_BACKOFF = 0.5
#: Longest restart delay (seconds): a task failing for good is retried twice a minute.
SUPERVISOR_MAX_BACKOFF = 30.0


@dataclasses.dataclass
class TaskHealth:
    """``alive``: a run is in progress (False before the first run, while backing off after a
    failure and once supervision ended). ``restarts``: unexpected stops so far.
    ``last_error``: ``"Type: message"`` of the latest one."""

    name: str
    alive: bool = False
    restarts: int = 0
    last_error: str = ""


async def supervise(health: TaskHealth, run: Callable[[], Awaitable[None]], *,
                    base: float = SUPERVISOR_INITIAL_BACKOFF, cap: float = SUPERVISOR_MAX_BACKOFF,
                    reset_after: float = 60.0, restart_on_return: bool = True,
                    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                    clock: Callable[[], float] = time.monotonic) -> None:
    """Run ``run()`` until cancelled, restarting it after failures (module docstring).

    ``restart_on_return``: a run that returns normally is treated as a failure and restarted
    (for followers that must never end); when False a normal return ends supervision.
    ``sleep``/``clock`` are injectable for tests.
    """
    failures = 0
    while True:
        started = clock()
        health.alive = True
        try:
            await run()
            if not restart_on_return:
                health.alive = False
                return
            error = "returned unexpectedly"
            log.error("%s %s", health.name, error)
        except asyncio.CancelledError:
            health.alive = False
            raise
        except Exception as e:  # anything else: log it, back off, restart
            error = f"{type(e).__name__}: {e}"[:500]
            log.exception("%s failed", health.name)
        health.alive = False
        health.restarts += 1
        health.last_error = error
        failures = 1 if clock() - started >= reset_after else failures + 1
        delay = min(cap, base * 2 ** (failures - 1))
        log.warning("restarting %s in %.1fs (restart #%d)", health.name, delay, health.restarts)
        await sleep(delay)


def dead(tasks: Iterable[TaskHealth]) -> list[TaskHealth]:
    """The supervised tasks that are not running right now."""
    return [h for h in tasks if not h.alive]


class Supervised:
    """An asyncio task running ``factory()`` under :func:`supervise`.

    ``initial_backoff``/``max_backoff`` default to the module constants (read at construction,
    so tests can patch them). ``restart_on_return`` as in :func:`supervise` (default False: a
    worker that returns has finished its job).
    """

    def __init__(self, name: str, factory: Callable[[], Awaitable[None]], *,
                 initial_backoff: float | None = None, max_backoff: float | None = None,
                 restart_on_return: bool = False) -> None:
        self.health = TaskHealth(name)
        self._factory = factory
        self._max = SUPERVISOR_MAX_BACKOFF if max_backoff is None else max_backoff
        self._initial = min(SUPERVISOR_INITIAL_BACKOFF if initial_backoff is None else initial_backoff,
                            self._max)
        self._restart_on_return = restart_on_return
        self._task: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.health.name

    @property
    def restarts(self) -> int:
        return self.health.restarts

    @property
    def last_error(self) -> str | None:
        return self.health.last_error or None

    @property
    def backing_off(self) -> bool:
        """True while waiting to restart after a failure."""
        return self._task is not None and not self._task.done() and not self.health.alive

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(
                supervise(self.health, self._factory, base=self._initial, cap=self._max,
                          reset_after=self._max, restart_on_return=self._restart_on_return),
                name=self.name)

    async def stop(self) -> None:
        """Cancel the current run (or backoff) and wait for it to end."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def status(self) -> dict:
        """A JSON-able summary for ``/health``."""
        return {"name": self.name, "restarts": self.restarts, "backing_off": self.backing_off,
                "last_error": self.last_error}


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait until ``event`` is set or ``timeout`` seconds pass; True when it was set.

    Use this, not ``asyncio.wait_for(event.wait(), timeout)``, in long-lived loops: on Python
    3.11 ``wait_for`` returns the result instead of raising when the awaited call finishes in the
    same loop step as a cancellation, so the task's cancel is lost and whoever awaits the
    cancelled task (a clean shutdown) waits forever. ``asyncio.timeout`` has no such gap.
    """
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
        return True
    except TimeoutError:
        return event.is_set()

