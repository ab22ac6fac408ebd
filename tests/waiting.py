"""How long a test waits for another process: scaled by the machine's load."""

from __future__ import annotations

import os


def patience(seconds: float) -> float:
    """``seconds`` of a quiet machine, stretched by how loaded this one is (load average per
    core, at least 1) and by ``$HYDRO_TEST_SLOW``: a busy shared machine is slow, not broken."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        load = 1.0
    return seconds * max(1.0, load) * float(os.environ.get("HYDRO_TEST_SLOW", "1"))
