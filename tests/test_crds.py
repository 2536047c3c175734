"""Pure tests of the ModelDeployment CRD (no cluster): structure, the field reference
docs/modeldeployment-api.md, and the shared cases of tests/crd_cases.py run through a small validator
that follows the API server's semantics for the keywords this schema uses.

The CEL rules can't be evaluated here (no CEL library): each rule is declared in the types the
CRD is generated from (operator/mlx_fleet_operator/spec.py) together with its ``check``, the same
predicate in Python, which the validator runs. The real API server runs the CEL text itself on
the same cases in the integration tests (tests/test_controlplane.py).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from crd_cases import base_spec, invalid_examples, make, valid_examples
from mlx_fleet.quantity import parse_quantity
from mlx_fleet_operator.crd.modeldeployment import MODEL_DEPLOYMENT

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


# --- The CEL rules' Python checks, from the types the CRD is generated from -----------------------

SOURCE_RE = "^(file://)?/.+|^hf://[^/]+/[^/]+$|^https://.+"

#: CEL rule text → its Python check (declared beside the rule, in spec.py).
CEL_EQUIVALENTS = {r.rule: r.check for r in MODEL_DEPLOYMENT.rules()}


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
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
    }[t]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: The API server's cause without a field, added when a blocking error skipped the CEL rules.
UNCHECKED = ("<nil>: Invalid value: some validation rules were not checked because the object was "
             "invalid; correct the existing errors to complete validation")


def _schema_errors(schema: dict[str, Any], value: Any, path: str) -> list[tuple[bool, str]]:
    """``(blocking, "<field path>: <message>")`` for the OpenAPI keywords. Blocking, as in the
    API server's ``hasBlockingErr``: wrong type, Required, Unsupported (enum), Too long
    (maxLength), Too many (maxItems, maxProperties)."""
    if value is None and schema.get("nullable"):
        return []
    if not _type_ok(schema, value):
        return [(True, f"{path}: Invalid value: must be of type {schema.get('type', 'int-or-string')}")]
    errors: list[tuple[bool, str]] = []
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                errors.append((True, f"{path + '.' if path else ''}{key}: Required value"))
        for key, sub in value.items():
            child = f"{path + '.' if path else ''}{key}"
            if key in schema.get("properties", {}):
                errors += _schema_errors(schema["properties"][key], sub, child)
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += _schema_errors(schema["additionalProperties"], sub, child)
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            errors.append((True, f"{path}: Too many: {len(value)}: must have at most "
                                 f"{schema['maxProperties']} items"))
    if isinstance(value, list):
        for i, item in enumerate(value):
            errors += _schema_errors(schema["items"], item, f"{path}[{i}]")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append((True, f"{path}: Too many: {len(value)}: must have at most {schema['maxItems']} items"))
    if "enum" in schema and value not in schema["enum"]:
        errors.append((True, f"{path}: Unsupported value: {value!r}"))
    if _number(value):
        exclusive_min, exclusive_max = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if "minimum" in schema and (value <= schema["minimum"] if exclusive_min else value < schema["minimum"]):
            errors.append((False, f"{path}: Invalid value: should be greater than "
                                  f"{'' if exclusive_min else 'or equal to '}{schema['minimum']}"))
        if "maximum" in schema and (value >= schema["maximum"] if exclusive_max else value > schema["maximum"]):
            errors.append((False, f"{path}: Invalid value: should be less than "
                                  f"{'' if exclusive_max else 'or equal to '}{schema['maximum']}"))
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append((False, f"{path}: Invalid value: should be at least {schema['minLength']} chars long"))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append((True, f"{path}: Too long: may not be more than {schema['maxLength']} bytes"))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append((False, f"{path}: Invalid value: should match '{schema['pattern']}'"))
    return errors


def _cel_errors(schema: dict[str, Any], value: Any, path: str, cel: dict[str, Any]) -> list[str]:
    """The CEL rules' errors, through their Python equivalents (``cel``), depth first."""
    if value is None:
        return []
    errors: list[str] = []
    if isinstance(value, dict):
        for key, sub in value.items():
            child = f"{path + '.' if path else ''}{key}"
            if key in schema.get("properties", {}):
                errors += _cel_errors(schema["properties"][key], sub, child, cel)
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += _cel_errors(schema["additionalProperties"], sub, child, cel)
    if isinstance(value, list):
        for i, item in enumerate(value):
            errors += _cel_errors(schema["items"], item, f"{path}[{i}]", cel)
    for rule in schema.get("x-kubernetes-validations", []):
        if not cel[rule["rule"]](value):  # the API server reports it at path + fieldPath
            errors.append(f"{path}{rule.get('fieldPath', '')}: Invalid value: {rule['message']}")
    return errors


def validate(schema: dict[str, Any], value: Any, path: str = "",
             cel: dict[str, Any] | None = None) -> list[str]:
    """Errors as ``"<field path>: <message>"``, like the API server's field errors. ``cel``: the
    Python equivalents of the schema's CEL rules (default: the ModelDeployment's).

    Like the API server, the CEL rules run on every value, also next to other errors (a pattern,
    a minimum), unless an error is blocking: then none runs, and the error list ends with the
    server's cause without a field (:data:`UNCHECKED`)."""
    schema_errors = _schema_errors(schema, value, path)
    if any(blocking for blocking, _ in schema_errors):
        return [e for _, e in schema_errors] + [UNCHECKED]
    return [e for _, e in schema_errors] + _cel_errors(schema, value, path,
                                                      CEL_EQUIVALENTS if cel is None else cel)


def validate_object(obj: dict[str, Any]) -> list[str]:
    return validate(SCHEMA, apply_defaults(SCHEMA, obj))


def named_errors(errors: list[str]) -> list[str]:
    """``errors`` without the API server's cause that names no field."""
    return [e for e in errors if e != UNCHECKED]


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
    assert list(cols) == ["Model", "Revision", "Ready", "Desired", "Status", "Served", "Router",
                          "Downloads", "Age"]
    assert [c["name"] for c in VERSION["additionalPrinterColumns"] if c.get("priority")] == [
        "Router", "Downloads"]                                         # only with -o wide
    assert cols == {
        "Model": ("string", ".spec.model.source"),
        "Revision": ("string", ".spec.model.revision"),
        "Ready": ("integer", ".status.readyReplicas"),
        "Desired": ("integer", ".spec.replicas"),
        "Status": ("string", '.status.conditions[?(@.type=="Ready")].status'),
        "Served": ("string", ".status.router.model"),
        "Router": ("string", ".status.router.url"),
        "Downloads": ("string", ".status.downloads"),
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
    assert SPEC["required"] == ["model"]
    assert prop("spec.model")["required"] == ["source", "revision"]
    assert "required" not in prop("spec.resources")  # memory: the user's override, optional
    assert "servedModelName" in prop("spec.model")["properties"]


def test_spec_fields_match_the_contract() -> None:
    assert set(SPEC["properties"]) == {
        "model", "replicas", "resources", "placement", "serving", "lifecycle", "strategy"}
    assert set(prop("spec.model")["properties"]) == {"source", "revision", "servedModelName",
                                                      "task"}
    assert prop("spec.model.task")["enum"] == ["TextGeneration", "TextEmbedding"]
    assert prop("spec.model.task")["default"] == "TextGeneration"
    assert set(prop("spec.placement")["properties"]) == {"nodeSelector", "minChipGeneration", "strategy"}
    assert set(prop("spec.serving")["properties"]) == {"maxConcurrentSequences", "maxContextTokens"}
    assert set(prop("spec.lifecycle")["properties"]) == {"idleUnloadSeconds", "prefetch",
                                                          "minReady"}
    assert set(prop("spec.strategy")["properties"]) == {"type", "rollingUpdate"}
    assert set(prop("spec.strategy.rollingUpdate")["properties"]) == {"maxSurge", "maxUnavailable"}
    assert prop("spec.placement.nodeSelector")["additionalProperties"] == {
        "type": "string", "maxLength": 63, "pattern": "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}


def _paths(node: dict[str, Any], prefix: str) -> set[str]:
    """Every field path below ``node`` as the reference writes it (``status.nodes[].name``)."""
    out: set[str] = set()
    for key, sub in node.get("properties", {}).items():
        out |= {f"{prefix}.{key}"} | _paths(sub, f"{prefix}.{key}")
        if isinstance(sub.get("items"), dict):
            out |= _paths(sub["items"], f"{prefix}.{key}[]")
    return out


def test_the_field_reference_names_every_field() -> None:
    """docs/modeldeployment-api.md (generated with the CRD, tests/test_crd_generation.py) has a
    row for every spec and status field of the CRD, and the printer columns."""
    text = SPEC_DOC.read_text()
    for path in _paths(SPEC, "spec") | _paths(STATUS, "status"):
        assert f"| `{path}` |" in text, path
    for column in VERSION["additionalPrinterColumns"]:
        assert f"| {column['name']} | `{column['jsonPath']}` |" in text


def test_defaults() -> None:
    expected = {
        "spec.replicas": 1,
        "spec.placement.minChipGeneration": "M3",
        "spec.placement.strategy": "Spread",
        "spec.serving.maxConcurrentSequences": 8,
        "spec.serving.maxContextTokens": 4096,
        "spec.lifecycle.idleUnloadSeconds": 300,
        "spec.lifecycle.prefetch": "Eager",
        "spec.lifecycle.minReady": 0,
        "spec.model.task": "TextGeneration",
        "spec.strategy.type": "RollingUpdate",
        "spec.strategy.rollingUpdate.maxSurge": "25%",
        "spec.strategy.rollingUpdate.maxUnavailable": 1,
    }
    assert {p: prop(p).get("default") for p in expected} == expected
    # Empty-object defaults on the optional sections make their field defaults apply when the
    # section is omitted altogether.
    for section in ("resources", "placement", "serving", "lifecycle", "strategy",
                    "strategy.rollingUpdate"):
        assert prop(f"spec.{section}")["default"] == {}


def test_defaulting_a_minimal_object_fills_every_default() -> None:
    obj = apply_defaults(SCHEMA, make("minimal", base_spec()))
    assert obj["spec"] == {
        **base_spec(),
        "model": {**base_spec()["model"], "task": "TextGeneration"},
        "replicas": 1,
        "placement": {"minChipGeneration": "M3", "strategy": "Spread"},
        "serving": {"maxConcurrentSequences": 8, "maxContextTokens": 4096},
        "lifecycle": {"idleUnloadSeconds": 300, "prefetch": "Eager", "minReady": 0},
        "strategy": {"type": "RollingUpdate",
                     "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 1}},
    }


def test_enums_and_bounds() -> None:
    assert prop("spec.placement.minChipGeneration")["enum"] == ["M3", "M4", "M5"]
    assert prop("spec.placement.strategy")["enum"] == ["Spread", "Binpack"]
    assert prop("spec.lifecycle.prefetch")["enum"] == ["Eager", "OnDemand"]
    bounds = {p: (prop(p).get("minimum"), prop(p).get("maximum")) for p in (
        "spec.replicas", "spec.serving.maxConcurrentSequences", "spec.serving.maxContextTokens",
        "spec.lifecycle.idleUnloadSeconds", "spec.lifecycle.minReady")}
    assert bounds == {
        "spec.replicas": (0, 1000),
        "spec.serving.maxConcurrentSequences": (1, 256),
        "spec.serving.maxContextTokens": (128, 1048576),
        "spec.lifecycle.idleUnloadSeconds": (0, None),
        "spec.lifecycle.minReady": (0, None),
    }


def test_revision_pattern_and_length() -> None:
    rev = prop("spec.model.revision")
    assert (rev["type"], rev["minLength"], rev["maxLength"], rev["pattern"]) == (
        "string", 1, 128, "^[A-Za-z0-9._-]+$")


def test_served_model_name_pattern_and_length() -> None:
    name = prop("spec.model.servedModelName")
    assert (name["type"], name["minLength"], name["maxLength"], name["pattern"]) == (
        "string", 1, 128, "^[A-Za-z0-9][A-Za-z0-9._:/-]*$")


def test_every_string_is_bounded() -> None:
    """Every spec string has a maxLength (or an enum): bounded input, and bounded CEL costs.
    nodeSelector's keys are bounded by its rule, its values by maxLength."""
    unbounded = [p for p, node in _walk(SPEC)
                 if node.get("type") == "string" and "maxLength" not in node and "enum" not in node]
    assert unbounded == []
    assert prop("spec.placement.nodeSelector")["maxProperties"] == 64


def test_node_selector_keys_follow_label_syntax() -> None:
    [rule] = prop("spec.placement.nodeSelector")["x-kubernetes-validations"]
    check = CEL_EQUIVALENTS[rule["rule"]]
    ok = ["rack", "mlx-fleet.io/rack", "a" * 63, f"{'p' * 253}/{'n' * 63}", "x.y.z/A_b-c.9"]
    bad = ["", "-rack", "rack-", "a" * 64, f"{'p' * 254}/n", "Upper.io/rack", "a/b/c", "/rack", "ra ck"]
    assert [k for k in ok if not check({k: "v"})] == []
    assert [k for k in bad if check({k: "v"})] == []
    assert "label" in rule["message"]


def test_strategy_schema_and_rules() -> None:
    strategy = prop("spec.strategy")
    assert prop("spec.strategy.type")["enum"] == ["RollingUpdate"]
    for field in ("maxSurge", "maxUnavailable"):
        node = prop(f"spec.strategy.rollingUpdate.{field}")
        assert node["x-kubernetes-int-or-string"] is True
        assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}]
        [rule] = node["x-kubernetes-validations"]
        assert rule["message"].startswith("must be an integer >= 0 or a percentage")
    [both] = prop("spec.strategy.rollingUpdate")["x-kubernetes-validations"]
    assert both["message"] == "maxSurge and maxUnavailable may not both be 0"
    zero = CEL_EQUIVALENTS[both["rule"]]
    assert not zero({"maxSurge": 0, "maxUnavailable": 0})
    assert not zero({"maxSurge": "0%", "maxUnavailable": "00%"})
    assert zero({"maxSurge": 0, "maxUnavailable": "1%"}) and zero({"maxSurge": "10%", "maxUnavailable": 0})
    assert "rolling" in strategy["description"].lower()


def test_source_rule_is_the_contract_pattern_with_a_message() -> None:
    assert f"self.matches('{SOURCE_RE}')".replace("|", "\\|") in SPEC_DOC.read_text()
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


def test_every_cel_rule_has_a_message_and_a_python_check() -> None:
    rules = [r for _, node in _walk(SCHEMA) for r in node.get("x-kubernetes-validations", [])]
    assert len(rules) == 7, "the schema uses CEL rules"
    for rule in rules:
        assert rule.get("message"), rule
        assert rule["rule"] in CEL_EQUIVALENTS, f"no Python check declared for {rule['rule']!r}"


def test_status_schema() -> None:
    assert set(STATUS["properties"]) == {
        "observedGeneration", "replicas", "readyReplicas", "updatedReplicas", "nodes", "endpoints",
        "downloads", "conditions", "router"}
    assert prop("status.updatedReplicas")["type"] == "integer"
    router = prop("status.router")
    assert set(router["properties"]) == {"url", "model"} and router["required"] == ["url", "model"]
    nodes = prop("status.nodes")
    assert set(nodes["items"]["properties"]) == {
        "name", "revision", "role", "state", "reason", "message", "endpoint", "download",
        "digest"}
    assert nodes["items"]["properties"]["digest"]["maxLength"] == 128
    assert nodes["items"]["properties"]["state"]["enum"] == [
        "Pending", "Prefetching", "Loading", "Ready", "Unloaded", "Failed"]
    assert nodes["items"]["properties"]["role"]["enum"] == ["Stable", "Candidate", "Previous"]
    # One entry per (Mac, revision): a Mac hosts two revisions during a surge or a Canary. A
    # list-map key must be required or defaulted.
    assert (nodes["x-kubernetes-list-type"], nodes["x-kubernetes-list-map-keys"]) == (
        "map", ["name", "revision"])
    assert nodes["items"]["required"] == ["name"]
    assert nodes["items"]["properties"]["revision"]["default"] == ""
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
    assert item["properties"]["type"]["enum"] == ["Ready", "Progressing", "Degraded", "Scheduled",
                                                  "ServedNameConflict", "SourceAllowed",
                                                  "ReplicasConsistent"]
    assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert item["properties"]["lastTransitionTime"]["format"] == "date-time"
    assert item["properties"]["observedGeneration"]["type"] == "integer"


# --- The validator's own footing, then the shared cases --------------------------------------

@pytest.mark.parametrize(("text", "value"), [
    ("256Mi", 256 * 2**20), ("1.5Gi", 3 * 2**29), ("2G", 2 * 10**9), ("0", 0), ("-1Gi", -(2**30)),
    ("100m", 1), ("1e3", 1000), ("lots", None), ("2GB", None), ("1mi", None), ("", None),
])
def test_quantity_parser_and_schema_pattern_agree(text: str, value: int | None) -> None:
    """The memory rule's check parses with mlx_fleet.quantity (rounded up, like
    ``Quantity.Value()``); it and the schema's pattern agree on what a quantity is."""
    try:
        parsed: int | None = parse_quantity(text)
    except ValueError:
        parsed = None
    assert parsed == value
    assert (re.search(QUANTITY_PATTERN, text) is not None) == (value is not None)
    [rule] = prop("spec.resources.memory")["x-kubernetes-validations"]
    assert CEL_EQUIVALENTS[rule["rule"]](text) == (value is not None and value > 0)


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
