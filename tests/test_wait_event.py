"""mlx_fleet.supervise.wait_event: the event-or-timeout wait of every long-lived loop."""

from __future__ import annotations

import asyncio

import pytest

from mlx_fleet.supervise import wait_event


async def test_returns_true_when_set_and_false_on_timeout() -> None:
    ev = asyncio.Event()
    assert await wait_event(ev, 0.01) is False
    ev.set()
    assert await wait_event(ev, 5) is True


async def test_a_cancel_arriving_as_the_event_is_set_is_never_lost() -> None:
    """The gap of Python 3.11's wait_for: cancelled in the very step its awaitable completes,
    it returned the result and the task went on. A loop built on wait_event stops."""
    for _ in range(50):
        ev = asyncio.Event()
        rounds = 0

        async def loop() -> None:
            nonlocal rounds
            while True:
                await wait_event(ev, 5)
                ev.clear()
                rounds += 1

        task = asyncio.create_task(loop())
        await asyncio.sleep(0)  # the loop is waiting
        ev.set()
        task.cancel()  # in the same step as the wake-up
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
