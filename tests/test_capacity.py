"""Capacity detection: pure parsers (table-driven) and the simulated probe on Linux."""

from __future__ import annotations

import sys

import pytest

from mlx_fleet.contract import NodeCapacity
import node_agent.capacity as capacity_module
from node_agent.capacity import (CapacityConfig, CapacityProbe, chip_generation,
                                 materially_different)


@pytest.mark.parametrize("brand, generation", [
    ("Apple M3 Max", 3),
    ("Apple M3", 3),
    ("Apple M4 Pro", 4),
    ("Apple M2 Ultra", 2),
    ("Apple M1", 1),
    ("apple m5 max", 5),
    ("Apple M10 Max", 10),
    ("Intel(R) Core(TM) i9-9980HK CPU @ 2.40GHz", 0),
    ("", 0),
    ("Apple Mx", 0),
    ("AppleM3", 0),
])
def test_chip_generation(brand: str, generation: int) -> None:
    assert chip_generation(brand) == generation


def _cap(**kw) -> NodeCapacity:
    base = dict(memory_total_bytes=64 * 2**30, memory_available_bytes=40 * 2**30,
                wired_limit_bytes=0, chip="Apple M3 Max", chip_generation=3, simulated=True)
    return NodeCapacity(**(base | kw))


@pytest.mark.parametrize("old, new, changed", [
    (None, _cap(), True),
    (_cap(), _cap(), False),
    (_cap(), _cap(memory_available_bytes=40 * 2**30 + 100 * 2**20), False),  # < 5 % of 64 GiB
    (_cap(), _cap(memory_available_bytes=36 * 2**30), True),
    (_cap(), _cap(wired_limit_bytes=48 * 2**30), True),
    (_cap(), _cap(chip="Apple M4 Max", chip_generation=4), True),
    (_cap(), _cap(max_loaded_models=2), True),
    (_cap(), _cap(memory_watermark=0.9), True),
])
def test_materially_different(old, new, changed: bool) -> None:
    assert materially_different(old, new) is changed


async def test_simulated_probe() -> None:
    probe = CapacityProbe(CapacityConfig(simulated_chip="Apple M4 Pro",
                                         simulated_memory_bytes=48 * 2**30))
    cap = await probe.read()
    assert cap.simulated is True
    assert cap.chip == "Apple M4 Pro" and cap.chip_generation == 4
    assert cap.memory_total_bytes == 48 * 2**30
    assert 0 < cap.memory_available_bytes <= cap.memory_total_bytes
    assert cap.wired_limit_bytes == 0
    assert cap.max_loaded_models == 0  # no limit unless configured


async def test_probe_reports_the_configured_model_limit() -> None:
    cap = await CapacityProbe(CapacityConfig(max_loaded_models=2)).read()
    assert cap.max_loaded_models == 2


@pytest.mark.parametrize("config, watermark, budget", [
    (CapacityConfig(simulated_memory_bytes=100 * 2**30), 0.8, 80 * 2**30),  # seed 004's 80 %
    (CapacityConfig(simulated_memory_bytes=100 * 2**30, memory_watermark=0.6), 0.6, 60 * 2**30),
    (CapacityConfig(simulated_memory_bytes=100 * 2**30, memory_watermark=1.0), 1.0, 100 * 2**30),
])
async def test_probe_reports_the_configured_watermark(config: CapacityConfig, watermark: float,
                                                      budget: int) -> None:
    cap = await CapacityProbe(config).read()
    assert cap.memory_watermark == watermark and cap.budget_bytes() == budget


async def test_defaults_are_simulated_off_macos() -> None:
    cap = await CapacityProbe().read()
    assert cap.simulated is (sys.platform != "darwin")
    if cap.simulated:
        assert cap.chip == "Apple M3 Max" and cap.chip_generation == 3


async def test_flags_force_simulation_on_macos(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_sysctl(name: str) -> str | None:
        raise AssertionError(f"a simulated node must not read sysctl {name}")

    monkeypatch.setattr(capacity_module.sys, "platform", "darwin")
    monkeypatch.setattr(capacity_module, "_sysctl", no_sysctl)
    assert CapacityProbe().simulated is False  # a real Mac by default
    for config in (CapacityConfig(simulated_chip="Apple M2 Ultra"),
                   CapacityConfig(simulated_memory_bytes=32 * 2**30)):
        cap = await CapacityProbe(config).read()
        assert cap.simulated is True and cap.wired_limit_bytes == 0
