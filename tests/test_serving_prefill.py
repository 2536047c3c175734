"""Prefill grouping (node_agent.serving.prefill): the table of group sizes, and on a real
generated model that a burst of prompts gets its first tokens from one prefill pass instead of
one pass per 8 (mlx-lm's fixed groups, ``prefill_batch_tokens=0``), with the same tokens."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from node_agent.serving import ServingCore, ServingOptions
from node_agent.serving.prefill import DEFAULT_PREFILL_BATCH_TOKENS, prefill_group_size
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
    ([1, 60, 60], 32, 120, 2),                             # one about to be split takes a slot
])
def test_group_size(waiting: list[int], free: int, budget: int, expected: int) -> None:
    assert prefill_group_size(waiting, free, batch_tokens=budget) == expected


@pytest.mark.parametrize("kw", [{"batch_tokens": 0}, {"batch_tokens": 10, "step_tokens": 0}])
def test_bad_arguments(kw: dict) -> None:
    with pytest.raises(ValueError):
        prefill_group_size([10], 4, **kw)


def test_option_is_validated() -> None:
    with pytest.raises(ValueError, match="prefill_batch_tokens"):
        ServingOptions(prefill_batch_tokens=-1)


#: The cores compared: prefill grouping at the default budget, mlx-lm's fixed groups (0), a
#: small budget, each with the first-token fast path off (every first token then comes out of
#: the generator), and the defaults (grouping and the fast path on).
SMALL_BUDGET = 48
CONFIGS = {
    "grouped": ServingOptions(fast_first_token=False),
    "fixed": ServingOptions(fast_first_token=False, prefill_batch_tokens=0),
    "small": ServingOptions(fast_first_token=False, prefill_batch_tokens=SMALL_BUDGET),
    "defaults": ServingOptions(),
}


@pytest_asyncio.fixture(scope="module")
async def cores(tiny_model_path: Path) -> AsyncIterator[dict[str, ServingCore]]:  # noqa: F811
    options = {k: dataclasses.replace(o, request_coalescing=False) for k, o in CONFIGS.items()}
    async with started_cores(tiny_model_path, options, BOUND,
                             max_concurrent_sequences=16) as out:
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


async def burst(core: ServingCore, prompts: list[str]) -> list[str]:
    """Distinct greedy requests for ``prompts`` submitted while the MLX thread is held, so that
    all of them wait for the same step; their texts."""
    async with mlx_thread_held(core, BOUND):
        tasks = [asyncio.create_task(core.generate("m", prompt=p, max_tokens=6, temperature=0))
                 for p in prompts]
        await wait_for(lambda: core._cmds.qsize() >= len(prompts))  # every submit queued
    gens = await asyncio.gather(*tasks)

    async def text(g) -> str:
        return "".join([c.text async for c in g])
    texts = await asyncio.wait_for(asyncio.gather(*(text(g) for g in gens)), BOUND)
    assert core.active_sequences("m") == 0 and core.queued_requests("m") == 0
    return texts


SHORT = [f"request {i}: tell me about {i}" for i in range(BURST)]


async def test_a_burst_is_prefilled_in_one_pass(cores: dict[str, ServingCore],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {k: FirstTokens(cores[k], monkeypatch) for k in ("grouped", "fixed", "defaults")}
    texts = {k: await burst(cores[k], SHORT) for k in seen}
    assert texts["grouped"] == texts["fixed"] == texts["defaults"]
    assert len(seen["grouped"].first_call) == len(seen["fixed"].first_call) == BURST
    assert len(set(seen["grouped"].first_call.values())) == 1
    assert len(set(seen["fixed"].first_call.values())) == 2   # 8, then 4 in a later pass
    # with the fast path the first request's first token comes before any next() call; the
    # other 11 still share one pass (the fast one's one-token insert takes a slot too)
    after_fast = sorted(seen["defaults"].first_call.items())[1:]
    assert len(after_fast) == BURST - 1 and len({call for _, call in after_fast}) == 1


async def test_no_pass_feeds_more_than_the_budget(cores: dict[str, ServingCore],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prefill pass mlx-lm builds (its right-padded rows × columns) stays within the
    budget, for a burst of short and long prompts (sequences in a multi-chunk prefill and ones
    about to leave the prompt stage counted as they should be)."""
    from mlx_lm.generate import PromptProcessingBatch

    passes: list[tuple[int, int]] = []      # (rows, columns) of each pass
    real = PromptProcessingBatch.prompt

    def recorded(self, tokens):
        if tokens:
            passes.append((len(tokens), max(len(t) for t in tokens)))
        return real(self, tokens)
    monkeypatch.setattr(PromptProcessingBatch, "prompt", recorded)
    prompts = [("a much longer question about the weather and the sea " * (1 + i % 3)) + str(i)
               if i % 4 == 0 else f"short {i}" for i in range(BURST)]
    texts = await burst(cores["small"], prompts)
    assert len(texts) == BURST and all(texts)
    # a prompt alone over the budget still goes (alone); any shared pass is within it
    assert all(rows == 1 or rows * cols <= SMALL_BUDGET for rows, cols in passes), passes
    assert any(rows > 1 for rows, _ in passes) and any(cols > SMALL_BUDGET for _, cols in passes)
