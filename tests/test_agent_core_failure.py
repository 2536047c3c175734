"""A node agent whose serving core failed does not stay registered: the real agent process
(``python -m node_agent`` with a fault injected into its MLX thread, see
``tests/core_failure_agent.py``) revokes its lease — the node record is gone from etcd at once,
so the operator re-places its replicas — and exits non-zero for launchd to restart it."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

from mlx_fleet.source_policy import DEV_POLICY
from mlx_fleet.contract import Assignment, Keys, ModelSource
from mlx_fleet.store import EtcdStore
from node_agent.main import EXIT_CORE_FAILED

NODE = "doomed"
TIMEOUT = 60.0
SCRIPT = Path(__file__).with_name("core_failure_agent.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until_present(store: EtcdStore, key: str) -> int:
    """Wait until ``key`` exists; returns the revision to watch its deletion from."""
    kv = await store.get(key)
    if kv is not None:
        return kv.mod_revision
    start = (await store.list(key)).revision + 1
    async for ev in store.watch(key, start):
        if ev.kv.key == key and ev.type == "PUT":
            return ev.kv.mod_revision
    raise AssertionError("watch ended")


async def _until_deleted(store: EtcdStore, key: str, start: int) -> None:
    async for ev in store.watch(key, start):
        if ev.kv.key == key and ev.type == "DELETE":
            return


async def test_failed_core_revokes_the_lease_and_exits_non_zero(
        etcd_server, store: EtcdStore, keys: Keys, test_model_dir: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(SCRIPT), "--node-name", NODE,
        "--etcd-endpoint", etcd_server.client_url, "--etcd-prefix", keys.root,
        "--listen", f"127.0.0.1:{_free_port()}", "--simulated-memory", "8Gi",
        "--lease-ttl", "30", "--source-policy", DEV_POLICY.to_json(),  # a temporary directory
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        node_key = keys.node(NODE)
        registered = await asyncio.wait_for(_until_present(store, node_key), TIMEOUT)
        deleted = asyncio.create_task(_until_deleted(store, node_key, registered + 1))
        a = Assignment(namespace="default", name="chat", generation=1, served_model_name="tiny",
                       source=ModelSource(uri=f"file://{test_model_dir}", revision="r1"),
                       memory_bytes=2**20)
        await store.put(keys.assignment(NODE, "default", "chat", "r1"), a.to_json())
        # the load kills the MLX thread; the agent leaves at once (a 30 s lease would keep a
        # crashed node's record for 30 s) and exits with its own status
        _, stderr = await asyncio.wait_for(proc.communicate(), TIMEOUT)
        await asyncio.wait_for(deleted, TIMEOUT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    err = stderr.decode()
    assert proc.returncode == EXIT_CORE_FAILED != 0, err
    assert await store.get(node_key) is None
    assert (await store.list(keys.root + "/reports/")).items == []
    critical = [line for line in err.splitlines() if "CRITICAL" in line]
    assert any("serving core failed (InjectedThreadDeath: injected: the MLX thread died while "
               "loading): stopping node agent doomed, revoking its lease" in line
               for line in critical), err
    assert "Traceback" not in err.split("stopping node agent")[-1], err
