"""What a pydantic field or model declares for its CRD schema beyond what pydantic knows.

Used as ``typing.Annotated`` metadata on a field (pydantic ignores objects it does not know)::

    source: Annotated[str, Field(min_length=1, max_length=2048), SOURCE_RULE]
    replicas: Annotated[Int32, Field(ge=0, le=1000)] = 1

and, for a rule about a whole object, as the model's class variable ``crd_rules: ClassVar[
tuple[Rule, ...]]`` (pydantic ignores class variables). :mod:`.schema` turns them into OpenAPI.

Pure: the standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Mapping

__all__ = ["Rule", "Keywords", "Wire", "Int32", "Int64", "QUANTITY_PATTERN", "INT_OR_STRING"]


@dataclass(frozen=True)
class Rule:
    """A CEL validation rule (``x-kubernetes-validations`` entry) of the field or model it is
    declared on, evaluated by the API server on the JSON value (``self``).

    ``check``: the same predicate in Python over the same JSON value (a value that passed the
    OpenAPI keywords of its node), for the pure schema tests and the parser's second line of
    defence; the real kube-apiserver tests (tests/test_controlplane.py, tests/test_canary_crd.py)
    run the same cases against the CEL text. ``field_path``/``reason``: as in
    ``ValidationRule`` (the path, relative to the node, the API server's error names).
    """

    rule: str
    message: str
    check: Callable[[Any], bool] = field(compare=False, repr=False)
    field_path: str | None = None
    reason: str | None = None

    def openapi(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule}
        if self.field_path is not None:
            out["fieldPath"] = self.field_path
        if self.reason is not None:
            out["reason"] = self.reason
        out["message"] = self.message
        return out


@dataclass(frozen=True)
class Keywords:
    """Extra OpenAPI keywords merged into the field's schema node last (``format``,
    ``maxLength``, ``nullable``, ``x-kubernetes-list-type`` ...)."""

    text: str  # the keywords as JSON: hashable, as typing requires of Annotated metadata

    def __init__(self, **keywords: Any) -> None:
        object.__setattr__(self, "text", json.dumps(keywords))

    @property
    def keywords(self) -> dict[str, Any]:
        return json.loads(self.text)


@dataclass(frozen=True)
class Wire:
    """The field's JSON schema where it differs from its Python type (a quantity parsed into
    bytes, a duration into seconds, ``"M3"`` into 3): ``schema`` replaces the node derived from
    the type (description, rules and :class:`Keywords` are still added). ``default``: the JSON
    default where it is not the field's own default (absent: the field's, which then is JSON,
    parsed through ``validate_default=True``)."""

    text: str  # the schema as JSON (hashable)
    default: Any = ...

    def __init__(self, schema: Mapping[str, Any], default: Any = ...) -> None:
        object.__setattr__(self, "text", json.dumps(schema))
        object.__setattr__(self, "default", default)

    @property
    def schema(self) -> dict[str, Any]:
        return json.loads(self.text)


#: A 32-bit / 64-bit integer field (OpenAPI ``format``, as Kubernetes' int32/int64 fields).
Int32 = Annotated[int, Keywords(format="int32")]
Int64 = Annotated[int, Keywords(format="int64")]

#: Kubernetes' quantity syntax (``resource.Quantity``, the pattern of its OpenAPI schema).
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")

#: The structural schema of an ``IntOrString`` value.
INT_OR_STRING: Mapping[str, Any] = {"x-kubernetes-int-or-string": True,
                                    "anyOf": [{"type": "integer"}, {"type": "string"}]}

