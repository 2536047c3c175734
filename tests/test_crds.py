"""Pure tests of the ModelDeployment CRD (no cluster): structure, the field contract of
docs/modeldeployment-api.md, and the shared cases of tests/crd_cases.py run through a small validator
that follows the API server's semantics for the keywords this schema uses.

The CEL rules can't be evaluated here (no CEL library); each rule string is pinned and paired with
a Python equivalent, so changing a rule without changing its equivalent fails loudly. The real
API server runs the same cases in the integration tests.
"""

from __future__ import annotations

import copy
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from crd_cases import base_spec, invalid_examples, make, valid_examples

REPO = Path(__file__).resolve().parents[1]
CRD_PATH = REPO / "crds" / "mlx-fleet.io_modeldeployments.yaml"
SPEC_DOC = REPO / "docs" / "modeldeployment-api.md"

QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _load_crd() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(CRD_PATH.read_text()) if d]
    assert len(docs) == 1, "the CRD file holds exactly one document"
    return docs[0]


CRD = _load_crd()
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SPEC = SCHEMA["properties"]["spec"]
STATUS = SCHEMA["properties"]["status"]


def prop(path: str) -> dict[str, Any]:
    """The schema node at dotted ``path`` below the root (e.g. ``spec.model.source``)."""
    node = SCHEMA
    for key in path.split("."):
        node = node["items"] if key == "[]" else node["properties"][key]
    return node


# --- Python equivalents of the CEL rules ---------------------------------------------------------

_SUFFIX = {
    "": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9, "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}


def quantity_value(text: str) -> Decimal | None:
    """The value of a Kubernetes quantity string, or None if it is not one (CEL ``isQuantity``)."""
    num = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    m = re.fullmatch(rf"([+-]?{num})([KMGTPE]i|[numkMGTPE]|[eE][+-]?{num})?", text)
    if not m:
        return None
    number, suffix = Decimal(m.group(1)), m.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return number * Decimal(10) ** Decimal(suffix[1:])
    return number * _SUFFIX[suffix]


SOURCE_RE = "^(file://)?/.+|^hf://[^/]+/[^/]+$|^https://.+"

CEL_EQUIVALENTS = {
    f"self.matches('{SOURCE_RE}')": lambda v: re.search(SOURCE_RE, v) is not None,
    "type(self) == int ? self > 0 : (isQuantity(self) && quantity(self).isGreaterThan(quantity('0')))":
        lambda v: v > 0 if isinstance(v, int) else (quantity_value(v) is not None and quantity_value(v) > 0),
}


# --- A validator with the API server's semantics for the keywords used here --------------------

def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: fill absent properties that have a ``default``, depth first."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    if isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], v) for v in value]
    return value


def _type_ok(schema: dict[str, Any], value: Any) -> bool:
    if schema.get("x-kubernetes-int-or-string"):
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    t = schema.get("type")
    return {
        None: True,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
    }[t]


def validate(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Errors as ``"<field path>: <message>"``, like the API server's field errors."""
    if not _type_ok(schema, value):
        return [f"{path}: Invalid value: must be of type {schema.get('type', 'int-or-string')}"]
    errors: list[str] = []
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path + '.' if path else ''}{key}: Required value")
        for key, sub in value.items():
            child = f"{path + '.' if path else ''}{key}"
            if key in schema.get("properties", {}):
                errors += validate(schema["properties"][key], sub, child)
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += validate(schema["additionalProperties"], sub, child)
    if isinstance(value, list):
        for i, item in enumerate(value):
            errors += validate(schema["items"], item, f"{path}[{i}]")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: Unsupported value: {value!r}")
    if isinstance(value, int) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: Invalid value: should be greater than or equal to {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: Invalid value: should be less than or equal to {schema['maximum']}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path}: Invalid value: should be at least {schema['minLength']} chars long")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: Too long: may not be more than {schema['maxLength']} bytes")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: Invalid value: should match '{schema['pattern']}'")
    # Like the API server, CEL rules run on every value of the right type, also next to other errors.
    for rule in schema.get("x-kubernetes-validations", []):
        if not CEL_EQUIVALENTS[rule["rule"]](value):
            errors.append(f"{path}: Invalid value: {rule['message']}")
    return errors


def validate_object(obj: dict[str, Any]) -> list[str]:
    return validate(SCHEMA, apply_defaults(SCHEMA, obj))


# --- Structure ---------------------------------------------------------------------------------

def test_identity_names_and_scope() -> None:
    assert CRD["apiVersion"] == "apiextensions.k8s.io/v1"
    assert CRD["kind"] == "CustomResourceDefinition"
    assert CRD["metadata"]["name"] == "modeldeployments.mlx-fleet.io"
    spec = CRD["spec"]
    assert spec["group"] == "mlx-fleet.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "ModelDeployment", "listKind": "ModelDeploymentList", "plural": "modeldeployments",
        "singular": "modeldeployment", "shortNames": ["md"], "categories": ["mlx-fleet"],
    }


def test_single_served_storage_version_with_status_subresource() -> None:
    assert [v["name"] for v in CRD["spec"]["versions"]] == ["v1alpha1"]
    assert VERSION["served"] is True and VERSION["storage"] is True
    assert VERSION["subresources"] == {"status": {}}


def test_printer_columns() -> None:
    cols = {c["name"]: (c["type"], c["jsonPath"]) for c in VERSION["additionalPrinterColumns"]}
    assert list(cols) == ["Model", "Revision", "Ready", "Desired", "Status", "Age"]
    assert cols == {
        "Model": ("string", ".spec.model.source"),
        "Revision": ("string", ".spec.model.revision"),
        "Ready": ("integer", ".status.readyReplicas"),
        "Desired": ("integer", ".spec.replicas"),
        "Status": ("string", '.status.conditions[?(@.type=="Ready")].status'),
        "Age": ("date", ".metadata.creationTimestamp"),
    }


def _walk(schema: dict[str, Any], path: str = ""):
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}" if path else key)
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_every_field_has_a_description() -> None:
    # Values of a string map (nodeSelector's entries) are described by the map itself.
    missing = [p or "<root>" for p, s in _walk(SCHEMA) if not p.endswith("{}") and not s.get("description")]
    # The API server forbids anything but `type` (and name/generateName) under metadata.
    assert missing == ["metadata"]
    assert SCHEMA["properties"]["metadata"] == {"type": "object"}


def test_schema_is_structural() -> None:
    """Every node has a type, except int-or-string ones, whose anyOf is exactly int|string."""
    for path, node in _walk(SCHEMA):
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
            assert node.get("anyOf") == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert node.get("type") in {"object", "array", "string", "integer", "boolean"}, path
        if node.get("type") == "object" and path not in {"metadata"}:
            assert "properties" in node or "additionalProperties" in node, path


def test_required_fields() -> None:
    assert SCHEMA["required"] == ["spec"]
    assert SPEC["required"] == ["model", "resources"]
    assert prop("spec.model")["required"] == ["source", "revision"]
    assert prop("spec.resources")["required"] == ["memory"]
    assert "servedModelName" in prop("spec.model")["properties"]


def test_spec_fields_match_the_contract() -> None:
    assert set(SPEC["properties"]) == {"model", "replicas", "resources", "placement", "serving", "lifecycle"}
    assert set(prop("spec.model")["properties"]) == {"source", "revision", "servedModelName"}
    assert set(prop("spec.placement")["properties"]) == {"nodeSelector", "minChipGeneration", "strategy"}
    assert set(prop("spec.serving")["properties"]) == {"maxConcurrentSequences", "maxContextTokens"}
    assert set(prop("spec.lifecycle")["properties"]) == {"idleUnloadSeconds", "prefetch"}
    assert prop("spec.placement.nodeSelector")["additionalProperties"] == {"type": "string"}


def test_defaults() -> None:
    expected = {
        "spec.replicas": 1,
        "spec.placement.minChipGeneration": "M3",
        "spec.placement.strategy": "Spread",
        "spec.serving.maxConcurrentSequences": 8,
        "spec.serving.maxContextTokens": 4096,
        "spec.lifecycle.idleUnloadSeconds": 300,
        "spec.lifecycle.prefetch": "Eager",
    }
    assert {p: prop(p).get("default") for p in expected} == expected
    # Empty-object defaults on the optional sections make their field defaults apply when the
    # section is omitted altogether.
    for section in ("placement", "serving", "lifecycle"):
        assert prop(f"spec.{section}")["default"] == {}


def test_defaulting_a_minimal_object_fills_every_default() -> None:
    obj = apply_defaults(SCHEMA, make("minimal", base_spec()))
    assert obj["spec"] == {
        **base_spec(),
        "replicas": 1,
        "placement": {"minChipGeneration": "M3", "strategy": "Spread"},
        "serving": {"maxConcurrentSequences": 8, "maxContextTokens": 4096},
        "lifecycle": {"idleUnloadSeconds": 300, "prefetch": "Eager"},
    }


def test_enums_and_bounds() -> None:
    assert prop("spec.placement.minChipGeneration")["enum"] == ["M3", "M4", "M5"]
    assert prop("spec.placement.strategy")["enum"] == ["Spread", "Binpack"]
    assert prop("spec.lifecycle.prefetch")["enum"] == ["Eager", "OnDemand"]
    bounds = {p: (prop(p).get("minimum"), prop(p).get("maximum")) for p in (
        "spec.replicas", "spec.serving.maxConcurrentSequences", "spec.serving.maxContextTokens",
        "spec.lifecycle.idleUnloadSeconds")}
    assert bounds == {
        "spec.replicas": (0, 1000),
        "spec.serving.maxConcurrentSequences": (1, 256),
        "spec.serving.maxContextTokens": (128, 1048576),
        "spec.lifecycle.idleUnloadSeconds": (0, None),
    }


def test_revision_pattern_and_length() -> None:
    rev = prop("spec.model.revision")
    assert (rev["type"], rev["minLength"], rev["maxLength"], rev["pattern"]) == (
        "string", 1, 128, "^[A-Za-z0-9._-]+$")


def test_source_rule_is_the_contract_pattern_with_a_message() -> None:
    doc_pattern = re.search(r"# pattern: (\S+)", SPEC_DOC.read_text()).group(1)
    assert doc_pattern == SOURCE_RE
    [rule] = prop("spec.model.source")["x-kubernetes-validations"]
    assert rule["rule"] == f"self.matches('{SOURCE_RE}')"
    assert "absolute path" in rule["message"]
    assert "maxLength" in prop("spec.model.source")  # bounds the CEL cost estimate


def test_memory_is_a_positive_quantity() -> None:
    mem = prop("spec.resources.memory")
    assert mem["x-kubernetes-int-or-string"] is True
    assert mem["pattern"] == QUANTITY_PATTERN
    [rule] = mem["x-kubernetes-validations"]
    assert "isQuantity" in rule["rule"] and "quantity('0')" in rule["rule"]
    assert rule["message"] == "must be a Kubernetes quantity greater than 0, such as 512Mi or 2Gi"


def test_every_cel_rule_has_a_message_and_a_checked_equivalent() -> None:
    rules = [r for _, node in _walk(SCHEMA) for r in node.get("x-kubernetes-validations", [])]
    assert rules, "the schema uses CEL rules"
    for rule in rules:
        assert rule.get("message"), rule
        assert rule["rule"] in CEL_EQUIVALENTS, f"no Python equivalent pinned for {rule['rule']!r}"


def test_status_schema() -> None:
    assert set(STATUS["properties"]) == {
        "observedGeneration", "replicas", "readyReplicas", "nodes", "endpoints", "conditions"}
    nodes = prop("status.nodes")
    assert set(nodes["items"]["properties"]) == {"name", "state", "reason", "message", "endpoint"}
    assert nodes["items"]["properties"]["state"]["enum"] == [
        "Pending", "Prefetching", "Loading", "Ready", "Unloaded", "Failed"]
    assert (nodes["x-kubernetes-list-type"], nodes["x-kubernetes-list-map-keys"]) == ("map", ["name"])
    assert nodes["items"]["required"] == ["name"]
    assert prop("status.endpoints")["items"]["type"] == "string"


def test_conditions_schema() -> None:
    cond = prop("status.conditions")
    assert cond["x-kubernetes-list-type"] == "map"
    assert cond["x-kubernetes-list-map-keys"] == ["type"]
    item = cond["items"]
    assert set(item["properties"]) == {
        "type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}
    # A list-map key must be required.
    assert "type" in item["required"] and "status" in item["required"]
    assert item["properties"]["type"]["enum"] == ["Ready", "Progressing", "Degraded"]
    assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert item["properties"]["lastTransitionTime"]["format"] == "date-time"
    assert item["properties"]["observedGeneration"]["type"] == "integer"


# --- The validator's own footing, then the shared cases --------------------------------------

@pytest.mark.parametrize(("text", "value"), [
    ("256Mi", Decimal(256 * 2**20)), ("1.5Gi", Decimal(3 * 2**29)), ("2G", Decimal(2 * 10**9)),
    ("0", Decimal(0)), ("-1Gi", Decimal(-(2**30))), ("100m", Decimal("0.1")), ("1e3", Decimal(1000)),
    ("lots", None), ("2GB", None), ("1mi", None), ("", None),
])
def test_quantity_value(text: str, value: Decimal | None) -> None:
    assert quantity_value(text) == value
    # Our parser and the schema's pattern agree on what a quantity is.
    assert (re.search(QUANTITY_PATTERN, text) is not None) == (value is not None)


@pytest.mark.parametrize("obj", valid_examples(), ids=lambda o: o["metadata"]["name"])
def test_valid_examples_are_accepted(obj: dict[str, Any]) -> None:
    assert validate_object(obj) == []


@pytest.mark.parametrize(("obj", "field"), invalid_examples(), ids=lambda o: o["metadata"]["name"]
                         if isinstance(o, dict) else "")
def test_invalid_examples_are_refused_naming_the_field(obj: dict[str, Any], field: str) -> None:
    errors = validate_object(obj)
    assert errors, f"{obj['metadata']['name']} was accepted"
    assert all(e.startswith(field) for e in errors), errors


def test_case_names_are_unique_and_valid() -> None:
    names = [o["metadata"]["name"] for o in valid_examples()] + [o["metadata"]["name"] for o, _ in invalid_examples()]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 63 for n in names)


# --- The example manifests ----------------------------------------------------------------------

def test_example_modeldeployment() -> None:
    text = (REPO / "examples" / "modeldeployment.yaml").read_text()
    assert "file://${MODEL_DIR}" in text
    obj = yaml.safe_load(text.replace("${MODEL_DIR}", "/models/llama-demo"))
    assert obj["apiVersion"] == "mlx-fleet.io/v1alpha1" and obj["kind"] == "ModelDeployment"
    assert obj["metadata"] == {"name": "llama-demo", "namespace": "default"}
    assert obj["spec"]["replicas"] == 1
    assert obj["spec"]["resources"]["memory"] == "256Mi"
    assert obj["spec"]["model"] == {"source": "file:///models/llama-demo", "revision": "v1",
                                    "servedModelName": "llama-demo"}
    assert validate_object(obj) == []
    # Without the substitution the API server refuses it (the comment in the file says so).
    assert [e.split(":")[0] for e in validate_object(yaml.safe_load(text))] == ["spec.model.source"]


def test_invalid_example_is_refused_on_each_documented_field() -> None:
    obj = yaml.safe_load((REPO / "examples" / "invalid-modeldeployment.yaml").read_text())
    fields = sorted({e.split(":")[0] for e in validate_object(obj)})
    assert fields == ["spec.model.source", "spec.replicas", "spec.resources.memory"]
