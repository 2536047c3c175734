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
        lifecycle={"idleUnloadSeconds": 0, "prefetch": "OnDemand", "minReady": 3},
        strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 2, "maxUnavailable": "50%"}},
    )
    full["model"]["servedModelName"] = "llama"
    full["model"]["task"] = "TextGeneration"
    return [
        make("ok-minimal", base_spec()),
        make("ok-full", full),
        _with("ok-plain-path", "model.source", "/Users/shared/models/llama"),
        _with("ok-hf", "model.source", "hf://mlx-community/Llama-3.2-1B-Instruct-4bit"),
        _with("ok-https", "model.source", "https://example.com/models/llama.tar"),
        _with("ok-embedding", "model.task", "TextEmbedding"),
        _with("ok-revision-chars", "model.revision", "2024-01-01_rc.1"),
        _with("ok-revision-128", "model.revision", "r" * 128),
        _with("ok-replicas-zero", "replicas", 0),
        _with("ok-min-ready-one", "lifecycle.minReady", 1),  # replicas defaults to 1
        _with("ok-replicas-max", "replicas", 1000),
        _with("ok-memory-int", "resources.memory", 268435456),
        _with("ok-memory-decimal", "resources.memory", "1.5Gi"),
        _with("ok-memory-si", "resources.memory", "2G"),
        _with("ok-resources-missing", "resources", ...),  # memory from the agents' estimates
        _with("ok-memory-missing", "resources.memory", ...),
        _with("ok-serving-min", "serving", {"maxConcurrentSequences": 1, "maxContextTokens": 128}),
        _with("ok-served-name-chars", "model.servedModelName", "mlx-community/Llama-3.2:1b_v2.0"),
        _with("ok-served-name-128", "model.servedModelName", "n" * 128),
        _with("ok-node-selector-labels", "placement.nodeSelector", {
            "rack": "", "mlx-fleet.io/tier": "gold_1.a", "a" * 63: "v" * 63,
            f"{'p' * 253}/{'n' * 63}": "x"}),
        _with("ok-node-selector-64", "placement.nodeSelector", {f"k{i}": "v" for i in range(64)}),
        _with("ok-strategy-empty", "strategy", {}),
        _with("ok-strategy-no-surge", "strategy.rollingUpdate", {"maxSurge": 0, "maxUnavailable": 1}),
        _with("ok-strategy-no-unavailable", "strategy.rollingUpdate", {"maxSurge": "100%", "maxUnavailable": 0}),
        _with("ok-strategy-surge-only-zero", "strategy.rollingUpdate", {"maxSurge": 0}),
        _with("ok-strategy-percents", "strategy.rollingUpdate", {"maxSurge": "0%", "maxUnavailable": "100%"}),
        _with("ok-strategy-big-surge", "strategy.rollingUpdate", {"maxSurge": "999%"}),
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
        (_with("bad-task", "model.task", "embed"), "spec.model.task"),
        (_with("bad-min-ready-negative", "lifecycle.minReady", -1), "spec.lifecycle.minReady"),
        (_with("bad-min-ready-over-default-replicas", "lifecycle.minReady", 2),
         "spec.lifecycle.minReady"),
        (make("bad-min-ready-over-replicas", {**base_spec(), "replicas": 2,
                                              "lifecycle": {"minReady": 3}}),
         "spec.lifecycle.minReady"),
        (_with("bad-served-name-empty", "model.servedModelName", ""), "spec.model.servedModelName"),
        (_with("bad-served-name-too-long", "model.servedModelName", "n" * 129), "spec.model.servedModelName"),
        (_with("bad-served-name-chars", "model.servedModelName", "my model!"), "spec.model.servedModelName"),
        (_with("bad-served-name-leading-dash", "model.servedModelName", "-llama"), "spec.model.servedModelName"),
        (_with("bad-source-too-long", "model.source", "/" + "m" * 2048), "spec.model.source"),
        (_with("bad-node-selector-key", "placement.nodeSelector", {"bad key": "a"}),
         "spec.placement.nodeSelector"),
        (_with("bad-node-selector-key-long-name", "placement.nodeSelector", {"a" * 64: "a"}),
         "spec.placement.nodeSelector"),
        (_with("bad-node-selector-key-long-prefix", "placement.nodeSelector", {f"{'p' * 254}/n": "a"}),
         "spec.placement.nodeSelector"),
        (_with("bad-node-selector-value-long", "placement.nodeSelector", {"rack": "v" * 64}),
         "spec.placement.nodeSelector"),
        (_with("bad-node-selector-value-chars", "placement.nodeSelector", {"rack": "a b"}),
         "spec.placement.nodeSelector"),
        (_with("bad-node-selector-too-many", "placement.nodeSelector", {f"k{i}": "v" for i in range(65)}),
         "spec.placement.nodeSelector"),
        (_with("bad-strategy-type", "strategy.type", "Recreate"), "spec.strategy.type"),
        (_with("bad-strategy-string", "strategy", "RollingUpdate"), "spec.strategy"),
        (_with("bad-strategy-both-zero", "strategy.rollingUpdate", {"maxSurge": 0, "maxUnavailable": 0}),
         "spec.strategy.rollingUpdate"),
        (_with("bad-strategy-both-zero-percent", "strategy.rollingUpdate",
               {"maxSurge": "0%", "maxUnavailable": "0%"}), "spec.strategy.rollingUpdate"),
        (_with("bad-surge-negative", "strategy.rollingUpdate.maxSurge", -1), "spec.strategy.rollingUpdate.maxSurge"),
        (_with("bad-surge-no-percent", "strategy.rollingUpdate.maxSurge", "25"),
         "spec.strategy.rollingUpdate.maxSurge"),
        (_with("bad-surge-garbage", "strategy.rollingUpdate.maxSurge", "a lot"),
         "spec.strategy.rollingUpdate.maxSurge"),
        (_with("bad-surge-too-big", "strategy.rollingUpdate.maxSurge", "1000%"),
         "spec.strategy.rollingUpdate.maxSurge"),
        (_with("bad-surge-float", "strategy.rollingUpdate.maxSurge", 1.5), "spec.strategy.rollingUpdate.maxSurge"),
        (_with("bad-unavailable-negative", "strategy.rollingUpdate.maxUnavailable", -2),
         "spec.strategy.rollingUpdate.maxUnavailable"),
        (_with("bad-unavailable-over-100", "strategy.rollingUpdate.maxUnavailable", "101%"),
         "spec.strategy.rollingUpdate.maxUnavailable"),
        (_with("bad-unavailable-fraction", "strategy.rollingUpdate.maxUnavailable", "12.5%"),
         "spec.strategy.rollingUpdate.maxUnavailable"),
    ]
