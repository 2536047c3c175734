"""The serving options on the real agent app over a real generated model: the prompt cache
(cached tokens in OpenAI's usage, hit/miss counters, its byte budget counting the live batch,
``--no-prompt-cache``), KV-aware admission (429 with ``Retry-After`` from the drain rate), a
slow-reading client beside a normal stream (bounded per-stream buffer), and the options on
``/metrics``."""

from __future__ import annotations

import asyncio
import re
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from node_agent.memory_estimate import kv_cache_bytes, kv_cache_bytes_per_token, read_config
from node_agent.serving import Overloaded, ServingCore, ServingOptions
from node_agent.serving.admission import retry_after_seconds
from serving_fixtures import (MODEL_ID, REVISION, Agent, close_agent, make_agent,  # noqa: F401
                              safetensors_bytes, tiny_model_path, wait_for)

SYSTEM = ("You are a careful assistant of the mlx-fleet project. Answer in one short sentence, "
          "name the model, the revision and the node that served the request, and never invent "
          "numbers that were not measured. ") * 3


def sample(registry: CollectorRegistry, name: str) -> float:
    return registry.get_sample_value(name, {"model": MODEL_ID, "revision": REVISION}) or 0.0


@pytest_asyncio.fixture(scope="module")
async def cached(tiny_model_path: Path) -> AsyncIterator[Agent]:  # noqa: F811
    a = await make_agent(tiny_model_path)
    yield a
    await close_agent(a)


@pytest_asyncio.fixture(scope="module")
async def uncached(tiny_model_path: Path) -> AsyncIterator[Agent]:  # noqa: F811
    a = await make_agent(tiny_model_path, options=ServingOptions(prompt_cache=False))
    yield a
    await close_agent(a)


def chat_body(question: str, **kw) -> dict:
    return {"model": MODEL_ID, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}], **kw}


async def stream_usage(agent: Agent, path: str, body: dict) -> dict:
    """The usage of the last event of a streamed request with include_usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with agent.client.post(path, json=body) as resp:
        assert resp.status == 200
        events = [line[6:] for line in (await resp.text()).splitlines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


async def test_cached_tokens_in_usage_and_hit_counters(cached: Agent) -> None:
    reg = cached.registry
    hits0, misses0 = (sample(reg, "mlxfleet_agent_prompt_cache_hits_total"),
                      sample(reg, "mlxfleet_agent_prompt_cache_misses_total"))
    resp = await cached.client.post("/v1/chat/completions", json=chat_body("What is MLX?"))
    first = (await resp.json())["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}        # nothing cached yet
    assert sample(reg, "mlxfleet_agent_prompt_cache_misses_total") == misses0 + 1
    # the same system prompt, another question: the shared prefix comes from the cache
    resp = await cached.client.post("/v1/chat/completions", json=chat_body("What is etcd?"))
    second = (await resp.json())["usage"]
    assert 100 < second["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens"]
    assert sample(reg, "mlxfleet_agent_prompt_cache_hits_total") == hits0 + 1
    # streamed chat with include_usage, and text completions, report it the same way
    usage = await stream_usage(cached, "/v1/chat/completions", chat_body("What is a lease?"))
    assert 100 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    text = {"model": MODEL_ID, "prompt": SYSTEM + " Q: a", "max_tokens": 3, "temperature": 0}
    await cached.client.post("/v1/completions", json=text)
    resp = await cached.client.post("/v1/completions", json={**text, "prompt": SYSTEM + " Q: b"})
    usage = (await resp.json())["usage"]
    assert 100 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    usage = await stream_usage(cached, "/v1/completions", {**text, "prompt": SYSTEM + " Q: c"})
    assert 100 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


async def test_no_prompt_cache_reuses_nothing(uncached: Agent, tiny_model_path: Path) -> None:  # noqa: F811
    reg = uncached.registry
    for question in ("What is MLX?", "What is etcd?"):
        resp = await uncached.client.post("/v1/chat/completions", json=chat_body(question))
        assert (await resp.json())["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    usage = await stream_usage(uncached, "/v1/chat/completions", chat_body("What is MLX?"))
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert sample(reg, "mlxfleet_agent_prompt_cache_hits_total") == 0
    assert sample(reg, "mlxfleet_agent_prompt_cache_misses_total") == 0   # never looked up
    # nothing is held beyond the weights
    assert uncached.core.memory_bytes(MODEL_ID, REVISION) == safetensors_bytes(tiny_model_path)


async def test_options_are_on_metrics(uncached: Agent) -> None:
    text = await (await uncached.client.get("/metrics")).text()
    for option, value in ServingOptions(prompt_cache=False).as_record().items():
        assert (f'mlxfleet_agent_serving_option_info{{option="{option}",value="{value}"}} 1.0'
                in text)
    assert 'option="prompt_cache",value="off"' in text


async def test_prompt_cache_budget_counts_the_live_batch(tiny_model_path: Path) -> None:  # noqa: F811
    per_token = kv_cache_bytes_per_token(read_config(tiny_model_path))
    budget = kv_cache_bytes(per_token, 512)             # two KVCache steps
    core = ServingCore(registry=CollectorRegistry(),
                       options=ServingOptions(prompt_cache_bytes=budget))
    await core.start()
    try:
        await core.load_model("m", tiny_model_path, revision="r1", max_concurrent_sequences=4)
        weights = core.memory_bytes("m", "r1")

        async def finish(prompt: str) -> None:
            gen = await core.generate("m", prompt=prompt, max_tokens=4, temperature=0)
            async for _ in gen:
                pass

        await finish("a short prompt")
        alone = core.memory_bytes("m", "r1") - weights
        assert 0 < alone <= budget                        # cached, within the budget
        # a long generation grows its live KV cache past 256 tokens (two steps: the budget)
        running = await core.generate("m", prompt="keep going", max_tokens=4000, temperature=0)
        async with running:
            n = 0
            async for _ in running:
                n += 1
                if n == 300:
                    break
            await finish("another short prompt")
            # budget − live batch = 0: the finished prompt's cache was trimmed away at once
            assert core.memory_bytes("m", "r1") == weights
        await wait_for(lambda: core.active_sequences("m") == 0)
        await finish("a third short prompt")              # no live batch: cached again
        assert 0 < core.memory_bytes("m", "r1") - weights <= budget
        # a prompt whose own cache exceeds the budget is not kept
        await finish("word " * 600)
        assert core.memory_bytes("m", "r1") - weights <= budget
    finally:
        await core.close()


async def test_kv_admission_refuses_with_retry_after_from_the_drain_rate(
        tiny_model_path: Path) -> None:  # noqa: F811
    # batch of 1, 1024 tokens of context: the KV budget is two such sequences
    agent = await make_agent(tiny_model_path, max_concurrent_sequences=1,
                             max_context_tokens=1024)
    core = agent.core
    try:
        for i in range(3):                              # a drain rate to estimate from
            await (await core.generate(MODEL_ID, prompt=f"warm {i}", max_tokens=2,
                                       temperature=0)).__anext__()
        await wait_for(lambda: core.inflight_requests() == 0)
        rate = core.drain_rate(MODEL_ID, REVISION)
        assert rate is not None and rate > 0
        running = await core.generate(MODEL_ID, prompt="a", max_tokens=1000, temperature=0)
        async with running:
            await running.__anext__()                   # it runs: 1024 tokens' worth of KV
            waiting = await core.generate(MODEL_ID, prompt="b", max_tokens=1000,
                                          temperature=0)  # waits: 2048 tokens' worth in all
            async with waiting:
                body = {"model": MODEL_ID, "prompt": "c", "max_tokens": 2, "temperature": 0}
                resp = await agent.client.post("/v1/completions", json=body)
                assert resp.status == 429
                err = (await resp.json())["error"]
                assert err["code"] == "overloaded" and "above the model's budget" in err["message"]
                # one request waits ahead, at the measured rate (no completion since)
                assert int(resp.headers["Retry-After"]) == retry_after_seconds(
                    1, core.drain_rate(MODEL_ID, REVISION))
    finally:
        await close_agent(agent)


async def test_count_policy_queues_what_kv_refuses(tiny_model_path: Path) -> None:  # noqa: F811
    def opts(policy: str) -> ServingOptions:
        return ServingOptions(admission_policy=policy)

    # batch of 1, 1024 tokens of context: KV budget 2048 tokens' worth. In flight: a long
    # request (1024) and a short one (256); then a long one (→ 2304) and a short one (→ 1536).
    for policy, refused in (("count", False), ("kv", True)):
        core = ServingCore(registry=CollectorRegistry(), options=opts(policy))
        await core.start()
        try:
            await core.load_model("m", tiny_model_path, revision="r1",
                                  max_concurrent_sequences=1, max_context_tokens=1024)
            gens = [await core.generate("m", prompt="a", max_tokens=1000, temperature=0)]
            await gens[0].__anext__()                     # a is in the batch
            gens.append(await core.generate("m", prompt="b", max_tokens=2, temperature=0))
            if refused:
                with pytest.raises(Overloaded) as exc:
                    await core.generate("m", prompt="c", max_tokens=1000, temperature=0)
                assert exc.value.retry_after_seconds >= 1 and exc.value.waiting == 1
            else:
                gens.append(await core.generate("m", prompt="c", max_tokens=1000,
                                                temperature=0))
            # the bound is bytes, not a count: a short request after the refused long one fits
            gens.append(await core.generate("m", prompt="d", max_tokens=2, temperature=0))
            assert core.inflight_requests("m") == len(gens) == (3 if refused else 4)
            for g in gens:
                g.cancel()
        finally:
            await core.close()


SLOW_PATH = "X-Test-Slow-Path"   # marks the request whose network path the test narrows


def _slow_client(port: int, body: bytes) -> socket.socket:
    """A client with a 4 KiB receive buffer that sends a streaming request and reads nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"%s: 1\r\n" % SLOW_PATH.encode()
                 + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                 + body)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Read until the chunked response ends (its zero-length last chunk)."""
    sock.settimeout(60)
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        part = sock.recv(65536)
        if not part:
            break
        data += part
    return data


async def test_a_slow_reader_is_cut_off_and_never_stalls_a_normal_stream(
        tiny_model_path: Path) -> None:  # noqa: F811
    async def small_send_buffer(request, response) -> None:
        # the slow client's network path: the server's socket buffer and aiohttp's write buffer
        # stay small, so a client that does not read fills them after about a hundred events
        if SLOW_PATH not in request.headers:
            return
        sock = request.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        request.transport.set_write_buffer_limits(high=1024)

    agent = await make_agent(
        tiny_model_path, options=ServingOptions(stream_buffer_chunks=64),
        prepare_app=lambda app: app.on_response_prepare.append(small_send_buffer))
    core, reg = agent.core, agent.registry
    slow = None
    try:
        body = {"model": MODEL_ID, "max_tokens": 3000, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": "Tell a very long story."}]}
        slow = await asyncio.to_thread(_slow_client, agent.client.port,
                                       json.dumps(body).encode())
        await wait_for(lambda: core.active_sequences() == 1)
        # a normal stream beside it runs to its end while the slow client reads nothing
        normal = {**body, "max_tokens": 48, "stream_options": {"include_usage": True}}
        async with agent.client.post("/v1/chat/completions", json=normal) as resp:
            events = [line[6:] for line in (await resp.text()).splitlines()
                      if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 48
        # the slow stream overflowed its buffer: stopped, out of the batch, nothing in flight
        await wait_for(lambda: sample(reg, "mlxfleet_agent_stream_buffer_overflows_total") == 1)
        await wait_for(lambda: core.inflight_requests() == 0 and core.active_sequences() == 0)
        # the slow client finally reads: what was generated, then the error, no [DONE]
        raw = await asyncio.to_thread(_read_all, slow)
        assert raw.startswith(b"HTTP/1.1 200")
        assert re.search(rb'"code": ?"stream_buffer_overflow"', raw) and b"[DONE]" not in raw
        assert raw.count(b"chat.completion.chunk") < 1000    # stopped long before its end
    finally:
        if slow is not None:
            slow.close()
        await close_agent(agent)


async def test_count_refusal_retry_after_from_the_drain_rate(tiny_model_path: Path) -> None:  # noqa: F811
    agent = await make_agent(tiny_model_path, max_queued_requests=1, max_concurrent_sequences=1)
    core = agent.core
    try:
        body = {"model": MODEL_ID, "prompt": "c", "max_tokens": 2, "temperature": 0}
        resp = await agent.client.post("/v1/completions", json=body)
        assert resp.status == 200                       # one completed: a rate is measured
        rate = core.drain_rate(MODEL_ID, REVISION)
        assert rate is not None and rate > 0
        running = await core.generate(MODEL_ID, prompt="a", max_tokens=1000, temperature=0)
        async with running:
            await running.__anext__()
            waiting = await core.generate(MODEL_ID, prompt="b", max_tokens=2, temperature=0)
            async with waiting:
                resp = await agent.client.post("/v1/completions", json=body)
                assert resp.status == 429
                assert "1 requests are already waiting (limit 1)" in (
                    await resp.json())["error"]["message"]
                assert int(resp.headers["Retry-After"]) == retry_after_seconds(1, rate)
    finally:
        await close_agent(agent)
