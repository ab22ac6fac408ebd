"""Training one fixed group of trials to the end: :func:`train_group`.

The members train fused and in lockstep from step 1; a member that ends early (pruned, diverged,
a non-finite validation value) leaves the group and nothing takes its place. A checkpoint
directory makes the run resumable, bit-identical to one never interrupted. ``verify_top_k``
and the tests train groups this way; the tuner's continuous batching, which refills slots,
is :mod:`hydro.tuning.slots`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import hydro.host as host
from hydro.tuning import checkpoint as _checkpoint
from hydro.tuning.group import FusedGroup, GroupInfo, Outcome, load_model_state
from hydro.tuning.task import Task

# report(member, step, value) -> True when the caller prunes that member
Report = Callable[[int, int, float], bool]


def train_group(
    task: Task,
    params: Sequence[dict[str, Any]],
    *,
    ratio: int,
    seeds: Sequence[int],
    report: Report | None = None,
    device: str | torch.device = "cpu",
    pruned: Callable[[], set[int]] | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    depth_ratio: int = 1,
    depth_alpha: float = 1.0,
) -> tuple[list[Outcome], GroupInfo]:
    """Train ``len(params)`` trials of ``task`` fused, and return how each ended.

    Each member trains on its own data order (from its seed) and ends exactly as it would
    alone. Members that end early leave the group; nothing takes their place (the driver's
    continuous batching refills slots: :class:`FusedGroup`).

    Args:
        task: what to train.
        params: each member's hyperparameters (all with the same :func:`group_key`).
        ratio: surrogate width divisor (1 trains the target itself).
        seeds: each member's initialization and data seed.
        report: called with ``(member, step, value)`` at every evaluation; returns ``True`` to
            prune that member.
        device: where to train.
        pruned: polled every step for members pruned meanwhile (when reports travel to
            another process and the answer comes later).
        checkpoint: a directory for the group's checkpoint: training resumes from the one
            found there, and ends bit-identical to a run never interrupted.
        checkpoint_every: save a checkpoint every this many steps (0: never).
        depth_ratio: keep every ``depth_ratio``-th block of each stack of repeated blocks
            (:func:`hydro.scale`); 1 keeps them all.
        depth_alpha: the residual-branch exponent of the depth cut (1: CompleteP).
    """
    start = time.perf_counter()
    n = len(params)
    group = FusedGroup(task, [(k, p, s) for k, (p, s) in enumerate(zip(params, seeds))],
                       ratio=ratio, device=device, refill=False, depth_ratio=depth_ratio,
                       depth_alpha=depth_alpha)
    outcomes: dict[int, Outcome] = {}
    history: dict[int, list[tuple[int, float]]] = {k: group.members[k].history for k in range(n)}
    first = 1
    saved = _checkpoint.load(checkpoint) if checkpoint is not None else None
    if saved is not None:
        first = _resume(saved, group, outcomes, history)
    for step in range(first, task.steps + 1):
        group.step()
        alive = [m.id for m in group.members]
        due = group.due()
        # on an accelerator the flags are read with the evaluation values (one wait); where a
        # read is free, at once: nothing refills a slot here, so a frozen member only costs
        if due or host.reads_are_free(group.device):
            for pos, at in group.diverged().items():
                k = alive[pos]
                if k not in outcomes:
                    outcomes[k] = Outcome("fail", None, at, f"diverged at step {at}: "
                                          "non-finite loss or gradient", history[k])
        for k in pruned() if pruned is not None else ():
            if k in alive and k not in outcomes:
                last = history[k][-1][1] if history[k] else None
                outcomes[k] = Outcome("pruned", last, step, "", history[k])
        if due:
            values = group.evaluate(full=None if step >= task.steps else [])
            for pos, k in enumerate(alive):
                if k not in outcomes:
                    _evaluated(k, step, float(values[pos]), history[k], outcomes, report,
                               task.steps)
        # members that ended (pruned, failed) leave the fused model and stop costing compute
        gone = [pos for pos, k in enumerate(alive) if k in outcomes]
        if gone:
            if len(gone) == len(alive):
                break
            group.drop(gone)
        if checkpoint is not None and checkpoint_every and step % checkpoint_every == 0 \
                and step < task.steps:
            _checkpoint.save(checkpoint, _state(step, group, outcomes, history))
    for m in group.members:
        if m.id not in outcomes:
            last = history[m.id][-1][1] if history[m.id] else None
            outcomes[m.id] = Outcome("complete", last, task.steps, "", history[m.id])
    info = GroupInfo(ratio=ratio, size=n, widths=group.widths, depth_ratio=depth_ratio,
                     depth_alpha=depth_alpha, blocks=group.blocks,
                     seconds=time.perf_counter() - start,
                     occupancy=group.live_steps / max(1, group.steps * n))
    return [outcomes[k] for k in range(n)], info


def _evaluated(k, step, v, history, outcomes, report, last) -> None:
    """Record member ``k``'s validation value; end it on a non-finite value or a prune."""
    history.append((step, v))
    if not math.isfinite(v):
        outcomes[k] = Outcome("fail", None, step, "non-finite validation value", history)
    elif report is not None and report(k, step, v) and step < last:
        outcomes[k] = Outcome("pruned", v, step, "", history)


def _state(step, group, outcomes, history) -> dict[str, Any]:
    """Everything the loop needs to go on after ``step``: tensors and plain containers only."""
    return {
        "step": step,
        "model": group.fused.state_dict(),
        "optimizer": group.opt.state_dict(),
        "alive": [m.id for m in group.members],
        "outcomes": {k: [o.state, o.value, o.step, o.reason] for k, o in outcomes.items()},
        "history": {k: [list(h) for h in v] for k, v in history.items()},
        "rng": _checkpoint.rng_state(),
    }


def _resume(saved, group, outcomes, history) -> int:
    """Put a freshly built group in the state of checkpoint ``saved``; returns the next step."""
    step = int(saved["step"])
    for k, v in saved["history"].items():
        history[int(k)][:] = [(int(s), float(x)) for s, x in v]
    for k, (state, value, at, reason) in saved["outcomes"].items():
        outcomes[int(k)] = Outcome(state, value, at, reason, history[int(k)])
    if group.sched is not None:  # per-trial schedules are pure functions of the step: replay them
        for _ in range(step):
            group.sched.step()
    alive = [int(k) for k in saved["alive"]]
    if len(alive) < group.n:
        group.drop([pos for pos, m in enumerate(group.members) if m.id not in alive])
    for m in group.members:  # each data stream continues where it stopped
        group.skip(step, m)
        m.step = step
    group.skip(step)  # the group's stream, with shared data
    load_model_state(group, saved["model"])
    group.opt.load_state_dict(saved["optimizer"])
    _checkpoint.set_rng_state(saved["rng"])
    return step + 1
