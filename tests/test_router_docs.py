"""docs/router.md's table of defaults says what the code's defaults are (one source: the code;
the page is checked against it)."""

from __future__ import annotations

import re
from pathlib import Path

from mlx_fleet.routing.session import PREFIX_CHARS
from mlx_fleet_router.breaker import BreakerConfig
from mlx_fleet_router.limits import QueueConfig
from mlx_fleet_router.picker import LOAD_FACTOR, REPLICATION
from mlx_fleet_router.retry import RetryConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "router.md"


def _table() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("decision", "---"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def _number(cell: str) -> float:
    m = re.match(r"[0-9.]+", cell)
    assert m, cell
    return float(m[0])


def test_defaults_table_matches_the_code() -> None:
    b, r, q = BreakerConfig(), RetryConfig(), QueueConfig()
    expected = {
        "load_factor": LOAD_FACTOR,
        "virtual nodes per Mac": REPLICATION,
        "prompt prefix (completions)": PREFIX_CHARS,
        "breaker error window": b.window_seconds,
        "breaker error ratio": b.error_ratio,
        "breaker minimum requests": b.min_requests,
        "breaker slow response": b.slow_seconds,
        "breaker failed probes": b.probe_failures,
        "breaker cooldown": b.cooldown_seconds,
        "retry attempts": r.max_attempts,
        "retry budget window": r.window_seconds,
        "retry budget ratio": r.ratio,
        "retry budget floor": r.min_retries,
        "queue length": q.max_queued,
        "queue wait": q.max_wait_seconds,
    }
    table = _table()
    assert set(table) == set(expected), set(table) ^ set(expected)
    for name, value in expected.items():
        assert _number(table[name]) == value, (name, table[name], value)
