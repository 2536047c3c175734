"""The real fleet router app in front of a real agent app, its table followed from a MemoryStore
holding the records an agent would write (node record, assignment, Ready report with the
capabilities the agent computes): the path a client's request takes through the fleet, without
etcd or processes. Used by the end-to-end tests of issue 20's API (tests/test_capabilities_e2e.py,
tests/test_api_parity_router.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from mlx_fleet.capabilities import ModelCapabilities
from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, Keys,
                                ModelSource, NodeCapacity, NodeRecord)
from mlx_fleet.memstore import MemoryStore
from mlx_fleet_router.app import build_app
from mlx_fleet_router.follow import Follower
from mlx_fleet_router.state import RouterSettings

KEYS = Keys()
NS, DEP, NODE = "team", "tiny", "mac-a"
CAP = NodeCapacity(memory_total_bytes=64 << 30, memory_available_bytes=60 << 30,
                   chip="Apple M4 Max", chip_generation=4)


async def publish(store: MemoryStore, endpoint: str, model_id: str, revision: str,
                  caps: ModelCapabilities | None) -> None:
    """Write what agent ``NODE`` serving ``model_id`` at ``revision`` on ``endpoint`` reports."""
    await store.put(KEYS.node(NODE), NodeRecord(name=NODE, address=endpoint,
                                                capacity=CAP).to_json())
    await store.put(KEYS.assignment(NODE, NS, DEP, revision), Assignment(
        namespace=NS, name=DEP, generation=1, served_model_name=model_id,
        source=ModelSource(uri="file:///m", revision=revision), memory_bytes=1).to_json())
    await store.put(KEYS.report(NODE, NS, DEP, revision), AssignmentReport(
        node=NODE, namespace=NS, name=DEP, generation=1, revision=revision,
        state=AssignmentState.READY, endpoint=endpoint, capabilities=caps).to_json())


@pytest_asyncio.fixture
async def router_url(memory_store: MemoryStore) -> AsyncIterator[tuple[Follower, str]]:
    """``(follower, base URL ending in /v1)`` of a router app following ``memory_store``."""
    follower = Follower(memory_store, KEYS, namespaces={NS})
    task = asyncio.create_task(follower.run())
    app = build_app(lambda: follower.table, registry=CollectorRegistry(),
                    settings=RouterSettings(probe_interval_seconds=0))
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    yield follower, str(client.make_url("/v1"))
    await client.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
