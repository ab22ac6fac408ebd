"""Small worker functions for examples and smoke tests of the executors.

They are importable (hence picklable) module-level functions, as every ``fn`` must be.
"""

from __future__ import annotations

import time

import torch

from ..groups import TrialGroup
from .base import Stopped, WorkerContext

__all__ = ["count_steps", "placed_steps"]


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


def placed_steps(group: TrialGroup, ctx: WorkerContext, seconds: float = 0.02) -> dict:
    """Like :func:`count_steps`, and movable by a placement policy; each step computes for
    ``seconds`` (summed over the ranks of a data-parallel group, which split the work).

    Each step: compute, all-reduce across the ranks (so a data-parallel group really is one),
    report, checkpoint, ``ctx.progress``, and stop for a move when the parent asks. Returns
    every step it trained (across moves, from the checkpoint: a lost or repeated step shows)
    and each placement it ran on as ``[world_size, threads, first step]``.
    """
    state = ctx.load_checkpoint() or {"step": 0, "trained": [], "placements": []}
    trained, placements = list(state["trained"]), list(state["placements"])
    placements.append([ctx.world_size, ctx.num_threads, int(state["step"])])
    steps = int(max(group.budgets))
    a = torch.randn(64, 64)
    for step in range(int(state["step"]), steps):
        end = time.perf_counter() + seconds / ctx.world_size
        while time.perf_counter() < end:
            a = torch.tanh(a @ a)
        if ctx.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(torch.ones(1))
        trained.append(step)
        live = [t for t, b in zip(group.trial_ids, group.budgets, strict=True) if step < b]
        for trial in live:
            if not ctx.is_pruned(trial):
                ctx.report(trial, step, float(step))
        ctx.save_checkpoint({"step": step + 1, "trained": trained, "placements": placements})
        ctx.progress(step + 1, len(live), score=float(min(map(hash, group.trial_ids))))
        if step + 1 < steps and ctx.should_stop():
            raise Stopped
    return {"trained": trained, "placements": placements}
