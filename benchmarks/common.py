"""What every benchmark records about the machine it ran on (imported as ``from common import
machine`` by the scripts in this folder)."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path


def machine() -> dict[str, str]:
    import mlx.core as mx

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    accelerator = "none"
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        accelerator = gpus.replace("\n", ", ") or accelerator
    except (OSError, subprocess.SubprocessError):
        pass
    return {"platform": platform.platform(), "cpu": cpu, "accelerator": accelerator,
            "python": platform.python_version(), "mlx_device": str(mx.default_device())}
