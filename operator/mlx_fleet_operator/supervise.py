"""Keep the operator's background tasks (the etcd followers) running.

:func:`supervise` runs a coroutine factory forever: when the coroutine raises (or returns,
which a follower never should), the error is logged with its traceback, the task is marked
dead in its :class:`TaskHealth` and restarted after an exponential backoff
(``base`` doubling up to ``cap``; reset once a run lasted ``reset_after`` seconds). The
liveness probe reads the :class:`TaskHealth` records and fails while any task is dead or
backing off, so a task that keeps failing ends in a pod restart rather than a silently stale
operator. Cancellation (operator shutdown) is never swallowed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TaskHealth:
    """``alive``: the task is running (False while it is dead and backing off).
    ``restarts``: how many times it stopped unexpectedly. ``last_error``: why, last time."""

    name: str
    alive: bool = False
    restarts: int = 0
    last_error: str = ""


async def supervise(health: TaskHealth, run: Callable[[], Awaitable[None]], *,
                    base: float = 0.5, cap: float = 30.0, reset_after: float = 60.0,
                    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                    clock: Callable[[], float] = time.monotonic) -> None:
    """Run ``run()`` until cancelled, restarting it with backoff (module docstring)."""
    failures = 0
    while True:
        started = clock()
        health.alive = True
        try:
            await run()
            error = "returned unexpectedly"
            log.error("%s %s", health.name, error)
        except asyncio.CancelledError:
            health.alive = False
            raise
        except Exception as e:  # anything else: log it, back off, restart
            error = f"{type(e).__name__}: {e}"
            log.exception("%s failed", health.name)
        health.alive = False
        health.restarts += 1
        health.last_error = error
        failures = 1 if clock() - started >= reset_after else failures + 1
        delay = min(cap, base * 2 ** (failures - 1))
        log.warning("restarting %s in %.1fs (restart #%d)", health.name, delay, health.restarts)
        await sleep(delay)


def dead(tasks: dict[str, TaskHealth]) -> list[TaskHealth]:
    """The supervised tasks that are not running right now."""
    return [h for h in tasks.values() if not h.alive]
