"""Executors run fused trial groups in worker processes: locally or on a Ray cluster.

Both satisfy :class:`Executor` and :class:`PlacingExecutor`
(:mod:`hydro_fluid.executors.protocol`); :func:`check_executor` checks an object of your own.
"""

from .base import GroupResult, TrialOutcome, WorkerContext
from .local import LocalExecutor
from .protocol import Executor, PlacingExecutor, check_executor
from .ray import RayExecutor

__all__ = [
    "Executor",
    "GroupResult",
    "LocalExecutor",
    "PlacingExecutor",
    "RayExecutor",
    "TrialOutcome",
    "WorkerContext",
    "check_executor",
]
