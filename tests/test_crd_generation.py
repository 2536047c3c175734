"""The CRDs, the chart's copies and both field references are generated from the pydantic types
(``python -m mlx_fleet_operator.crd``): the committed files are exactly what the generator
writes, so a field can't drift; and the generator's own rules (type → OpenAPI), table-tested.

Pure: no cluster.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import pytest
import yaml
from pydantic import BaseModel, Field

from mlx_fleet_operator.crd.generate import COMMAND, RESOURCES, outputs, stale
from mlx_fleet_operator.crd.markers import INT_OR_STRING, Int32, Keywords, Rule, Wire
from mlx_fleet_operator.crd.schema import model_schema, rules_of

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted(outputs()))
def test_committed_file_is_the_generated_one(path: str) -> None:
    committed = REPO / path
    assert committed.is_file(), f"{path} is missing: run {COMMAND}"
    assert committed.read_text() == outputs()[path], (
        f"{path} differs from what the CRD types generate: change the types (spec.py, "
        f"canary_spec.py, crd/), never the file, and run {COMMAND}")


def test_generator_writes_crds_chart_copies_and_both_references() -> None:
    assert sorted(outputs()) == sorted([
        "crds/mlx-fleet.io_modeldeployments.yaml", "crds/mlx-fleet.io_canaries.yaml",
        "charts/mlx-fleet/crds/mlx-fleet.io_modeldeployments.yaml",
        "charts/mlx-fleet/crds/mlx-fleet.io_canaries.yaml",
        "docs/modeldeployment-api.md", "docs/canary-api.md"])


def test_check_names_stale_files_and_write_fixes_them(tmp_path: Path) -> None:
    """The CLI on a copy of the tree: --check fails naming the stale file and the command; a
    plain run rewrites it; --check passes after."""
    for path in outputs():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text((REPO / path).read_text())
    target = tmp_path / "crds" / "mlx-fleet.io_canaries.yaml"
    target.write_text(target.read_text().replace("maxItems: 32", "maxItems: 33"))
    assert stale(tmp_path) == ["crds/mlx-fleet.io_canaries.yaml"]
    env_path = f"{REPO}:{REPO / 'operator'}"
    run = [sys.executable, "-m", "mlx_fleet_operator.crd", "--root", str(tmp_path)]
    checked = subprocess.run([*run, "--check"], capture_output=True, text=True,
                             env={"PYTHONPATH": env_path}, check=False)
    assert checked.returncode == 1
    assert "crds/mlx-fleet.io_canaries.yaml" in checked.stderr and COMMAND in checked.stderr
    wrote = subprocess.run(run, capture_output=True, text=True, env={"PYTHONPATH": env_path},
                           check=True)
    assert wrote.stdout.split() == ["wrote", "crds/mlx-fleet.io_canaries.yaml"]
    assert stale(tmp_path) == []


def test_every_rule_has_a_message_and_a_python_check() -> None:
    for resource in RESOURCES:
        rules = resource.rules()
        assert rules, resource.kind
        for rule in rules:
            assert rule.message and callable(rule.check), rule.rule
        in_yaml = [r["rule"] for r in _rules_in(resource.manifest())]
        assert sorted(in_yaml) == sorted(r.rule for r in rules)


def _rules_in(node: object) -> list[dict]:
    out: list[dict] = []
    if isinstance(node, dict):
        out += node.get("x-kubernetes-validations", [])
        for key, value in node.items():
            if key != "x-kubernetes-validations":
                out += _rules_in(value)
    elif isinstance(node, list):
        for value in node:
            out += _rules_in(value)
    return out


# --- The type → OpenAPI rules ---------------------------------------------------------------------

POSITIVE = Rule("self > 0", "must be positive", check=lambda v: v > 0)
BOTH = Rule("has(self.a) == has(self.b)", "a and b go together",
            check=lambda v: ("a" in v) == ("b" in v), field_path=".a", reason="FieldValueInvalid")


class Item(BaseModel):
    """One item."""

    crd_rules: ClassVar[tuple[Rule, ...]] = (BOTH,)

    a: int | None = None
    b: int | None = None


class Inner(BaseModel):
    flag: bool = Field(default=True, description="A flag.")


class Sample(BaseModel):
    name: Annotated[str, Field(min_length=1, max_length=8, pattern="^[a-z]+$")] = Field(
        description="The name.")
    count: Annotated[Int32, Field(ge=0, le=10), POSITIVE] = 1
    ratio: Annotated[float, Field(gt=0, le=1)] | None = None
    mode: Literal["A", "B"] = "A"
    surge: int | str = Field(default="25%", alias="maxSurge")
    seconds: Annotated[float, Wire({"type": "string", "maxLength": 4})] = Field(
        default="10s", validate_default=False)
    raw: Annotated[int, Wire({"type": "string"}, default="M3")] = 3
    labels: Annotated[dict[str, Annotated[str, Field(max_length=3)]], Field(max_length=2)] = Field(
        default_factory=dict)
    items: Annotated[tuple[Item, ...], Field(max_length=5),
                     Keywords(**{"x-kubernetes-list-type": "atomic"})] = ()
    inner: Inner = Field(default_factory=Inner, description="Inner.")
    value: Annotated[float, Keywords(nullable=True)] | None = None


def test_model_schema_table() -> None:
    props = model_schema(Sample, description="  A   sample. ")["properties"]
    assert model_schema(Sample)["required"] == ["name"]
    assert model_schema(Sample, description="  A   sample. ")["description"] == "A sample."
    assert props["name"] == {"type": "string", "description": "The name.", "minLength": 1,
                             "maxLength": 8, "pattern": "^[a-z]+$"}
    assert props["count"] == {"type": "integer", "format": "int32", "default": 1, "minimum": 0,
                              "maximum": 10, "x-kubernetes-validations": [
                                  {"rule": "self > 0", "message": "must be positive"}]}
    assert props["ratio"] == {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1}
    assert props["mode"] == {"type": "string", "default": "A", "enum": ["A", "B"]}
    assert props["maxSurge"] == {**INT_OR_STRING, "default": "25%"}
    assert props["seconds"] == {"type": "string", "default": "10s", "maxLength": 4}
    assert props["raw"] == {"type": "string", "default": "M3"}
    assert props["labels"] == {"type": "object", "maxProperties": 2,  # a dict default: none
                               "additionalProperties": {"type": "string", "maxLength": 3}}
    assert props["items"] == {
        "type": "array", "x-kubernetes-list-type": "atomic", "maxItems": 5,
        "items": {"type": "object", "description": "One item.",
                  "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                  "x-kubernetes-validations": [{"rule": BOTH.rule, "fieldPath": ".a",
                                                "reason": "FieldValueInvalid",
                                                "message": BOTH.message}]}}
    assert props["inner"] == {"type": "object", "description": "Inner.", "default": {},
                              "properties": {"flag": {"type": "boolean", "description": "A flag.",
                                                      "default": True}}}
    assert props["value"] == {"type": "number", "nullable": True}
    assert rules_of(Sample) == [POSITIVE, BOTH]


def test_unsupported_types_fail_loudly() -> None:
    class Bad(BaseModel):
        x: int | float = 0

    with pytest.raises(TypeError, match="union"):
        model_schema(Bad)


def test_generated_crds_are_structural_and_documented() -> None:
    """Every node has a type (int-or-string ones exactly int|string), every field but metadata
    a description."""
    for resource in RESOURCES:
        schema = resource.manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

        def walk(node: dict, path: str) -> None:
            if node.get("x-kubernetes-int-or-string"):
                assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            else:
                assert node.get("type") in {"object", "array", "string", "integer", "number",
                                            "boolean"}, path
            for key, sub in node.get("properties", {}).items():
                assert sub.get("description") or f"{path}.{key}" == ".metadata", f"{path}.{key}"
                walk(sub, f"{path}.{key}")
            if isinstance(node.get("items"), dict):
                walk(node["items"], f"{path}[]")

        walk(schema, "")


def test_generated_yaml_loads_as_the_manifest() -> None:
    for resource in RESOURCES:
        from mlx_fleet_operator.crd.generate import crd_yaml
        assert yaml.safe_load(crd_yaml(resource)) == resource.manifest()
