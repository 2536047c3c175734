"""Shared fixtures for the serving-core and OpenAI-API tests: tiny generated models (one per
session each: the default one and one with other weights, to tell revisions apart), a started
:class:`ServingCore` with the default one loaded, and an aiohttp test server/client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import threading
from collections.abc import AsyncIterator, Callable, Hashable, Mapping
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from mlx_fleet.testmodel import make_test_model
from node_agent.openai_api import build_app
from node_agent.serving import ServingCore, ServingOptions

MODEL_ID = "tiny"
REVISION = "r1"


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def other_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's architecture and tokenizer with other weights (another "revision")."""
    return make_test_model(tmp_path_factory.mktemp("models") / "tiny-other", seed=1)


def safetensors_bytes(path: Path) -> int:
    """The bytes of the tensors stored in ``path``'s ``model.safetensors`` (from its header)."""
    raw = (path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    return sum(end - start for name, t in header.items() if name != "__metadata__"
               for start, end in [t["data_offsets"]])


async def wait_for(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    """Await until ``cond()`` is true (bounded; polls the event loop)."""
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(poll(), timeout)


class Agent:
    """A core with the tiny model loaded, served by the real app on a test server."""

    def __init__(self, core: ServingCore, client: TestClient, registry: CollectorRegistry,
                 health: dict) -> None:
        self.core = core
        self.client = client
        self.registry = registry
        self.health = health

    @property
    def base_url(self) -> str:
        return str(self.client.make_url("/v1"))


async def make_agent(path: Path, *, max_queued_requests: int = 64,
                     max_concurrent_sequences: int = 8,
                     max_context_tokens: int = 8192,
                     options: ServingOptions | None = None,
                     prepare_app: Callable[[web.Application], None] | None = None) -> Agent:
    """``prepare_app``: called with the app before it is served (to add signal handlers)."""
    registry = CollectorRegistry()
    core = ServingCore(registry=registry, max_queued_requests=max_queued_requests,
                       options=options)
    await core.start()
    await core.load_model(MODEL_ID, path, revision=REVISION,
                          max_concurrent_sequences=max_concurrent_sequences,
                          max_context_tokens=max_context_tokens)
    health = {"ok": True, "details": {"node": "test"}}
    app = build_app(core, health=lambda: (health["ok"], health["details"]), registry=registry)
    if prepare_app is not None:
        prepare_app(app)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    return Agent(core, client, registry, health)


async def close_agent(agent: Agent) -> None:
    await agent.client.close()
    await agent.core.close()


@pytest_asyncio.fixture(scope="session")
async def agent(tiny_model_path: Path) -> AsyncIterator[Agent]:
    a = await make_agent(tiny_model_path)
    yield a
    await close_agent(a)


@contextlib.asynccontextmanager
async def mlx_thread_held(core, timeout: float):
    """Hold the serving core's MLX thread (a command that blocks it) for the ``async with``
    body: nothing decodes, loads or unloads meanwhile, so requests admitted before stay in
    flight. Released (and the command awaited) on the way out."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(timeout)

    held = asyncio.create_task(core._call(hold))
    try:
        assert await asyncio.to_thread(entered.wait, timeout)
        yield
    finally:
        release.set()
        await held


@contextlib.asynccontextmanager
async def started_cores(path: Path, options: Mapping[Hashable, ServingOptions],
                        timeout: float = 60.0, **load: object
                        ) -> AsyncIterator[dict[Hashable, ServingCore]]:
    """One started core per entry of ``options`` (same keys), each with ``path`` loaded as
    ``m@r1`` (``load``: more ``load_model`` arguments): the same requests compared with an
    option on and off. Closed on the way out."""
    cores: dict[Hashable, ServingCore] = {}
    try:
        for key, opts in options.items():
            cores[key] = c = ServingCore(registry=CollectorRegistry(), options=opts)
            await c.start()
            await c.load_model("m", path, revision="r1", **load)
        yield cores
    finally:
        for c in cores.values():
            await asyncio.wait_for(c.close(), timeout)
