"""Per-trial gradient clipping."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


def clip_grad_norm_(
    parameters: nn.Module | Iterable[torch.Tensor],
    max_norm: float | Sequence[float] | torch.Tensor,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Clip each trial's gradients by that trial's own total norm, like ``torch.nn.utils``'s.

    The norm of trial ``k`` is taken over slice ``k`` of every fused parameter's gradient; trials
    never share a norm (the design's rule: anything that reduces across parameters is per trial).

    Args:
        parameters: a fused model or its parameters (leading trial dimension ``[n, ...]``).
        max_norm: the largest norm, one for all trials or one per trial.
        norm_type: the p of the p-norm (``float("inf")`` for the max norm).

    Returns:
        Each trial's total gradient norm before clipping, ``[n]``.

    Example:
        >>> import torch
        >>> from hydro.fusion import fuse
        >>> import hydro.optim
        >>> fused = fuse(torch.nn.Linear(4, 1), n=2)
        >>> fused(torch.randn(8, 4)).sum().backward()
        >>> hydro.optim.clip_grad_norm_(fused, max_norm=[1.0, 0.1]).shape
        torch.Size([2])
    """
    if isinstance(parameters, nn.Module):
        parameters = parameters.parameters()
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(0)
    n = grads[0].shape[0]
    limit = torch.as_tensor(max_norm, dtype=torch.float64).to(grads[0].device, non_blocking=True)
    return _clip_grads(grads, limit.expand(n), norm_type)


def _clip_grads(
    grads: list[torch.Tensor], limit: torch.Tensor, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale ``grads`` in place to each trial's ``limit`` ``[n]``; returns the norms (also
    traced into the whole-step graph of :mod:`hydro.fusion.step`)."""
    n = grads[0].shape[0]
    # One norm per (tensor, trial), then per trial over tensors: a fixed number of ops
    # whatever n, and no host synchronization.
    norms = torch.stack(
        [
            g.abs() if g.dim() == 1 else torch.linalg.vector_norm(g, norm_type, dim=_rest(g))
            for g in grads
        ]
    )
    total = torch.linalg.vector_norm(norms, norm_type, dim=0)
    coef = torch.clamp(limit.to(total.dtype).expand(n) / (total + 1e-6), max=1.0)
    views: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    scales = []
    for g in grads:
        key = (g.dim(), g.dtype)
        if key not in views:
            views[key] = coef.to(g.dtype).view((-1,) + (1,) * (g.dim() - 1))
        scales.append(views[key])
    torch._foreach_mul_(grads, scales)
    return total


def _rest(g: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(1, g.dim()))
