"""Executors run fused trial groups in worker processes: locally or on a Ray cluster."""

from .base import GroupResult, TrialOutcome, WorkerContext
from .local import LocalExecutor

__all__ = ["GroupResult", "LocalExecutor", "TrialOutcome", "WorkerContext"]
