"""Issue 6 §2 and §5 on real processes: "an agent restart re-registers, re-adopts its assignments
and reloads from disk without a download".

A node agent *process* (``python -m node_agent``, as launchd runs it) is assigned an
``https://`` model served by the local TLS mirror of tests/test_sources.py; once it is Ready the
agent is stopped — SIGTERM (graceful: the lease is revoked, its node record and reports vanish)
and then SIGKILL (a crash: the old lease still holds its keys until the TTL) — the mirror is
made to refuse every request (HTTP 503) and to count them, and the agent is started again with
the same download directory (``MLX_FLEET_CACHE``). It must register again under a new lease,
report the assignment Ready from the directory on disk, and the mirror must have received no
request at all (the server side's count is the proof, not the agent's word). Every wait is an
etcd watch; the assignment is written directly (no operator), as the operator would.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, Keys,
                                LifecyclePolicy, ModelSource, NodeRecord, PREFETCH_EAGER)
from mlx_fleet.devcluster.controlplane import ControlPlane, EtcdServer
from mlx_fleet.devcluster.fleet import AgentProcess, start_agent
from mlx_fleet.store import EtcdStore
from node_agent.fetch import STATE_FILE, mirror_dir
from test_sources import Mirror, mirror, model_files, tls  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

NODE = "restart-mac"
LEASE_TTL = 3  # seconds: what a SIGKILLed agent's keys outlive it by
TIMEOUT = 120  # seconds: an agent start and a model load on two busy CPU cores


def remote_assignment(uri: str) -> Assignment:
    return Assignment(namespace="default", name="adopt", generation=1, served_model_name="adopt",
                      source=ModelSource(uri=uri, revision="r1"), memory_bytes=2**20,
                      lifecycle=LifecyclePolicy(prefetch=PREFETCH_EAGER, idle_unload_seconds=0))


async def events_until(store: EtcdStore, keys: list[str], start: int,
                       until) -> list[tuple[str, bytes | None, int]]:
    """``(key, value or None when deleted, lease)`` of every change to ``keys`` from revision
    ``start``, up to and including the first for which ``until(events so far)`` holds (an etcd
    watch on the keys' common prefix, from a revision: nothing before it is seen)."""
    seen: list[tuple[str, bytes | None, int]] = []
    prefix = common_prefix(keys)

    async def collect() -> None:
        async for ev in store.watch(prefix, start):
            if ev.kv.key not in keys:
                continue
            seen.append((ev.kv.key, ev.kv.value if ev.type == "PUT" else None, ev.kv.lease))
            if until(seen):
                return

    await asyncio.wait_for(collect(), TIMEOUT)
    return seen


def common_prefix(keys: list[str]) -> str:
    prefix = keys[0]
    for k in keys[1:]:
        while not k.startswith(prefix):
            prefix = prefix[:-1]
    return prefix


def report_of(value: bytes | None) -> AssignmentReport | None:
    return AssignmentReport.from_json(value) if value is not None else None


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    """The agent processes a test starts; whatever still runs is stopped after it."""
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        if agent.process.alive():
            agent.process.stop()


async def test_agent_restart_readopts_the_download_without_contacting_the_mirror(
        control_plane: ControlPlane, etcd_server: EtcdServer, store: EtcdStore, keys: Keys,
        mirror: Mirror, tls: tuple[Path, Path], tmp_path: Path,
        agents: list[AgentProcess]) -> None:
    cache = tmp_path / "agent-cache"
    env = {"MLX_FLEET_CACHE": str(cache), "SSL_CERT_FILE": str(tls[0])}
    node_key = keys.node(NODE)
    report_key = keys.report(NODE, "default", "adopt", "r1")
    watched = [node_key, report_key]

    async def start() -> AgentProcess:
        # in a thread: start_agent polls /health, and the mirror is served by this event loop
        agent = await asyncio.to_thread(
            start_agent, control_plane, NODE, etcd_prefix=keys.root,
            etcd_url=etcd_server.client_url, lease_ttl=LEASE_TTL, timeout=TIMEOUT, env=env)
        agents.append(agent)
        return agent

    def ready(events: list[tuple[str, bytes | None, int]]) -> bool:
        r = report_of(events[-1][1]) if events[-1][0] == report_key else None
        return r is not None and r.state in (AssignmentState.READY, AssignmentState.FAILED)

    # 1. first start: the weights are downloaded from the mirror, then served
    agent = await start()
    start_rev = (await store.list(keys.root + "/")).revision + 1
    await store.put(keys.assignment(NODE, "default", "adopt", "r1"),
                    remote_assignment(mirror.url).to_json())
    seen = await events_until(store, watched, start_rev, ready)
    first = report_of(seen[-1][1])
    assert first is not None and first.state is AssignmentState.READY, first
    downloaded = {n for n, _ in mirror.requests} - {"manifest.json"}
    assert downloaded == set(mirror.files)  # every file came from the mirror, once
    on_disk = mirror_dir(mirror.url, cache / "models")
    assert (on_disk / STATE_FILE).is_file()

    for how in ("SIGTERM", "SIGKILL"):
        # 2. stop it; from now on the mirror refuses everything (and counts it)
        old_lease = (await store.get(node_key)).lease  # type: ignore[union-attr]
        stop_rev = (await store.list(keys.root + "/")).revision + 1
        if how == "SIGTERM":
            assert agent.process.stop() == 0
            # graceful: the lease is revoked, so the node record and the report go at once
            gone = await events_until(
                store, watched, stop_rev,
                lambda ev: {k for k, v, _ in ev if v is None} == set(watched))
            assert {k for k, v, _ in gone if v is None} == set(watched)
        else:
            agent.process.signal(signal.SIGKILL)
            await asyncio.to_thread(agent.process.proc.wait)
            assert agent.process.proc.returncode == -signal.SIGKILL
        mirror.requests.clear()
        for name in [*mirror.files, "manifest.json"]:
            mirror.status[name] = 503

        # 3. start it again with the same download directory
        restart_rev = (await store.list(keys.root + "/")).revision + 1
        agent = await start()
        seen = await events_until(store, watched, restart_rev, ready)
        assert mirror.requests == [], (how, mirror.requests)  # not one byte asked for
        node_puts = [(v, lease) for k, v, lease in seen if k == node_key and v is not None]
        assert node_puts, f"{how}: the node did not register again"
        assert all(lease not in (0, old_lease) for _, lease in node_puts), how  # a new lease
        assert NodeRecord.from_json(node_puts[-1][0]).name == NODE
        reports = [report_of(v) for k, v, _ in seen if k == report_key]
        last = reports[-1]
        assert last is not None and last.state is AssignmentState.READY, (how, last)
        assert last.generation == 1 and last.endpoint == agent.url
        loading = [r for r in reports if r is not None and r.state is AssignmentState.LOADING]
        # the weights came from the cache (no request above); the status names the source,
        # never the Mac's local path (issue 19: statuses without paths)
        assert loading and mirror.url.rstrip("/") in loading[-1].message, (how, loading)
        assert str(cache) not in loading[-1].message, (how, loading)
        assert all(r.progress is None or r.progress.rate_bytes_per_second == 0
                   for r in reports if r is not None), (how, reports)  # no bytes arrived
        kv = await store.get(report_key)
        assert kv is not None and kv.lease == node_puts[-1][1]  # bound to the new lease
        for name in [*mirror.files, "manifest.json"]:
            del mirror.status[name]
