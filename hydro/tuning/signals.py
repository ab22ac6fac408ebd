"""SIGTERM stops a run as Ctrl-C does, at a clean point.

``kill``, Slurm, Docker and systemd stop a process with SIGTERM, whose default action ends it on
the spot: trials left RUNNING, workers and scratch directories left behind. While a run is
active, :func:`terminate_as_interrupt` turns SIGTERM into :class:`Terminated`, a
``KeyboardInterrupt``, so it takes the very path Ctrl-C takes (trials requeued, workers stopped,
scratch removed) and the process then exits by itself.

It is not raised wherever the main thread happens to be: inside a storage transaction or an
atomic checkpoint write it would leave a half-written row or a temporary file (and the
database library's own "error closing cursor" traceback), and between a trial's ask and its
bookkeeping a trial nobody puts back, and inside an import (torch's runs C++ that cannot take
an exception: the process would abort). There it is put off and delivered again a moment later,
until the main thread is out of such code. The ``hydro`` command treats Ctrl-C the same way
(:func:`interrupt_at_a_clean_point`).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["Terminated", "interrupt_at_a_clean_point", "terminate_as_interrupt"]

# modules inside which an exception would break something half done: storage, atomic writes
# and imports: an exception raised in a module's body that a C++ extension is running (torch's
# import does) ends the process with "terminate called after throwing ...", exit 134
_UNSAFE = ("sqlalchemy", "sqlite3", "alembic", "optuna", "hydro.tuning.bookkeeping",
           "hydro.tuning.checkpoint", "importlib._bootstrap")
_RETRY_SECONDS = 0.05
_MAX_TRIES = 200  # then raised wherever it lands: ten seconds in storage code is a hang


_WORDS = {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGINT: "interrupted (SIGINT)"}


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
    with _at_a_clean_point(signal.SIGTERM, (signal.SIG_DFL,), Terminated, seen):
        yield


@contextmanager
def interrupt_at_a_clean_point(seen: list[int] | None = None) -> Iterator[None]:
    """While inside, Ctrl-C (SIGINT) raises ``KeyboardInterrupt`` as usual, but never inside
    storage or checkpoint code: there it is put off a moment, as SIGTERM is. A second SIGINT
    while the first is being handled is ignored (the clean-up goes on); a third raises at once.

    For a command-line program (``hydro``): also installed where SIGINT was ignored, as a shell
    starts a script's background job (``hydro tune ... &``), so that ``kill -INT`` stops it.
    ``seen`` as in :func:`terminate_as_interrupt`.
    """
    with _at_a_clean_point(signal.SIGINT, (signal.default_int_handler, signal.SIG_IGN),
                           KeyboardInterrupt, seen, give_up_after=2):
        yield


@contextmanager
def _at_a_clean_point(
    signum: int,
    over: tuple,
    exc: type[BaseException],
    seen: list[int] | None,
    give_up_after: int = 0,
) -> Iterator[None]:
    """Raise ``exc`` in the main thread on ``signum``, put off while in storage code; installed
    only where the handler now is one of ``over``. ``give_up_after``: signals ignored while the
    first is handled, after which one raises wherever it lands (0: ignore them all)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signum) not in over
    ):
        yield
        return
    received: list[int] = seen if seen is not None else []
    state = {"tries": 0, "raised": 0, "timer": None}

    def handler(number: int, frame: Any) -> None:
        if state["raised"]:  # another while the first is being handled: let the clean-up end
            state["raised"] += 1
            if give_up_after and state["raised"] > give_up_after:
                raise exc(f"{signal.Signals(number).name}, again")
            return
        if not state["tries"]:
            received.append(number)
        state["tries"] += 1
        if _in_unsafe_code(frame) and state["tries"] < _MAX_TRIES:
            # deliver it again shortly: Python runs the handler in the main thread then
            timer = threading.Timer(_RETRY_SECONDS, os.kill, (os.getpid(), number))
            timer.daemon = True
            state["timer"] = timer
            timer.start()
            return
        state["raised"] = 1
        raise exc(_WORDS.get(number, signal.Signals(number).name))

    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        timer = state["timer"]
        if timer is not None:  # stopped before the handler goes: the default would end us
            timer.cancel()
            timer.join()
        signal.signal(signum, previous)
    if state["tries"] and not state["raised"]:  # put off, and the run ended meanwhile
        raise exc(_WORDS.get(signum, signal.Signals(signum).name))
