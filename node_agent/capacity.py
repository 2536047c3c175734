"""What this node offers: unified memory, GPU wired-memory limit, chip, the configured limit on
loaded models and memory watermark → :class:`NodeCapacity`.

On macOS every value comes from the hardware:

* ``hw.memsize`` (``sysctl -n``): physical unified memory in bytes;
* ``machdep.cpu.brand_string``: the chip's marketing name, e.g. ``"Apple M3 Max"``, whose number
  is the chip generation (:func:`mlx_fleet.chips.chip_generation`, re-exported here);
* ``iogpu.wired_limit_mb``: the GPU wired-memory limit in MiB (absent or 0 = the OS default,
  reported as 0);
* available memory: ``psutil.virtual_memory().available`` (free + reclaimable, bytes).

Anywhere else (Linux, for development and tests) chip and total memory come from configuration
(``--simulated-chip``, ``--simulated-memory``) and the capacity carries ``simulated=True``, so the
operator and a human reading etcd never mistake such a node for a Mac. Configuring either value
on macOS forces the same simulated mode (many simulated agents on one Mac).

Memory quantities go through the project's one grammar,
:func:`mlx_fleet.quantity.parse_quantity` (re-exported here for the agent's CLI).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys

import psutil

from mlx_fleet.chips import chip_generation
from mlx_fleet.contract import WATERMARK, NodeCapacity
from mlx_fleet.quantity import format_bytes, parse_quantity

log = logging.getLogger(__name__)

__all__ = ["chip_generation", "parse_quantity", "format_bytes", "CapacityConfig", "CapacityProbe",
           "materially_different", "DEFAULT_SIMULATED_CHIP"]

#: Chip reported by a simulated node when ``--simulated-chip`` is not given.
DEFAULT_SIMULATED_CHIP = "Apple M3 Max"


@dataclasses.dataclass(frozen=True)
class CapacityConfig:
    """How to detect capacity. ``simulated_chip`` / ``simulated_memory_bytes``: configured
    values (either one forces simulation; off macOS simulation is always on, with
    :data:`DEFAULT_SIMULATED_CHIP` and the host's physical memory as defaults).
    ``max_loaded_models``: the node's limit on resident revisions, reported as is in
    :attr:`NodeCapacity.max_loaded_models` (``--max-loaded-models``; 0 = no limit).
    ``memory_watermark``: the share of unified memory resident models may take, reported as is
    in :attr:`NodeCapacity.memory_watermark` (``--memory-watermark``; default
    :data:`mlx_fleet.contract.WATERMARK`, 0.8)."""

    simulated_chip: str | None = None
    simulated_memory_bytes: int | None = None
    max_loaded_models: int = 0
    memory_watermark: float = WATERMARK

    @property
    def simulated(self) -> bool:
        return (sys.platform != "darwin" or self.simulated_chip is not None
                or self.simulated_memory_bytes is not None)


async def _sysctl(name: str) -> str | None:
    """``sysctl -n name`` without blocking the event loop; None when absent or failing."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "sysctl", "-n", name, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=5.0)
    except (OSError, asyncio.TimeoutError) as e:
        log.debug("sysctl %s failed: %s", name, e)
        return None
    if proc.returncode != 0:
        return None
    return out.decode(errors="replace").strip() or None


class CapacityProbe:
    """Reads this node's :class:`NodeCapacity`; :meth:`read` is cheap enough to call on every
    heartbeat (static facts are read once, available memory and the wired limit each time).
    """

    def __init__(self, config: CapacityConfig = CapacityConfig()) -> None:
        self.config = config
        self._chip: str | None = None
        self._total: int | None = None

    @property
    def simulated(self) -> bool:
        return self.config.simulated

    async def _static(self) -> tuple[str, int]:
        if self._chip is None or self._total is None:
            if self.simulated:
                host_total = psutil.virtual_memory().total
                self._chip = self.config.simulated_chip or DEFAULT_SIMULATED_CHIP
                self._total = self.config.simulated_memory_bytes or host_total
            else:
                self._chip = await _sysctl("machdep.cpu.brand_string") or "unknown"
                raw = await _sysctl("hw.memsize")
                self._total = int(raw) if raw and raw.isdigit() else psutil.virtual_memory().total
        return self._chip, self._total

    async def read(self) -> NodeCapacity:
        """Current capacity (bytes). Simulated nodes report the host's *fraction* of available
        memory applied to the simulated total, so a simulated 64 GiB node on a 16 GiB host is
        placeable and still reacts to real memory pressure."""
        chip, total = await self._static()
        vm = await asyncio.to_thread(psutil.virtual_memory)
        if self.simulated:
            available = int(total * (vm.available / vm.total)) if vm.total else 0
            wired = 0
        else:
            available = min(vm.available, total)
            raw = await _sysctl("iogpu.wired_limit_mb")
            wired = int(raw) * 2**20 if raw and raw.isdigit() else 0
        return NodeCapacity(memory_total_bytes=total, memory_available_bytes=available,
                            wired_limit_bytes=wired, chip=chip,
                            chip_generation=chip_generation(chip), simulated=self.simulated,
                            max_loaded_models=self.config.max_loaded_models,
                            memory_watermark=self.config.memory_watermark)


def materially_different(old: NodeCapacity | None, new: NodeCapacity, *,
                         available_threshold_bytes: int | None = None) -> bool:
    """True when ``new`` is worth rewriting the node record for: any static fact changed, or
    available memory moved by more than ``available_threshold_bytes`` (default: 5 % of total
    memory, at least 256 MiB)."""
    if old is None:
        return True
    if (old.memory_total_bytes, old.wired_limit_bytes, old.chip, old.chip_generation,
            old.simulated, old.max_loaded_models, old.memory_watermark) != (
                new.memory_total_bytes, new.wired_limit_bytes, new.chip, new.chip_generation,
                new.simulated, new.max_loaded_models, new.memory_watermark):
        return True
    threshold = (available_threshold_bytes if available_threshold_bytes is not None
                 else max(256 * 2**20, new.memory_total_bytes // 20))
    return abs(old.memory_available_bytes - new.memory_available_bytes) > threshold
