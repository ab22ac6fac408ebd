"""Data parallel fused groups: one group trained by ``world_size`` processes, exactly.

Every rank builds the same fused group and draws every member's whole batch from the member's
own stream; rank ``r`` trains on its contiguous share of the rows (rows ``r * b / k`` to
``(r + 1) * b / k`` of a batch of ``b``, for ``k`` ranks). A trial's loss is the mean over its
rows, so the mean of the ranks' losses (and gradients) over equal shards is the whole batch's:
one all-reduce per step, over one flat buffer of every gradient and the trials' losses, makes
each rank's update the single-process update on the whole batch (to the rounding of the sum).

Everything a step decides from outside the arithmetic (evaluation values, divergence, the
driver's answers: pruned trials, refills) is decided on rank 0 and broadcast, so the ranks
never drift apart. Two things would break the equality with the single-device group, and are
refused with a :class:`~hydro.errors.ConfigError` (``FusedGroup.distribute``): batch
normalization (its statistics would be a shard's, not the batch's) and random ops such as
dropout (a trial's random numbers are indexed by the element's place in its batch, which a
shard changes). The task's loss must be a mean over the batch's rows (every built-in loss is).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hydro.errors import ConfigError

__all__ = ["all_reduce_mean", "batch_norm", "random_ops", "share", "shard"]


def share(obj: Any, rank: int, world_size: int) -> Any:
    """Rank 0's ``obj`` on every rank (each rank passes its own; only rank 0's counts)."""
    if world_size == 1:
        return obj
    import torch.distributed as dist

    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard(batch: Any, rank: int, world_size: int, rows: int) -> Any:
    """Rank ``rank``'s contiguous share of the ``rows`` rows of every tensor in ``batch``."""
    if rows % world_size:
        raise ConfigError(
            f"a batch of {rows} rows cannot be split evenly over world_size {world_size}: "
            "use a batch size divisible by the world size, or world_size 1"
        )
    per = rows // world_size
    lo = rank * per

    def take(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.dim() == 0 or t.shape[0] != rows:
            raise ConfigError(
                f"a batch holds a tensor of shape {tuple(t.shape)} whose first dimension is "
                f"not the batch's {rows} rows, so it cannot be sharded for data parallel: "
                "give every tensor of a batch the rows first, or train with world_size 1"
            )
        return t[lo : lo + per]

    return torch.utils._pytree.tree_map(take, batch)


def all_reduce_mean(fused: nn.Module, losses: torch.Tensor, world_size: int) -> torch.Tensor:
    """Average every gradient of ``fused`` and the trials' ``losses`` over the ranks, in place;
    returns the averaged losses. One all-reduce per dtype (one in practice), not one per
    parameter."""
    import torch.distributed as dist

    grads = [p.grad for p in fused.parameters() if p.grad is not None]
    out = losses
    for dtype in dict.fromkeys([losses.dtype, *(g.dtype for g in grads)]):
        parts = [g for g in grads if g.dtype == dtype]
        has_loss = losses.dtype == dtype
        tensors = ([losses] if has_loss else []) + parts
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)  # a sum: the mean over equal shards is the sum over the ranks
        flat.div_(world_size)
        at = 0
        if has_loss:
            out = flat[: losses.numel()].view_as(losses).clone()
            at = losses.numel()
        for g in parts:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()
    return out


def batch_norm(model: nn.Module) -> str | None:
    """The first module of ``model`` that normalizes over the batch (``"name (Type)"``), or
    ``None``: on a shard its statistics are not the whole batch's."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return f"module {name or type(model).__name__!r} ({type(module).__name__})"
    return None


def random_ops(fused: nn.Module, batch: Any, task: Any) -> bool:
    """Whether a training step of ``fused`` on per-trial batches like ``batch`` (stacked, with
    the trial dimension first) draws random numbers: its per-trial masks are indexed by each
    element's place in the batch, so a shard would draw other masks than the whole batch."""
    args, kwargs, _ = task.split(batch, next(fused.parameters()).device)
    return fused.draws_random(*args, shared=False, **kwargs)
