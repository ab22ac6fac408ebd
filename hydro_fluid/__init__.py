"""hydro_fluid: resource-aware placement and execution of fused trial groups.

Model the work (:class:`TrialGroup`) and the resources (:class:`Device`, :class:`Cluster`),
decide placements (:func:`fifo`, :func:`static_fluid`, :func:`dynamic_fluid`,
:func:`deadline`), try them in the simulator (:func:`simulate`), and run fused groups in
worker processes (:class:`LocalExecutor`) or on a Ray cluster (:class:`RayExecutor`, needs
``pip install 'hydro-surrogate[ray]'``). The Coordinator (:mod:`hydro_fluid.coordinator`)
runs trial groups in the bubbles of a pipeline-parallel job (:class:`PipelineJob`,
:func:`interleave`, :func:`simulate_coordinator`).
"""

from .coordinator import PipelineJob, interleave, simulate_coordinator
from .executors import GroupResult, LocalExecutor, TrialOutcome, WorkerContext
from .executors.ray import RayExecutor
from .groups import TrialGroup
from .policy import Allocation, deadline, dynamic_fluid, fifo, static_fluid
from .resources import Cluster, Device
from .simulate import SimResult, lower_bound, simulate

__all__ = [
    "Allocation",
    "Cluster",
    "Device",
    "GroupResult",
    "LocalExecutor",
    "PipelineJob",
    "RayExecutor",
    "SimResult",
    "TrialGroup",
    "TrialOutcome",
    "WorkerContext",
    "deadline",
    "dynamic_fluid",
    "fifo",
    "interleave",
    "lower_bound",
    "simulate",
    "simulate_coordinator",
    "static_fluid",
]
