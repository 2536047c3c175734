"""The fleet router end to end on real parts: etcd + kube-apiserver, the operator process, two
agent processes serving a generated MLX model with replicas 2, and the router process
(``python -m mlx_fleet_router``, started by ``mlx_fleet.devcluster.fleet.start_router``).

Issue #17's failover case: one serving agent SIGKILLed under load through the router → no
non-streamed request fails and no stream fails before its first byte (the ones in flight on the
killed Mac are retried before their first byte, the Mac is ejected when it refuses a
connection); a stream already running on the killed Mac is cut (counted, not resumed)."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from fleet_helpers import manifest, wait_ready
from mlx_fleet.contract import Keys
from mlx_fleet.devcluster.controlplane import ControlPlane
from mlx_fleet.devcluster.fleet import AgentProcess, RouterProcess, start_agent, start_operator, \
    start_router
from mlx_fleet.devcluster.processes import ManagedProcess

pytestmark = pytest.mark.integration

LEASE_TTL = 3
NAME = "router-e2e"
#: Requests that must succeed through the router before the kill, and after it.
BEFORE_KILL, AFTER_KILL = 12, 30
WORKERS = 4
STREAM_WORKERS = 2


@pytest.fixture(scope="module")
def fleet_keys() -> Keys:
    return Keys(f"/mlx-fleet-router-e2e/{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
def operator(control_plane: ControlPlane, fleet_keys: Keys, namespace: str
             ) -> Iterator[ManagedProcess]:
    proc = start_operator(control_plane, etcd_prefix=fleet_keys.root,
                          extra_args=("--namespace", namespace), log_name="operator-router")
    yield proc
    control_plane.kubectl("delete", "modeldeployments", "--all", "-n", namespace, "--wait=true",
                          "--timeout=60s", check=False, timeout=70)
    proc.stop()


@pytest.fixture(scope="module")
def agents(control_plane: ControlPlane, fleet_keys: Keys, operator: ManagedProcess
           ) -> Iterator[dict[str, AgentProcess]]:
    agents = {n: start_agent(control_plane, n, etcd_prefix=fleet_keys.root, memory="64Gi",
                             labels={"agent.mlx-fleet.io/pool": "router"}, lease_ttl=LEASE_TTL)
              for n in ("rmac-1", "rmac-2")}
    yield agents
    for agent in agents.values():
        agent.process.stop()


@pytest.fixture(scope="module")
def router(control_plane: ControlPlane, fleet_keys: Keys, namespace: str,
           agents: dict[str, AgentProcess]) -> Iterator[RouterProcess]:
    proc = start_router(control_plane, etcd_prefix=fleet_keys.root, namespaces=(namespace,))
    yield proc
    proc.process.stop()


def _sample(metrics: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for line in metrics.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def test_sigkilled_agent_under_load_costs_no_request(
        control_plane: ControlPlane, agents: dict[str, AgentProcess], router: RouterProcess,
        test_model_dir: Path, namespace: str) -> None:
    control_plane.kubectl("apply", "-f", "-", input=manifest(
        NAME, namespace, test_model_dir, replicas=2, selector={"agent.mlx-fleet.io/pool": "router"}))
    md = await asyncio.to_thread(wait_ready, control_plane, namespace, NAME)
    assert md["status"]["readyReplicas"] == 2

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        # the router follows etcd: both replicas in its table
        async def models() -> dict:
            async with http.get(f"{router.url}/v1/models") as r:
                return {m["id"]: m for m in (await r.json())["data"]}

        while (await models()).get(NAME, {}).get("ready_replicas") != 2:
            await asyncio.sleep(0.1)

        ok, failed = 0, []
        streams_ok, streams_cut = 0, 0
        enough_before = asyncio.Event()
        killed = asyncio.Event()
        ok_after = 0
        done = asyncio.Event()

        def body(w: int, i: int, stream: bool) -> dict:
            return {"model": NAME, "max_tokens": 4, "stream": stream,
                    "messages": [{"role": "user", "content": f"hello {w}-{i}"}]}

        async def worker(w: int) -> None:
            nonlocal ok, ok_after
            i = 0
            while not done.is_set():
                i += 1
                after = killed.is_set()
                try:
                    async with http.post(f"{router.url}/v1/chat/completions",
                                         json=body(w, i, False),
                                         headers={"X-Session-ID": f"w{w}-{i}"}) as r:
                        answer = await r.json()
                        if r.status != 200 or answer["object"] != "chat.completion":
                            failed.append((r.status, answer))
                            continue
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    failed.append(repr(e))
                    continue
                ok += 1
                if ok >= BEFORE_KILL:
                    enough_before.set()
                if after:
                    ok_after += 1
                    if ok_after >= AFTER_KILL:
                        done.set()

        async def streamer(w: int) -> None:
            """Streams: one that fails before its first byte is a failure; one cut after it
            (it ran on the killed Mac) is counted."""
            nonlocal streams_ok, streams_cut
            i = 0
            while not done.is_set():
                i += 1
                started = False
                try:
                    async with http.post(f"{router.url}/v1/chat/completions",
                                         json=body(100 + w, i, True),
                                         headers={"X-Session-ID": f"s{w}-{i}"}) as r:
                        if r.status != 200:
                            failed.append(("stream", r.status, await r.text()))
                            continue
                        text = b""
                        async for part in r.content.iter_any():
                            started = True
                            text += part
                        if not text.rstrip().endswith(b"data: [DONE]"):
                            failed.append(("stream ended without [DONE]", text[-200:]))
                            continue
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    if started:
                        streams_cut += 1
                    else:
                        failed.append(("stream", repr(e)))
                    continue
                streams_ok += 1

        workers = [asyncio.create_task(worker(w)) for w in range(WORKERS)]
        workers += [asyncio.create_task(streamer(w)) for w in range(STREAM_WORKERS)]
        await asyncio.wait_for(enough_before.wait(), 60)
        # both Macs served through the router before the kill (a replica in standby loads on
        # its first request, which takes seconds on a busy machine: wait for it, bounded)
        deadline = time.monotonic() + 60
        while True:
            async with http.get(f"{router.url}/metrics") as r:
                before = await r.text()
            served = {n: _sample(before, "mlxfleet_router_upstream_attempts_total", node=n,
                                 result="ok") for n in agents}
            if all(v > 0 for v in served.values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert all(v > 0 for v in served.values()), served
        victim = "rmac-1"
        agents[victim].process.kill()  # SIGKILL under load: no lease revocation
        killed.set()
        await asyncio.wait_for(done.wait(), 60)
        await asyncio.gather(*workers)
        assert failed == []
        assert streams_ok > 0
        # a stream running on the Mac at the kill is cut (resuming it elsewhere is later work):
        # at most one per stream worker
        assert streams_cut <= STREAM_WORKERS
        async with http.get(f"{router.url}/metrics") as r:
            after = await r.text()
    # the router saw the dead Mac fail (a reset in flight or a refused connection) and ejected it
    failures = sum(_sample(after, "mlxfleet_router_upstream_attempts_total", node=victim,
                           result=k) for k in ("connect_error", "reset", "timeout"))
    assert failures >= 1
    # ... and every failed attempt was retried on the other Mac, but for the streams it cut
    retried = _sample(after, "mlxfleet_router_retries_total", model=NAME, reason="Retry")
    cut = _sample(after, "mlxfleet_router_retries_total", model=NAME, reason="BytesSent")
    assert (retried + cut, cut) == (failures, streams_cut)
    assert _sample(after, "mlxfleet_router_requests_total", model=NAME, code="200") >= \
        BEFORE_KILL + AFTER_KILL
