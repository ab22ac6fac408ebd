"""Exceptions raised by Hydro.

Every error names what is wrong (a module path, a graph node, a file and key) and says what to do.
They subclass ``ValueError`` for bad input and ``RuntimeError`` for failures while running, so code
that already catches those keeps working.
"""

from __future__ import annotations


class HydroError(Exception):
    """Base class of every exception raised by Hydro."""


class TraceError(HydroError, ValueError):
    """The model could not be captured by running it on its example inputs."""


class ScaleError(HydroError, ValueError):
    """The model cannot be scaled by the requested ratio."""


class FuseError(HydroError, ValueError):
    """Several trials of a model cannot be fused into one model."""


class ConfigError(HydroError, ValueError):
    """A search space, task or config file is malformed."""


class StorageError(HydroError, RuntimeError):
    """An Optuna storage could not be opened."""


class ExecutorError(HydroError, RuntimeError):
    """An executor could not start (Ray did not come up): ``hydro tune`` exits 3."""

    exit_code = 3  # read by hydro.cli.main: the environment failed, not the input


class DataError(HydroError, ValueError):
    """Training or validation data are malformed (lengths, keys, labels, NaN)."""


class ModelError(HydroError, ValueError):
    """The model (or its factory) cannot be used as given."""


class StudyError(HydroError, RuntimeError):
    """A study holds no result to read (no completed trial), or cannot be found."""


class UserCodeError(HydroError, RuntimeError):
    """The user's own code (data, loss, metric, model) raised while a group trained.

    The message is one line naming the callable, the exception and the innermost line of the
    user's file that raised it. It is deterministic: an executor does not retry it.
    """

    deterministic = True  # read by hydro_fluid's executors: retrying would raise it again


class HydroWarning(UserWarning):
    """Something works but is probably not what was meant (e.g. a surrogate as big as the model)."""
