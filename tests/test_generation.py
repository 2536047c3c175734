"""Generation.next_batch (node_agent/serving/generation.py) over its Inbox
(node_agent/serving/inbox.py): every chunk already waiting in one call, in order; an error after
chunks comes with the next call; nothing is lost or repeated."""

from __future__ import annotations

import asyncio

import pytest

from node_agent.serving.errors import GenerationAborted, StreamBufferOverflow
from node_agent.serving.generation import Generation, Request
from node_agent.serving.inbox import Inbox
from node_agent.serving.types import Chunk


class _Inbox(Inbox):
    """An inbox that tells when its consumer waits on it."""

    __slots__ = ("waiting",)

    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()

    async def _wait(self) -> None:
        if self.empty():
            self.waiting.set()
        await super()._wait()


def _generation(items: list, cancelled: list | None = None) -> Generation:
    loop = asyncio.get_running_loop()
    q = _Inbox()
    for item in items:
        q.put_nowait(item)
    req = Request(("m", "r"), "p", None, None, 0.0, 1.0, [], None, q, loop)
    return Generation(lambda r: (cancelled if cancelled is not None else []).append(r), req,
                      3, 10)


async def test_waiting_chunks_come_in_one_batch_up_to_the_last() -> None:
    chunks = [Chunk("a", 1), Chunk("b", 2), Chunk("", 3, "stop")]
    gen = _generation([*chunks, Chunk("never", 4)])
    assert await gen.next_batch() == chunks
    assert (gen.completion_tokens, gen.finish_reason) == (3, "stop")
    assert await gen.next_batch() == []


async def test_a_batch_waits_for_the_first_chunk_then_takes_what_is_there() -> None:
    gen = _generation([])
    task = asyncio.ensure_future(gen.next_batch())
    await gen._out.waiting.wait()   # it blocks on the empty queue
    assert not task.done()
    gen._out.put_nowait(Chunk("x", 1))
    gen._out.put_nowait(Chunk("y", 2))
    assert await task == [Chunk("x", 1), Chunk("y", 2)]
    assert gen.completion_tokens == 2 and gen.finish_reason is None


@pytest.mark.parametrize("error", [GenerationAborted("unloaded"), StreamBufferOverflow(4)])
async def test_an_error_after_chunks_comes_with_the_next_call(error: Exception) -> None:
    gen = _generation([Chunk("a", 1), Chunk("b", 2), error])
    assert await gen.next_batch() == [Chunk("a", 1), Chunk("b", 2)]
    with pytest.raises(type(error)):
        await gen.next_batch()
    assert await gen.next_batch() == []


async def test_an_error_first_is_raised_at_once() -> None:
    gen = _generation([GenerationAborted("gone"), Chunk("never", 1)])
    with pytest.raises(GenerationAborted, match="gone"):
        await gen.next_batch()
    assert await gen.next_batch() == []


async def test_iteration_after_a_batch_keeps_the_order_and_the_error() -> None:
    gen = _generation([Chunk("a", 1), GenerationAborted("late")])
    assert await gen.next_batch() == [Chunk("a", 1)]
    with pytest.raises(GenerationAborted, match="late"):
        await gen.__anext__()
    with pytest.raises(StopAsyncIteration):
        await gen.__anext__()


async def test_cancelling_a_waiting_batch_cancels_the_generation() -> None:
    cancelled: list = []
    gen = _generation([], cancelled)
    task = asyncio.ensure_future(gen.next_batch())
    await gen._out.waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(cancelled) == 1


async def test_inbox_is_fifo_and_wakes_its_consumer() -> None:
    box = _Inbox()
    assert box.empty() and box.qsize() == 0
    with pytest.raises(asyncio.QueueEmpty):
        box.get_nowait()
    waiting = asyncio.ensure_future(box.get())
    await box.waiting.wait()
    box.put_nowait(1)
    box.put_nowait(2)
    assert await waiting == 1
    assert box.qsize() == 1 and box.get_nowait() == 2
    for i in range(3):
        box.put_nowait(i)
    assert await box.get_all() == [0, 1, 2] and box.empty()


async def test_a_cancelled_wait_leaves_the_inbox_usable() -> None:
    box = _Inbox()
    waiting = asyncio.ensure_future(box.get_all())
    await box.waiting.wait()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    box.put_nowait("x")
    assert await box.get_all() == ["x"]
