"""Issue 19, finding 5: nothing slow that a client controls runs on the MLX thread. Prompts are
bounded in bytes before anything tokenizes them, and tokenizing / chat-template rendering run in
the core's tokenizer pool: a stream keeps producing tokens while another request's tokenizer is
blocked. (The measured version, four 1 MB prompts beside a stream, is
``benchmarks/prompt_stall.py``.)"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from node_agent.serving import ContextLengthExceeded, PromptTooLarge, ServingCore
from node_agent.serving.tokenize import (default_tokenizer_threads, limit_tokenizer_parallelism,
                                         prompt_bytes)
from serving_fixtures import MODEL_ID, Agent, agent, tiny_model_path  # noqa: F401

BOUND = 60.0
KEY = ("m", "r1")


@pytest.mark.parametrize("prompt, messages, n", [
    ("abc", None, 3), ("é", None, 2), ("", None, 0),
    (None, [{"role": "user", "content": "héllo"}], 4 + 6),
    (None, [{"role": "system", "content": "x"}, {"role": "user", "content": "yz"}], 6 + 1 + 4 + 2)])
def test_prompt_bytes(prompt: str | None, messages: list[dict] | None, n: int) -> None:
    assert prompt_bytes(prompt, messages) == n


@pytest.mark.parametrize("cpus, threads", [(None, 1), (1, 1), (2, 1), (8, 2), (16, 4), (64, 4)])
def test_default_tokenizer_threads(cpus: int | None, threads: int) -> None:
    assert default_tokenizer_threads(cpus) == threads


def test_tokenizers_parallelism_is_off_unless_set() -> None:
    env: dict[str, str] = {}
    limit_tokenizer_parallelism(env)
    assert env == {"TOKENIZERS_PARALLELISM": "false"}
    env = {"TOKENIZERS_PARALLELISM": "true"}
    limit_tokenizer_parallelism(env)
    assert env == {"TOKENIZERS_PARALLELISM": "true"}


class _Spy:
    """Wraps a tokenizer: records the thread of every encode / template call; an encode of a
    prompt containing ``BLOCK`` waits until :attr:`release` is set (a slow tokenizer)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.threads: list[str] = []
        self.blocked = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def encode(self, text: str, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        if "BLOCK" in text:
            self.blocked.set()
            self.release.wait(BOUND)
        return self._tok.encode(text, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self._tok.apply_chat_template(*args, **kwargs)


async def _core(path: Path, **kwargs: Any) -> tuple[ServingCore, _Spy]:
    core = ServingCore(registry=CollectorRegistry(), **kwargs)
    await core.start()
    await core.load_model(*KEY[:1], path, revision=KEY[1], max_context_tokens=4096)
    spy = _Spy(core._tokenizers[KEY])
    core._tokenizers[KEY] = spy
    res = core._engine.registry.get(KEY)  # the MLX thread's copy too (a tree that used it)
    await core._call(lambda: setattr(res, "tokenizer", spy))
    return core, spy


async def test_a_blocked_tokenizer_does_not_stall_a_stream(
        tiny_model_path: Path) -> None:  # noqa: F811
    core, spy = await _core(tiny_model_path)
    try:
        stream = await core.generate("m", prompt="Once upon a time", max_tokens=400,
                                     temperature=0)
        first = [await stream.__anext__() for _ in range(3)]
        slow = asyncio.create_task(core.generate("m", prompt="BLOCK " * 10, max_tokens=2,
                                                 temperature=0))
        assert await asyncio.to_thread(spy.blocked.wait, BOUND)
        # the tokenizer is stuck; the stream goes on (it would wait if the MLX thread were
        # the one tokenizing)
        more = [await asyncio.wait_for(stream.__anext__(), BOUND) for _ in range(20)]
        assert len(first + more) == 23 and not slow.done()
        spy.release.set()
        gen = await asyncio.wait_for(slow, BOUND)
        async for _ in gen:
            pass
        assert gen.finish_reason == "length"
        async for _ in stream:
            pass
        threads = set(spy.threads)
        assert threads and all(t.startswith("mlxfleet-tokenize") for t in threads), threads
        await core.generate("m", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        assert spy.threads[-1].startswith("mlxfleet-tokenize")
    finally:
        spy.release.set()
        await core.close()


async def test_a_prompt_over_the_byte_bound_is_refused_before_tokenizing(
        tiny_model_path: Path) -> None:  # noqa: F811
    core, spy = await _core(tiny_model_path, max_prompt_bytes=1000)
    try:
        for kwargs in ({"prompt": "x" * 1001},
                       {"messages": [{"role": "user", "content": "é" * 501}]}):
            with pytest.raises(PromptTooLarge) as e:
                await core.generate("m", max_tokens=2, **kwargs)
            assert (e.value.size, e.value.limit) == (1001 if "prompt" in kwargs else 1006, 1000)
            assert "1000 bytes" in str(e.value) and "--max-prompt-bytes" in str(e.value)
        assert spy.threads == []  # nothing was tokenized
        assert core.inflight_requests() == 0
        # at the bound: tokenized (and refused by the context length, after tokenizing)
        with pytest.raises(ContextLengthExceeded):
            await core.generate("m", prompt="word " * 200, max_tokens=4000)
        assert len(spy.threads) == 1 and core.inflight_requests() == 0
    finally:
        await core.close()


async def test_http_answers_prompt_too_large_naming_the_limit(agent: Agent) -> None:  # noqa: F811
    limit = agent.core.max_prompt_bytes
    resp = await agent.client.post("/v1/completions", json={
        "model": MODEL_ID, "prompt": "x" * (limit + 1), "max_tokens": 1})
    body = await resp.json()
    assert resp.status == 400, body
    assert body["error"]["code"] == "prompt_too_large" and body["error"]["param"] == "prompt"
    assert f"{limit} bytes" in body["error"]["message"]
