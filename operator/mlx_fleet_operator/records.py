"""The per-object records the operator keeps in memory (plain data, no I/O).

* :class:`CandidateIntent`: what a running Canary asks of its target's placement;
* :class:`CanaryRecord`: per Canary (by uid), what its daemon remembers between ticks — the
  last analysis window's end and the status last patched (kopf's ``body`` lags behind it).

Held by the operator's :class:`~.handlers.Runtime`, never in module globals; lost on restart
(a restarted operator re-arms the window and reads the status back from the object).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlx_fleet.contract import StatsReport

from .analysis import WindowStats

#: A ModelDeployment (or a Canary's target): (namespace, name).
DeploymentKey = tuple[str, str]
#: One replica of a deployment: (node, revision).
Slot = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class CandidateIntent:
    """What a running Canary asks of its target ModelDeployment's placement: keep the
    candidate ``revision`` resident (``source``/``memory_bytes``: None = the target's)."""

    canary: str
    revision: str
    source: str | None = None
    memory_bytes: int | None = None


@dataclasses.dataclass
class AnalysisWindow:
    """The statistics snapshot the last analysis window ended at (``at``: the tick's clock,
    seconds; ``reports``: node → the agents' cumulative statistics then), and the last stable
    window that had enough requests to judge against (``baseline``)."""

    at: float
    reports: dict[str, StatsReport]
    baseline: WindowStats | None = None


@dataclasses.dataclass
class CanaryRecord:
    """What one Canary's daemon keeps between ticks: ``window`` (None: none ended yet) and
    ``last_status``, the status it patched last (``{}``: none)."""

    window: AnalysisWindow | None = None
    last_status: dict[str, Any] = dataclasses.field(default_factory=dict)
