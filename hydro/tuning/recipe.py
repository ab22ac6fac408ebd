"""The training recipe of one fused group, read from a :class:`Task` and each trial's params.

The fused optimizer with each trial's hyperparameters (``lr``, ``weight_decay``, betas or
momentum, with the task optimizer's defaults), each trial's learning-rate schedule (warm-up,
then the task's decay), one training step of every member, and the validation of every member.
:mod:`hydro.tuning.group` builds its groups with these.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import hydro.optim as fused_optim
from hydro.errors import ConfigError
from hydro.tuning.task import Task, autocast

DEFAULTS = {"adamw": {"lr": 1e-3, "weight_decay": 0.01}, "adam": {"lr": 1e-3, "weight_decay": 0.0},
            "sgd": {"lr": 1e-2, "weight_decay": 0.0}}


def _train_step(task, fused, opt, batch, clip, device, shared=True, reduce=None, scales=None) -> torch.Tensor:  # noqa: E501
    """One step of every member; returns their losses ``[n]`` (detached, on the device: no host
    synchronization). ``reduce(losses)``, run after the backward pass, averages the losses and
    gradients of data parallel replicas and returns the averaged losses. ``scales`` (float16:
    a :class:`~hydro.tuning.loss_scale.LossScales`) scales each member's loss before the
    backward pass and unscales its gradients after; a member whose gradients overflowed skips
    this step (it is held out of the update like a diverged trial, for this step only) and
    backs off its scale.

    Nothing of the autograd graph outlives this function: ``select`` shrinks parameters in place,
    which autograd accepts only once no graph still refers to them.

    A compiled fused model trains through one graph for the whole step
    (:func:`hydro.fusion.step.train_step`: forward, losses, backward, clipping and update), or
    through its two-graph fallback where that does not apply; data parallel replicas
    (``reduce``) average between backward and update, so they keep the step below.
    """
    args, kwargs, y = task.split(batch, device)
    if reduce is None and getattr(fused, "_compiler", None) is not None \
            and task.precision == "fp32":
        return _whole_step(task, fused, opt, shared, clip)(args, y, kwargs, shared=shared)
    with autocast(task.precision, device):  # the forward and the losses; not the update
        losses = task.trial_losses(fused(*args, shared=shared, **kwargs), y, shared=shared)
    if task.precision != "fp32":
        losses = losses.float()  # a loss autocast left in bfloat16
    opt.zero_grad(set_to_none=True)
    (losses if scales is None else scales.scale(losses)).sum().backward()
    if reduce is not None:
        losses = reduce(losses.detach())
    # a non-finite loss freezes its member even where its gradients came out finite
    fused.diverged.logical_or_(~torch.isfinite(losses.detach()))
    overflowed = None if scales is None else scales.unscale_(fused.parameters())
    if any(c is not None for c in clip):
        fused_optim.clip_grad_norm_(fused, [c if c is not None else math.inf for c in clip])
    if overflowed is None:
        opt.step()
        return losses.detach()
    # held out like a diverged trial (no update, no optimizer step counted), then let go
    diverged = fused.diverged.clone()
    fused.diverged.logical_or_(overflowed)
    opt.step()
    fused.diverged.copy_(diverged)
    scales.update(overflowed)
    return losses.detach()


def _whole_step(task: Task, fused: nn.Module, opt: fused_optim.FusedOptimizer, shared: bool,
                clip: Sequence[float | None]) -> Any:
    """The group's :class:`hydro.fusion.step.TrainStep`, kept on the fused model while its
    optimizer and task stay; the clipping norms are read each step (a refill changes them
    without a recompile)."""
    from hydro.fusion.step import train_step

    kept = fused.__dict__.get("_hydro_train_step")
    if kept is None or kept[0] is not opt or kept[1] is not task or kept[2] != shared:
        step = train_step(fused, opt, functools.partial(task.trial_losses, shared=shared),
                          loss_key=("task", id(task), shared))
        kept = fused.__dict__["_hydro_train_step"] = (opt, task, shared, step)
    step = kept[3]
    step.clip = list(clip)
    return step


@torch.no_grad()
def evaluate(
    task: Task, fused: nn.Module, batch_size: int, device: Any, full: Sequence[int] | None = None,
    samples: int | None = None,
) -> list[float]:
    """Each member's metric (or loss) averaged over the validation data.

    With ``task.eval_samples`` set, members not in ``full`` (default: all are) get the mean over
    the fixed subsample (:meth:`Task.val_sample`; ``samples``: its size where
    ``eval_samples="auto"``, else none is read), those in ``full`` the mean over all of it,
    computed exactly as without a subsample. Only what some member needs is read, and each value
    depends on its own member only, whatever the others need.
    """
    fused.eval()
    sample = task.val_sample(samples)
    whole = set(range(fused.n)) if sample is None or full is None else set(full)
    values: dict[str, list[float]] = {}
    if whole:
        values["all"] = _mean(task, fused, task.val_batches(max(batch_size, 64)), device)
    if sample is not None and len(whole) < fused.n:
        values["sample"] = _mean(task, fused, sample, device)
    fused.train()
    return [values["all"][k] if k in whole else values["sample"][k] for k in range(fused.n)]


@torch.no_grad()
def block_means(task: Task, fused: nn.Module, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Every member's mean over each block of the validation split, in the subsamples' order
    (:meth:`Task.val_blocks`): ``[blocks, n]`` and each block's samples ``[blocks]``, on the
    CPU (what ``eval_samples="auto"`` measures, :mod:`hydro.tuning.eval_sample`)."""
    fused.eval()
    means, sizes = [], []
    for batch in task.val_blocks():
        args, kwargs, y = task.split(batch, device)
        with autocast(task.precision, device):
            out = fused(*args, **kwargs)
        means.append(task.trial_metrics(out, y).double())
        sizes.append(task.batch_len(batch))
    fused.train()
    if not means:
        return torch.empty(0, fused.n, dtype=torch.float64), torch.empty(0, dtype=torch.long)
    return torch.stack(means).cpu(), torch.tensor(sizes)


def _mean(task: Task, fused: nn.Module, batches: Any, device: Any) -> list[float]:
    total, count = None, 0
    for batch in batches:
        args, kwargs, y = task.split(batch, device)
        size = task.batch_len(batch)
        with autocast(task.precision, device):
            out = fused(*args, **kwargs)
        v = task.trial_metrics(out, y).double() * size
        total = v if total is None else total + v
        count += size
    return (total / max(count, 1)).tolist() if total is not None else [math.nan] * fused.n


def _optimizer(
    task: Task, fused: nn.Module, params: Sequence[dict], compile: bool | str = "auto"
) -> fused_optim.FusedOptimizer:
    """The fused optimizer of ``params``' hyperparameters; ``compile``: its update's
    (:class:`hydro.optim.base.FusedOptimizer`; ``True`` where the model is compiled)."""
    defaults = DEFAULTS[task.optimizer]

    def column(name: str, default: float) -> list[float]:
        return [float(p.get(name, default)) for p in params]

    lr = column("lr", defaults["lr"])
    wd = column("weight_decay", defaults["weight_decay"])
    if task.optimizer == "sgd":
        return fused_optim.SGD(fused.parameters(), lr=lr, momentum=column("momentum", 0.0),
                               weight_decay=wd, compile=compile)
    cls = fused_optim.AdamW if task.optimizer == "adamw" else fused_optim.Adam
    return cls(fused.parameters(), lr=lr, betas=(column("beta1", 0.9), column("beta2", 0.999)),
               eps=column("eps", 1e-8), weight_decay=wd, compile=compile)


def _hyper(task: Task, p: dict[str, Any]) -> dict[str, Any]:
    """One trial's optimizer hyperparameters, as :meth:`FusedOptimizer.reset_trial` takes them."""
    defaults = DEFAULTS[task.optimizer]
    out = {"lr": float(p.get("lr", defaults["lr"])),
           "weight_decay": float(p.get("weight_decay", defaults["weight_decay"]))}
    if task.optimizer == "sgd":
        out["momentum"] = float(p.get("momentum", 0.0))
    else:
        out["betas"] = (float(p.get("beta1", 0.9)), float(p.get("beta2", 0.999)))
        out["eps"] = float(p.get("eps", 1e-8))
    return out


def _scheduler(
    task: Task, opt: fused_optim.FusedOptimizer, params: Sequence[dict], always: bool = False
) -> Any:
    """Each member's own learning-rate schedule (warm-up, then the task's decay), read from
    ``params[k]`` whenever slot ``k``'s schedule is (re)built; ``None`` when no member has one
    (unless ``always``: a group whose slots take new trials)."""
    steps = task.steps
    warm = [int(p.get("warmup", 0)) for p in params]
    if any(w >= steps for w in warm):
        raise ConfigError(f"warmup {max(warm)} must be shorter than steps ({steps}): draw "
                          f"warm-ups of at most {steps - 1}, or train more steps")
    if task.scheduler == "none" and not any(warm) and not always:
        return None
    return fused_optim.lr_scheduler.TrialScheduler(
        opt, lambda o, k: _schedule(task.scheduler, steps, int(params[k].get("warmup", 0)), o)
    )


def _schedule(kind: str, steps: int, warmup: int, o: torch.optim.Optimizer) -> Any:
    """One trial's torch schedule on (stand-in) optimizer ``o``: the one :func:`hydro.recipe`
    builds for the full model, whatever the other members of its group do."""
    if warmup >= steps:
        raise ConfigError(f"warmup {warmup} must be shorter than steps ({steps}): draw "
                          f"warm-ups of at most {steps - 1}, or train more steps")
    S = torch.optim.lr_scheduler
    rest = max(1, steps - max(warmup, 1))  # a 1-step run still gets a (never reached) decay
    if kind == "cosine":
        main = S.CosineAnnealingLR(o, T_max=rest)
    elif kind == "linear":
        main = S.LinearLR(o, start_factor=1.0, end_factor=1e-3, total_iters=rest)
    elif kind == "step":
        main = S.StepLR(o, step_size=max(1, rest // 3), gamma=0.1)
    else:
        main = S.LinearLR(o, start_factor=1.0, end_factor=1.0, total_iters=1)
    if not warmup:
        return main
    ramp = S.LinearLR(o, start_factor=1.0 / (warmup + 1), end_factor=1.0, total_iters=warmup)
    return S.SequentialLR(o, [ramp, main], milestones=[warmup])
