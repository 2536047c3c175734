"""Reading the ``--source-policy`` value of the operator and the agent (a file or inline
JSON/YAML) into a :class:`~mlx_fleet.source_policy.SourcePolicy`: the one place that touches
a file for it, at start-up."""

from __future__ import annotations

from .source_policy import DEFAULT_POLICY, PolicyError, SourcePolicy, parse_policy

__all__ = ["load_policy", "ENV_SOURCE_POLICY"]

#: Environment variable read when ``--source-policy`` is not given (both processes).
ENV_SOURCE_POLICY = "MLX_FLEET_SOURCE_POLICY"


def load_policy(value: str | None) -> SourcePolicy:
    """The ``--source-policy`` value: inline JSON/YAML when it starts with ``{``, else the path
    of a JSON/YAML file. None or empty: the secure default
    (:data:`~mlx_fleet.source_policy.DEFAULT_POLICY`). Raises
    :class:`~mlx_fleet.source_policy.PolicyError` (a ``ValueError``, one line)."""
    if value is None or not value.strip():
        return DEFAULT_POLICY
    text = value.strip()
    if not text.startswith("{"):
        try:
            with open(text, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise PolicyError(f"cannot read the source policy file {value}: "
                              f"{e.strerror or e}") from None
    return parse_policy(text)
