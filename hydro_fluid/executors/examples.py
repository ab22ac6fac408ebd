"""Small worker functions for examples and smoke tests of the executors.

They are importable (hence picklable) module-level functions, as every ``fn`` must be.
"""

from __future__ import annotations

import time

import torch

from ..groups import TrialGroup
from .base import Stopped, WorkerContext

__all__ = ["count_steps", "placed_steps", "fused_mlp"]


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


def fused_mlp(group: TrialGroup, ctx: WorkerContext, width: int = 64, batch: int = 32) -> dict:
    """Train one small MLP regression per member, fused (``bmm``), each for its own budget.

    Members leave the fused step when they reach their budget (so a step gets cheaper as
    the group thins out), every step reports each live member's loss, and the group is
    movable: checkpoint every 10 steps and on ``ctx.should_stop()``, ``ctx.progress`` each
    step (score: the best loss so far). Returns each member's last loss.
    """
    n, steps = group.size, int(max(group.budgets))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 1, generator=g))
    state = ctx.load_checkpoint()
    if state is None:
        gen = torch.Generator().manual_seed(sum(map(hash, group.trial_ids)) % 2**31)
        state = {
            "step": 0,
            "w1": torch.randn(n, 16, width, generator=gen) / 4,
            "w2": torch.randn(n, width, 1, generator=gen) / width**0.5,
            "last": [float("nan")] * n,
        }
    w1, w2, last = state["w1"], state["w2"], list(state["last"])
    lrs = torch.logspace(-2.5, -0.5, n).view(n, 1, 1)
    budgets = torch.tensor([float(b) for b in group.budgets])
    for step in range(int(state["step"]), steps):
        live = torch.nonzero(budgets > step).flatten()
        rows = torch.randint(0, 512, (batch,), generator=torch.Generator().manual_seed(step))
        a, b = w1[live].requires_grad_(), w2[live].requires_grad_()
        pred = torch.bmm(torch.relu(torch.bmm(x[rows].expand(len(live), -1, -1), a)), b)
        losses = ((pred - y[rows]) ** 2).mean(dim=(1, 2))
        losses.sum().backward()
        with torch.no_grad():
            w1[live] = a - lrs[live] * a.grad
            w2[live] = b - lrs[live] * b.grad
        for i, value in zip(live.tolist(), losses.tolist(), strict=True):
            last[i] = value
            if not ctx.is_pruned(group.trial_ids[i]):
                ctx.report(group.trial_ids[i], step, value)
        done = {"step": step + 1, "w1": w1, "w2": w2, "last": last}
        ctx.progress(step + 1, len(live), score=min(v for v in last if v == v))
        if step + 1 < steps and ctx.should_stop():
            ctx.save_checkpoint(done)
            raise Stopped
        if (step + 1) % 10 == 0:
            ctx.save_checkpoint(done)
    return {"last": last}
