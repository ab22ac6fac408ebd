"""Tuning: the task, search spaces, fused group training, the driver and transfer/export."""

from hydro.tuning.task import Task
from hydro.tuning.tune import TuneResult, export, tune, verify

__all__ = ["Task", "TuneResult", "export", "tune", "verify"]
