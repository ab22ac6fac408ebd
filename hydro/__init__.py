"""Hydro: cheap hyperparameter tuning for PyTorch models.

The pipeline, one module a stage: capture (:mod:`hydro.fx.capture`) → width analysis
(:mod:`hydro.fx.widths`) → scale (:mod:`hydro.scaling`) → muP parametrization
(:mod:`hydro.parametrize`) → fuse → optimize → tune → place → export.

The public names are imported on first use (PEP 562): ``import hydro`` costs a few
milliseconds, and ``hydro --help`` or a mistyped flag never waits for torch to load.
``hydro.scale``, ``from hydro import fuse`` and ``dir(hydro)`` work as for eager imports.
"""

import importlib as _importlib
from types import ModuleType as _ModuleType
from typing import TYPE_CHECKING, Any

# the error classes need only the standard library: eager, so `except hydro.ConfigError` is free
from hydro.errors import ConfigError, FuseError, HydroError, ScaleError, StorageError, TraceError

if TYPE_CHECKING:  # type checkers and IDEs see the names the lazy table below provides
    from hydro import optim, parametrize
    from hydro.coord import CoordCheckResult, coord_check
    from hydro.fusion import FusedModel, fuse, trial_loss
    from hydro.inspection import InspectReport, inspect
    from hydro.scaling import scale
    from hydro.transfer import Recipe, recipe
    from hydro.tuning import Loop, Run, Task, TuneOptions, TuneResult, tune

from hydro._version import __version__ as __version__  # the leaf setup.cfg reads

# public name -> the module that defines it (a submodule when the name is the module itself)
_LAZY = {
    "optim": "hydro.optim",
    "parametrize": "hydro.parametrize",
    "CoordCheckResult": "hydro.coord",
    "coord_check": "hydro.coord",
    "FusedModel": "hydro.fusion",
    "fuse": "hydro.fusion",
    "trial_loss": "hydro.fusion",
    "InspectReport": "hydro.inspection",
    "inspect": "hydro.inspection",
    "scale": "hydro.scaling",
    "Recipe": "hydro.transfer",
    "recipe": "hydro.transfer",
    # hydro.tuning.tune is both a submodule and a function: read the function from its module
    "Task": "hydro.tuning.task",
    "Loop": "hydro.tuning.loop",
    "Run": "hydro.tuning.loop",
    "TuneOptions": "hydro.tuning.options",
    "TuneResult": "hydro.tuning.outputs",
    "tune": "hydro.tuning.tune",
}

__all__ = [
    "CoordCheckResult",
    "FusedModel",
    "Loop",
    "Run",
    "Task",
    "TuneOptions",
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
    "Recipe",
    "recipe",
    "scale",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access and cache the name in this module."""
    where = _LAZY.get(name)
    if where is None:
        # a submodule read as an attribute (`hydro.fusion.X` after `import hydro`), as the eager
        # imports this module once made allowed
        if name.startswith("_"):
            raise AttributeError(f"module 'hydro' has no attribute {name!r}")
        where = f"hydro.{name}"
        try:
            return _importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name != where:  # the submodule exists but something it imports does not
                raise
            raise AttributeError(f"module 'hydro' has no attribute {name!r}") from None
    module = _importlib.import_module(where)
    value = module if where == f"hydro.{name}" else getattr(module, name)
    globals()[name] = value  # later reads skip __getattr__
    return value


def __dir__() -> list[str]:
    """The public names, imported yet or not, the dunders and the submodules imported so far."""
    loaded = {
        n for n, v in globals().items() if isinstance(v, _ModuleType) and v.__name__ == f"hydro.{n}"
    }
    return sorted(set(__all__) | loaded | {n for n in globals() if n.startswith("__")})
