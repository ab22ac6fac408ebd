"""Per-trial learning-rate schedules for the fused optimizers.

Each scheduler takes the arguments of its ``torch.optim.lr_scheduler`` namesake, where every
argument may instead be a length-``n`` sequence with one value per trial (``milestones`` of
``MultiStepLR``/``SequentialLR``: a list of ``n`` lists). Under the hood each trial runs the real
``torch`` scheduler on a small stand-in optimizer, so every trial's schedule is exactly torch's
(its closed forms, chaining and warm-up rules included); after each ``step()`` the trials'
learning rates (and, for ``OneCycleLR``, momenta/betas) are gathered on the host into one
float64 tensor ``[n]`` per group and value, which the optimizer copies to the device once. The
host-side cost grows with ``n`` (Python, a few microseconds per trial); the device sees one copy
per step, whatever ``n``.

Example:
    >>> import torch
    >>> from hydro.fusion import fuse
    >>> import hydro.optim
    >>> fused = fuse(torch.nn.Linear(4, 1), n=2)
    >>> opt = hydro.optim.SGD(fused.parameters(), lr=[0.1, 0.2])
    >>> sched = hydro.optim.lr_scheduler.StepLR(opt, step_size=[1, 2], gamma=0.5)
    >>> sched.step()
    >>> opt.param_groups[0]["lr"]
    tensor([0.0500, 0.2000], dtype=torch.float64)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.optim import lr_scheduler as torch_sched

from hydro.optim.optimizers import FusedOptimizer

__all__ = [
    "CosineAnnealingLR",
    "ExponentialLR",
    "LinearLR",
    "MultiStepLR",
    "OneCycleLR",
    "SequentialLR",
    "StepLR",
    "TrialScheduler",
]


def _pick(value: object, k: int, n: int, nested: bool = False) -> object:
    """Trial ``k``'s value of a scalar-or-per-trial argument.

    ``nested``: the argument is itself a list (milestones), so it is per trial only when it is a
    list of ``n`` lists.
    """
    if torch.is_tensor(value):
        return value.item() if value.dim() == 0 else value[k].item()
    if isinstance(value, (list, tuple)):
        if nested:
            per_trial = len(value) == n and all(isinstance(v, (list, tuple)) for v in value)
            return list(value[k]) if per_trial else list(value)
        if len(value) != n:
            raise ValueError(f"a per-trial argument has {len(value)} values for {n} trials")
        return value[k]
    return value


class TrialScheduler:
    """Runs one ``torch.optim.lr_scheduler`` per trial and writes their values into ``optimizer``.

    Args:
        optimizer: a fused optimizer from ``hydro.optim``.
        make: ``make(stand_in_optimizer, k)`` builds trial ``k``'s torch scheduler.
    """

    def __init__(
        self, optimizer: FusedOptimizer, make: Callable[[torch.optim.Optimizer, int], object]
    ) -> None:
        if not isinstance(optimizer, FusedOptimizer):
            raise TypeError("hydro.optim.lr_scheduler needs a hydro.optim optimizer")
        self.optimizer = optimizer
        stand_ins = optimizer.trial_optimizers()
        self.schedulers = [make(stand_ins[k], k) for k in range(optimizer.n)]
        optimizer._attach(self)
        self._sync()

    def step(self) -> None:
        """Advance every trial's schedule by one step."""
        for opt in self.optimizer.trial_optimizers():
            opt._opt_called = True  # stand-ins never step; the fused optimizer did
        for s in self.schedulers:
            s.step()
        self._sync()

    def get_last_lr(self) -> list[torch.Tensor]:
        """The last learning rates, one ``[n]`` tensor per parameter group."""
        return [g["lr"].clone() for g in self.optimizer.param_groups]

    def select_trials(self, index: torch.Tensor) -> None:
        """Keep the schedules of the trials in ``index`` (called by ``optimizer.select``)."""
        self.schedulers = [self.schedulers[i] for i in index.tolist()]

    def state_dict(self) -> dict:
        """Every trial's torch scheduler state and its stand-in optimizer's values.

        With the optimizer's ``state_dict``, a run resumed from it continues bit for bit.
        """
        stand_ins = self.optimizer.trial_optimizers()
        keys = ("lr", "initial_lr", "max_lr", "min_lr", "betas", "momentum")
        return {
            "trials": [s.state_dict() for s in self.schedulers],
            "stand_ins": [
                [{k: g[k] for k in keys if k in g} for g in opt.param_groups] for opt in stand_ins
            ],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` returned (same number of trials)."""
        if len(state_dict["trials"]) != len(self.schedulers):
            raise ValueError(
                f"the scheduler state has {len(state_dict['trials'])} trials, this scheduler "
                f"{len(self.schedulers)}"
            )
        for s, state in zip(self.schedulers, state_dict["trials"]):
            s.load_state_dict(state)
        for opt, groups in zip(self.optimizer.trial_optimizers(), state_dict["stand_ins"]):
            for group, values in zip(opt.param_groups, groups):
                group.update(values)
        self._sync()

    def _sync(self) -> None:
        # The host computes n floats; the optimizer moves each changed vector to the device once.
        stand_ins = self.optimizer.trial_optimizers()
        for g, group in enumerate(self.optimizer.param_groups):
            rows = [opt.param_groups[g] for opt in stand_ins]
            group["lr"] = torch.tensor([float(r["lr"]) for r in rows], dtype=torch.float64)
            if "betas" in group:
                b1 = torch.tensor([float(r["betas"][0]) for r in rows], dtype=torch.float64)
                if not torch.equal(b1, group["betas"][0]):  # only OneCycleLR changes betas
                    group["betas"] = (b1, group["betas"][1])
            if "momentum" in group:
                m = torch.tensor([float(r["momentum"]) for r in rows], dtype=torch.float64)
                if not torch.equal(m, group["momentum"]):
                    group["momentum"] = m


class StepLR(TrialScheduler):
    """Per-trial ``torch.optim.lr_scheduler.StepLR``."""

    def __init__(self, optimizer: FusedOptimizer, step_size, gamma=0.1) -> None:  # noqa: ANN001
        n = optimizer.n
        super().__init__(
            optimizer,
            lambda o, k: torch_sched.StepLR(o, _pick(step_size, k, n), _pick(gamma, k, n)),
        )


class MultiStepLR(TrialScheduler):
    """Per-trial ``MultiStepLR``: ``milestones`` one list, or a list of ``n`` lists."""

    def __init__(self, optimizer: FusedOptimizer, milestones, gamma=0.1) -> None:  # noqa: ANN001
        n = optimizer.n
        super().__init__(
            optimizer,
            lambda o, k: torch_sched.MultiStepLR(
                o, _pick(milestones, k, n, nested=True), _pick(gamma, k, n)
            ),
        )


class ExponentialLR(TrialScheduler):
    """Per-trial ``ExponentialLR``."""

    def __init__(self, optimizer: FusedOptimizer, gamma) -> None:  # noqa: ANN001
        n = optimizer.n
        super().__init__(optimizer, lambda o, k: torch_sched.ExponentialLR(o, _pick(gamma, k, n)))


class CosineAnnealingLR(TrialScheduler):
    """Per-trial ``CosineAnnealingLR``."""

    def __init__(self, optimizer: FusedOptimizer, T_max, eta_min=0.0) -> None:  # noqa: ANN001, N803
        n = optimizer.n
        super().__init__(
            optimizer,
            lambda o, k: torch_sched.CosineAnnealingLR(o, _pick(T_max, k, n), _pick(eta_min, k, n)),
        )


class LinearLR(TrialScheduler):
    """Per-trial ``LinearLR`` (linear warm-up or decay)."""

    def __init__(  # noqa: ANN001
        self, optimizer: FusedOptimizer, start_factor=1.0 / 3, end_factor=1.0, total_iters=5
    ) -> None:
        n = optimizer.n
        super().__init__(
            optimizer,
            lambda o, k: torch_sched.LinearLR(
                o, _pick(start_factor, k, n), _pick(end_factor, k, n), _pick(total_iters, k, n)
            ),
        )


class SequentialLR(TrialScheduler):
    """Per-trial ``SequentialLR`` over schedulers built on the same fused optimizer."""

    def __init__(  # noqa: ANN001
        self, optimizer: FusedOptimizer, schedulers: Sequence[TrialScheduler], milestones
    ) -> None:
        n = optimizer.n
        self.children = list(schedulers)
        super().__init__(
            optimizer,
            lambda o, k: torch_sched.SequentialLR(
                o, [s.schedulers[k] for s in self.children], _pick(milestones, k, n, nested=True)
            ),
        )


class OneCycleLR(TrialScheduler):
    """Per-trial ``OneCycleLR`` (cycles momentum, or Adam's beta1, when ``cycle_momentum``)."""

    def __init__(  # noqa: ANN001
        self,
        optimizer: FusedOptimizer,
        max_lr,
        total_steps=None,
        pct_start=0.3,
        anneal_strategy="cos",
        cycle_momentum=True,
        base_momentum=0.85,
        max_momentum=0.95,
        div_factor=25.0,
        final_div_factor=1e4,
        three_phase=False,
    ) -> None:
        n = optimizer.n
        super().__init__(
            optimizer,
            lambda o, k: torch_sched.OneCycleLR(
                o,
                max_lr=_pick(max_lr, k, n),
                total_steps=_pick(total_steps, k, n),
                pct_start=_pick(pct_start, k, n),
                anneal_strategy=anneal_strategy,
                cycle_momentum=cycle_momentum,
                base_momentum=_pick(base_momentum, k, n),
                max_momentum=_pick(max_momentum, k, n),
                div_factor=_pick(div_factor, k, n),
                final_div_factor=_pick(final_div_factor, k, n),
                three_phase=three_phase,
            ),
        )
