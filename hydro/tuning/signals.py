"""SIGTERM stops a run as Ctrl-C does.

``kill``, Slurm, Docker and systemd stop a process with SIGTERM, whose default action ends it on
the spot: trials left RUNNING, workers and scratch directories left behind. While a run is
active, :func:`terminate_as_interrupt` turns SIGTERM into :class:`Terminated`, a
``KeyboardInterrupt``, so it takes the very path Ctrl-C takes (trials requeued, workers stopped,
scratch removed) and the process then exits by itself.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Terminated", "terminate_as_interrupt"]


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived during a run: it stops as on Ctrl-C (``hydro tune`` exits 143)."""


@contextmanager
def terminate_as_interrupt(seen: list[int] | None = None) -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated` in the main thread.

    Installed only in the main thread (the only one Python delivers signals to) and only over
    the default action: a handler the user installed, or SIGTERM ignored, is left as it is.
    Nested uses find this handler in place and do nothing. The previous handler is restored on
    the way out.

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

    def on_sigterm(signum: int, frame: Any) -> None:
        received.append(signum)
        # once only: a second SIGTERM must not cut short the clean-up the first one started
        if received.count(signum) == 1:
            raise Terminated("terminated (SIGTERM)")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
