"""Hydro: cheap hyperparameter tuning for PyTorch models.

The pipeline, one module a stage: capture (:mod:`hydro.fx.capture`) → width analysis
(:mod:`hydro.fx.widths`) → scale (:mod:`hydro.scaling`) → muP parametrization
(:mod:`hydro.parametrize`) → fuse → optimize → tune → place → export.
"""

from hydro import optim, parametrize
from hydro.coord import CoordCheckResult, coord_check
from hydro.errors import ConfigError, FuseError, HydroError, ScaleError, StorageError, TraceError
from hydro.fusion import FusedModel, fuse, trial_loss
from hydro.inspection import InspectReport, inspect
from hydro.scaling import scale
from hydro.tuning import Task, TuneResult, tune

__version__ = "0.1.0"

__all__ = [
    "CoordCheckResult",
    "FusedModel",
    "Task",
    "TuneResult",
    "fuse",
    "optim",
    "trial_loss",
    "tune",
    "InspectReport",
    "coord_check",
    "inspect",
    "ConfigError",
    "FuseError",
    "HydroError",
    "ScaleError",
    "StorageError",
    "TraceError",
    "parametrize",
    "scale",
]
