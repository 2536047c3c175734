"""ModelDeployment objects the CRD schema must accept or refuse, shared by the pure schema tests
(tests/test_crds.py) and the integration test that applies them to a real kube-apiserver.

Each refused object comes with the field path the API server's error must name, e.g.
``spec.replicas``: the error of a refused ``kubectl apply`` reads
``ModelDeployment.mlx-fleet.io "bad-replicas-negative" is invalid: spec.replicas: Invalid value: ...``.
Every object has a unique ``metadata.name`` (usable as a test id) in namespace ``default``.
Plain data only: no imports beyond the standard library.
"""

from __future__ import annotations

import copy
from typing import Any

API_VERSION = "mlx-fleet.io/v1alpha1"
KIND = "ModelDeployment"
NAMESPACE = "default"


def base_spec() -> dict[str, Any]:
    """The smallest valid spec: only the required fields."""
    return {
        "model": {"source": "file:///models/llama-demo", "revision": "v1"},
        "resources": {"memory": "256Mi"},
    }


def make(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A ModelDeployment object named ``name`` in :data:`NAMESPACE` with ``spec``."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


def _with(name: str, path: str, value: Any) -> dict[str, Any]:
    """:func:`base_spec` with the dotted ``path`` set to ``value`` (``...`` deletes it)."""
    spec = copy.deepcopy(base_spec())
    *parents, leaf = path.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    if value is ...:
        del node[leaf]
    else:
        node[leaf] = value
    return make(name, spec)


def valid_examples() -> list[dict[str, Any]]:
    """Objects the API server must accept."""
    full = base_spec()
    full.update(
        replicas=3,
        placement={"nodeSelector": {"mlx-fleet.io/rack": "a"}, "minChipGeneration": "M4",
                   "strategy": "Binpack"},
        serving={"maxConcurrentSequences": 256, "maxContextTokens": 1048576},
        lifecycle={"idleUnloadSeconds": 0, "prefetch": "OnDemand"},
    )
    full["model"]["servedModelName"] = "llama"
    return [
        make("ok-minimal", base_spec()),
        make("ok-full", full),
        _with("ok-plain-path", "model.source", "/Users/shared/models/llama"),
        _with("ok-hf", "model.source", "hf://mlx-community/Llama-3.2-1B-Instruct-4bit"),
        _with("ok-https", "model.source", "https://example.com/models/llama.tar"),
        _with("ok-revision-chars", "model.revision", "2024-01-01_rc.1"),
        _with("ok-revision-128", "model.revision", "r" * 128),
        _with("ok-replicas-zero", "replicas", 0),
        _with("ok-replicas-max", "replicas", 1000),
        _with("ok-memory-int", "resources.memory", 268435456),
        _with("ok-memory-decimal", "resources.memory", "1.5Gi"),
        _with("ok-memory-si", "resources.memory", "2G"),
        _with("ok-serving-min", "serving", {"maxConcurrentSequences": 1, "maxContextTokens": 128}),
    ]


def invalid_examples() -> list[tuple[dict[str, Any], str]]:
    """``(object, field)`` pairs: the API server must refuse ``object`` naming ``field``."""
    return [
        (_with("bad-model-missing", "model", ...), "spec.model"),
        (_with("bad-source-missing", "model.source", ...), "spec.model.source"),
        (_with("bad-source-relative", "model.source", "models/llama"), "spec.model.source"),
        (_with("bad-source-s3", "model.source", "s3://bucket/llama"), "spec.model.source"),
        (_with("bad-source-hf-no-repo", "model.source", "hf://mlx-community"), "spec.model.source"),
        (_with("bad-source-http", "model.source", "http://example.com/llama"), "spec.model.source"),
        (_with("bad-source-unsubstituted", "model.source", "file://${MODEL_DIR}"), "spec.model.source"),
        (_with("bad-revision-missing", "model.revision", ...), "spec.model.revision"),
        (_with("bad-revision-empty", "model.revision", ""), "spec.model.revision"),
        (_with("bad-revision-chars", "model.revision", "v1 beta!"), "spec.model.revision"),
        (_with("bad-revision-too-long", "model.revision", "r" * 129), "spec.model.revision"),
        (_with("bad-replicas-negative", "replicas", -1), "spec.replicas"),
        (_with("bad-replicas-too-many", "replicas", 1001), "spec.replicas"),
        (_with("bad-replicas-string", "replicas", "two"), "spec.replicas"),
        (_with("bad-resources-missing", "resources", ...), "spec.resources"),
        (_with("bad-memory-missing", "resources.memory", ...), "spec.resources.memory"),
        (_with("bad-memory-lots", "resources.memory", "lots"), "spec.resources.memory"),
        (_with("bad-memory-unit", "resources.memory", "2GB"), "spec.resources.memory"),
        (_with("bad-memory-zero", "resources.memory", "0"), "spec.resources.memory"),
        (_with("bad-memory-zero-int", "resources.memory", 0), "spec.resources.memory"),
        (_with("bad-memory-negative", "resources.memory", "-1Gi"), "spec.resources.memory"),
        (_with("bad-chip-m2", "placement.minChipGeneration", "M2"), "spec.placement.minChipGeneration"),
        (_with("bad-strategy", "placement.strategy", "Random"), "spec.placement.strategy"),
        (_with("bad-node-selector-value", "placement.nodeSelector", {"rack": 1}),
         "spec.placement.nodeSelector"),
        (_with("bad-sequences-zero", "serving.maxConcurrentSequences", 0),
         "spec.serving.maxConcurrentSequences"),
        (_with("bad-sequences-too-many", "serving.maxConcurrentSequences", 257),
         "spec.serving.maxConcurrentSequences"),
        (_with("bad-context-too-small", "serving.maxContextTokens", 127), "spec.serving.maxContextTokens"),
        (_with("bad-context-too-large", "serving.maxContextTokens", 1048577),
         "spec.serving.maxContextTokens"),
        (_with("bad-idle-negative", "lifecycle.idleUnloadSeconds", -1), "spec.lifecycle.idleUnloadSeconds"),
        (_with("bad-prefetch", "lifecycle.prefetch", "Lazy"), "spec.lifecycle.prefetch"),
    ]
