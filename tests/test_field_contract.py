"""One source per field: the CRDs, the operator's parsers and the generated docs agree.

* The spec fields of each CRD and the alias tree of the pydantic model the operator parses that
  spec with are the same set of paths: ModelDeployment ↔ ``mlx_fleet_operator.spec.DeploymentSpec``,
  Canary ↔ ``mlx_fleet_operator.canary_spec.CanarySpec``. A field in one and not the other fails,
  named.
* The CRD's defaults and the parser's are the same (parsing a spec with or without the API
  server's defaulting gives the same result), and every object the CRD accepts (the valid cases)
  parses.
* What the operator writes into a Canary's ``status.lastAnalysis`` fits the CRD's status schema.
* docs/modeldeployment-api.md and docs/canary-api.md name every field of their CRD (both are
  generated with the CRDs from the types; tests/test_crd_generation.py keeps them up to date).

Pure: no cluster.
"""

from __future__ import annotations

import collections.abc
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, Field

import canary_crd_cases
import crd_cases
from test_crds import apply_defaults

REPO = Path(__file__).resolve().parents[1]
MD_CRD = REPO / "crds" / "mlx-fleet.io_modeldeployments.yaml"
CANARY_CRD = REPO / "crds" / "mlx-fleet.io_canaries.yaml"
CANARY_DOC = REPO / "docs" / "canary-api.md"
MD_DOC = REPO / "docs" / "modeldeployment-api.md"


def _schema(path: Path) -> dict[str, Any]:
    [crd] = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


# --- The two trees -------------------------------------------------------------------------------

def crd_paths(node: dict[str, Any], prefix: str = "spec") -> set[str]:
    """Every field path below ``node`` (``spec.steps[].pause.duration``); maps and
    int-or-string values are leaves."""
    out: set[str] = set()
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}.{key}"
        out.add(path)
        out |= crd_paths(sub, path)
        if isinstance(sub.get("items"), dict):
            out |= crd_paths(sub["items"], f"{path}[]")
    return out


def _model_of(annotation: Any) -> tuple[str, type[BaseModel] | None]:
    """``("[]" per list level, the pydantic model inside)`` of a field's type, or ``("", None)``
    for a leaf. Optional/Annotated are unwrapped; dicts are leaves (maps)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _model_of(args[0])
    if origin in (typing.Union, types.UnionType):
        found = [_model_of(a) for a in args if a is not type(None)]
        models = [f for f in found if f[1] is not None]
        return models[0] if models else ("", None)
    if origin in (list, tuple, set, frozenset, collections.abc.Sequence):
        inner = [a for a in args if a is not Ellipsis]
        suffix, model = _model_of(inner[0]) if inner else ("", None)
        return ("[]" + suffix, model) if model is not None else ("", None)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "", annotation
    return "", None


def model_paths(model: type[BaseModel], prefix: str = "spec") -> set[str]:
    """Every field path of ``model`` by the names the spec uses (aliases)."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}.{info.alias or name}"
        out.add(path)
        suffix, sub = _model_of(info.annotation)
        if sub is not None:
            out |= model_paths(sub, path + suffix)
    return out


def _compare(crd: set[str], model: set[str], crd_name: str, model_name: str) -> None:
    only_crd, only_model = sorted(crd - model), sorted(model - crd)
    assert not only_crd and not only_model, (
        f"fields in the {crd_name} CRD but not in {model_name}: {only_crd}; "
        f"fields in {model_name} but not in the {crd_name} CRD: {only_model}")


def _canary_spec_module() -> Any:
    try:
        from mlx_fleet_operator import canary_spec
    except ImportError as e:  # the module is the operator's; the CRD must not get ahead of it
        pytest.fail(f"operator/mlx_fleet_operator/canary_spec.py (CanarySpec, parse_canary_spec) "
                    f"is missing or broken: {e}")
    return canary_spec


def test_the_tree_walkers_see_aliases_lists_and_optionals() -> None:
    class Leaf(BaseModel):
        x_y: int = 0

    class Item(BaseModel):
        leaf: Leaf | None = None

    class Root(BaseModel):
        items: typing.Annotated[tuple[Item, ...], "meta"] = ()
        things: list[Item] = []
        names: list[str] = []
        labels: dict[str, str] = {}
        renamed: int = Field(default=0, alias="reNamed")
    assert model_paths(Root) == {
        "spec.items", "spec.items[].leaf", "spec.items[].leaf.x_y", "spec.things", "spec.things[].leaf",
        "spec.things[].leaf.x_y", "spec.names", "spec.labels", "spec.reNamed"}
    assert crd_paths({"properties": {"a": {"type": "array", "items": {"properties": {"b": {}}}},
                                     "m": {"additionalProperties": {"type": "string"}}}}) == {
        "spec.a", "spec.a[].b", "spec.m"}


def test_modeldeployment_crd_and_deploymentspec_have_the_same_fields() -> None:
    from mlx_fleet_operator.spec import DeploymentSpec

    _compare(crd_paths(_schema(MD_CRD)["properties"]["spec"]), model_paths(DeploymentSpec),
             "ModelDeployment", "DeploymentSpec")


def test_canary_crd_and_canaryspec_have_the_same_fields() -> None:
    canary_spec = _canary_spec_module()
    _compare(crd_paths(_schema(CANARY_CRD)["properties"]["spec"]), model_paths(canary_spec.CanarySpec),
             "Canary", "CanarySpec")


# --- Defaults and accepted values ----------------------------------------------------------------

def _parsers() -> dict[str, tuple[Any, dict[str, Any], list[dict[str, Any]]]]:
    from mlx_fleet_operator.spec import parse_spec

    canary_spec = _canary_spec_module()
    return {
        "ModelDeployment": (parse_spec, _schema(MD_CRD), crd_cases.valid_examples()),
        "Canary": (canary_spec.parse_canary_spec, _schema(CANARY_CRD), canary_crd_cases.valid_examples()),
    }


@pytest.mark.parametrize("kind", ["ModelDeployment", "Canary"])
def test_crd_defaults_are_the_parsers_defaults(kind: str) -> None:
    """The API server's defaulting changes nothing the parser would not have filled in itself."""
    parse, schema, valid = _parsers()[kind]
    for obj in valid:
        spec = obj["spec"]
        defaulted = apply_defaults(schema, obj)["spec"]
        assert parse(defaulted) == parse(spec), obj["metadata"]["name"]


@pytest.mark.parametrize("kind", ["ModelDeployment", "Canary"])
def test_every_object_the_crd_accepts_parses(kind: str) -> None:
    parse, schema, valid = _parsers()[kind]
    for obj in valid:
        parse(apply_defaults(schema, obj)["spec"])


# --- Status written by the operator --------------------------------------------------------------

def test_last_analysis_written_by_the_operator_fits_the_canary_status_schema() -> None:
    from mlx_fleet_operator.analysis import AnalysisResult, CheckResult, Verdict

    analysis = _schema(CANARY_CRD)["properties"]["status"]["properties"]["lastAnalysis"]
    check = CheckResult("errorRate", Verdict.PASS, None, 0.0, 0.02, "ok")
    written = AnalysisResult(Verdict.PASS, (check,), 20, 20, "ok").to_dict()
    assert set(written) - set(analysis["properties"]) == set()
    assert set(written["checks"][0]) == set(analysis["properties"]["checks"]["items"]["properties"])
    assert {v.value for v in Verdict} == set(analysis["properties"]["verdict"]["enum"])


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "object": dict,
               "array": list, "boolean": bool}


def test_canary_state_written_by_the_operator_fits_the_canary_status_schema() -> None:
    """Every field the step machine persists exists in the CRD with its type — a field the API
    server would prune (or refuse) would be lost on an operator restart."""
    from mlx_fleet_operator.canary import CanaryState, Phase

    props = _schema(CANARY_CRD)["properties"]["status"]["properties"]
    state = CanaryState(phase=Phase.PROGRESSING, step_index=2, weight=50,
                        step_started=1_790_000_000.25, started=1_790_000_000.0,
                        stable_revision="v1", candidate_revision="v2", failed_windows=1,
                        last_analysis={"verdict": "Pass", "checks": []}, message="m",
                        reason="StepStarted", last_promote_token="a",
                        last_promote_full_token="b", last_abort_token="c",
                        memory_baseline_bytes=123)
    written = state.to_status()
    assert set(written) - set(props) == set(), "fields the API server would prune"
    for key, value in written.items():
        if value is not None:
            assert isinstance(value, _JSON_TYPES[props[key]["type"]]), (key, value)
    assert written["currentWeight"] == 50 and written["currentStepIndex"] == 2
    assert written["stepStarted"] == "2026-09-21T14:13:20.250Z"
    assert CanaryState.from_status(written) == state  # a restart resumes exactly


# --- The generated pages ------------------------------------------------------------------------

def test_canary_docs_name_every_field_and_manual_action() -> None:
    text = CANARY_DOC.read_text()
    schema = _schema(CANARY_CRD)
    for path in crd_paths(schema["properties"]["spec"]) | crd_paths(schema["properties"]["status"], "status"):
        assert f"`{path}`" in text, path
    for annotation in ("mlx-fleet.io/promote:", "mlx-fleet.io/promote-full:", "mlx-fleet.io/abort:"):
        assert annotation in text
    assert "InvalidSpec" in text and "spec.candidate.revision" in text and "spec.targetRef.name" in text


def test_modeldeployment_docs_name_every_field() -> None:
    text = MD_DOC.read_text()
    schema = _schema(MD_CRD)
    for path in crd_paths(schema["properties"]["spec"]) | crd_paths(schema["properties"]["status"], "status"):
        assert f"`{path}`" in text, path
