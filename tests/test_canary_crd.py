"""The Canary CRD (crds/mlx-fleet.io_canaries.yaml): structure, defaults and bounds, the shared
cases of tests/canary_crd_cases.py through the pure validator of tests/test_crds.py, and the same
cases, the example and the status subresource against a real kube-apiserver (``integration``).

As in tests/test_crds.py, the pure validator runs each CEL rule's Python ``check``, declared beside
the rule in the types the CRD is generated from (canary_spec.py, and spec.py for the rules the
two resources share); the real API server evaluates the rules themselves (its CEL list library's
``isSorted`` included).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from canary_crd_cases import base_spec, full_spec, invalid_examples, make, valid_examples
from mlx_fleet_operator.canary_spec import go_duration_ns
from mlx_fleet_operator.crd.canary import CANARY
from mlx_fleet_operator.crd.modeldeployment import MODEL_DEPLOYMENT
from test_crds import apply_defaults, named_errors, validate

REPO = Path(__file__).resolve().parents[1]
CRD_PATH = REPO / "crds" / "mlx-fleet.io_canaries.yaml"
MD_CRD_PATH = REPO / "crds" / "mlx-fleet.io_modeldeployments.yaml"
EXAMPLE = REPO / "examples" / "canary.yaml"


def _load(path: Path) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert len(docs) == 1, f"{path.name} holds exactly one document"
    return docs[0]


CRD = _load(CRD_PATH)
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SPEC = SCHEMA["properties"]["spec"]
STATUS = SCHEMA["properties"]["status"]
MD_SCHEMA = _load(MD_CRD_PATH)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def prop(path: str, schema: dict[str, Any] = SCHEMA) -> dict[str, Any]:
    """The schema node at dotted ``path`` below the root; ``[]`` steps into array items."""
    node = schema
    for key in path.split("."):
        node = node["items"] if key == "[]" else node["properties"][key]
    return node


def _walk(schema: dict[str, Any], path: str = ""):
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}" if path else key)
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


# --- The CEL rules' Python checks, from the types the CRD is generated from -----------------------

DURATION_RE = "^([0-9]+([.][0-9]+)?(ms|s|m|h))+$"

#: CEL rule text → its Python check (declared beside the rule, in canary_spec.py / spec.py).
CEL_EQUIVALENTS = {r.rule: r.check for r in CANARY.rules()}


def validate_object(obj: dict[str, Any]) -> list[str]:
    return validate(SCHEMA, apply_defaults(SCHEMA, obj), cel=CEL_EQUIVALENTS)


# --- Structure ---------------------------------------------------------------------------------

def test_identity_names_and_scope() -> None:
    assert CRD["apiVersion"] == "apiextensions.k8s.io/v1"
    assert CRD["kind"] == "CustomResourceDefinition"
    assert CRD["metadata"]["name"] == "canaries.mlx-fleet.io"
    spec = CRD["spec"]
    assert (spec["group"], spec["scope"]) == ("mlx-fleet.io", "Namespaced")
    assert spec["names"] == {
        "kind": "Canary", "listKind": "CanaryList", "plural": "canaries", "singular": "canary",
        "shortNames": ["can"], "categories": ["mlx-fleet"],
    }


def test_single_served_storage_version_with_status_subresource() -> None:
    assert [v["name"] for v in CRD["spec"]["versions"]] == ["v1alpha1"]
    assert VERSION["served"] is True and VERSION["storage"] is True
    assert VERSION["subresources"] == {"status": {}}


def test_printer_columns() -> None:
    cols = {c["name"]: (c["type"], c["jsonPath"]) for c in VERSION["additionalPrinterColumns"]}
    assert cols == {
        "Target": ("string", ".spec.targetRef.name"),
        "Candidate": ("string", ".spec.candidate.revision"),
        "Weight": ("integer", ".status.currentWeight"),
        "Phase": ("string", ".status.phase"),
        "Age": ("date", ".metadata.creationTimestamp"),
    }
    assert list(cols) == ["Target", "Candidate", "Weight", "Phase", "Age"]


def test_every_field_has_a_description() -> None:
    missing = [p or "<root>" for p, s in _walk(SCHEMA) if not s.get("description")]
    assert missing == ["metadata"]
    assert SCHEMA["properties"]["metadata"] == {"type": "object"}


def test_schema_is_structural_and_closed() -> None:
    """Every node has a type (int-or-string ones exactly int|string); no field keeps unknown
    fields; nullable only on the analysis values that may be unknown."""
    nullable = []
    for path, node in _walk(SCHEMA):
        assert "x-kubernetes-preserve-unknown-fields" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node and node.get("anyOf") == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, path
        if node.get("type") == "object" and path != "metadata":
            assert "properties" in node, path
        if node.get("nullable"):
            nullable.append(path)
    assert nullable == [f"status.lastAnalysis.checks[].{k}" for k in ("stable", "candidate", "threshold")]


def test_spec_field_names_are_the_contract() -> None:
    """The names operator/mlx_fleet_operator/canary_spec.py parses (tests/test_field_contract.py
    compares the whole tree with its pydantic models)."""
    assert SCHEMA["required"] == ["spec"]
    assert SPEC["required"] == ["targetRef", "candidate"]
    assert set(SPEC["properties"]) == {"targetRef", "candidate", "steps", "analysis"}
    assert prop("spec.targetRef")["required"] == ["name"]
    assert prop("spec.candidate")["required"] == ["revision"]
    assert set(prop("spec.candidate")["properties"]) == {"revision", "source", "memory"}
    assert set(prop("spec.steps.[]")["properties"]) == {"setWeight", "pause"}
    assert set(prop("spec.steps.[].pause")["properties"]) == {"duration"}
    assert set(prop("spec.analysis")["properties"]) == {
        "interval", "minRequests", "failureLimit", "checks", "localGuard"}
    checks = prop("spec.analysis.checks")["properties"]
    assert {k: set(v["properties"]) for k, v in checks.items()} == {
        "errorRate": {"enabled", "maxRatio", "floor", "max"},
        "latencyP95": {"enabled", "maxRatio", "maxSeconds"},
        "ttftP95": {"enabled", "maxRatio", "maxSeconds"},
        "tokensPerSecond": {"enabled", "minRatio", "min"},
        "memoryGrowth": {"enabled", "maxPerHour"},
        "crashRate": {"enabled", "max"},
    }
    assert set(prop("spec.analysis.localGuard")["properties"]) == {
        "enabled", "window", "minFailures", "failureRatio"}


def test_shared_fields_copy_the_modeldeployment_schema() -> None:
    """candidate.revision/source/memory take the same values as the ModelDeployment's."""
    def bare(node: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in node.items() if k != "description"}

    assert bare(prop("spec.candidate.revision")) == bare(prop("spec.model.revision", MD_SCHEMA))
    assert bare(prop("spec.candidate.source")) == bare(prop("spec.model.source", MD_SCHEMA))
    assert bare(prop("spec.candidate.memory")) == bare(prop("spec.resources.memory", MD_SCHEMA))


def test_defaults() -> None:
    expected = {
        "spec.analysis.interval": "10s",
        "spec.analysis.minRequests": 20,
        "spec.analysis.failureLimit": 1,
        "spec.analysis.checks.errorRate.enabled": True,
        "spec.analysis.checks.errorRate.maxRatio": 2.0,
        "spec.analysis.checks.errorRate.floor": 0.01,
        "spec.analysis.checks.latencyP95.enabled": True,
        "spec.analysis.checks.latencyP95.maxRatio": 1.5,
        "spec.analysis.checks.ttftP95.enabled": True,
        "spec.analysis.checks.ttftP95.maxRatio": 1.5,
        "spec.analysis.checks.tokensPerSecond.enabled": True,
        "spec.analysis.checks.tokensPerSecond.minRatio": 0.67,
        "spec.analysis.checks.memoryGrowth.enabled": True,
        "spec.analysis.checks.memoryGrowth.maxPerHour": 0.2,
        "spec.analysis.checks.crashRate.enabled": True,
        "spec.analysis.checks.crashRate.max": 0.001,
        "spec.analysis.localGuard.enabled": True,
        "spec.analysis.localGuard.window": "5s",
        "spec.analysis.localGuard.minFailures": 3,
        "spec.analysis.localGuard.failureRatio": 0.5,
    }
    assert {p: prop(p).get("default") for p in expected} == expected
    # No default: the absolute limits (unset = not used), and the steps (the operator's default
    # plan), and the candidate's source and memory (the target's).
    for p in ("spec.analysis.checks.errorRate.max", "spec.analysis.checks.latencyP95.maxSeconds",
              "spec.analysis.checks.ttftP95.maxSeconds", "spec.analysis.checks.tokensPerSecond.min",
              "spec.steps", "spec.candidate.source", "spec.candidate.memory"):
        assert "default" not in prop(p), p
    for section in ("analysis", "analysis.checks", "analysis.localGuard",
                    *(f"analysis.checks.{c}" for c in prop("spec.analysis.checks")["properties"])):
        assert prop(f"spec.{section}")["default"] == {}, section


def test_defaulting_a_minimal_object_fills_the_analysis() -> None:
    spec = apply_defaults(SCHEMA, make("minimal", base_spec()))["spec"]
    assert spec["targetRef"] == {"name": "llama-demo"} and spec["candidate"] == {"revision": "v2"}
    assert "steps" not in spec
    assert spec["analysis"] == {
        "interval": "10s", "minRequests": 20, "failureLimit": 1,
        "checks": {
            "errorRate": {"enabled": True, "maxRatio": 2.0, "floor": 0.01},
            "latencyP95": {"enabled": True, "maxRatio": 1.5},
            "ttftP95": {"enabled": True, "maxRatio": 1.5},
            "tokensPerSecond": {"enabled": True, "minRatio": 0.67},
            "memoryGrowth": {"enabled": True, "maxPerHour": 0.2},
            "crashRate": {"enabled": True, "max": 0.001},
        },
        "localGuard": {"enabled": True, "window": "5s", "minFailures": 3, "failureRatio": 0.5},
    }


def _bounds(path: str) -> tuple[Any, ...]:
    node = prop(path)
    return (node.get("minimum"), bool(node.get("exclusiveMinimum")), node.get("maximum"))


def test_number_bounds() -> None:
    c = "spec.analysis.checks"
    assert {p: _bounds(p) for p in (
        "spec.steps.[].setWeight", "spec.analysis.minRequests", "spec.analysis.failureLimit",
        f"{c}.errorRate.maxRatio", f"{c}.errorRate.floor", f"{c}.errorRate.max",
        f"{c}.latencyP95.maxRatio", f"{c}.latencyP95.maxSeconds", f"{c}.ttftP95.maxRatio",
        f"{c}.ttftP95.maxSeconds", f"{c}.tokensPerSecond.minRatio", f"{c}.tokensPerSecond.min",
        f"{c}.memoryGrowth.maxPerHour", f"{c}.crashRate.max",
        "spec.analysis.localGuard.minFailures", "spec.analysis.localGuard.failureRatio",
    )} == {
        "spec.steps.[].setWeight": (0, False, 100),
        "spec.analysis.minRequests": (1, False, None),
        "spec.analysis.failureLimit": (1, False, None),
        f"{c}.errorRate.maxRatio": (0, True, None),
        f"{c}.errorRate.floor": (0, False, 1),
        f"{c}.errorRate.max": (0, False, 1),
        f"{c}.latencyP95.maxRatio": (0, True, None),
        f"{c}.latencyP95.maxSeconds": (0, True, None),
        f"{c}.ttftP95.maxRatio": (0, True, None),
        f"{c}.ttftP95.maxSeconds": (0, True, None),
        f"{c}.tokensPerSecond.minRatio": (0, True, 1),
        f"{c}.tokensPerSecond.min": (0, True, None),
        f"{c}.memoryGrowth.maxPerHour": (0, True, None),
        f"{c}.crashRate.max": (0, False, 1),
        "spec.analysis.localGuard.minFailures": (1, False, None),
        "spec.analysis.localGuard.failureRatio": (0, True, 1),
    }
    assert prop("spec.steps")["maxItems"] == 32


def test_every_spec_string_is_bounded() -> None:
    """Bounded input, and bounded CEL cost estimates."""
    assert [p for p, n in _walk(SPEC) if n.get("type") == "string" and "maxLength" not in n] == []
    name = prop("spec.targetRef.name")
    assert (name["minLength"], name["maxLength"]) == (1, 253)
    assert name["pattern"] == "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def test_durations_share_one_pattern_and_rule() -> None:
    durations = [p for p, n in _walk(SCHEMA) if n.get("pattern") == DURATION_RE]
    assert durations == ["spec.steps[].pause.duration", "spec.analysis.interval",
                         "spec.analysis.localGuard.window"]
    for path, node in _walk(SCHEMA):
        if path in durations:
            [rule] = node["x-kubernetes-validations"]
            assert rule["rule"] == f"!self.matches('{DURATION_RE}') || duration(self) > duration('0s')"
            assert rule["message"].startswith("must be a positive duration")
            assert node["maxLength"] == 32


def test_step_rules() -> None:
    [one] = prop("spec.steps.[]")["x-kubernetes-validations"]
    assert one == {"rule": "has(self.setWeight) != has(self.pause)",
                   "message": "must set exactly one of setWeight or pause"}
    [order] = prop("spec.steps")["x-kubernetes-validations"]
    assert order["rule"] == "self.filter(s, has(s.setWeight)).map(s, s.setWeight).isSorted()"
    assert order["message"] == "setWeight may not decrease from one step to the next"


def test_every_cel_rule_has_a_message_and_a_python_check() -> None:
    rules = [r for _, node in _walk(SCHEMA) for r in node.get("x-kubernetes-validations", [])]
    assert len(rules) == 7
    for rule in rules:
        assert rule.get("message"), rule
        assert rule["rule"] in CEL_EQUIVALENTS, f"no Python check declared for {rule['rule']!r}"
    # The shared rules (candidate.source, candidate.memory) are the ModelDeployment's objects.
    md = {r.rule: r for r in MODEL_DEPLOYMENT.rules()}
    shared = [r for r in CANARY.rules() if r.rule in md]
    assert len({r.rule for r in shared}) == 2 and all(md[r.rule] is r for r in shared)


def test_status_schema() -> None:
    assert set(STATUS["properties"]) == {
        "phase", "observedGeneration", "stableRevision", "candidateRevision", "currentStepIndex",
        "currentWeight", "stepStarted", "started", "failedWindows", "message", "lastPromoteToken",
        "lastAbortToken", "lastAnalysis", "conditions", "lastPromoteFullToken", "reason",
        "memoryBaselineBytes"}
    assert prop("status.phase")["enum"] == [
        "Pending", "Progressing", "Paused", "Promoting", "Succeeded", "RolledBack", "Aborted", "Failed"]
    for p in ("observedGeneration", "currentStepIndex", "currentWeight", "failedWindows"):
        assert prop(f"status.{p}")["type"] == "integer", p
    analysis = prop("status.lastAnalysis")
    assert set(analysis["properties"]) == {
        "verdict", "windowEnd", "message", "stableRequests", "candidateRequests", "checks"}
    assert analysis["properties"]["verdict"]["enum"] == ["Pass", "Fail", "Inconclusive"]
    checks = analysis["properties"]["checks"]
    assert (checks["x-kubernetes-list-type"], checks["x-kubernetes-list-map-keys"]) == ("map", ["name"])
    item = checks["items"]
    assert item["required"] == ["name"]
    assert set(item["properties"]) == {"name", "verdict", "stable", "candidate", "threshold", "message"}
    for k in ("stable", "candidate", "threshold"):
        assert item["properties"][k] == {**item["properties"][k], "type": "number", "nullable": True}


def test_conditions_schema_is_the_modeldeployments_with_canary_types() -> None:
    def bare(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: bare(v) for k, v in node.items() if k != "description"}
        return node

    ours, theirs = bare(prop("status.conditions")), bare(prop("status.conditions", MD_SCHEMA))
    assert ours["items"]["properties"]["type"]["enum"] == ["Progressing", "Succeeded", "Degraded"]
    theirs["items"]["properties"]["type"]["enum"] = ["Progressing", "Succeeded", "Degraded"]
    assert ours == theirs


# --- The validator's footing, then the shared cases ----------------------------------------------

@pytest.mark.parametrize(("text", "ns"), [
    ("30s", 30 * 10**9), ("5m", 300 * 10**9), ("1h", 3600 * 10**9), ("1m30s", 90 * 10**9),
    ("500ms", 5 * 10**8), ("1.5h", 5400 * 10**9), ("0s", 0), ("0h0m0s", 0),
    ("2562047h", 2562047 * 3600 * 10**9), ("3000000h", None),
])
def test_go_duration(text: str, ns: int | None) -> None:
    assert re.search(DURATION_RE, text)
    assert go_duration_ns(text) == ns


@pytest.mark.parametrize("text", ["", "30", "-5s", "+5s", "1d", "1m 30s", "soon", "1.s", ".5s", "5S", "1us"])
def test_duration_pattern_refuses(text: str) -> None:
    assert re.search(DURATION_RE, text) is None


@pytest.mark.parametrize("obj", valid_examples(), ids=lambda o: o["metadata"]["name"])
def test_valid_examples_are_accepted(obj: dict[str, Any]) -> None:
    assert validate_object(obj) == []


@pytest.mark.parametrize(("obj", "field"), invalid_examples(), ids=lambda o: o["metadata"]["name"]
                         if isinstance(o, dict) else "")
def test_invalid_examples_are_refused_naming_the_field(obj: dict[str, Any], field: str) -> None:
    errors = validate_object(obj)
    assert errors, f"{obj['metadata']['name']} was accepted"
    assert named_errors(errors) and all(e.startswith(field) for e in named_errors(errors)), errors


def test_case_names_are_unique_and_valid() -> None:
    names = [o["metadata"]["name"] for o in valid_examples()] + [o["metadata"]["name"] for o, _ in invalid_examples()]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 63 for n in names)


def test_full_spec_sets_every_spec_field() -> None:
    """ok-full exercises every field of the schema (so a new field gets a case)."""
    def paths(value: Any, path: str = "") -> set[str]:
        out = {path} if path else set()
        if isinstance(value, dict):
            for k, v in value.items():
                out |= paths(v, f"{path}.{k}" if path else k)
        elif isinstance(value, list):
            for v in value:
                out |= paths(v, f"{path}[]")
        return out

    in_schema = {p for p, _ in _walk(SPEC) if p}
    assert in_schema - paths(full_spec()) == set()


# --- The example manifest ------------------------------------------------------------------------

def _example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def test_example_canary_targets_the_example_modeldeployment() -> None:
    obj = _example()
    md = yaml.safe_load((REPO / "examples" / "modeldeployment.yaml").read_text())
    assert obj["apiVersion"] == "mlx-fleet.io/v1alpha1" and obj["kind"] == "Canary"
    assert obj["metadata"]["namespace"] == md["metadata"]["namespace"]
    assert obj["spec"]["targetRef"] == {"name": md["metadata"]["name"]}
    # The candidate must differ from the target's revision (the operator refuses it otherwise).
    assert obj["spec"]["candidate"]["revision"] != md["spec"]["model"]["revision"]
    assert validate_object(obj) == []
    # It is commented: every manual action is shown.
    text = EXAMPLE.read_text()
    for annotation in ("mlx-fleet.io/promote", "mlx-fleet.io/promote-full", "mlx-fleet.io/abort"):
        assert annotation in text


# --- Against a real kube-apiserver ---------------------------------------------------------------

def _refused(res: Any, field: str) -> None:
    assert res.returncode != 0, "accepted"
    # Schema errors read "... is invalid: <field>: ..."; with kubectl's default strict field
    # validation an unknown field is refused at decoding ("strict decoding error: unknown field
    # "<field>...""), before the schema validation.
    assert "is invalid" in res.stderr or "strict decoding error" in res.stderr, res.stderr
    assert field in res.stderr, res.stderr


@pytest.mark.integration
def test_crd_is_established_with_printer_columns(control_plane: Any, namespace: str) -> None:
    crd = json.loads(control_plane.kubectl("get", "crd", "canaries.mlx-fleet.io", "-o", "json").stdout)
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"
    obj = make("printer", base_spec())
    obj["metadata"]["namespace"] = namespace
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(obj))
    header, row = control_plane.kubectl("get", "can", "-n", namespace).stdout.splitlines()[:2]
    assert header.split() == ["NAME", "TARGET", "CANDIDATE", "WEIGHT", "PHASE", "AGE"]
    assert row.split()[:3] == ["printer", "llama-demo", "v2"]  # WEIGHT, PHASE: no status yet
    # `kubectl get mlx-fleet` lists both kinds of the category.
    both = control_plane.kubectl("get", "mlx-fleet", "-n", namespace, "-o", "name").stdout
    assert "canary.mlx-fleet.io/printer" in both


@pytest.mark.integration
@pytest.mark.parametrize("obj", valid_examples(), ids=lambda o: o["metadata"]["name"])
def test_valid_objects_accepted_with_defaults(control_plane: Any, obj: dict[str, Any]) -> None:
    out = control_plane.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(obj))
    applied = json.loads(out.stdout)
    # The server applied the same defaults as the pure validator (numbers compared as numbers).
    assert applied["spec"] == apply_defaults(SCHEMA, obj)["spec"]


@pytest.mark.integration
@pytest.mark.parametrize(("obj", "field"), invalid_examples(), ids=lambda v: v["metadata"]["name"]
                         if isinstance(v, dict) else v)
def test_invalid_objects_refused_naming_the_field(control_plane: Any, obj: dict[str, Any], field: str) -> None:
    res = control_plane.kubectl("apply", "-f", "-", input=json.dumps(obj), check=False)
    _refused(res, field)
    got = control_plane.kubectl("get", "canary", obj["metadata"]["name"], check=False)
    assert got.returncode != 0  # nothing was stored


@pytest.mark.integration
def test_unknown_step_field_without_strict_validation_is_pruned_then_refused(control_plane: Any) -> None:
    """Without strict field validation the server prunes the unknown key; the empty step left
    is refused by the step rule, naming it."""
    obj = make("bad-step-pruned", {**base_spec(), "steps": [{"setWeight": 10}, {"weight": 50}]})
    res = control_plane.kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(obj), check=False)
    _refused(res, "spec.steps[1]")
    assert "must set exactly one of setWeight or pause" in res.stderr


@pytest.mark.integration
def test_example_manifest_is_valid(control_plane: Any) -> None:
    control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(_example()))


@pytest.mark.integration
def test_status_subresource_keeps_everything_the_operator_writes(control_plane: Any, namespace: str) -> None:
    """A full status (nullable numbers as null) goes through the status subresource unpruned.
    Sent as a JSON patch: a merge patch (kopf's) drops the nulls, leaving those keys absent,
    which the schema also allows (both mean "unknown")."""
    obj = make("status-roundtrip", base_spec())
    obj["metadata"]["namespace"] = namespace
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(obj))
    status = {
        "phase": "Progressing", "observedGeneration": 1, "stableRevision": "v1",
        "candidateRevision": "v2", "currentStepIndex": 2, "currentWeight": 10,
        "stepStarted": "2025-01-01T00:01:00Z", "started": "2025-01-01T00:00:00Z",
        "failedWindows": 0, "message": "step 3/4: weight 10%", "lastPromoteToken": "t1",
        "lastAbortToken": "",
        "lastAnalysis": {
            "verdict": "Pass", "windowEnd": "2025-01-01T00:01:10Z", "message": "all checks passed",
            "stableRequests": 180, "candidateRequests": 20,
            "checks": [
                {"name": "errorRate", "verdict": "Pass", "stable": 0.0, "candidate": 0.0,
                 "threshold": 0.02, "message": "errorRate: candidate 0% vs stable 0%"},
                {"name": "memoryGrowth", "verdict": "Inconclusive", "stable": None, "candidate": None,
                 "threshold": 0.2, "message": "memoryGrowth: n/a"},
            ],
        },
        "conditions": [{"type": "Progressing", "status": "True", "reason": "StepRunning",
                        "message": "weight 10%", "lastTransitionTime": "2025-01-01T00:01:00Z",
                        "observedGeneration": 1}],
    }

    def get_status() -> dict[str, Any]:
        return json.loads(control_plane.kubectl("get", "canary", "status-roundtrip", "-n", namespace,
                                                "-o", "json").stdout)["status"]

    control_plane.kubectl("patch", "canary", "status-roundtrip", "-n", namespace, "--subresource=status",
                          "--type=json", "-p", json.dumps([{"op": "add", "path": "/status", "value": status}]))
    assert get_status() == status
    control_plane.kubectl("patch", "canary", "status-roundtrip", "-n", namespace, "--subresource=status",
                          "--type=merge", "-p", json.dumps({"status": status}))
    unknown = status["lastAnalysis"]["checks"][1]
    assert get_status()["lastAnalysis"]["checks"][1] == {k: v for k, v in unknown.items() if v is not None}
    row = control_plane.kubectl("get", "can", "status-roundtrip", "-n", namespace).stdout.splitlines()[1]
    assert row.split()[1:5] == ["llama-demo", "v2", "10", "Progressing"]
    bad = control_plane.kubectl("patch", "canary", "status-roundtrip", "-n", namespace,
                                "--subresource=status", "--type=merge",
                                "-p", json.dumps({"status": {"phase": "Done"}}), check=False)
    assert bad.returncode != 0 and "status.phase" in bad.stderr


@pytest.mark.integration
def test_modeldeployment_status_holds_two_revisions_per_node(control_plane: Any, namespace: str) -> None:
    """status.nodes is keyed by (name, revision): a Mac serving the Stable and the Previous (or
    a Candidate) revision at once has two entries; revision defaults to ""."""
    from crd_cases import base_spec as md_spec, make as make_md

    obj = make_md("two-revisions", md_spec())
    obj["metadata"]["namespace"] = namespace
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(obj))
    nodes = [
        {"name": "mac-1", "revision": "v1", "role": "Previous", "state": "Ready"},
        {"name": "mac-1", "revision": "v2", "role": "Stable", "state": "Loading"},
        {"name": "mac-2", "state": "Pending"},
    ]
    status = {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 0, "nodes": nodes}
    control_plane.kubectl("patch", "md", "two-revisions", "-n", namespace, "--subresource=status",
                          "--type=merge", "-p", json.dumps({"status": status}))
    got = json.loads(control_plane.kubectl("get", "md", "two-revisions", "-n", namespace,
                                           "-o", "json").stdout)["status"]
    assert got["updatedReplicas"] == 0
    assert got["nodes"] == [*nodes[:2], {**nodes[2], "revision": ""}]
    dup = control_plane.kubectl("patch", "md", "two-revisions", "-n", namespace, "--subresource=status",
                                "--type=merge", "-p", json.dumps({"status": {"nodes": [nodes[0], nodes[0]]}}),
                                check=False)
    assert dup.returncode != 0 and "status.nodes" in dup.stderr
