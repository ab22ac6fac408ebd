"""Dynamic loss scaling per trial, for float16 training of a fused group.

float16 gradients underflow unless the loss is scaled up before the backward pass, and a scale
too large overflows them. :class:`torch.amp.GradScaler` keeps one scale and skips the whole
optimizer step when any gradient overflows; in a fused group that would let one trial's
overflow skip every trial's step, and make a trial's training depend on its group. Here each
trial keeps its own scale and its own count of clean steps, with GradScaler's rule and
defaults (start at 2**16; an overflow halves the scale and skips that trial's step only; 2000
clean steps in a row double it), so a trial trains in a group as it would alone.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LossScales"]


class LossScales:
    """One dynamic loss scale per trial of a fused group of ``n``.

    Args:
        n: trials.
        device: where the scales live (the group's device).
        init: every trial's first scale.
        growth: the factor after ``interval`` clean steps in a row.
        backoff: the factor after a step whose gradients overflowed.
        interval: clean steps in a row before the scale grows.

    Example:
        >>> scales = LossScales(2, "cpu", init=4.0)
        >>> w = torch.ones(2, 3, requires_grad=True)
        >>> (scales.scale(torch.stack([w[0].sum(), w[1].sum() * float("inf")]))).sum().backward()
        >>> scales.unscale_([w]).tolist()  # trial 1's gradients overflowed
        [False, True]
        >>> w.grad[0].tolist(), w.grad[1].tolist()  # unscaled; the overflowed trial's zeroed
        ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
        >>> scales.update(torch.tensor([False, True]))
        >>> scales.scales.tolist()
        [4.0, 2.0]
    """

    def __init__(self, n: int, device: Any, init: float = 2.0**16, growth: float = 2.0,
                 backoff: float = 0.5, interval: int = 2000) -> None:
        self.init, self.growth, self.backoff, self.interval = init, growth, backoff, interval
        self.scales = torch.full((n,), float(init), dtype=torch.float32, device=device)
        self.clean = torch.zeros(n, dtype=torch.int32, device=device)

    @property
    def n(self) -> int:
        """The number of trials."""
        return int(self.scales.shape[0])

    def scale(self, losses: torch.Tensor) -> torch.Tensor:
        """The losses ``[n]`` each times its trial's scale (what the backward pass starts from)."""
        return losses * self.scales.to(losses.dtype)

    @torch.no_grad()
    def unscale_(self, params: Any) -> torch.Tensor:
        """Divide every gradient (leading trial dimension) by its trial's scale, in place, and
        return which trials' gradients overflowed ``[n]``; their gradients are set to zero, so
        that nothing downstream (clipping, the optimizer's divergence check) reads an infinity
        from a step that is skipped anyway."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(self.n, dtype=torch.bool, device=self.scales.device)
        sums = torch.stack([g.float().reshape(g.shape[0], -1).sum(dim=1) for g in grads])
        found = ~torch.isfinite(sums).all(dim=0)
        inverse = torch.where(found, torch.zeros_like(self.scales), self.scales.reciprocal())
        for g in grads:
            view = inverse.to(g.dtype).view((-1,) + (1,) * (g.dim() - 1))
            # an overflowed trial: inf * 0 is nan, which nan_to_num turns into the zero it means
            g.mul_(view).nan_to_num_(0.0, posinf=0.0, neginf=0.0)
        return found

    @torch.no_grad()
    def update(self, found: torch.Tensor) -> None:
        """After the step: overflowed trials back off and restart their count; the others count
        one clean step, and grow where the count reaches ``interval``."""
        found = found.to(self.scales.device)
        self.clean = torch.where(found, torch.zeros_like(self.clean), self.clean + 1)
        grow = self.clean >= self.interval
        factor = torch.where(found, torch.full_like(self.scales, self.backoff),
                             torch.where(grow, torch.full_like(self.scales, self.growth),
                                         torch.ones_like(self.scales)))
        self.scales = self.scales * factor
        self.clean = torch.where(grow, torch.zeros_like(self.clean), self.clean)

    def select(self, slots: list[int]) -> None:
        """Keep the trials of ``slots``, in that order (a slot may repeat: the group grows)."""
        index = torch.tensor(slots, dtype=torch.long, device=self.scales.device)
        self.scales = self.scales.index_select(0, index)
        self.clean = self.clean.index_select(0, index)

    def reset(self, slot: int) -> None:
        """A new trial in ``slot`` starts from the first scale."""
        self.scales[slot] = self.init
        self.clean[slot] = 0

    def trial_state(self, slot: int) -> dict[str, float | int]:
        """Trial ``slot``'s scale and clean-step count (plain numbers, for checkpoints)."""
        return {"scale": float(self.scales[slot]), "clean": int(self.clean[slot])}

    def load_trial_state(self, slot: int, state: dict[str, float | int]) -> None:
        """Put back what :meth:`trial_state` gave."""
        self.scales[slot] = float(state["scale"])
        self.clean[slot] = int(state["clean"])
