"""End to end on real parts: kube-apiserver + etcd + the operator process + agent processes
serving a generated MLX model, driven with kubectl and the official ``openai`` client.

Each test uses its own ModelDeployment (and, where it kills agents, its own agents selected
by a label), so the tests do not depend on each other's order.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from fault_record import FaultRecord
from fleet_helpers import manifest, wait_ready, watch_until
from mlx_fleet.contract import AssignmentReport, AssignmentState, Keys
from mlx_fleet.devcluster.controlplane import ControlPlane
from mlx_fleet.devcluster.fleet import AgentProcess, start_agent, start_operator
from mlx_fleet.devcluster.processes import ManagedProcess
from mlx_fleet.store import EtcdStore

pytestmark = pytest.mark.integration

LEASE_TTL = 3  # seconds; short so node loss is detected quickly in tests


@pytest.fixture(scope="module")
def fleet_keys() -> Keys:
    return Keys(f"/mlx-fleet-e2e/{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
def operator(control_plane: ControlPlane, fleet_keys: Keys, namespace: str) -> Iterator[dict[str, ManagedProcess]]:
    """The operator, watching only this module's namespace, in a holder a test may restart it in."""
    holder = {"process": start_operator(control_plane, etcd_prefix=fleet_keys.root,
                                        extra_args=("--namespace", namespace))}
    yield holder
    # Delete what the tests left while the operator still runs, so finalizers are released.
    control_plane.kubectl("delete", "modeldeployments", "--all", "-n", namespace, "--wait=true",
                          "--timeout=60s", check=False, timeout=70)
    holder["process"].stop()


@pytest.fixture(scope="module")
def fleet(control_plane: ControlPlane, fleet_keys: Keys, operator: dict) -> Iterator[dict[str, AgentProcess]]:
    """Two agents (an M3 Max and an M4 Pro, both simulated on Linux) with the operator running."""
    agents = {
        "mac-a": start_agent(control_plane, "mac-a", etcd_prefix=fleet_keys.root, chip="Apple M3 Max",
                             memory="64Gi", labels={"agent.mlx-fleet.io/pool": "main"}, lease_ttl=LEASE_TTL),
        "mac-b": start_agent(control_plane, "mac-b", etcd_prefix=fleet_keys.root, chip="Apple M4 Pro",
                             memory="24Gi", labels={"agent.mlx-fleet.io/pool": "main"}, lease_ttl=LEASE_TTL),
    }
    yield agents
    for agent in agents.values():
        agent.process.stop()


async def test_apply_to_ready_then_complete(control_plane: ControlPlane, fleet: dict[str, AgentProcess],
                                           fleet_keys: Keys, test_model_dir: Path, namespace: str) -> None:
    name = "e2e-basic"
    control_plane.kubectl("apply", "-f", "-", input=manifest(name, namespace, test_model_dir))
    async with EtcdStore(control_plane.etcd_url) as store:
        # The operator's assignment reaches etcd ...
        def mine(k: str) -> bool:
            return (fleet_keys.parse_assignment(k) or ("",) * 4)[1:3] == (namespace, name)

        view = await watch_until(store, fleet_keys.assignments_prefix,
                                  lambda v: any(mine(k) for k in v))
        (node,) = [fleet_keys.parse_assignment(k)[0] for k in view if mine(k)]
        # ... the agent loads the model and reports Ready under its lease ...
        reports = await watch_until(store, fleet_keys.report(node, namespace, name, "v1"),
                                     lambda v: any(AssignmentReport.from_json(b).state is AssignmentState.READY
                                                   for b in v.values()))
        report = AssignmentReport.from_json(next(iter(reports.values())))
        report_kv = await store.get(fleet_keys.report(node, namespace, name, "v1"))
        assert report_kv is not None and report_kv.lease != 0
    # ... and the operator folds it into status.
    md = wait_ready(control_plane, namespace, name)
    status = md["status"]
    assert status["observedGeneration"] == md["metadata"]["generation"]
    assert status["readyReplicas"] == 1
    assert status["endpoints"] == [report.endpoint] == [fleet[node].url]
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"

    client = openai.AsyncOpenAI(base_url=f"{report.endpoint}/v1", api_key="unused")
    try:
        done = await client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8)
        assert done.choices[0].message.role == "assistant"
        assert done.usage.completion_tokens == 8 or done.choices[0].finish_reason == "stop"
        assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens

        stream = await client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Stream please"}], max_tokens=6,
            stream=True, stream_options={"include_usage": True})
        text, usage, finish = "", None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert finish in {"length", "stop"}
        assert usage is not None and usage.completion_tokens >= 1
        models = await client.models.list()
        assert name in [m.id for m in models.data]
    finally:
        await client.close()

    # The printer columns show it.
    table = control_plane.kubectl("get", "modeldeployments", name, "-n", namespace).stdout
    assert name in table and "v1" in table


async def test_agent_api_rejects_bad_requests(fleet: dict[str, AgentProcess]) -> None:
    async with aiohttp.ClientSession(base_url=fleet["mac-a"].url) as http:
        async with http.post("/v1/chat/completions", data=b"{not json",
                             headers={"content-type": "application/json"}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with http.post("/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": "many"}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "max_tokens"
        async with http.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi"}) as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"
        # The agent is still healthy after all that.
        async with http.get("/health") as r:
            assert r.status == 200


async def stream_until_cut(url: str, model: str, started: asyncio.Event) -> Exception:
    """Stream a long completion from ``url``; set ``started`` at the first token; return the
    error that ends the stream (the test kills the agent mid-stream), or fail if it ends well."""
    try:
        async with aiohttp.ClientSession() as http, http.post(
                f"{url}/v1/completions", json={"model": model, "prompt": "A long story",
                                               "max_tokens": 3500, "temperature": 0,
                                               "stream": True}) as r:
            assert r.status == 200
            async for _ in r.content:
                started.set()
    except aiohttp.ClientError as e:
        return e
    raise AssertionError("the stream ended without an error though its agent was killed")


async def stream_in_full(url: str, model: str, max_tokens: int, started: asyncio.Event) -> int:
    """Stream a greedy completion to its end; returns its completion tokens (from the usage)."""
    tokens = 0
    async with aiohttp.ClientSession() as http, http.post(
            f"{url}/v1/completions", json={"model": model, "prompt": "Go on", "temperature": 0,
                                           "max_tokens": max_tokens, "stream": True,
                                           "stream_options": {"include_usage": True}}) as r:
        assert r.status == 200
        async for line in r.content:
            started.set()
            if line.startswith(b"data: {") and b'"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens


@pytest.mark.fault("agent SIGKILL mid-stream",
                   holds="the client of the killed Mac gets a clean connection error at once, not a "
                         "hang; a stream on another Mac, running across the kill, finishes in full; "
                         "the lease expires, the node record goes and the model is re-placed on the "
                         "surviving Mac, Ready there (recovery: from the kill to Ready)")
async def test_sigkilled_agent_is_replaced(control_plane: ControlPlane, fleet: dict[str, AgentProcess],
                                           fleet_keys: Keys, test_model_dir: Path, namespace: str,
                                           fault_record: FaultRecord) -> None:
    pool = f"failover-{uuid.uuid4().hex[:6]}"
    victims = {
        n: start_agent(control_plane, n, etcd_prefix=fleet_keys.root, labels={"agent.mlx-fleet.io/pool": pool},
                       lease_ttl=LEASE_TTL)
        for n in (f"{pool}-1", f"{pool}-2")
    }
    name, bystander = "e2e-failover", "e2e-bystander"
    try:
        control_plane.kubectl("apply", "-f", "-", input=manifest(bystander, namespace, test_model_dir,
                                                                 selector={"agent.mlx-fleet.io/pool": "main"}))
        control_plane.kubectl("apply", "-f", "-", input=manifest(name, namespace, test_model_dir, selector={"agent.mlx-fleet.io/pool": pool}))
        (other_url,) = wait_ready(control_plane, namespace, bystander)["status"]["endpoints"]
        first = wait_ready(control_plane, namespace, name)["status"]["nodes"]
        (serving,) = [n["name"] for n in first if n["state"] == "Ready"]
        survivor = next(n for n in victims if n != serving)

        other_started, started = asyncio.Event(), asyncio.Event()
        other = asyncio.create_task(stream_in_full(other_url, bystander, 600, other_started))
        await asyncio.wait_for(other_started.wait(), 60)
        stream = asyncio.create_task(stream_until_cut(victims[serving].url, name, started))
        await asyncio.wait_for(started.wait(), 60)
        async with EtcdStore(control_plane.etcd_url) as store:
            victims[serving].process.kill()  # SIGKILL: no lease revocation, as a crashed Mac
            fault_record.fault_ended()
            # the client mid-stream gets a clean error, not a hang
            error = await asyncio.wait_for(stream, 10)
            fault_record.note(f"the client mid-stream got {type(error).__name__}")
            assert not other.done()  # the other Mac's stream runs across the kill ...
            assert await asyncio.wait_for(other, 120) == 600  # ... and finishes in full
            fault_record.note("the stream on another Mac finished in full (600 tokens)")
            # The node record vanishes by itself when the lease expires ...
            await watch_until(store, fleet_keys.node(serving), lambda v: not v, timeout=LEASE_TTL + 30)
            # ... and the deployment is placed on the surviving node, which reports Ready.
            await watch_until(
                store, fleet_keys.report(survivor, namespace, name, "v1"),
                lambda v: any(AssignmentReport.from_json(b).state is AssignmentState.READY for b in v.values()),
                timeout=120)
            fault_record.recovered()
            assert not (await store.list(fleet_keys.node_assignments_prefix(serving))).items
        md = wait_ready(control_plane, namespace, name)
        assert [n["name"] for n in md["status"]["nodes"]] == [survivor]
        assert md["status"]["endpoints"] == [victims[survivor].url]
    finally:
        control_plane.kubectl("delete", "modeldeployment", name, bystander, "-n", namespace,
                              "--ignore-not-found", "--timeout=60s")
        for v in victims.values():
            if v.process.alive():
                v.process.stop()


async def test_delete_removes_assignments_and_finalizer(control_plane: ControlPlane,
                                                        fleet: dict[str, AgentProcess],
                                                        fleet_keys: Keys, test_model_dir: Path, namespace: str) -> None:
    name = "e2e-delete"
    control_plane.kubectl("apply", "-f", "-", input=manifest(name, namespace, test_model_dir, replicas=2))
    md = wait_ready(control_plane, namespace, name)
    assert md["status"]["readyReplicas"] == 2
    assert "mlx-fleet.io/finalizer" in md["metadata"]["finalizers"]
    control_plane.kubectl("delete", "modeldeployment", name, "-n", namespace, "--wait=true", "--timeout=90s", timeout=100)
    assert control_plane.kubectl("get", "modeldeployment", name, "-n", namespace, check=False).returncode != 0
    async with EtcdStore(control_plane.etcd_url) as store:
        suffix = f"/{namespace}/{name}/v1"
        assert not [kv for kv in (await store.list(fleet_keys.assignments_prefix)).items
                    if kv.key.endswith(suffix)]
        # Agents unload it and withdraw their reports.
        await watch_until(store, fleet_keys.reports_prefix,
                           lambda v: not any(k.endswith(suffix) for k in v), timeout=60)
    for agent in fleet.values():
        async with aiohttp.ClientSession(base_url=agent.url) as http, http.get("/v1/models") as r:
            assert name not in [m["id"] for m in (await r.json())["data"]]



@pytest.mark.fault("operator SIGKILL mid-reconcile, then restart",
                   holds="the restarted operator converges to the state the spec asks for (a scale-up "
                         "made while it was down): one assignment per replica, both Ready, "
                         "observedGeneration current; no assignment written more than twice (etcd's "
                         "version of each key) (recovery: from the restart to 2 Ready)")
async def test_operator_killed_mid_reconcile_converges_after_restart(
        control_plane: ControlPlane, operator: dict, fleet: dict[str, AgentProcess], fleet_keys: Keys,
        test_model_dir: Path, namespace: str, fault_record: FaultRecord) -> None:
    name = "e2e-restart"
    control_plane.kubectl("apply", "-f", "-", input=manifest(name, namespace, test_model_dir))
    suffix = f"/{namespace}/{name}/v1"
    async with EtcdStore(control_plane.etcd_url) as store:
        # The operator has written the assignment but (typically) not yet folded Ready into
        # status: kill it there, as a crashed pod, with no chance to clean up.
        await watch_until(store, fleet_keys.assignments_prefix, lambda v: any(k.endswith(suffix) for k in v))
        operator["process"].kill()
        # While no operator runs, the user scales up.
        control_plane.kubectl("patch", "modeldeployment", name, "-n", namespace, "--type=merge",
                              "-p", '{"spec": {"replicas": 2}}')
        fault_record.fault_ended()
        operator["process"] = start_operator(control_plane, etcd_prefix=fleet_keys.root,
                                             extra_args=("--namespace", namespace))
        await watch_until(store, fleet_keys.reports_prefix,
                           lambda v: sum(k.endswith(suffix) and AssignmentReport.from_json(b).state
                                         is AssignmentState.READY for k, b in v.items()) == 2, timeout=120)
        fault_record.recovered()
        assigned = [kv for kv in (await store.list(fleet_keys.assignments_prefix)).items
                    if kv.key.endswith(suffix)]
        assert sorted(fleet_keys.parse_assignment(kv.key)[0] for kv in assigned) == ["mac-a", "mac-b"]
        # etcd counts the writes of each key since its creation: none beyond one retry
        writes = max(kv.version for kv in assigned)
        assert writes <= 2, [(kv.key, kv.version) for kv in assigned]
        fault_record.note(f"at most {writes} write(s) per assignment key")
    control_plane.kubectl("wait", "--for=jsonpath={.status.readyReplicas}=2", f"modeldeployment/{name}",
                          "-n", namespace, "--timeout=60s", timeout=70)
    md = wait_ready(control_plane, namespace, name)
    assert md["status"]["observedGeneration"] == md["metadata"]["generation"] == 2


def _metric(text: str, name: str, model: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("model") == model:
                return sample.value
    return 0.0


async def test_client_disconnect_stops_generation(control_plane: ControlPlane, fleet: dict[str, AgentProcess],
                                                  test_model_dir: Path, namespace: str) -> None:
    """A non-streaming client that hangs up must not leave its sequence decoding to max_tokens."""
    name = "e2e-disconnect"
    control_plane.kubectl("apply", "-f", "-", input=manifest(name, namespace, test_model_dir))
    endpoint = wait_ready(control_plane, namespace, name)["status"]["endpoints"][0]
    max_tokens = 3500

    async with aiohttp.ClientSession(base_url=endpoint) as http:
        async def metric(metric_name: str) -> float:
            async with http.get("/metrics") as r:
                return _metric(await r.text(), metric_name, name)

        async def hang_up_later() -> None:
            async with aiohttp.ClientSession(base_url=endpoint) as client, client.post(
                    "/v1/completions", json={"model": name, "prompt": "Tell a long story",
                                             "max_tokens": max_tokens, "temperature": 0}) as r:
                await r.read()

        request = asyncio.create_task(hang_up_later())
        occupancy = 0.0

        # /metrics is the only view from outside the process: poll it, gently.
        async def running() -> None:
            nonlocal occupancy
            while (occupancy := await metric("mlxfleet_agent_batch_occupancy")) < 1:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(running(), 30)
        request.cancel()  # closes the connection mid-generation
        with pytest.raises(asyncio.CancelledError):
            await request

        async def drained() -> None:
            nonlocal occupancy
            while (occupancy := await metric("mlxfleet_agent_batch_occupancy")) > 0:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(drained(), 60)
        generated = await metric("mlxfleet_agent_generated_tokens_total")
        assert 0 < generated < max_tokens / 2, generated
