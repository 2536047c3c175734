"""The first-token fast path (node_agent.serving.fastpath): a request that finds its revision's
batch empty gets its first token from one forward pass outside mlx-lm's BatchGenerator, then
continues in the generator. Same tokens as without it, on a real generated model; the decision is
table-tested."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from node_agent.serving import ServingCore, ServingOptions
from node_agent.serving.fastpath import MAX_PREFILL_TOKENS, applies
from serving_fixtures import started_cores, tiny_model_path  # noqa: F401

BOUND = 60


@pytest.mark.parametrize("enabled, batch, prefill, expected", [
    (True, 0, 12, True),
    (True, 0, 1, True),                        # a full prompt-cache hit leaves one token
    (True, 0, MAX_PREFILL_TOKENS, True),
    (True, 0, MAX_PREFILL_TOKENS + 1, False),  # long prompts: the generator's stepped prefill
    (True, 1, 12, False),                      # someone to batch with
    (False, 0, 12, False),                     # switched off
    (True, 0, 0, False),
])
def test_applies(enabled: bool, batch: int, prefill: int, expected: bool) -> None:
    assert applies(enabled, batch, prefill) is expected


@pytest_asyncio.fixture(scope="module")
async def cores(tiny_model_path: Path) -> AsyncIterator[dict[bool, ServingCore]]:  # noqa: F811
    options = {fast: ServingOptions(fast_first_token=fast) for fast in (True, False)}
    async with started_cores(tiny_model_path, options, BOUND, max_context_tokens=8192) as out:
        yield out


class NextCalls:
    """Counts BatchGenerator.next() calls of the core's one resident revision."""

    def __init__(self, core: ServingCore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        gen = next(iter(core._engine.registry)).generator
        real = gen.next

        def counted():
            self.n += 1
            return real()
        monkeypatch.setattr(gen, "next", counted)


async def run(core: ServingCore, **kw) -> tuple[str, list[str | None]]:
    gen = await core.generate("m", **kw)
    chunks = [c async for c in gen]
    return "".join(c.text for c in chunks), [c.finish_reason for c in chunks]


@pytest.mark.parametrize("kw", [
    {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0},
    {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.8, "seed": 7},
    {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
     "temperature": 0},
    {"prompt": "A", "max_tokens": 1, "temperature": 0},
])
async def test_same_tokens_with_and_without_the_fast_path(cores: dict[bool, ServingCore],
                                                           kw: dict) -> None:
    fast, slow = await run(cores[True], **kw), await run(cores[False], **kw)
    assert fast == slow
    assert fast[1][-1] in ("length", "stop")


async def test_a_one_token_request_never_enters_the_generator(
        cores: dict[bool, ServingCore], monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {fast: NextCalls(c, monkeypatch) for fast, c in cores.items()}
    for fast, c in cores.items():
        text, reasons = await run(c, prompt="Tokens are generated", max_tokens=1, temperature=0)
        assert reasons == ["length"]
    assert calls[True].n == 0          # the first (and only) token came from the fast path
    assert calls[False].n >= 3         # prefill, split into the batch, first step
    for c in cores.values():
        assert c.active_sequences("m") == 0 and c.queued_requests("m") == 0


async def test_the_fast_path_fills_the_prompt_cache(cores: dict[bool, ServingCore]) -> None:
    c = cores[True]

    def hits() -> float:
        return c.registry.get_sample_value("mlxfleet_agent_prompt_cache_hits_total",
                                           {"model": "m", "revision": "r1"}) or 0.0
    prompt = "A prompt that is long enough to be cached, with a few more words in it"
    first = await run(c, prompt=prompt, max_tokens=4, temperature=0)
    before = hits()
    assert await run(c, prompt=prompt, max_tokens=4, temperature=0) == first
    assert hits() == before + 1


async def test_a_second_request_batches_with_the_first(cores: dict[bool, ServingCore]) -> None:
    c = cores[True]
    gen = await c.generate("m", prompt="Once upon a time", max_tokens=4000, temperature=0)
    await asyncio.wait_for(gen.__anext__(), BOUND)      # in the batch, decoding
    assert c.active_sequences("m") == 1
    other = await run(c, prompt="The quick brown fox", max_tokens=12, temperature=0)
    gen.cancel()
    assert other == await run(cores[False], prompt="The quick brown fox", max_tokens=12,
                              temperature=0)


def test_agent_flag_reaches_the_config() -> None:
    from node_agent.cli import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args([])).serving.fast_first_token is True
    off = config_from_args(build_parser().parse_args(["--no-fast-first-token"]))
    assert off.serving.fast_first_token is False
    assert off.serving.as_record()["fast_first_token"] == "off"
