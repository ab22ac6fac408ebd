"""SIGTERM stops a run as Ctrl-C does, at a clean point.

``kill``, Slurm, Docker and systemd stop a process with SIGTERM, whose default action ends it on
the spot: trials left RUNNING, workers and scratch directories left behind. While a run is
active, :func:`terminate_as_interrupt` turns SIGTERM into :class:`Terminated`, a
``KeyboardInterrupt``, so it takes the very path Ctrl-C takes (trials requeued, workers stopped,
scratch removed) and the process then exits by itself.

Unlike Ctrl-C it is not raised wherever the main thread happens to be: inside a storage
transaction or an atomic checkpoint write it would leave a half-written row or a temporary
file (and the database library's own "error closing cursor" traceback). There it is put off
and delivered again a moment later, until the main thread is out of such code.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["Terminated", "terminate_as_interrupt"]

# modules inside which an exception would break something half done: storage, atomic writes
_UNSAFE = ("sqlalchemy", "sqlite3", "alembic", "optuna", "hydro.tuning.bookkeeping",
           "hydro.tuning.checkpoint")  # fmt: skip
_RETRY_SECONDS = 0.05
_MAX_TRIES = 200  # then raised wherever it lands: ten seconds in storage code is a hang


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived during a run: it stops as on Ctrl-C (``hydro tune`` exits 143)."""


def _in_unsafe_code(frame: FrameType | None) -> bool:
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        if any(name == m or name.startswith(m + ".") for m in _UNSAFE):
            return True
        frame = frame.f_back
    return False


@contextmanager
def terminate_as_interrupt(seen: list[int] | None = None) -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated` in the main thread, at a clean point.

    Installed only in the main thread (the only one Python delivers signals to) and only over
    the default action: a handler the user installed, or SIGTERM ignored, is left as it is.
    Nested uses find this handler in place and do nothing. The previous handler is restored on
    the way out; a SIGTERM still put off then is raised there.

    Args:
        seen: a list each SIGTERM received is appended to (its signal number), so a caller can
            tell that one came even if a library turned the exception into another error.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    received: list[int] = seen if seen is not None else []
    state = {"tries": 0, "raised": False, "timer": None}

    def on_sigterm(signum: int, frame: Any) -> None:
        if state["raised"]:  # a second SIGTERM must not cut short the clean-up of the first
            return
        if not state["tries"]:
            received.append(signum)
        state["tries"] += 1
        if _in_unsafe_code(frame) and state["tries"] < _MAX_TRIES:
            # deliver it again shortly: Python runs the handler in the main thread then
            timer = threading.Timer(_RETRY_SECONDS, os.kill, (os.getpid(), signum))
            timer.daemon = True
            state["timer"] = timer
            timer.start()
            return
        state["raised"] = True
        raise Terminated("terminated (SIGTERM)")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        timer = state["timer"]
        if timer is not None:  # stopped before the handler goes: SIG_DFL would end the process
            timer.cancel()
            timer.join()
        signal.signal(signal.SIGTERM, previous)
    if state["tries"] and not state["raised"]:  # put off, and the run ended meanwhile
        raise Terminated("terminated (SIGTERM)")
