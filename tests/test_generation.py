"""Generation.next_batch (node_agent/serving/generation.py): every chunk already waiting in one
call, in order; an error after chunks comes with the next call; nothing is lost or repeated."""

from __future__ import annotations

import asyncio

import pytest

from node_agent.serving.errors import GenerationAborted, StreamBufferOverflow
from node_agent.serving.generation import Generation, Request
from node_agent.serving.types import Chunk


class _Queue(asyncio.Queue):
    """A queue that tells when a consumer waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()

    async def get(self):  # type: ignore[no-untyped-def]
        if self.empty():
            self.waiting.set()
        return await super().get()


def _generation(items: list, cancelled: list | None = None) -> Generation:
    loop = asyncio.get_running_loop()
    q = _Queue()
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
