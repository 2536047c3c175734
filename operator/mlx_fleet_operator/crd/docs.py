#!/usr/bin/env python3
"""Generate docs/canary-api.md from the Canary CRD (crds/mlx-fleet.io_canaries.yaml).

One source per field: every field's type, bounds, default, pattern, rules and description come
from the CRD's OpenAPI schema; only the prose that is about no single field (manual actions,
the rules a schema cannot express) lives here. tests/test_field_contract.py regenerates the page
and fails when the committed one differs.

    python scripts/gen_canary_docs.py           # rewrite docs/canary-api.md
    python scripts/gen_canary_docs.py --check   # exit 1 when it is out of date
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import yaml

REPO = Path(__file__).resolve().parents[1]
CRD_PATH = REPO / "crds" / "mlx-fleet.io_canaries.yaml"
DOC_PATH = REPO / "docs" / "canary-api.md"

INTRO = """\
Example: [examples/canary.yaml](../examples/canary.yaml). The CRD enforces every bound below at
`kubectl apply`; the operator parses the same fields
(`operator/mlx_fleet_operator/canary_spec.py`, `CanarySpec`; tests/test_field_contract.py keeps the
two trees identical)."""

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


def generate(crd: dict[str, Any] | None = None) -> str:
    """The text of docs/canary-api.md for ``crd`` (default: the CRD file's)."""
    if crd is None:
        [crd] = [d for d in yaml.safe_load_all(CRD_PATH.read_text()) if d]
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
        "<!-- Generated by scripts/gen_canary_docs.py from crds/mlx-fleet.io_canaries.yaml: edit the CRD "
        "(or the script's prose) and run `python scripts/gen_canary_docs.py`. -->",
        f"# {names['kind']} {version['name']} — the field contract",
        identity,
        " ".join(schema["description"].split()),
        INTRO,
        "## spec\n\n" + " ".join(spec["description"].split()) + "\n\n" + _table(spec, "spec"),
        "## status\n\n" + " ".join(status["description"].split()) + "\n\n" + _table(status, "status"),
        "## Printer columns\n\n| Column | JSONPath | Description |\n|---|---|---|\n" + columns,
        MANUAL_ACTIONS,
        CROSS_OBJECT,
    ]) + "\n"


def main(argv: list[str]) -> int:
    text = generate()
    if "--check" in argv:
        if DOC_PATH.read_text() != text:
            print(f"{DOC_PATH.relative_to(REPO)} is out of date: run python scripts/gen_canary_docs.py",
                  file=sys.stderr)
            return 1
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
