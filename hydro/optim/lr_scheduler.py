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

from hydro.errors import ConfigError
from hydro.optim.base import FusedOptimizer

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
        make: ``make(stand_in_optimizer, k)`` builds trial ``k``'s torch scheduler. The
            subclasses below build theirs from :attr:`trial_args` instead.

    Attributes:
        trial_args: per slot, the scheduler's arguments for that slot's trial (subclasses).
    """

    arg_names: tuple[str, ...] = ()  # the per-trial arguments of a subclass
    nested: tuple[str, ...] = ()  # arguments that are lists themselves (milestones)

    def __init__(
        self,
        optimizer: FusedOptimizer,
        make: Callable[[torch.optim.Optimizer, int], object] | None = None,
    ) -> None:
        if not isinstance(optimizer, FusedOptimizer):
            raise TypeError("hydro.optim.lr_scheduler needs a hydro.optim optimizer")
        self.optimizer = optimizer
        if not hasattr(self, "trial_args"):
            self.trial_args: list[dict] = [{} for _ in range(optimizer.n)]
        self._make = make
        stand_ins = optimizer.trial_optimizers()
        self.schedulers = [self._build(stand_ins[k], k) for k in range(optimizer.n)]
        optimizer._attach(self)
        self._sync()

    def _per_trial(self, optimizer: FusedOptimizer, **args: object) -> None:
        """Split the constructor's arguments into one dict per trial (before ``__init__``)."""
        n = optimizer.n
        self.trial_args = [
            {name: _pick(value, k, n, nested=name in self.nested) for name, value in args.items()}
            for k in range(n)
        ]

    def _build(self, stand_in: torch.optim.Optimizer, k: int) -> object:
        """Slot ``k``'s torch scheduler on ``stand_in``."""
        if self._make is None:
            raise TypeError(f"{type(self).__name__} builds no scheduler: give `make`")
        return self._make(stand_in, k)

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

    def reset_trial(
        self, k: int, base_lr: float | Sequence[float] | None = None, **schedule_params: object
    ) -> None:
        """Restart slot ``k``'s schedule from its step 0, for a new trial joining the group.

        Slot ``k`` gets a fresh torch scheduler with the arguments of the constructor for this
        slot, each one given here replaced (one trial's value: ``T_max=50``, ``gamma=0.5``,
        ``milestones=[3]``; for :class:`SequentialLR`, ``schedulers=[{...}, {...}]`` gives
        its children's). Its base learning rate is ``base_lr`` (one value, or one per parameter
        group), by default the optimizer's current learning rate of slot ``k``: call
        :meth:`hydro.optim.FusedOptimizer.reset_trial` with the new trial's ``lr`` first. The
        other slots' schedules are untouched, so a trial that joins late follows exactly the
        schedule it would follow alone.

        Raises:
            hydro.errors.ConfigError: ``k`` out of range, or an argument this scheduler has not.

        Example:
            >>> import torch
            >>> from hydro.fusion import fuse
            >>> import hydro.optim
            >>> fused = fuse(torch.nn.Linear(4, 1), n=2)
            >>> opt = hydro.optim.SGD(fused.parameters(), lr=[0.1, 0.2])
            >>> sched = hydro.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            >>> sched.step()
            >>> opt.reset_trial(1, lr=1.0)
            >>> sched.reset_trial(1, gamma=0.1)
            >>> sched.step()
            >>> opt.param_groups[0]["lr"].tolist()
            [0.025, 0.1]
        """
        n = self.optimizer.n
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
            raise ConfigError(f"reset_trial: slot {k!r} is not one of the {n} fused trials")
        groups = self.optimizer.param_groups
        if base_lr is None:
            lrs = [float(g["lr"][k]) for g in groups]
        elif isinstance(base_lr, (int, float)):
            lrs = [float(base_lr)] * len(groups)
        else:
            lrs = [float(v) for v in base_lr]
            if len(lrs) != len(groups):
                raise ConfigError(
                    f"reset_trial: base_lr has {len(lrs)} values for {len(groups)} parameter "
                    "groups; give one number or one per group"
                )
        self._check(schedule_params)
        stand_ins = self.optimizer.trial_optimizers()
        stand_ins[k] = self.optimizer._stand_in(k, lrs)
        self._rebuild(stand_ins[k], k, dict(schedule_params))
        self._sync()

    def _check(self, params: dict) -> None:
        unknown = sorted(set(params) - set(self.arg_names))
        if unknown:
            have = ", ".join(self.arg_names) or "none"
            raise ConfigError(
                f"reset_trial: {type(self).__name__} has no argument {', '.join(unknown)} "
                f"(its per-trial arguments: {have})"
            )

    def _rebuild(self, stand_in: torch.optim.Optimizer, k: int, params: dict) -> None:
        for name, value in params.items():
            self.trial_args[k][name] = list(value) if name in self.nested else value
        self.schedulers[k] = self._build(stand_in, k)

    def select_trials(self, index: torch.Tensor) -> None:
        """Keep the schedules of the trials in ``index`` (called by ``optimizer.select``)."""
        self.schedulers = [self.schedulers[i] for i in index.tolist()]
        # a copy per slot: an index given twice (a group growing by a slot) must not tie them
        self.trial_args = [dict(self.trial_args[i]) for i in index.tolist()]

    def trial_state(self, k: int) -> dict:
        """Slot ``k``'s schedule: its torch scheduler's state and its stand-in optimizer's
        values, for :meth:`load_trial_state` into any slot of a scheduler built the same way."""
        stand_in = self.optimizer.trial_optimizers()[k]
        keys = ("lr", "initial_lr", "max_lr", "min_lr", "betas", "momentum")
        return {
            "scheduler": self.schedulers[k].state_dict(),
            "stand_in": [{key: g[key] for key in keys if key in g} for g in stand_in.param_groups],
        }

    def load_trial_state(self, k: int, state: dict) -> None:
        """Put what :meth:`trial_state` returned in slot ``k`` (after :meth:`reset_trial` for
        the trial's own arguments); the slot's schedule goes on from the saved step."""
        self.schedulers[k].load_state_dict(state["scheduler"])
        for group, values in zip(self.optimizer.trial_optimizers()[k].param_groups,
                                 state["stand_in"]):
            group.update(values)
        self._sync()

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
            "args": self._args_state(),
        }

    def _args_state(self) -> dict:
        return {"trial_args": [dict(a) for a in self.trial_args]}

    def _load_args(self, state: dict) -> None:
        self.trial_args = [dict(a) for a in state["trial_args"]]

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
        if "args" in state_dict:  # checkpoints from before reset_trial have none
            self._load_args(state_dict["args"])
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

    arg_names = ("step_size", "gamma")

    def __init__(self, optimizer: FusedOptimizer, step_size, gamma=0.1) -> None:
        self._per_trial(optimizer, step_size=step_size, gamma=gamma)
        super().__init__(optimizer)

    def _build(self, o: torch.optim.Optimizer, k: int) -> object:
        a = self.trial_args[k]
        return torch_sched.StepLR(o, a["step_size"], a["gamma"])


class MultiStepLR(TrialScheduler):
    """Per-trial ``MultiStepLR``: ``milestones`` one list, or a list of ``n`` lists."""

    arg_names = ("milestones", "gamma")
    nested = ("milestones",)

    def __init__(self, optimizer: FusedOptimizer, milestones, gamma=0.1) -> None:
        self._per_trial(optimizer, milestones=milestones, gamma=gamma)
        super().__init__(optimizer)

    def _build(self, o: torch.optim.Optimizer, k: int) -> object:
        a = self.trial_args[k]
        return torch_sched.MultiStepLR(o, a["milestones"], a["gamma"])


class ExponentialLR(TrialScheduler):
    """Per-trial ``ExponentialLR``."""

    arg_names = ("gamma",)

    def __init__(self, optimizer: FusedOptimizer, gamma) -> None:
        self._per_trial(optimizer, gamma=gamma)
        super().__init__(optimizer)

    def _build(self, o: torch.optim.Optimizer, k: int) -> object:
        return torch_sched.ExponentialLR(o, self.trial_args[k]["gamma"])


class CosineAnnealingLR(TrialScheduler):
    """Per-trial ``CosineAnnealingLR``."""

    arg_names = ("T_max", "eta_min")

    def __init__(self, optimizer: FusedOptimizer, T_max, eta_min=0.0) -> None:
        self._per_trial(optimizer, T_max=T_max, eta_min=eta_min)
        super().__init__(optimizer)

    def _build(self, o: torch.optim.Optimizer, k: int) -> object:
        a = self.trial_args[k]
        return torch_sched.CosineAnnealingLR(o, a["T_max"], a["eta_min"])


class LinearLR(TrialScheduler):
    """Per-trial ``LinearLR`` (linear warm-up or decay)."""

    arg_names = ("start_factor", "end_factor", "total_iters")

    def __init__(
        self, optimizer: FusedOptimizer, start_factor=1.0 / 3, end_factor=1.0, total_iters=5
    ) -> None:
        self._per_trial(
            optimizer, start_factor=start_factor, end_factor=end_factor, total_iters=total_iters
        )
        super().__init__(optimizer)

    def _build(self, o: torch.optim.Optimizer, k: int) -> object:
        a = self.trial_args[k]
        return torch_sched.LinearLR(o, a["start_factor"], a["end_factor"], a["total_iters"])


class SequentialLR(TrialScheduler):
    """Per-trial ``SequentialLR`` over schedulers built on the same fused optimizer.

    ``reset_trial(k, milestones=[...], schedulers=[{...}, ...])`` restarts slot ``k`` of this
    scheduler and of its children; ``schedulers`` gives each child's new arguments (a dict per
    child, in order; ``{}`` keeps a child's).
    """

    arg_names = ("milestones", "schedulers")
    nested = ("milestones",)

    def __init__(
        self, optimizer: FusedOptimizer, schedulers: Sequence[TrialScheduler], milestones
    ) -> None:
        self.children = list(schedulers)
        self._per_trial(optimizer, milestones=milestones)
        super().__init__(optimizer)

    def _build(self, o: torch.optim.Optimizer, k: int) -> object:
        return torch_sched.SequentialLR(
            o, [s.schedulers[k] for s in self.children], self.trial_args[k]["milestones"]
        )

    def _rebuild(self, stand_in: torch.optim.Optimizer, k: int, params: dict) -> None:
        # torch builds the children first, on the same optimizer: so do we
        children = params.pop("schedulers", None) or [{}] * len(self.children)
        if len(children) != len(self.children):
            raise ConfigError(
                f"reset_trial: schedulers has {len(children)} entries for "
                f"{len(self.children)} child schedulers; give one dict per child"
            )
        for child, child_params in zip(self.children, children):
            child._check(child_params)
        for child, child_params in zip(self.children, children):
            child._rebuild(stand_in, k, dict(child_params))
        super()._rebuild(stand_in, k, params)

    def _args_state(self) -> dict:
        return {**super()._args_state(), "children": [c._args_state() for c in self.children]}

    def _load_args(self, state: dict) -> None:
        super()._load_args(state)
        for child, child_state in zip(self.children, state.get("children", [])):
            child._load_args(child_state)


class OneCycleLR(TrialScheduler):
    """Per-trial ``OneCycleLR`` (cycles momentum, or Adam's beta1, when ``cycle_momentum``)."""

    arg_names = (
        "max_lr", "total_steps", "pct_start", "anneal_strategy", "cycle_momentum",
        "base_momentum", "max_momentum", "div_factor", "final_div_factor", "three_phase",
    )

    def __init__(
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
        self._per_trial(
            optimizer,
            max_lr=max_lr,
            total_steps=total_steps,
            pct_start=pct_start,
            base_momentum=base_momentum,
            max_momentum=max_momentum,
            div_factor=div_factor,
            final_div_factor=final_div_factor,
        )
        for a in self.trial_args:
            a.update(
                anneal_strategy=anneal_strategy,
                cycle_momentum=cycle_momentum,
                three_phase=three_phase,
            )
        super().__init__(optimizer)

    def _build(self, o: torch.optim.Optimizer, k: int) -> object:
        return torch_sched.OneCycleLR(o, **self.trial_args[k])
