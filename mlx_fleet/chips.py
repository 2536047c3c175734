"""Apple-Silicon chips: the generation a chip's name says, and the most unified memory a Mac with
that chip can have — the bound the operator holds a node agent's capacity claim to (issue 19,
finding 10: an agent credential must not attract deployments with memory its Mac can't have).

Pure: strings and integers only.

The table is Apple's: each chip's largest unified-memory configuration in the Tech Specs of the
Macs that carry it (https://support.apple.com/specs, https://www.apple.com/mac/compare/), in
Apple's "GB", which are GiB (2**30 bytes; a "128GB" Mac reports ``hw.memsize`` 137438953472):

======  ====  =====  =====  ======  ==========================================================
gen     base  Pro    Max    Ultra   carried by (largest configuration)
======  ====  =====  =====  ======  ==========================================================
M1      16    32     64     128     MacBook Air/Pro 2020, MacBook Pro 2021, Mac Studio 2022
M2      24    32     96     192     MacBook Air 2022, MacBook Pro 2023, Mac Studio/Pro 2023
M3      24    36     128    512     MacBook Air 2024, MacBook Pro 2023, Mac Studio 2025
M4      32    64     128    —       MacBook Air 2025, Mac mini/MacBook Pro 2024, Mac Studio 2025
M5      32    —      —      —       MacBook Pro 14-inch 2025
======  ====  =====  =====  ======  ==========================================================

A chip the table does not know (a later generation or tier, a name that is no Apple M chip) is
bounded by the largest entry (:data:`LARGEST_UNIFIED_MEMORY_BYTES`, M3 Ultra's 512 GB): no Mac
has more. Add a row when Apple ships a chip.
"""

from __future__ import annotations

import re

__all__ = ["chip_generation", "chip_model", "max_unified_memory_bytes", "MAX_UNIFIED_MEMORY_GIB",
           "LARGEST_UNIFIED_MEMORY_BYTES"]

GiB = 2**30

#: ``(generation, tier)`` → the largest unified memory of a Mac with that chip, GiB (module
#: docstring; tier "" is the base chip).
MAX_UNIFIED_MEMORY_GIB: dict[tuple[int, str], int] = {
    (1, ""): 16, (1, "Pro"): 32, (1, "Max"): 64, (1, "Ultra"): 128,
    (2, ""): 24, (2, "Pro"): 32, (2, "Max"): 96, (2, "Ultra"): 192,
    (3, ""): 24, (3, "Pro"): 36, (3, "Max"): 128, (3, "Ultra"): 512,
    (4, ""): 32, (4, "Pro"): 64, (4, "Max"): 128,
    (5, ""): 32,
}
#: The bound of a chip the table does not know: the most any Mac has.
LARGEST_UNIFIED_MEMORY_BYTES = max(MAX_UNIFIED_MEMORY_GIB.values()) * GiB

_CHIP_RE = re.compile(r"\bApple\s+M(\d+)(?:\s+(Pro|Max|Ultra))?\b", re.IGNORECASE)


def chip_generation(brand: str) -> int:
    """Apple-Silicon generation from a brand string: ``"Apple M3 Max"`` → 3, ``"Apple M4"`` → 4.

    Returns 0 when the string names no Apple M-series chip (Intel Macs, other CPUs, empty),
    which the operator's placement treats as "below every minimum generation".
    """
    m = _CHIP_RE.search(brand or "")
    return int(m.group(1)) if m else 0


def chip_model(brand: str) -> tuple[int, str] | None:
    """``(generation, tier)`` of a brand string (``"Apple M3 Max"`` → ``(3, "Max")``, ``"Apple
    M4"`` → ``(4, "")``), None when it names no Apple M-series chip."""
    m = _CHIP_RE.search(brand or "")
    return (int(m.group(1)), (m.group(2) or "").capitalize()) if m else None


def max_unified_memory_bytes(brand: str) -> int:
    """The most unified memory (bytes) a Mac with the chip ``brand`` can have: the table's entry
    (module docstring), else :data:`LARGEST_UNIFIED_MEMORY_BYTES`."""
    model = chip_model(brand)
    gib = MAX_UNIFIED_MEMORY_GIB.get(model) if model is not None else None
    return gib * GiB if gib is not None else LARGEST_UNIFIED_MEMORY_BYTES
