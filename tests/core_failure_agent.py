"""``python tests/core_failure_agent.py AGENT-FLAGS...``: the real node agent process
(``node_agent.main.main``) whose serving core fails as soon as it starts loading a model: the
MLX thread's first load step raises a ``BaseException`` that no guard on the thread contains
(the failure mode of ``tests/test_serving.py``'s fatal-thread test, in a process of its own).
Used by ``tests/test_integration_agent.py`` (a failed serving core in a real agent process)."""

from __future__ import annotations

import sys

from node_agent.main import main
from node_agent.serving.engine import Engine


class InjectedThreadDeath(BaseException):
    """Not an ``Exception``: it ends the MLX thread."""


def _die(self, info):  # noqa: ANN001 - Engine.begin_load's signature
    raise InjectedThreadDeath("injected: the MLX thread died while loading")


Engine.begin_load = _die  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
