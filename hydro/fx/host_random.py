"""Randomness drawn on the host while a model is captured: Python's ``random`` and NumPy's.

Capture by example runs ``forward`` once; a draw from torch's RNG becomes a random op the graph
replays at every step, but a draw from Python's ``random`` or NumPy's global generator is made
once and its result is frozen into the graph (a SpecAugment mask made with ``np.random`` masks
the same frames at every step; a layerdrop decided by ``random.random()`` drops the same layers
forever). :func:`watch` notices such draws by the generators' states, then finds the user's line
by running ``forward`` once more under a profiler that sees the generators' C methods.
"""

from __future__ import annotations

import linecache
import os
import random
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from hydro.errors import HydroWarning, TraceError

_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) for m in (torch, np)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
)
_RANDOM_FILE = os.path.abspath(random.__file__)
# `x < self.layerdrop`, `p < self.config.layerdrop`: the attribute a random draw is compared to
_THRESHOLD = re.compile(r"<=?\s*(self(?:\.\w+)+)")
_PROBABILITY = re.compile(r"\b(self(?:\.\w+)*\.\w*(?:drop|prob)\w*)")


def _state() -> tuple[Any, int, bytes]:
    return (random.getstate(), *_state_of(np.random.get_state()))


def _state_of(np_state: tuple) -> tuple[int, bytes]:
    _, keys, pos, *_ = np_state
    return int(pos), keys.tobytes()


def _user_frame(frame: Any) -> Any:
    """The innermost frame outside torch, NumPy, ``random`` and Hydro: the user's line."""
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        library = path == _RANDOM_FILE or path.startswith(_LIBRARY_DIRS)
        if not library and not frame.f_code.co_filename.startswith("<"):
            return frame
        frame = frame.f_back
    return None


def _compared_with_zero(frame: Any) -> bool:
    """Whether the draw at ``frame``'s line is compared with an attribute that is 0 now (a
    layerdrop of 0: the draw decides nothing, whatever it is)."""
    found = _THRESHOLD.search(linecache.getline(frame.f_code.co_filename, frame.f_lineno))
    if found is None or "self" not in frame.f_locals:
        return False
    value = frame.f_locals["self"]
    for part in found.group(1).split(".")[1:]:
        value = getattr(value, part, None)
    return isinstance(value, (int, float)) and value == 0


def _draw_sites(
    model: nn.Module, args: tuple, kwargs: Mapping[str, Any]
) -> tuple[list[tuple], bool]:
    """``(kind, file, line)`` of each host draw when ``forward`` runs once more (eagerly, with
    every generator's state restored afterwards), and whether that run drew from NumPy's global
    generator at all (a draw seen during capture but not now was another thread's).

    ``random``'s draws are C methods, which a profiler sees; NumPy's global functions are
    Cython ones, which it does not, so ``np.random.*`` are wrapped for that one run.
    """
    sites: list[tuple[str, str, int]] = []

    def seen(kind: str, frame: Any) -> None:
        user = _user_frame(frame)
        if user is None or _compared_with_zero(user):
            return  # `random.random() < self.layerdrop` with layerdrop 0: never taken
        where = (user.f_code.co_filename, user.f_lineno)
        if (kind, *where) not in sites:
            sites.append((kind, *where))

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and isinstance(getattr(arg, "__self__", None), random.Random):
            seen("python", frame)

    def wrap(fn: Any) -> Any:
        def recorded(*a: Any, **k: Any) -> Any:
            seen("numpy", sys._getframe(1))
            return fn(*a, **k)

        return recorded

    global_rng = np.random.mtrand._rand
    wrapped = {}
    for name in dir(np.random):
        fn = getattr(np.random, name)
        if getattr(fn, "__self__", None) is global_rng:
            wrapped[name] = fn
    py_state, np_state = random.getstate(), np.random.get_state()
    drew = False
    try:
        for name, fn in wrapped.items():
            setattr(np.random, name, wrap(fn))
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            sys.setprofile(profile)
            try:
                model(*args, **kwargs)
            finally:
                sys.setprofile(None)
                drew = _state()[1:] != _state_of(np_state)
    except Exception:  # locating is best effort; the draw was seen anyway
        pass
    finally:
        for name, fn in wrapped.items():
            setattr(np.random, name, fn)
        random.setstate(py_state)
        np.random.set_state(np_state)
    return sites, drew


def _at(file: str, line: int) -> str:
    code = linecache.getline(file, line).strip()
    return f"{file}:{line}" + (f" (`{code}`)" if code else "")


def probability_to_zero(file: str, line: int, first: int | None = None) -> str:
    """What to set so that a random branch at ``file:line`` is never taken: the attribute the
    draw is compared with (``self.config.layerdrop``), read from the source around the line."""
    lines = [linecache.getline(file, n) for n in range(max(first or line - 3, 1), line + 1)]
    for pattern in (_THRESHOLD, _PROBABILITY):
        for text in reversed(lines):
            found = pattern.search(text)
            if found:
                return f"set `{found.group(1)}` to 0 (e.g. layerdrop=0 in the model's config)"
    return "set the probability that drives it to 0 (e.g. layerdrop=0 in the model's config)"


@contextmanager
def watch(model: nn.Module, args: tuple, kwargs: Mapping[str, Any], mode: str) -> Iterator[None]:
    """Around one capture of ``model`` in ``mode``: a Python ``random`` draw raises
    :class:`TraceError` saying what to set; a NumPy draw warns (:class:`HydroWarning`), naming
    the line and what to use instead."""
    before = _state()
    yield
    after = _state()
    if after == before:
        return
    name = type(model).__name__
    sites, drew_numpy = _draw_sites(model, args, kwargs)
    if not sites and not drew_numpy:
        return  # draws that decide nothing (compared with a probability of 0), or another thread's
    sites = sites or [("numpy", "", 0)]
    python = [s for s in sites if s[0] == "python"]
    if python:
        _, file, line = python[0]
        raise TraceError(
            f"cannot capture {name}: forward draws from Python's random module at "
            f"{_at(file, line)} in {mode} mode, and capture would freeze that one draw for "
            f"every step (a layer dropped, or kept, forever); {probability_to_zero(file, line)}"
            ", or draw with torch (torch.rand) so that the graph draws again at each step"
        )
    shown = "; ".join(_at(f, n) for _, f, n in sites if f) or "a line Hydro could not locate"
    warnings.warn(HydroWarning(
        f"{name}.forward draws from NumPy's random generator in {mode} mode at {shown}: capture "
        "froze the result into the graph as a constant, so every step reuses that one draw (a "
        "SpecAugment mask hides the same frames at every step). Draw with torch's RNG instead "
        "(torch.rand, torch.randint, torch.bernoulli), which the graph replays at each step, or "
        "turn it off for tuning (its probability to 0, e.g. mask_time_prob=0)"
    ), stacklevel=5)


__all__ = ["probability_to_zero", "watch"]
