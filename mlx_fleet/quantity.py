"""Kubernetes resource quantities and byte formatting: the one grammar of the whole project.

The operator (``spec.resources.memory``, a Canary's ``candidate.memory``) and the agent
(``--simulated-memory``) parse memory through :func:`parse_quantity`, so a value means the same on
both sides and nothing the API server refuses is accepted elsewhere. The grammar is the API
server's own (``k8s.io/apimachinery/pkg/api/resource``, the regular expression the CRD's
``x-kubernetes-int-or-string`` pattern uses): an optional sign, a decimal number, then one binary
suffix (``Ki Mi Gi Ti Pi Ei``), one decimal SI suffix (``n u m k M G T P E``) or an exponent
(``e3``). No spaces, no ``"GB"``. Pure: standard library only.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal

__all__ = ["parse_quantity", "positive_quantity", "format_bytes"]

#: Suffix → multiplier, as in k8s.io/apimachinery/pkg/api/resource (binary SI, decimal SI).
_SUFFIXES: dict[str, Decimal] = {
    "Ki": Decimal(1024), "Mi": Decimal(1024) ** 2, "Gi": Decimal(1024) ** 3,
    "Ti": Decimal(1024) ** 4, "Pi": Decimal(1024) ** 5, "Ei": Decimal(1024) ** 6,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("0.001"), "": Decimal(1),
    "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
}
_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)|[eE](?P<exp>[+-]?[0-9]+))?")


def parse_quantity(value: str | int) -> int:
    """A Kubernetes resource quantity → whole units (bytes for memory), rounded up like
    ``Quantity.Value()``.

    ``"64Gi"`` → 68719476736, ``"512Mi"``, ``"1.5G"``, ``"1e9"``, ``"1500m"`` (→ 2), an int.
    Raises ``ValueError`` naming the input for anything else (``"64 Gi"``, ``"64GB"``, ``""``,
    a bool, a float, an exponent beyond ±60). Negative quantities parse; the caller decides
    whether they are allowed.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"invalid quantity {value!r}: expected an integer or a string like '2Gi'")
    if isinstance(value, int):
        return value
    m = _QUANTITY.fullmatch(value)
    if not m:
        raise ValueError(f"invalid quantity {value!r}: expected a number with an optional "
                         f"suffix (Ki, Mi, Gi, Ti, Pi, Ei, n, u, m, k, M, G, T, P, E) or "
                         f"exponent, no spaces, e.g. '64Gi'")
    num = Decimal(m["num"])
    if m["exp"] is not None:
        exp = int(m["exp"])
        if abs(exp) > 60:
            raise ValueError(f"invalid quantity {value!r}: exponent out of range")
        num = num.scaleb(exp)
    else:
        num *= _SUFFIXES[m["suffix"] or ""]
    result = int(num.to_integral_value(rounding=ROUND_CEILING))
    return -result if m["sign"] == "-" else result


def positive_quantity(text: str) -> int:
    """A Kubernetes quantity of at least one (the agent's and the router's
    ``--max-prompt-bytes``); raises ``ValueError``."""
    n = parse_quantity(text)
    if n < 1:
        raise ValueError(f"must be at least 1, got {text!r}")
    return n


def format_bytes(n: int) -> str:
    """Bytes → a short human text in binary units with one decimal: ``1536`` → ``"1.5KiB"``,
    ``512`` → ``"512B"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{int(value)}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")
