"""The Coordinator: tuning trials in the idle bubbles of pipeline-parallel training jobs.

Model the host job (:class:`PipelineJob`, its :class:`Timeline` and :class:`Bubble`\\ s),
plan a study's trial groups into the bubbles (:func:`interleave`), compare against running
the study elsewhere (:func:`simulate_coordinator`). A real 2-stage pipeline with a guest
trial group in its bubbles is an example: ``examples/coordinator/pipeline.py``.
"""

from .interleave import GuestRun, InterleavePlan, interleave, periodic_bubbles
from .pipeline import Bubble, Op, PipelineJob, Timeline
from .simulate import CoordinatorResult, simulate_coordinator

__all__ = [
    "Bubble",
    "CoordinatorResult",
    "GuestRun",
    "InterleavePlan",
    "Op",
    "PipelineJob",
    "Timeline",
    "interleave",
    "periodic_bubbles",
    "simulate_coordinator",
]
