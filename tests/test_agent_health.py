"""The agent's ``/health`` verdict (node_agent.main.health_verdict), table-driven: a node that
only lost etcd is degraded but serving; anything else wrong makes it unhealthy. Pure."""

from __future__ import annotations

import pytest

from node_agent.main import health_verdict

CORE = "serving core failed: boom"
TASK = "task controller:follow failed (x); restarting"


@pytest.mark.parametrize(("registered", "etcd_problem", "failures", "expected"), [
    (True, None, [], (True, "ok", [])),
    (True, "etcd unreachable", [], (True, "degraded", ["etcd unreachable"])),
    (True, "lease not alive", [], (True, "degraded", ["lease not alive"])),
    (True, "etcd unreachable", [CORE], (False, "unhealthy", ["etcd unreachable", CORE])),
    (True, None, [CORE, TASK], (False, "unhealthy", [CORE, TASK])),
    (False, None, [], (False, "unhealthy", ["not registered in etcd yet"])),
    (False, "etcd unreachable", [],
     (False, "unhealthy", ["etcd unreachable", "not registered in etcd yet"])),
])
def test_health_verdict(registered: bool, etcd_problem: str | None, failures: list[str],
                        expected: tuple[bool, str, list[str]]) -> None:
    assert health_verdict(registered=registered, etcd_problem=etcd_problem,
                          failures=failures) == expected
