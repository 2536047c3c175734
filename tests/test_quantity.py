"""The project's one Kubernetes-quantity grammar (mlx_fleet.quantity), used by the operator's
spec parsing and the agent's --simulated-memory alike: table-driven, no cluster."""

from __future__ import annotations

import pytest

from mlx_fleet.quantity import format_bytes, parse_quantity
from node_agent.cli import build_parser

GiB = 1024**3


@pytest.mark.parametrize("text, want", [
    ("2Gi", 2 * GiB), ("512Mi", 512 * 1024**2), ("1Ki", 1024), ("1Ti", 1024**4), ("1Pi", 1024**5),
    ("1Ei", 1024**6), ("1k", 1000), ("1.5G", 1_500_000_000), ("1M", 10**6), ("1T", 10**12),
    ("1P", 10**15), ("1E", 10**18), ("1e9", 10**9), ("2.5E+3", 2500), ("1500m", 2), ("123", 123),
    (4096, 4096), (".5Ki", 512), ("+1k", 1000), ("1.5Gi", 3 * 2**29), ("0.5", 1), ("1n", 1),
    ("-1Gi", -GiB),
])
def test_parse_quantity(text, want):
    assert parse_quantity(text) == want


@pytest.mark.parametrize("bad", ["", "Gi", "1GB", "1 Gi", "64 Gi", " 2Ki ", "abc", "1.2.3", "0x10",
                                 True, None, 1.5, "1e999", "64 gibibytes"])
def test_parse_quantity_rejects(bad):
    with pytest.raises(ValueError, match="invalid quantity"):
        parse_quantity(bad)


@pytest.mark.parametrize("n, text", [(0, "0B"), (512, "512B"), (1536, "1.5KiB"),
                                     (3 * 2**29, "1.5GiB"), (-2048, "-2.0KiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("bad", ["64 Gi", "0", "-1Gi", "64GB"])
def test_agent_refuses_a_bad_simulated_memory(bad, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--simulated-memory", bad])
    assert e.value.code == 2
    assert "--simulated-memory" in capsys.readouterr().err


def test_agent_and_operator_read_memory_the_same():
    # both sides import the one parser: no second grammar that can drift
    import node_agent.capacity as cap
    import mlx_fleet_operator.spec as spec
    assert cap.parse_quantity is spec.parse_quantity is parse_quantity
