"""The field references docs/modeldeployment-api.md and docs/canary-api.md, generated from the
CRDs (themselves generated from the pydantic types, :mod:`.resource`).

Every field's type, bounds, default, pattern, rules and description come from the CRD's OpenAPI
schema; only the prose that is about no single field (examples, manual actions, the rules a
schema cannot express) lives here. Pure: the standard library.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

__all__ = ["generate", "modeldeployment_page", "canary_page"]

MODEL_DEPLOYMENT_INTRO = """\
Example: [examples/modeldeployment.yaml](../examples/modeldeployment.yaml). The CRD enforces every
bound below at `kubectl apply`; the operator parses the same fields
(`operator/mlx_fleet_operator/spec.py`, `DeploymentSpec`, from which the CRD and this page are
generated)."""

MODEL_DEPLOYMENT_NOTES = """\
## Notes

* `spec.model.source`: `hf://org/repo` downloads through huggingface_hub (its cache and offline
  mode); `https://mirror/dir/` needs a `manifest.json` with sizes and sha256 (resumable, verified
  downloads).
* Standby: a replica idle for `spec.lifecycle.idleUnloadSeconds` is unloaded (its memory
  returned) but stays assigned; its `status.nodes[]` entry reads `Unloaded` with reason
  `IdleUnloaded`, then `Loading` with reason `ReloadingOnDemand` while the next request, which
  waits for it, reloads it. A standby replica counts as ready (`readyReplicas`,
  `updatedReplicas`, `endpoints`, the Ready condition) and is not a failure.
* `status.nodes[].reason` `Withdrawn`: the replica is replaced while its Mac drains and is out of
  `status.endpoints`.
* `status.replicas` counts the Macs with a Stable or Previous replica placed, `readyReplicas` those
  with a Ready (or standby) one.
* Condition `Scheduled` False with reason `Unschedulable`: replicas that fit nowhere, with needed vs
  free memory per node in its message (docs/operator.md).
* `spec.strategy.rollingUpdate`: when percents make both limits resolve to 0 for the replica count,
  a surge of 1 is used, as the Deployment controller does.

A Canary (docs/canary-api.md) releases a new revision of a ModelDeployment progressively,
with traffic weights and automatic analysis, instead of the rolling update above."""

CANARY_INTRO = """\
Example: [examples/canary.yaml](../examples/canary.yaml). The CRD enforces every bound below at
`kubectl apply`; the operator parses the same fields
(`operator/mlx_fleet_operator/canary_spec.py`, `CanarySpec`, from which the CRD and this page are
generated)."""

MANUAL_ACTIONS = """\
## Manual actions (annotations)

Manual actions are annotations on the Canary. The value is a token: any value the operator has not
acted on yet is a new request (a timestamp does); it records the last one it acted on in
`status.lastPromoteToken` or `status.lastAbortToken`, so re-applying the same manifest repeats
nothing.

| Annotation | Effect |
|---|---|
| `mlx-fleet.io/promote: <token>` | Advance past the current step or pause (a `pause` without `duration` waits for this). |
| `mlx-fleet.io/promote-full: <token>` | Promote now: skip the remaining steps; the target's `spec.model.revision` becomes the candidate's (phase `Promoting`, then `Succeeded`). |
| `mlx-fleet.io/abort: <token>` | Stop: weight 0, the candidate is unloaded, phase `Aborted`. |

The CLI shows and sets them: `mlx-fleet canary status NAME`, `mlx-fleet canary promote NAME`,
`mlx-fleet canary abort NAME`. With kubectl:

```sh
kubectl annotate canary NAME --overwrite mlx-fleet.io/promote="$(date +%s)"
kubectl annotate canary NAME --overwrite mlx-fleet.io/promote-full="$(date +%s)"
kubectl annotate canary NAME --overwrite mlx-fleet.io/abort="$(date +%s)"
```"""

CROSS_OBJECT = """\
## Rules the schema cannot express

A CRD schema validates one object on its own, so `kubectl apply` accepts these; the operator
enforces them when it reconciles: phase `Failed`, condition `Degraded` with reason `InvalidSpec`,
and a Warning event naming the field.

* `spec.candidate.revision` must differ from the target ModelDeployment's `spec.model.revision`.
* One active Canary per ModelDeployment (`spec.targetRef.name`): a second Canary for the same target
  fails while the first is not finished (`Succeeded`, `RolledBack`, `Aborted` or `Failed`).

`spec.targetRef.name` must also name a ModelDeployment in the Canary's own namespace (there is no
namespace field); whether it exists is, again, only known to the operator."""


def _walk(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """``(path, node, required)`` depth first, parents before children."""
    for key, sub in node.get("properties", {}).items():
        child = f"{path}.{key}"
        yield child, sub, key in node.get("required", [])
        yield from _walk(sub, child)
        if isinstance(sub.get("items"), dict):
            yield from _walk(sub["items"], f"{child}[]")


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    t = node.get("type", "")
    if isinstance(node.get("additionalProperties"), dict):
        return f"map[string]{_type(node['additionalProperties'])}"
    if t == "array":
        item = node["items"]
        return f"[]{'object' if item.get('type') == 'object' else _type(item)}"
    if node.get("format") == "date-time":
        return "string (date-time)"
    return t + (", nullable" if node.get("nullable") else "")


def _code(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return "`" + text.replace("|", "\\|") + "`"


def _constraints(node: dict[str, Any], required: bool) -> str:
    parts: list[str] = ["required"] if required else []
    if "enum" in node:
        parts.append("one of " + ", ".join(_code(v) for v in node["enum"]))
    lo, hi = node.get("minimum"), node.get("maximum")
    if lo is not None:
        parts.append(f"{'>' if node.get('exclusiveMinimum') else '>='} {lo}")
    if hi is not None:
        parts.append(f"{'<' if node.get('exclusiveMaximum') else '<='} {hi}")
    if "minLength" in node or "maxLength" in node:
        lo_len, hi_len = node.get("minLength"), node.get("maxLength")
        parts.append(f"{lo_len}..{hi_len} chars" if lo_len is not None and hi_len is not None
                     else f"at most {hi_len} chars" if hi_len is not None else f"at least {lo_len} chars")
    if "maxItems" in node:
        parts.append(f"at most {node['maxItems']} items")
    if "maxProperties" in node:
        parts.append(f"at most {node['maxProperties']} entries")
    values = node.get("additionalProperties")
    if isinstance(values, dict) and _constraints(values, False):
        parts.append(f"values: {_constraints(values, False)}")
    if "pattern" in node:
        parts.append("pattern " + _code(node["pattern"]))
    if "x-kubernetes-list-map-keys" in node:
        parts.append("list-map keyed by " + ", ".join(_code(k) for k in node["x-kubernetes-list-map-keys"]))
    for rule in node.get("x-kubernetes-validations", []):
        parts.append(f"rule {_code(rule['rule'])}: {rule['message']}")
    return "; ".join(parts)


def _table(root: dict[str, Any], path: str) -> str:
    rows = ["| Field | Type | Default | Constraints | Description |", "|---|---|---|---|---|"]
    for p, node, required in _walk(root, path):
        default = _code(node["default"]) if "default" in node and node["default"] != {} else ""
        desc = " ".join(node.get("description", "").split()).replace("|", "\\|")
        rows.append(f"| `{p}` | {_type(node)} | {default} | {_constraints(node, required)} | {desc} |")
    return "\n".join(rows)


def generate(crd: dict[str, Any], intro: str, *extra: str) -> str:
    """The field reference of the resource whose CustomResourceDefinition is ``crd``: identity,
    description, ``intro``, the spec and status tables, the printer columns, then ``extra``
    sections."""
    names, [version] = crd["spec"]["names"], crd["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    api = f"{crd['spec']['group']}/{version['name']}"
    identity = (f"apiVersion: `{api}`, kind: `{names['kind']}`, plural `{names['plural']}`, "
                f"singular `{names['singular']}`, shortNames [{', '.join(names.get('shortNames', []))}], "
                f"categories [{', '.join(names.get('categories', []))}], "
                f"{'namespaced' if crd['spec']['scope'] == 'Namespaced' else 'cluster-scoped'}"
                f"{', status subresource' if 'status' in version.get('subresources', {}) else ''}.")
    columns = "\n".join(f"| {c['name']} | `{c['jsonPath']}` | {c['description']} |"
                        for c in version.get("additionalPrinterColumns", []))
    spec, status = schema["properties"]["spec"], schema["properties"]["status"]
    return "\n\n".join([
        f"<!-- Generated by `python -m mlx_fleet_operator.crd` from the {names['kind']} types "
        f"(operator/mlx_fleet_operator/): edit them (or the prose in crd/docs.py) and rerun it. -->",
        f"# {names['kind']} {version['name']} — the field contract",
        identity,
        " ".join(schema["description"].split()),
        intro,
        "## spec\n\n" + " ".join(spec["description"].split()) + "\n\n" + _table(spec, "spec"),
        "## status\n\n" + " ".join(status["description"].split()) + "\n\n" + _table(status, "status"),
        "## Printer columns\n\n| Column | JSONPath | Description |\n|---|---|---|\n" + columns,
        *extra,
    ]) + "\n"


def modeldeployment_page(crd: dict[str, Any]) -> str:
    """docs/modeldeployment-api.md for the ModelDeployment CRD ``crd``."""
    return generate(crd, MODEL_DEPLOYMENT_INTRO, MODEL_DEPLOYMENT_NOTES)


def canary_page(crd: dict[str, Any]) -> str:
    """docs/canary-api.md for the Canary CRD ``crd``."""
    return generate(crd, CANARY_INTRO, MANUAL_ACTIONS, CROSS_OBJECT)
