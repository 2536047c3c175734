"""Embeddings end to end on real parts (issue 20 §4): etcd + kube-apiserver, the operator
process, an agent process and the fleet router process. A ModelDeployment with
``spec.model.task: TextEmbedding`` over the generated embedding model is placed, loaded and
Ready like any other; the official ``openai`` client through the router gets a batch's vectors
equal to one input at a time, unit length; a chat request to it is the agent's 400
``wrong_model_task``, relayed."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import numpy as np
import openai
import pytest

from fleet_helpers import manifest, wait_ready
from mlx_fleet.contract import Keys
from mlx_fleet.devcluster.controlplane import ControlPlane
from mlx_fleet.devcluster.fleet import AgentProcess, RouterProcess, start_agent, start_operator, \
    start_router
from mlx_fleet.devcluster.processes import ManagedProcess
from mlx_fleet.testmodel import make_test_model

pytestmark = pytest.mark.integration

NAME = "embed-e2e"
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "a",
         "Kubernetes schedules workloads onto nodes."]


@pytest.fixture(scope="module")
def fleet_keys() -> Keys:
    return Keys(f"/mlx-fleet-embed-e2e/{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
def operator(control_plane: ControlPlane, fleet_keys: Keys, namespace: str
             ) -> Iterator[ManagedProcess]:
    proc = start_operator(control_plane, etcd_prefix=fleet_keys.root,
                          extra_args=("--namespace", namespace), log_name="operator-embed")
    yield proc
    control_plane.kubectl("delete", "modeldeployments", "--all", "-n", namespace, "--wait=true",
                          "--timeout=60s", check=False, timeout=70)
    proc.stop()


@pytest.fixture(scope="module")
def agent(control_plane: ControlPlane, fleet_keys: Keys, operator: ManagedProcess
          ) -> Iterator[AgentProcess]:
    a = start_agent(control_plane, "emac-1", etcd_prefix=fleet_keys.root, memory="64Gi",
                    labels={"agent.mlx-fleet.io/pool": "embed"})
    yield a
    a.process.stop()


@pytest.fixture(scope="module")
def router(control_plane: ControlPlane, fleet_keys: Keys, namespace: str,
           agent: AgentProcess) -> Iterator[RouterProcess]:
    proc = start_router(control_plane, etcd_prefix=fleet_keys.root, namespaces=(namespace,),
                        log_name="router-embed")
    yield proc
    proc.process.stop()


async def test_an_embedding_deployment_serves_embeddings_through_the_router(
        control_plane: ControlPlane, agent: AgentProcess, router: RouterProcess,
        namespace: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = make_test_model(tmp_path_factory.mktemp("models") / "emb", embedding=True)
    obj = json.loads(manifest(NAME, namespace, model_dir, selector={"agent.mlx-fleet.io/pool": "embed"}))
    obj["spec"]["model"]["task"] = "TextEmbedding"
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(obj))
    md = await asyncio.to_thread(wait_ready, control_plane, namespace, NAME)
    assert md["status"]["readyReplicas"] == 1

    client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    try:
        while NAME not in {m.id async for m in client.models.list()}:
            await asyncio.sleep(0.1)   # the router follows etcd: the replica joins its table
        batch = await client.embeddings.create(model=NAME, input=TEXTS)
        got = np.array([d.embedding for d in batch.data], dtype=np.float32)
        singles = np.array([(await client.embeddings.create(model=NAME, input=t)).data[0]
                            .embedding for t in TEXTS], dtype=np.float32)
        np.testing.assert_allclose(got, singles, atol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        assert batch.usage.prompt_tokens > len(TEXTS)
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "hi"}])
        assert e.value.code == "wrong_model_task" and e.value.param == "model"
    finally:
        await client.close()
