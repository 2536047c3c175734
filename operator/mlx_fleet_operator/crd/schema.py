"""A pydantic model → the structural OpenAPI v3 schema of a CRD (``openAPIV3Schema``).

What becomes what (the JSON names are the fields' aliases):

* ``bool`` ``int`` ``float`` ``str`` → ``boolean`` ``integer`` ``number`` ``string``; a
  ``Literal`` of strings or a string ``Enum`` → ``string`` with ``enum``; ``int | str`` →
  int-or-string; ``X | None`` → ``X`` (``None`` means absent, not ``null``: a nullable field says
  :class:`~.markers.Keywords` ``(nullable=True)``).
* ``tuple[X, ...]``/``list[X]`` → ``array``; ``dict[str, X]`` → ``object`` with
  ``additionalProperties``; a model → ``object`` with ``properties`` and ``required`` (its fields
  without a default), described by the field that holds it, or, as an array's items, by its
  docstring.
* pydantic's ``ge``/``gt``/``le``/``lt`` → ``minimum``/``maximum`` (``exclusiveMinimum: true``
  for ``gt``), ``min_length``/``max_length`` → ``minLength``/``maxLength`` (``minItems``/
  ``maxItems`` on arrays, ``maxProperties`` on maps), ``pattern`` → ``pattern``.
* ``Field(description=...)`` → ``description``; a scalar default → ``default``; a model default
  (``default_factory``) → ``default: {}`` so the API server applies the defaults inside it when
  the object is omitted; a ``None`` default or one of models (a list) → none.
* :class:`~.markers.Rule` metadata and a model's ``crd_rules`` → ``x-kubernetes-validations``;
  :class:`~.markers.Keywords` → merged last; :class:`~.markers.Wire` → replaces what the type
  would give (and its ``default``, when given, the field's). A field whose JSON differs from its
  Python value declares the JSON default and ``validate_default=True``, so the one default is
  parsed like any input (``"10s"`` → 10.0 seconds).

Pure: pydantic and the standard library.
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .markers import INT_OR_STRING, Keywords, Rule, Wire

__all__ = ["model_schema", "field_schema", "rules_of"]

#: Key order of a schema node in the generated YAML (the rest after, as declared).
_ORDER = ("type", "format", "x-kubernetes-int-or-string", "anyOf", "nullable", "description",
          "required", "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "default", "enum",
          "minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "minLength", "maxLength",
          "pattern", "minItems", "maxItems", "maxProperties", "properties", "additionalProperties",
          "items", "x-kubernetes-validations")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    rank = {k: i for i, k in enumerate(_ORDER)}
    return dict(sorted(node.items(), key=lambda kv: rank.get(kv[0], len(_ORDER))))


def _doc(text: str | None) -> str:
    return " ".join((text or "").split())


def _metadata(items: Sequence[Any]) -> list[Any]:
    """``Annotated`` metadata flattened: a ``Field(...)`` inside contributes its own metadata."""
    out: list[Any] = []
    for m in items:
        out.extend(_metadata(m.metadata) if isinstance(m, FieldInfo) else [m])
    return out


def _apply(node: dict[str, Any], metadata: Sequence[Any], rules: list[Rule] | None,
           *, constraints: bool = True) -> dict[str, Any]:
    """``node`` with the constraints, :class:`Keywords` and :class:`Rule` of ``metadata``."""
    kind = node.get("type")
    extra: dict[str, Any] = {}
    for m in _metadata(metadata):
        if isinstance(m, Rule):
            node.setdefault("x-kubernetes-validations", []).append(m.openapi())
            if rules is not None:
                rules.append(m)
        elif isinstance(m, Keywords):
            extra.update(m.keywords)
        elif not constraints:
            continue
        elif isinstance(m, at.Ge):
            node["minimum"] = m.ge
        elif isinstance(m, at.Gt):
            node["minimum"], node["exclusiveMinimum"] = m.gt, True
        elif isinstance(m, at.Le):
            node["maximum"] = m.le
        elif isinstance(m, at.Lt):
            node["maximum"], node["exclusiveMaximum"] = m.lt, True
        elif isinstance(m, (at.MinLen, at.MaxLen)):
            which = "min" if isinstance(m, at.MinLen) else "max"
            unit = {"array": "Items", "object": "Properties"}.get(kind, "Length")
            node[f"{which}{unit}"] = m.min_length if which == "min" else m.max_length
        elif getattr(m, "pattern", None) is not None:
            node["pattern"] = m.pattern
    node.update(extra)
    return node


def _wire(metadata: Sequence[Any]) -> Wire | None:
    return next((m for m in _metadata(metadata) if isinstance(m, Wire)), None)


def _annotated(tp: Any, metadata: Sequence[Any], rules: list[Rule] | None) -> dict[str, Any]:
    """The node of ``Annotated[tp, *metadata]``: a :class:`Wire`'s schema, else ``tp``'s with
    the pydantic constraints; then keywords and rules."""
    wire = _wire(metadata)
    if wire is not None:
        return _apply(wire.schema, metadata, rules, constraints=False)
    return _apply(_type_schema(tp, rules), metadata, rules)


def _type_schema(tp: Any, rules: list[Rule] | None) -> dict[str, Any]:
    """The schema node of a Python type (with the constraints of any ``Annotated`` in it)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _annotated(args[0], args[1:], rules)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:
            return _type_schema(members[0], rules)
        bases = {typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a
                 for a in members}
        if bases == {int, str}:
            return dict(INT_OR_STRING)
        raise TypeError(f"no CRD schema for the union {tp!r}")
    if origin is Literal:
        return {"type": "string", "enum": list(args)}
    if origin in (tuple, list, Sequence):
        [item] = [a for a in args if a is not Ellipsis]
        items = _type_schema(item, rules)
        if isinstance(item, type) and issubclass(item, BaseModel) and item.__doc__:
            items = _ordered({**items, "description": _doc(item.__doc__)})
        return {"type": "array", "items": items}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(args[1], rules)}
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return model_schema(tp, rules=rules)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"type": "string", "enum": [e.value for e in tp]}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if tp in simple:
        return {"type": simple[tp]}
    raise TypeError(f"no CRD schema for {tp!r}")


def _default(info: FieldInfo, wire: Wire | None) -> Any:
    """The JSON default of a field, or ``...`` for none."""
    if wire is not None and wire.default is not ...:
        return wire.default
    if info.default_factory is not None:
        made = info.default_factory()  # type: ignore[call-arg]
        return {} if isinstance(made, BaseModel) else ...
    value = info.default
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (bool, int, float, str)):
        return value
    return ...  # PydanticUndefined, None, a tuple of models: no default


def field_schema(info: FieldInfo, rules: list[Rule] | None = None) -> dict[str, Any]:
    """The schema node of one model field (see the module docstring)."""
    node = _annotated(info.annotation, info.metadata, rules)
    if info.description:
        node["description"] = _doc(info.description)
    default = _default(info, _wire(info.metadata))
    if default is not ... and default is not PydanticUndefined:
        node["default"] = default
    return _ordered(node)


def model_schema(model: type[BaseModel], *, description: str | None = None,
                 rules: list[Rule] | None = None) -> dict[str, Any]:
    """The ``object`` node of ``model``; ``rules`` (when given) collects every :class:`Rule`
    met, in schema order."""
    node: dict[str, Any] = {"type": "object"}
    if description:
        node["description"] = _doc(description)
    fields = model.model_fields
    required = [info.alias or name for name, info in fields.items() if info.is_required()]
    if required:
        node["required"] = required
    node["properties"] = {info.alias or name: field_schema(info, rules)
                          for name, info in fields.items()}
    own: tuple[Rule, ...] = getattr(model, "crd_rules", ())
    if own:
        node["x-kubernetes-validations"] = [r.openapi() for r in own]
        if rules is not None:
            rules.extend(own)
    return _ordered(node)


def rules_of(model: type[BaseModel]) -> list[Rule]:
    """Every :class:`Rule` declared on ``model`` and the models below it."""
    found: list[Rule] = []
    model_schema(model, rules=found)
    return found
