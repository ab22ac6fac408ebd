"""Small worker functions for examples and smoke tests of the executors.

They are importable (hence picklable) module-level functions, as every ``fn`` must be.
"""

from __future__ import annotations

from ..groups import TrialGroup
from .base import WorkerContext

__all__ = ["count_steps"]


def count_steps(group: TrialGroup, ctx: WorkerContext) -> int:
    """Report ``step`` as the value of every live trial for each step of its budget.

    Resumes from its checkpoint, so a retried group continues where it stopped. Returns
    the number of steps of the longest budget.

    Example:
        >>> from hydro_fluid import LocalExecutor, TrialGroup
        >>> from hydro_fluid.executors.examples import count_steps
        >>> [result] = LocalExecutor(devices=[], num_workers=1).run(
        ...     [TrialGroup("g", (0,), (5,))], count_steps)
        >>> result.value
        5
    """
    state = ctx.load_checkpoint() or {"step": 0}
    steps = int(max(group.budgets))
    for step in range(state["step"], steps):
        for trial, budget in zip(group.trial_ids, group.budgets, strict=True):
            if step < budget and not ctx.is_pruned(trial):
                ctx.report(trial, step, float(step))
        ctx.save_checkpoint({"step": step + 1})
    return steps
