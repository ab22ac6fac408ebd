"""hydro_fluid: resource-aware placement and execution of fused trial groups.

Model the work (:class:`TrialGroup`) and the resources (:class:`Device`, :class:`Cluster`),
decide placements (:func:`fifo`, :func:`static_fluid`, :func:`dynamic_fluid`,
:func:`deadline`), try them in the simulator (:func:`simulate`), and run fused groups in
worker processes (:class:`LocalExecutor`) or on a Ray cluster (:class:`RayExecutor`, needs
``pip install 'hydro-surrogate[ray]'``).
"""

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
    "RayExecutor",
    "SimResult",
    "TrialGroup",
    "TrialOutcome",
    "WorkerContext",
    "deadline",
    "dynamic_fluid",
    "fifo",
    "lower_bound",
    "simulate",
    "static_fluid",
]
