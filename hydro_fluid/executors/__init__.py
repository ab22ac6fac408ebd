"""Executors run fused trial groups in worker processes: locally or on a Ray cluster."""

from .base import GroupResult, TrialOutcome, WorkerContext
from .local import LocalExecutor
from .ray import RayExecutor

__all__ = ["GroupResult", "LocalExecutor", "RayExecutor", "TrialOutcome", "WorkerContext"]
