"""Prefill grouping (node_agent.serving.prefill): the table of group sizes, and on a real
generated model that a burst of prompts gets its first tokens from one prefill pass instead of
one pass per 8 (mlx-lm's fixed groups, ``prefill_batch_tokens=0``), with the same tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from node_agent.serving import ServingCore, ServingOptions
from node_agent.serving.prefill import (DEFAULT_PREFILL_BATCH_TOKENS,
                                        MLX_LM_PREFILL_BATCH_SIZE, prefill_group_size)
from serving_fixtures import (mlx_thread_held, started_cores, tiny_model_path,  # noqa: F401
                              wait_for)

BOUND = 60
BURST = 12          # more than one of mlx-lm's fixed groups of 8


@pytest.mark.parametrize("waiting, free, budget, expected", [
    ([60] * 32, 32, DEFAULT_PREFILL_BATCH_TOKENS, 32),    # a burst of short prompts: one pass
    ([60] * 32, 20, DEFAULT_PREFILL_BATCH_TOKENS, 20),    # no more than the batch has room for
    ([60] * 32, 0, DEFAULT_PREFILL_BATCH_TOKENS, 1),      # always at least one
    ([3000] * 10, 32, DEFAULT_PREFILL_BATCH_TOKENS, 8),   # long prompts: mlx-lm's 8 x 2048 chunk
    ([100, 5000], 32, 4096, 2),                            # padded to the 2048-token chunk: 4096
    ([100, 5000, 10], 32, 4096, 2),                        # a third would make 3 x 2048
    ([1000, 1000, 1000, 3000], 32, 3000, 3),               # the fourth pads all to 2048
    ([5000], 32, 100, 1),                                  # alone over the budget: still goes
    ([10, 10, 10], 32, 30, 3),                             # exactly at the budget
    ([10, 10, 10], 32, 29, 2),
    ([0, 0], 32, 1, 1),                                    # a chunk is at least one token
    ([60] * 32, 32, 0, MLX_LM_PREFILL_BATCH_SIZE),         # 0: mlx-lm's fixed groups
    ([60] * 3, 32, 0, MLX_LM_PREFILL_BATCH_SIZE),
])
def test_group_size(waiting: list[int], free: int, budget: int, expected: int) -> None:
    assert prefill_group_size(waiting, free, batch_tokens=budget) == expected


@pytest.mark.parametrize("kw", [{"batch_tokens": -1}, {"batch_tokens": 10, "step_tokens": 0}])
def test_bad_arguments(kw: dict) -> None:
    with pytest.raises(ValueError):
        prefill_group_size([10], 4, **kw)


def test_option_is_validated() -> None:
    with pytest.raises(ValueError, match="prefill_batch_tokens"):
        ServingOptions(prefill_batch_tokens=-1)


@pytest_asyncio.fixture(scope="module")
async def cores(tiny_model_path: Path) -> AsyncIterator[dict[int, ServingCore]]:  # noqa: F811
    # (the fast path is off: every request's first token comes out of the generator)
    async with started_cores(tiny_model_path, {
            budget: ServingOptions(prefill_batch_tokens=budget, request_coalescing=False,
                                   fast_first_token=False)
            for budget in (DEFAULT_PREFILL_BATCH_TOKENS, 0)},
            BOUND, max_concurrent_sequences=16) as out:
        yield out


class FirstTokens:
    """Which of the generator's ``next()`` calls gave each sequence its first token."""

    def __init__(self, core: ServingCore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.first_call: dict[int, int] = {}
        gen = next(iter(core._engine.registry)).generator
        real = gen.next

        def recorded():
            self.calls += 1
            prompts, responses = real()
            for r in responses:
                self.first_call.setdefault(r.uid, self.calls)
            return prompts, responses
        monkeypatch.setattr(gen, "next", recorded)


async def burst(core: ServingCore) -> list[str]:
    """``BURST`` distinct greedy requests submitted while the MLX thread is held, so that all of
    them wait for the same step; their texts."""
    async with mlx_thread_held(core, BOUND):
        tasks = [asyncio.create_task(core.generate("m", prompt=f"request {i}: tell me about {i}",
                                                   max_tokens=6, temperature=0))
                 for i in range(BURST)]
        await wait_for(lambda: core._cmds.qsize() >= BURST)   # every submit queued behind it
    gens = await asyncio.gather(*tasks)

    async def text(g) -> str:
        return "".join([c.text async for c in g])
    return await asyncio.wait_for(asyncio.gather(*(text(g) for g in gens)), BOUND)


async def test_a_burst_is_prefilled_in_one_pass(cores: dict[int, ServingCore],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {budget: FirstTokens(c, monkeypatch) for budget, c in cores.items()}
    texts = {budget: await burst(c) for budget, c in cores.items()}
    assert texts[DEFAULT_PREFILL_BATCH_TOKENS] == texts[0]
    grouped = set(seen[DEFAULT_PREFILL_BATCH_TOKENS].first_call.values())
    fixed = sorted(set(seen[0].first_call.values()))
    assert len(seen[DEFAULT_PREFILL_BATCH_TOKENS].first_call) == len(seen[0].first_call) == BURST
    assert len(grouped) == 1
    assert len(fixed) == 2                     # 8, then the other 4 in a later pass
    for c in cores.values():
        assert c.active_sequences("m") == 0 and c.queued_requests("m") == 0
