"""``trial_loss``: each fused trial's own loss, as if it were trained alone."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hydro.errors import DataError, HydroWarning


def trial_loss(
    loss_fn: Callable[..., torch.Tensor],
    output: torch.Tensor,
    target: torch.Tensor,
    *,
    shared: bool = True,
) -> torch.Tensor:
    """Each trial's own loss: ``[n]``, with ``loss_fn`` applied to every trial's output alone.

    Backpropagating ``trial_loss(...).sum()`` gives every trial exactly the gradient it would get
    trained alone (the loss convention: the sum over trials of each trial's own mean loss).

    Args:
        loss_fn: a loss for one model, e.g. ``torch.nn.functional.cross_entropy``.
        output: a fused model's output ``[n, ...]``.
        target: one model's target, the same for every trial; with ``shared=False``, ``[n, ...]``
            with each trial's own target.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from hydro.fusion import fuse, trial_loss
        >>> fused = fuse(torch.nn.Linear(4, 3), n=2)
        >>> trial_loss(F.cross_entropy, fused(torch.randn(8, 4)), torch.randint(0, 3, (8,))).shape
        torch.Size([2])
    """
    try:
        if loss_fn is F.cross_entropy and output.dim() >= 3:  # batched logits [n, B, C, ...]
            return _cross_entropy(output, target, shared)
        in_dims = (0, None if shared else 0)
        try:
            return torch.func.vmap(loss_fn, in_dims=in_dims)(output, target)
        except RuntimeError as exc:
            if not _unbatchable(exc) or _batch_mismatch(output, target, shared) is not None:
                raise  # the loss's own error (a wrong shape, a bad value): the user's to see
            _warn_per_trial(loss_fn, exc, output.shape[0])
        targets = [target] * output.shape[0] if shared else list(target)
        return torch.stack([loss_fn(o, t) for o, t in zip(output, targets)])
    except Exception as exc:
        mismatch = _batch_mismatch(output, target, shared)
        if mismatch is None:
            raise
        raise DataError(mismatch) from exc


# What torch.func.vmap raises where it cannot batch an op (no batching rule, .item(), a
# data-dependent branch, random ops, in-place writes into an unbatched tensor, an
# autograd.Function without a vmap rule): functorch has no exception class of its own, so its
# messages tell these apart from the loss's own errors.
_VMAP_MARKERS = ("vmap", "batching rule", "batchedtensor", "functorch")
_warned_losses: weakref.WeakSet = weakref.WeakSet()
_warned_names: set[str] = set()  # losses that cannot be weakly referenced


def _unbatchable(exc: RuntimeError) -> bool:
    """Whether ``exc`` is vmap saying it cannot batch an op (not the loss's own error)."""
    text = str(exc).lower()
    return any(marker in text for marker in _VMAP_MARKERS)


def _warn_per_trial(loss_fn: Callable, exc: RuntimeError, n: int) -> None:
    """Warn, once per loss function, that it runs once per trial (n calls a step)."""
    key = getattr(loss_fn, "__func__", loss_fn)  # a bound method is a new object each access
    name = getattr(key, "__qualname__", None) or type(key).__name__
    try:
        if key in _warned_losses:
            return
        _warned_losses.add(key)
    except TypeError:
        if name in _warned_names:
            return
        _warned_names.add(name)
    why = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0]
    warnings.warn(
        HydroWarning(
            f"trial_loss: torch.func.vmap cannot batch the loss {name} ({why}); it runs once "
            f"per trial instead ({n} calls a step). Write it with tensor ops vmap batches (no "
            ".item(), no Python branch on a tensor's value) to make it one call"
        ),
        stacklevel=3,
    )


def _batch_mismatch(output: torch.Tensor, target: Any, shared: bool) -> str | None:
    """The line to raise when the target's batch is not the output's, else ``None``."""
    if not isinstance(target, torch.Tensor) or output.dim() < 2:
        return None
    n, batch = output.shape[0], output.shape[1]
    lead = 0 if shared else 1
    if not shared and (target.dim() < 1 or target.shape[0] != n):
        return (
            f"trial_loss(shared=False): the target has shape {tuple(target.shape)} but there are "
            f"{n} trials; give each trial its target, a tensor [{n}, {batch}, ...]"
        )
    if target.dim() <= lead or target.shape[lead] == batch:
        return None
    expected = f"[{batch}, ...]" if shared else f"[{n}, {batch}, ...]"
    return (
        f"trial_loss: the output has a batch of {batch} (shape {tuple(output.shape)}: {n} "
        f"trials) but the target has {target.shape[lead]} (shape {tuple(target.shape)}); "
        f"expected a target {expected}: pass the targets of the batch the inputs came from"
    )


# On the CPU, log_softmax over rows narrower than a vector register (16 floats) runs elementwise;
# over dim 1 of ``[n, C, B]`` it vectorizes across the batch instead: 1.4-3.8x faster forward and
# backward below 16 classes, slower from 16 on (measured, torch 2.14, this repository's VM)
FEW_CLASSES = 16


def _cross_entropy(output: torch.Tensor, target: torch.Tensor, shared: bool) -> torch.Tensor:
    """Per-trial mean cross-entropy in one call over the folded batch (no vmap)."""
    n = output.shape[0]
    if (
        output.dim() == 3
        and output.shape[2] < FEW_CLASSES
        and output.device.type == "cpu"
        and not target.is_floating_point()
    ):
        # classes as dim 1 of [n, C, B] (a view), the shared target a stride-0 view [n, B]
        per = target.expand(n, *target.shape) if shared else target
        losses = F.cross_entropy(output.transpose(1, 2), per, reduction="none")
        counted = target != -100  # a shared target counts the same for every trial
        return losses.sum(dim=1) / (counted.sum() if shared else counted.sum(dim=1))
    if shared:
        target = target.unsqueeze(0).expand(n, *target.shape)
    losses = F.cross_entropy(output.flatten(0, 1), target.flatten(0, 1), reduction="none")
    if target.is_floating_point():  # class probabilities: the mean over samples
        return losses.view(n, -1).mean(dim=1)
    # class indices: the mean over targets that are not ignore_index (-100), as torch's "mean"
    return losses.view(n, -1).sum(dim=1) / (target != -100).view(n, -1).sum(dim=1)
