"""User code that raises while a group trains: a one-line reason, and when to stop the run.

The user's callables (data streams, loss, metric, model factory: code in files outside Hydro,
the standard library and installed packages) run inside a group's training. When one
raises, :func:`describe` names it in one line (``data 'mymod:make_batches' raised ValueError:
bad shard at mymod.py:12``, the innermost line of the user's file), the group's trials fail
with that reason and the study goes on asking others. :class:`Faults` stops the run once every
trial it ended failed the same way (:data:`SAME_FAULT_GROUPS` groups, or the whole run), so a
loss that always raises does not burn the budget. Exceptions of the types given to
``hydro.tune(catch=...)`` are expected: their trials fail the same way, but never stop the run.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sysconfig
import traceback
import types
from collections.abc import Iterable
from typing import Any

import torch

from hydro.errors import HydroError, ModelError, UserCodeError

__all__ = ["SAME_FAULT_GROUPS", "Faults", "describe"]

SAME_FAULT_GROUPS = 3  # groups failed alike, and nothing else ended, before the run stops
_MOST = 400  # characters of a reason (one line)


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Directories whose frames are not the user's: Hydro (wherever it is installed), the
    standard library and installed packages (PyTorch, Optuna, NumPy, ...)."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    # hydro/ (this file is hydro/tuning/faults.py) and hydro_fluid/ beside it, found without
    # importing either package's face
    hydro_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    fluid = importlib.util.find_spec("hydro_fluid")
    dirs |= {hydro_dir, os.path.dirname(torch.__file__)}
    if fluid is not None and fluid.origin:
        dirs.add(os.path.dirname(fluid.origin))
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


@functools.cache
def _not_training() -> tuple[str, ...]:
    """Files through which the user's code runs outside a group's training: Optuna (a pruner,
    a sampler) and Hydro's sampling of a trial's parameters (a space function)."""
    import optuna

    from hydro.tuning import space

    return os.path.dirname(optuna.__file__) + os.sep, space.__file__


def _is_user(filename: str) -> bool:
    # "<...>": generated code (torch.fx graph modules, frozen modules), never the user's file
    return not filename.startswith("<") and \
        not os.path.realpath(filename).startswith(_library_dirs())


def describe(exc: BaseException, task: Any) -> str | None:
    """One line naming the user's callable that raised ``exc`` (``loss 'mod:fn' raised
    ValueError: ... at mod.py:12``; a model factory's, that Hydro wrapped in a
    :class:`ModelError`, too), or ``None`` when ``exc`` is not the user's: Hydro's own
    errors, out of memory, an interrupt, an exception with no frame in the user's files, or
    one raised through Optuna (the study's pruner or sampler)."""
    if getattr(exc, "_hydro_resume_others", False):
        return None  # a tune(callbacks=...) callback raised: it stops the run, as in Optuna
    if isinstance(exc, ModelError) and _factory_raised(exc.__cause__):
        return describe(exc.__cause__, task)  # the model factory raised, for these arguments
    if not isinstance(exc, Exception) or isinstance(
        exc, (HydroError, MemoryError, torch.cuda.OutOfMemoryError)
    ):
        return None
    walked = list(traceback.walk_tb(exc.__traceback__))
    if any(f.f_code.co_filename.startswith(_not_training()) for f, _ in walked):
        return None  # the study's pruner or sampler, a space function: not the training
    frames = [(f, line) for f, line in walked if _is_user(f.f_code.co_filename)]
    if not frames:
        return None
    outer, (inner, line) = frames[0][0], frames[-1]  # the callable Hydro called; where it raised
    name = f"{outer.f_globals.get('__name__', '?')}:{outer.f_code.co_qualname}"
    message = (str(exc).strip().splitlines() or [""])[0]
    text = f"{_role(outer, task)} {name!r} raised {type(exc).__name__}"
    text += f": {message}" if message else ""
    return f"{text[: _MOST - 60]} at {os.path.basename(inner.f_code.co_filename)}:{line}"


def _factory_raised(cause: BaseException | None) -> bool:
    """Whether ``cause`` is what the model factory raised when :meth:`Task.build_model` called
    it (and wrapped in a :class:`ModelError`)."""
    from hydro.tuning.task import Task

    if not isinstance(cause, Exception) or isinstance(cause, HydroError):
        return False
    tb = cause.__traceback__  # starts in the frame that caught it
    return tb is not None and tb.tb_frame.f_code is Task.build_model.__code__


def _role(frame: types.FrameType, task: Any) -> str:
    """Which of the task's callables ``frame`` runs: ``data``, ``loss``, ``metric``, ``model``,
    your own ``train`` function (else ``code``)."""
    me = frame.f_locals.get("self")
    for role, objs in (("loss", [getattr(task, "loss", None)]),
                       ("metric", [getattr(task, "metric", None)]),
                       ("train", [getattr(task, "train", None)]), ("model", [task.model]),
                       ("data", [task.train_data, task.val_data])):
        for obj in objs:
            if obj is None or isinstance(obj, (str, tuple, dict, torch.Tensor)):
                continue
            if (me is not None and me is obj) or frame.f_code in _codes(obj):
                return role
    return "code"


def _codes(obj: Any) -> set[types.CodeType]:
    """The code objects ``obj`` runs directly: its function's (and functions nested in it), or
    its class's methods for an object (a Dataset, a callable instance)."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    obj = getattr(obj, "__func__", obj)
    if isinstance(obj, types.FunctionType):
        roots = [obj.__code__]
    else:
        roots = [v.__code__ for c in type(obj).__mro__ for v in vars(c).values()
                 if isinstance(v, types.FunctionType)]
    found: set[types.CodeType] = set()
    while roots:
        code = roots.pop()
        found.add(code)
        roots.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return found


class Faults:
    """What user code did to this run's groups: the run stops (:meth:`check` raises
    :class:`UserCodeError`) once every trial it ended failed with one description, in
    :data:`SAME_FAULT_GROUPS` groups or, at the end (``end=True``), in all of them."""

    def __init__(self, catch: tuple[type[BaseException], ...] = ()) -> None:
        self.catch = catch  # tune(catch=...): expected failures, which never stop the run
        self.kinds: set[str] = set()  # descriptions (trial and group left out)
        self.keys: set[tuple] = set()  # the failed groups' keys
        self.groups = 0
        self.first = ""  # the first trial's reason, the line the run stops with
        self.other = False  # a trial of this run ended otherwise (complete, pruned, diverged)

    def told(self, fault: bool) -> None:
        """A trial was told; ``fault``: it failed because user code raised."""
        if not fault:
            self.other = True

    def caught(self, exc: BaseException | str | None) -> bool:
        """Whether a fault is of a type the run was told to ``catch``: an exception raised in
        this process by ``isinstance``; a worker's one-line description (:func:`describe`,
        the exception itself stayed in the worker) by the class name it gives."""
        if not self.catch or exc is None:
            return False
        if isinstance(exc, BaseException):
            return isinstance(exc, self.catch)
        if any(c in (Exception, BaseException) for c in self.catch):
            return True
        found = re.search(r" raised ([\w.]+)", exc)
        return found is not None and found.group(1).rsplit(".", 1)[-1] in \
            {c.__name__ for c in self.catch}

    def failed(self, what: str, reason: str, key: tuple | None) -> None:
        """A group of ``key`` failed because user code raised (``what``, :func:`describe`);
        ``reason`` is its first trial's."""
        self.kinds.add(what)
        self.keys.add(key)
        self.groups += 1
        self.first = self.first or reason

    def check(self, end: bool = False, training: Iterable[tuple] = ()) -> None:
        """Raise :class:`UserCodeError` if the run should stop. ``training``: the keys of the
        trials in flight; one of a key no failed group had may yet end otherwise, so the run
        goes on while there is one."""
        if self.other or len(self.kinds) != 1 or not (end or self.groups >= SAME_FAULT_GROUPS):
            return
        if any(k not in self.keys for k in training):
            return
        raise UserCodeError(f"{self.first} (every trial of this run failed this way, in "
                            f"{self.groups} group{'s' if self.groups > 1 else ''}: fix it and "
                            "run again)")
