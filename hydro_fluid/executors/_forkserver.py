"""Preloaded last in LocalExecutor's fork server: when the fork server exits (the process that
started it died or stopped), it exits at once instead of tearing down every module it imported
(seconds with torch.export loaded), so nothing of a killed tuner outlives it for long.

Imported anywhere but in a fork server's start-up, it does nothing.
"""

from __future__ import annotations

import atexit
import os
import sys


def _in_forkserver_startup() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith(
            os.path.join("multiprocessing", "forkserver.py")
        ):
            return True
        frame = frame.f_back
    return False


if _in_forkserver_startup():
    # registered after the preloaded modules' own handlers, so it runs first (LIFO); the fork
    # server's children leave with os._exit and never run it
    atexit.register(os._exit, 0)
