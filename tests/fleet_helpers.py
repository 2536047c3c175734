"""Helpers shared by the tests: wait on etcd state through a real watch, and node records and
assignments as an agent or the operator would write them. Imported as
``from fleet_helpers import ...``."""

from __future__ import annotations

import asyncio
import json
import string
from collections.abc import Callable
from pathlib import Path

import pytest

from mlx_fleet.contract import Assignment, Keys, ModelSource, NodeCapacity, NodeRecord
from mlx_fleet.devcluster.controlplane import ControlPlane
from mlx_fleet.store import Snapshot, Store, WatchEvent, follow_prefix

GiB = 1024**3
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "modeldeployment.yaml"


async def watch_until(store: Store, prefix: str, predicate: Callable[[dict[str, bytes]], bool],
                      timeout: float = 60.0) -> dict[str, bytes]:
    """Follow ``prefix`` (list, then watch) until ``predicate(key → value)`` holds; return that
    view. Raises ``TimeoutError`` after ``timeout`` seconds."""
    view: dict[str, bytes] = {}
    done = asyncio.Event()

    async def on_snapshot(snap: Snapshot) -> None:
        view.clear()
        view.update({kv.key: kv.value for kv in snap.items})
        if predicate(view):
            done.set()

    async def on_event(ev: WatchEvent) -> None:
        if ev.type == "PUT":
            view[ev.kv.key] = ev.kv.value
        else:
            view.pop(ev.kv.key, None)
        if predicate(view):
            done.set()

    task = asyncio.create_task(follow_prefix(store, prefix, on_snapshot, on_event))
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    return dict(view)


async def until_assignments(store: Store, keys: Keys, predicate: Callable[[dict[str, Assignment]], bool],
                            timeout: float = 60.0) -> dict[str, Assignment]:
    """:func:`watch_until` over ``assignments/``, seen as node → assignment (one deployment)."""

    def by_node(raw: dict[str, bytes]) -> dict[str, Assignment]:
        return {keys.parse_assignment(k)[0]: Assignment.from_json(v) for k, v in raw.items()}

    return by_node(await watch_until(store, keys.assignments_prefix,
                                     lambda raw: predicate(by_node(raw)), timeout))


def node_record(name: str, *, chip: str = "Apple M4 Max", generation: int = 4,
                memory_gib: int = 64) -> NodeRecord:
    """A simulated Mac's node record, as its agent would register it."""
    return NodeRecord(name=name, address=f"http://{name}.local:8000",
                      capacity=NodeCapacity(memory_total_bytes=memory_gib * GiB,
                                            memory_available_bytes=(memory_gib - 4) * GiB,
                                            chip=chip, chip_generation=generation, simulated=True))


def stub_manifest(name: str, namespace: str, *, replicas: int = 1,
                  placement: dict | None = None) -> str:
    """A ModelDeployment for simulated Macs (node records only: no agent loads it), as JSON
    for ``kubectl apply -f -``: 1 GiB per replica, so placement needs no estimate."""
    spec: dict = {"model": {"source": "file:///models/tiny-llama", "revision": "v1"},
                  "replicas": replicas, "resources": {"memory": "1Gi"}}
    if placement:
        spec["placement"] = placement
    return json.dumps({"apiVersion": "mlx-fleet.io/v1alpha1", "kind": "ModelDeployment",
                       "metadata": {"name": name, "namespace": namespace}, "spec": spec})


def manifest(name: str, namespace: str, model_dir: Path, *, replicas: int = 1, selector: dict[str, str] | None = None) -> str:
    """The shipped example, renamed, pointed at the generated model, optionally re-scoped."""
    obj_text = string.Template(EXAMPLE.read_text()).safe_substitute(MODEL_DIR=str(model_dir))
    import yaml

    obj = yaml.safe_load(obj_text)
    obj["metadata"]["name"] = name
    obj["metadata"]["namespace"] = namespace
    obj["spec"]["model"]["servedModelName"] = name
    obj["spec"]["replicas"] = replicas
    if selector:
        obj["spec"].setdefault("placement", {})["nodeSelector"] = selector
    return json.dumps(obj)


def get_md(cp: ControlPlane, namespace: str, name: str) -> dict:
    return json.loads(cp.kubectl("get", "modeldeployment", name, "-n", namespace, "-o", "json").stdout)


def wait_ready(cp: ControlPlane, namespace: str, name: str, timeout: int = 180) -> dict:
    """``kubectl wait`` on the Ready condition (the API server pushes the change; no polling).
    On a timeout the failure says why: the object's conditions and per-node status."""
    done = cp.kubectl("wait", "--for=condition=Ready", f"modeldeployment/{name}", "-n",
                      namespace, f"--timeout={timeout}s", timeout=timeout + 10, check=False)
    md = get_md(cp, namespace, name)
    if done.returncode != 0:
        status = md.get("status", {})
        raise AssertionError(f"modeldeployment/{name} not Ready in {timeout}s: conditions "
                             f"{json.dumps(status.get('conditions'))}, nodes "
                             f"{json.dumps(status.get('nodes'))}")
    return md


def stored_assignment(ns: str, name: str, uid: str) -> bytes:
    """A stored assignment of ``ns/name`` (object ``uid``), revision v1, 1 GiB (JSON)."""
    return Assignment(namespace=ns, name=name, uid=uid, served_model_name=name,
                      source=ModelSource(uri="/m", revision="v1"), memory_bytes=GiB).to_json()


def asg_key(keys: Keys, node: str, ns: str, name: str) -> str:
    """The key of :func:`stored_assignment` (revision v1)."""
    return keys.assignment(node, ns, name, "v1")
