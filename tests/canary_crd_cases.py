"""Canary objects the CRD schema must accept or refuse, shared by the pure schema tests and the
integration tests that apply them to a real kube-apiserver (both in tests/test_canary_crd.py).

Each refused object comes with the field path the API server's error must name, e.g.
``spec.steps[0].pause.duration``: the error of a refused ``kubectl apply`` reads
``Canary.mlx-fleet.io "bad-pause-zero" is invalid: spec.steps[0].pause.duration: Invalid value: ...``.
Every object has a unique ``metadata.name`` (usable as a test id) in namespace ``default``.
Plain data only: no imports beyond the standard library.
"""

from __future__ import annotations

import copy
from typing import Any

API_VERSION = "mlx-fleet.io/v1alpha1"
KIND = "Canary"
NAMESPACE = "default"


def base_spec() -> dict[str, Any]:
    """The smallest valid spec: only the required fields."""
    return {"targetRef": {"name": "llama-demo"}, "candidate": {"revision": "v2"}}


def full_spec() -> dict[str, Any]:
    """A spec that sets every field."""
    return {
        "targetRef": {"name": "llama-demo"},
        "candidate": {"revision": "v2", "source": "file:///models/llama-demo-v2", "memory": "512Mi"},
        "steps": [
            {"setWeight": 1}, {"pause": {"duration": "30s"}},
            {"setWeight": 10}, {"pause": {"duration": "1m30s"}},
            {"setWeight": 50}, {"pause": {}},
            {"setWeight": 100},
        ],
        "analysis": {
            "interval": "30s", "minRequests": 50, "failureLimit": 2,
            "checks": {
                "errorRate": {"enabled": True, "maxRatio": 3, "floor": 0.02, "max": 0.05},
                "latencyP95": {"enabled": True, "maxRatio": 1.2, "maxSeconds": 4.5},
                "ttftP95": {"enabled": False, "maxRatio": 2.0, "maxSeconds": 0.8},
                "tokensPerSecond": {"enabled": True, "minRatio": 0.8, "min": 12.5},
                "memoryGrowth": {"enabled": True, "maxPerHour": 0.1},
                "crashRate": {"enabled": True, "max": 0.0},
            },
            "localGuard": {"enabled": True, "window": "10s", "minFailures": 5, "failureRatio": 1},
        },
    }


def make(name: str, spec: dict[str, Any] | None) -> dict[str, Any]:
    """A Canary object named ``name`` in :data:`NAMESPACE` with ``spec`` (None: no spec)."""
    obj: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND,
                           "metadata": {"name": name, "namespace": NAMESPACE}}
    if spec is not None:
        obj["spec"] = spec
    return obj


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


def _steps(name: str, *steps: Any) -> dict[str, Any]:
    return _with(name, "steps", list(steps))


def _pause(name: str, duration: Any) -> dict[str, Any]:
    return _steps(name, {"setWeight": 10}, {"pause": {"duration": duration}})


def valid_examples() -> list[dict[str, Any]]:
    """Objects the API server must accept."""
    return [
        make("ok-minimal", base_spec()),
        make("ok-full", full_spec()),
        _with("ok-target-dotted", "targetRef.name", "llama.demo-2"),
        _with("ok-target-253", "targetRef.name", ".".join(["a" * 63] * 4)[:253].rstrip(".")),
        _with("ok-revision-chars", "candidate.revision", "2024-01-01_rc.1"),
        _with("ok-revision-128", "candidate.revision", "r" * 128),
        _with("ok-source-hf", "candidate.source", "hf://mlx-community/Llama-3.2-1B-Instruct-4bit"),
        _with("ok-source-path", "candidate.source", "/Users/shared/models/llama-v2"),
        _with("ok-memory-int", "candidate.memory", 536870912),
        _with("ok-memory-decimal", "candidate.memory", "1.5Gi"),
        _steps("ok-steps-empty"),
        _steps("ok-steps-manual-pause", {"setWeight": 10}, {"pause": {}}, {"setWeight": 100}),
        _steps("ok-steps-equal-weights", {"setWeight": 10}, {"setWeight": 10}, {"setWeight": 100}),
        _steps("ok-steps-zero-weight", {"setWeight": 0}, {"pause": {"duration": "1m"}}),
        _steps("ok-steps-only-pauses", {"pause": {"duration": "1h"}}, {"pause": {}}),
        _with("ok-steps-32", "steps", [{"setWeight": min(i * 4, 100)} for i in range(32)]),
        _pause("ok-duration-ms", "500ms"),
        _pause("ok-duration-compound", "1h2m3s"),
        _pause("ok-duration-decimal", "1.5h"),
        _pause("ok-duration-zero-part", "0h1s"),
        _with("ok-interval-ms", "analysis.interval", "250ms"),
        _with("ok-thresholds-edges", "analysis", {
            "minRequests": 1, "failureLimit": 1,
            "checks": {"errorRate": {"floor": 0, "max": 1}, "tokensPerSecond": {"minRatio": 1},
                       "crashRate": {"max": 1}},
            "localGuard": {"minFailures": 1, "failureRatio": 1}}),
        _with("ok-thresholds-small", "analysis", {
            "checks": {"errorRate": {"maxRatio": 0.001, "floor": 0.0},
                       "latencyP95": {"maxRatio": 0.5, "maxSeconds": 0.001},
                       "tokensPerSecond": {"minRatio": 0.01, "min": 0.1},
                       "memoryGrowth": {"maxPerHour": 0.001}, "crashRate": {"max": 0}}}),
        _with("ok-checks-disabled", "analysis.checks", {
            name: {"enabled": False} for name in
            ("errorRate", "latencyP95", "ttftP95", "tokensPerSecond", "memoryGrowth", "crashRate")}),
        _with("ok-guard-disabled", "analysis.localGuard", {"enabled": False}),
    ]


def invalid_examples() -> list[tuple[dict[str, Any], str]]:
    """``(object, field)`` pairs: the API server must refuse ``object`` naming ``field``."""
    return [
        (make("bad-spec-missing", None), "spec"),
        # targetRef
        (_with("bad-target-missing", "targetRef", ...), "spec.targetRef"),
        (_with("bad-target-string", "targetRef", "llama-demo"), "spec.targetRef"),
        (_with("bad-target-name-missing", "targetRef.name", ...), "spec.targetRef.name"),
        (_with("bad-target-name-empty", "targetRef.name", ""), "spec.targetRef.name"),
        (_with("bad-target-name-upper", "targetRef.name", "Llama-Demo"), "spec.targetRef.name"),
        (_with("bad-target-name-slash", "targetRef.name", "default/llama-demo"), "spec.targetRef.name"),
        (_with("bad-target-name-int", "targetRef.name", 7), "spec.targetRef.name"),
        (_with("bad-target-name-too-long", "targetRef.name", "a" * 254), "spec.targetRef.name"),
        # candidate
        (_with("bad-candidate-missing", "candidate", ...), "spec.candidate"),
        (_with("bad-revision-missing", "candidate.revision", ...), "spec.candidate.revision"),
        (_with("bad-revision-empty", "candidate.revision", ""), "spec.candidate.revision"),
        (_with("bad-revision-chars", "candidate.revision", "v2 final!"), "spec.candidate.revision"),
        (_with("bad-revision-too-long", "candidate.revision", "r" * 129), "spec.candidate.revision"),
        (_with("bad-revision-int", "candidate.revision", 2), "spec.candidate.revision"),
        (_with("bad-source-relative", "candidate.source", "models/llama"), "spec.candidate.source"),
        (_with("bad-source-s3", "candidate.source", "s3://bucket/llama"), "spec.candidate.source"),
        (_with("bad-source-empty", "candidate.source", ""), "spec.candidate.source"),
        (_with("bad-source-too-long", "candidate.source", "/" + "m" * 2048), "spec.candidate.source"),
        (_with("bad-memory-lots", "candidate.memory", "lots"), "spec.candidate.memory"),
        (_with("bad-memory-zero", "candidate.memory", "0"), "spec.candidate.memory"),
        (_with("bad-memory-zero-int", "candidate.memory", 0), "spec.candidate.memory"),
        (_with("bad-memory-negative", "candidate.memory", "-1Gi"), "spec.candidate.memory"),
        # steps: shape
        (_with("bad-steps-string", "steps", "1,10,50,100"), "spec.steps"),
        (_with("bad-steps-too-many", "steps", [{"setWeight": 50}] * 33), "spec.steps"),
        (_steps("bad-step-both", {"setWeight": 10, "pause": {"duration": "1m"}}), "spec.steps[0]"),
        (_steps("bad-step-empty", {"setWeight": 10}, {}), "spec.steps[1]"),
        (_steps("bad-step-unknown-shape", {"weight": 50}), "spec.steps[0]"),
        (_steps("bad-step-int", 50), "spec.steps[0]"),
        (_steps("bad-step-pause-string", {"pause": "30s"}), "spec.steps[0].pause"),
        # steps: weights
        (_steps("bad-weight-negative", {"setWeight": -1}), "spec.steps[0].setWeight"),
        (_steps("bad-weight-over-100", {"setWeight": 10}, {"setWeight": 101}), "spec.steps[1].setWeight"),
        (_steps("bad-weight-string", {"setWeight": "50%"}), "spec.steps[0].setWeight"),
        (_steps("bad-weight-float", {"setWeight": 12.5}), "spec.steps[0].setWeight"),
        (_steps("bad-weights-decreasing", {"setWeight": 50}, {"setWeight": 10}), "spec.steps"),
        (_steps("bad-weights-decreasing-across-pause", {"setWeight": 10}, {"pause": {}},
                {"setWeight": 5}), "spec.steps"),
        (_steps("bad-weights-decreasing-at-end", {"setWeight": 1}, {"setWeight": 10},
                {"setWeight": 100}, {"setWeight": 0}), "spec.steps"),
        # steps: pause durations
        (_pause("bad-pause-zero", "0s"), "spec.steps[1].pause.duration"),
        (_pause("bad-pause-zero-compound", "0h0m0s"), "spec.steps[1].pause.duration"),
        (_pause("bad-pause-negative", "-5s"), "spec.steps[1].pause.duration"),
        (_pause("bad-pause-garbage", "soon"), "spec.steps[1].pause.duration"),
        (_pause("bad-pause-no-unit", "30"), "spec.steps[1].pause.duration"),
        (_pause("bad-pause-days", "1d"), "spec.steps[1].pause.duration"),
        (_pause("bad-pause-spaces", "1m 30s"), "spec.steps[1].pause.duration"),
        (_pause("bad-pause-empty", ""), "spec.steps[1].pause.duration"),
        (_pause("bad-pause-int", 30), "spec.steps[1].pause.duration"),
        (_pause("bad-pause-too-long", "1s" * 17), "spec.steps[1].pause.duration"),
        (_pause("bad-pause-overflow", "3000000h"), "spec.steps[1].pause.duration"),
        # analysis
        (_with("bad-analysis-string", "analysis", "strict"), "spec.analysis"),
        (_with("bad-interval-zero", "analysis.interval", "0ms"), "spec.analysis.interval"),
        (_with("bad-interval-garbage", "analysis.interval", "often"), "spec.analysis.interval"),
        (_with("bad-interval-int", "analysis.interval", 10), "spec.analysis.interval"),
        (_with("bad-min-requests-zero", "analysis.minRequests", 0), "spec.analysis.minRequests"),
        (_with("bad-min-requests-string", "analysis.minRequests", "20"), "spec.analysis.minRequests"),
        (_with("bad-failure-limit-zero", "analysis.failureLimit", 0), "spec.analysis.failureLimit"),
        (_with("bad-error-max-ratio-zero", "analysis.checks.errorRate.maxRatio", 0),
         "spec.analysis.checks.errorRate.maxRatio"),
        (_with("bad-error-floor-over-one", "analysis.checks.errorRate.floor", 1.5),
         "spec.analysis.checks.errorRate.floor"),
        (_with("bad-error-floor-negative", "analysis.checks.errorRate.floor", -0.1),
         "spec.analysis.checks.errorRate.floor"),
        (_with("bad-error-max-over-one", "analysis.checks.errorRate.max", 2),
         "spec.analysis.checks.errorRate.max"),
        (_with("bad-error-enabled-string", "analysis.checks.errorRate.enabled", "yes"),
         "spec.analysis.checks.errorRate.enabled"),
        (_with("bad-latency-max-ratio-negative", "analysis.checks.latencyP95.maxRatio", -1),
         "spec.analysis.checks.latencyP95.maxRatio"),
        (_with("bad-latency-max-seconds-zero", "analysis.checks.latencyP95.maxSeconds", 0),
         "spec.analysis.checks.latencyP95.maxSeconds"),
        (_with("bad-ttft-max-ratio-string", "analysis.checks.ttftP95.maxRatio", "1.5x"),
         "spec.analysis.checks.ttftP95.maxRatio"),
        (_with("bad-ttft-max-seconds-negative", "analysis.checks.ttftP95.maxSeconds", -2),
         "spec.analysis.checks.ttftP95.maxSeconds"),
        (_with("bad-tps-min-ratio-over-one", "analysis.checks.tokensPerSecond.minRatio", 1.2),
         "spec.analysis.checks.tokensPerSecond.minRatio"),
        (_with("bad-tps-min-ratio-zero", "analysis.checks.tokensPerSecond.minRatio", 0),
         "spec.analysis.checks.tokensPerSecond.minRatio"),
        (_with("bad-tps-min-zero", "analysis.checks.tokensPerSecond.min", 0),
         "spec.analysis.checks.tokensPerSecond.min"),
        (_with("bad-memory-growth-zero", "analysis.checks.memoryGrowth.maxPerHour", 0),
         "spec.analysis.checks.memoryGrowth.maxPerHour"),
        (_with("bad-crash-max-over-one", "analysis.checks.crashRate.max", 1.01),
         "spec.analysis.checks.crashRate.max"),
        (_with("bad-crash-max-negative", "analysis.checks.crashRate.max", -0.001),
         "spec.analysis.checks.crashRate.max"),
        (_with("bad-guard-window-zero", "analysis.localGuard.window", "0s"), "spec.analysis.localGuard.window"),
        (_with("bad-guard-window-garbage", "analysis.localGuard.window", "5 seconds"),
         "spec.analysis.localGuard.window"),
        (_with("bad-guard-min-failures-zero", "analysis.localGuard.minFailures", 0),
         "spec.analysis.localGuard.minFailures"),
        (_with("bad-guard-ratio-zero", "analysis.localGuard.failureRatio", 0),
         "spec.analysis.localGuard.failureRatio"),
        (_with("bad-guard-ratio-over-one", "analysis.localGuard.failureRatio", 1.01),
         "spec.analysis.localGuard.failureRatio"),
        (_with("bad-guard-enabled-int", "analysis.localGuard.enabled", 1), "spec.analysis.localGuard.enabled"),
    ]
