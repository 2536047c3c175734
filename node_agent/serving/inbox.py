"""A request's (or a coalesced subscriber's) events waiting for its consumer on the event loop.

What ``asyncio.Queue`` does for one consumer, without what a stream does not need (no bound, no
putters, no ``join``): a deque and at most one waiting future. Per event it costs an append and,
when the consumer waits, one ``set_result``; the consumer takes everything that is waiting at
once (:meth:`Inbox.get_all`), so one wake-up of its task serves every event that arrived since
the last one. Event-loop only (not thread-safe: the MLX thread hands events over with
``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

__all__ = ["Inbox"]


class Inbox:
    """Unbounded FIFO of events for one consumer (the bound is the caller's:
    ``--stream-buffer-chunks`` compares :meth:`qsize` with it)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        """Append ``item``; wakes the consumer if it waits."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def qsize(self) -> int:
        """Events waiting."""
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Any:
        """The oldest event; ``asyncio.QueueEmpty`` when none waits."""
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> Any:
        """The oldest event, once there is one."""
        await self._wait()
        return self._items.popleft()

    async def get_all(self) -> list[Any]:
        """Every event waiting, oldest first, once there is at least one (the inbox is then
        empty)."""
        await self._wait()
        items = list(self._items)
        self._items.clear()
        return items

    async def _wait(self) -> None:
        while not self._items:
            if self._waiter is not None:
                raise RuntimeError("an Inbox has one consumer: another one already waits")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
