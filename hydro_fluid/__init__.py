"""hydro_fluid: resource-aware placement and execution of fused trial groups.

Model the work (:class:`TrialGroup`) and the resources (:class:`Device`, :class:`Cluster`),
decide placements (:func:`fifo`, :func:`static_fluid`, :func:`dynamic_fluid`,
:func:`deadline`, or any registered :class:`Policy`: :func:`policy_names`), try them in the
simulator (:func:`simulate`), and run fused groups in worker processes
(:class:`LocalExecutor`) or on a Ray cluster (:class:`RayExecutor`, needs
``pip install 'hydro-surrogate[ray]'``); both satisfy the :class:`Executor` protocol
(:func:`check_executor`). The Coordinator (:mod:`hydro_fluid.coordinator`) runs trial
groups in the bubbles of a pipeline-parallel job (:class:`PipelineJob`, :func:`interleave`,
:func:`simulate_coordinator`).

The executors (which need torch) and the Coordinator are imported on first use (PEP 562);
the rest needs the standard library only, so the policy registry that ``hydro tune --help``
lists loads in milliseconds. ``simulate`` is imported eagerly: it names both a submodule
and its function, and a lazy name would be shadowed by the submodule once imported.
"""

import importlib as _importlib
from typing import TYPE_CHECKING, Any

from .groups import TrialGroup
from .policies import PlacementState, Policy, get_policy, policy_names, register_policy
from .policy import Allocation, deadline, dynamic_fluid, fifo, static_fluid
from .resources import Cluster, Device
from .simulate import SimResult, lower_bound, simulate

if TYPE_CHECKING:  # type checkers and IDEs see the names the lazy table below provides
    from .coordinator import PipelineJob, interleave, simulate_coordinator
    from .executors import (
        Executor,
        GroupResult,
        LocalExecutor,
        PlacingExecutor,
        TrialOutcome,
        WorkerContext,
        check_executor,
    )
    from .executors.ray import RayExecutor

# public name -> the module that defines it, imported on first access: the executors load
# torch, the coordinator's planning is a few modules that `hydro --help` need not wait for
_LAZY = {
    "PipelineJob": "hydro_fluid.coordinator",
    "interleave": "hydro_fluid.coordinator",
    "simulate_coordinator": "hydro_fluid.coordinator",
    "Executor": "hydro_fluid.executors",
    "PlacingExecutor": "hydro_fluid.executors",
    "check_executor": "hydro_fluid.executors",
    "GroupResult": "hydro_fluid.executors",
    "LocalExecutor": "hydro_fluid.executors",
    "TrialOutcome": "hydro_fluid.executors",
    "WorkerContext": "hydro_fluid.executors",
    "RayExecutor": "hydro_fluid.executors.ray",
}

__all__ = [
    "Allocation",
    "Cluster",
    "Device",
    "Executor",
    "GroupResult",
    "LocalExecutor",
    "PipelineJob",
    "PlacementState",
    "PlacingExecutor",
    "Policy",
    "RayExecutor",
    "SimResult",
    "TrialGroup",
    "TrialOutcome",
    "WorkerContext",
    "check_executor",
    "deadline",
    "dynamic_fluid",
    "fifo",
    "get_policy",
    "interleave",
    "lower_bound",
    "policy_names",
    "register_policy",
    "simulate",
    "simulate_coordinator",
    "static_fluid",
]


def __getattr__(name: str) -> Any:
    """Import a lazy name's module on first access and cache the name in this module."""
    where = _LAZY.get(name)
    if where is None:
        # a submodule read as an attribute (`hydro_fluid.coordinator.X` after `import
        # hydro_fluid`), as the eager imports this module once made allowed
        if name.startswith("_"):
            raise AttributeError(f"module 'hydro_fluid' has no attribute {name!r}")
        try:
            return _importlib.import_module(f"hydro_fluid.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"hydro_fluid.{name}":
                raise
            raise AttributeError(f"module 'hydro_fluid' has no attribute {name!r}") from None
    value = getattr(_importlib.import_module(where), name)
    globals()[name] = value  # later reads skip __getattr__
    return value


def __dir__() -> list[str]:
    """The public names, imported yet or not, and whatever this module holds now."""
    return sorted(set(__all__) | set(globals()))
