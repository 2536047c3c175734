"""A custom resource declared once in Python → its CustomResourceDefinition manifest.

Pure: pydantic and the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from .markers import Rule
from .schema import model_schema

__all__ = ["PrinterColumn", "Resource", "GROUP", "VERSION", "CATEGORY", "LABELS"]

GROUP = "mlx-fleet.io"
VERSION = "v1alpha1"
CATEGORY = "mlx-fleet"
LABELS = {"app.kubernetes.io/name": "mlx-fleet", "app.kubernetes.io/part-of": "mlx-fleet"}

_API_VERSION_DOC = ("APIVersion defines the versioned schema of this representation of an "
                    "object. More info: https://git.k8s.io/community/contributors/devel/"
                    "sig-architecture/api-conventions.md#resources")
_KIND_DOC = ("Kind is a string value representing the REST resource this object represents. "
             "More info: https://git.k8s.io/community/contributors/devel/sig-architecture/"
             "api-conventions.md#types-kinds")


@dataclass(frozen=True)
class PrinterColumn:
    """One ``additionalPrinterColumns`` entry; ``priority`` 1: shown by ``-o wide`` only."""

    name: str
    type: str
    description: str
    json_path: str
    priority: int = 0

    def openapi(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "type": self.type}
        if self.priority:
            out["priority"] = self.priority
        out.update(description=self.description, jsonPath=self.json_path)
        return out


@dataclass(frozen=True)
class Resource:
    """A namespaced custom resource of :data:`GROUP` at :data:`VERSION`, served and stored,
    in the :data:`CATEGORY` category, with a status subresource.

    ``spec``/``status``: the models of the two halves, described by ``spec_doc``/``status_doc``;
    ``doc``: the object's description. ``comment``: the lines heading the YAML file.
    ``scale``: the scale subresource's paths (``specReplicasPath``, ``statusReplicasPath``,
    optional ``labelSelectorPath``), None for none.
    """

    kind: str
    plural: str
    short_names: tuple[str, ...]
    doc: str
    spec: type[BaseModel]
    spec_doc: str
    status: type[BaseModel]
    status_doc: str
    columns: tuple[PrinterColumn, ...]
    comment: str = ""
    scale: dict[str, str] | None = None
    singular: str = field(default="")

    @property
    def name(self) -> str:
        return f"{self.plural}.{GROUP}"

    def schema(self, rules: list[Rule] | None = None) -> dict[str, Any]:
        """The ``openAPIV3Schema``; ``rules`` collects every CEL rule, in schema order."""
        return {
            "type": "object",
            "description": " ".join(self.doc.split()),
            "required": ["spec"],
            "properties": {
                "apiVersion": {"type": "string", "description": _API_VERSION_DOC},
                "kind": {"type": "string", "description": _KIND_DOC},
                "metadata": {"type": "object"},
                "spec": model_schema(self.spec, description=self.spec_doc, rules=rules),
                "status": model_schema(self.status, description=self.status_doc, rules=rules),
            },
        }

    def rules(self) -> list[Rule]:
        """Every CEL rule of the schema, with its Python check."""
        found: list[Rule] = []
        self.schema(found)
        return found

    def manifest(self) -> dict[str, Any]:
        """The CustomResourceDefinition (apiextensions.k8s.io/v1) as plain data."""
        subresources: dict[str, Any] = {"status": {}}
        if self.scale is not None:
            subresources["scale"] = dict(self.scale)
        return {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": self.name, "labels": dict(LABELS)},
            "spec": {
                "group": GROUP,
                "scope": "Namespaced",
                "names": {"kind": self.kind, "listKind": f"{self.kind}List", "plural": self.plural,
                          "singular": self.singular or self.kind.lower(),
                          "shortNames": list(self.short_names), "categories": [CATEGORY]},
                "versions": [{
                    "name": VERSION, "served": True, "storage": True,
                    "subresources": subresources,
                    "additionalPrinterColumns": [c.openapi() for c in self.columns],
                    "schema": {"openAPIV3Schema": self.schema()},
                }],
            },
        }
