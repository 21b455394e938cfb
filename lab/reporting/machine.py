"""The machine a result ran on (recorded with every benchmark's JSON)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["machine_info"]


def machine_info() -> dict[str, Any]:
    """The machine a benchmark ran on (CPU model, cores, Python, platform), recorded with its result."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        # What else ran: a real-time figure from a busy machine says little about the code.
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
