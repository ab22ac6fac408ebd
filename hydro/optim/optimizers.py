"""Fused SGD, Adam and AdamW: one step for ``n`` trials, each with its own hyperparameters.

Every parameter has a leading trial dimension ``[n, ...]``. Each hyperparameter may be a scalar
(the same for every trial) or a length-``n`` sequence/tensor; internally it is a float64 tensor
``[n]`` in the parameter group, broadcast over the trial dimension. The update of trial ``k`` is
the update ``torch.optim`` would make with trial ``k``'s hyperparameters (the same formulas, in the
same order, checked step by step in ``tests/fusion``).

muP: a parameter carrying ``infshape`` (every parameter of a Hydro surrogate) gets the learning
rate and weight decay multipliers of :func:`hydro.parametrize.optimizer_multipliers`; a plain
parameter gets none.

Isolation: before each step, a trial with a non-finite gradient is marked in the fused model's
``diverged`` flags. Diverged trials are frozen: their parameters and optimizer state are restored
after the step, so they stop changing, while every other trial's update is computed exactly as
without them (all update math is elementwise per trial).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch

from hydro.parametrize import optimizer_multipliers

HyperParam = float | bool | Sequence[float] | torch.Tensor


def per_trial(value: HyperParam, n: int, name: str) -> torch.Tensor:
    """``value`` as a float64 tensor ``[n]`` (a scalar is repeated for every trial)."""
    t = torch.as_tensor(value, dtype=torch.float64).detach().clone().cpu()
    if t.dim() == 0:
        return t.repeat(n)
    if t.shape != (n,):
        raise ValueError(f"{name} has {t.numel()} values but there are {n} fused trials")
    return t


def _trial_view(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A ``[n]`` vector shaped ``[n, 1, ..., 1]`` to broadcast against ``like``."""
    return v.to(device=like.device, dtype=like.dtype).view(-1, *([1] * (like.dim() - 1)))


class FusedOptimizer(torch.optim.Optimizer):
    """Base of the fused optimizers: per-trial hyperparameters, muP multipliers, isolation."""

    kind = "adam"  # which muP multipliers apply: "adam" or "sgd"
    per_trial_keys: tuple[str, ...] = ()

    def __init__(self, params: Iterable, defaults: dict) -> None:
        super().__init__(params, defaults)
        first = self.param_groups[0]["params"][0]
        self.n = int(first.shape[0])
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() == 0 or p.shape[0] != self.n:
                    raise ValueError(
                        "every parameter of a fused optimizer needs the same leading trial "
                        f"dimension {self.n}; got shape {tuple(p.shape)}"
                    )
            for key in self.per_trial_keys:
                if key == "betas":
                    group[key] = tuple(per_trial(b, self.n, key) for b in group[key])
                else:
                    group[key] = per_trial(group[key], self.n, key)
        self._schedulers: list[weakref.ref] = []
        self._trial_optimizers: list[torch.optim.Optimizer] | None = None

    def _diverged(self) -> torch.Tensor | None:
        for group in self.param_groups:
            for p in group["params"]:
                flags = getattr(p, "hydro_diverged", None)
                if flags is not None:
                    return flags
        return None

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch.optim signature
        """One update of every trial that has not diverged."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with_grad = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not with_grad:
            return loss
        bad = torch.zeros(self.n, dtype=torch.bool, device=with_grad[0].device)
        for p in with_grad:
            bad |= ~torch.isfinite(p.grad).flatten(1).all(dim=1)
        flags = self._diverged()
        if flags is not None:
            flags |= bad.to(flags.device)
            frozen = flags.to(bad.device)
        else:
            frozen = bad
        frozen_idx = frozen.nonzero().flatten() if bool(frozen.any()) else None
        active = (~frozen).to(torch.float64)

        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                saved = None
                if frozen_idx is not None:
                    saved = {
                        k: v[frozen_idx].clone() for k, v in state.items() if torch.is_tensor(v)
                    }
                    saved_param = p[frozen_idx].clone()
                self._update(p, p.grad, state, group, active)
                if frozen_idx is not None:
                    p[frozen_idx] = saved_param
                    for k, v in saved.items():
                        state[k][frozen_idx] = v
        return loss

    def _multipliers(self, p: torch.Tensor) -> tuple[float, float]:
        return optimizer_multipliers(p, self.kind)

    def _update(self, p, grad, state, group, active) -> None:  # noqa: ANN001
        raise NotImplementedError

    # --- dropping trials, schedulers ------------------------------------------------------------

    def select(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep only the trials ``indices``: pair with ``fused.select(indices)``.

        Slices every per-trial hyperparameter and state tensor, and the per-trial state of the
        learning-rate schedulers attached to this optimizer.
        """
        index = torch.as_tensor(indices, dtype=torch.long)
        for group in self.param_groups:
            for key in self.per_trial_keys:
                if key == "betas":
                    group[key] = tuple(b[index] for b in group[key])
                else:
                    group[key] = group[key][index]
            for k in ("initial_lr", "max_lr", "min_lr"):
                if torch.is_tensor(group.get(k)):
                    group[k] = group[k][index]
        for state in self.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = value[index.to(value.device)]
        if self._trial_optimizers is not None:
            self._trial_optimizers = [self._trial_optimizers[i] for i in index.tolist()]
        live = []
        for ref in self._schedulers:
            sched = ref()
            if sched is not None:
                sched.select_trials(index)
                live.append(ref)
        self._schedulers = live
        self.n = len(index)

    def trial_optimizers(self) -> list[torch.optim.Optimizer]:
        """One stand-in ``torch.optim`` optimizer per trial, for per-trial schedulers to drive."""
        if self._trial_optimizers is None:
            self._trial_optimizers = [self._stand_in(k) for k in range(self.n)]
        return self._trial_optimizers

    def _stand_in(self, k: int) -> torch.optim.Optimizer:
        groups = []
        for group in self.param_groups:
            values = {"params": [torch.zeros(1)], "lr": float(group["lr"][k])}
            if "betas" in group:
                values["betas"] = tuple(float(b[k]) for b in group["betas"])
            if "momentum" in group:
                values["momentum"] = float(group["momentum"][k])
            groups.append(values)
        cls = torch.optim.Adam if "betas" in self.defaults else torch.optim.SGD
        return cls(groups)

    def _attach(self, scheduler: object) -> None:
        self._schedulers.append(weakref.ref(scheduler))


class SGD(FusedOptimizer):
    """Fused ``torch.optim.SGD``: momentum, dampening, Nesterov and weight decay per trial.

    Example:
        >>> import torch
        >>> from hydro.fusion import fuse
        >>> import hydro.optim
        >>> fused = fuse(torch.nn.Linear(4, 1), n=3)
        >>> opt = hydro.optim.SGD(fused.parameters(), lr=[0.1, 0.01, 0.001], momentum=0.9)
        >>> fused(torch.randn(8, 4)).pow(2).mean(dim=(1, 2)).sum().backward()
        >>> opt.step()
    """

    kind = "sgd"
    per_trial_keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov")

    def __init__(
        self,
        params: Iterable,
        lr: HyperParam = 1e-3,
        momentum: HyperParam = 0.0,
        dampening: HyperParam = 0.0,
        weight_decay: HyperParam = 0.0,
        nesterov: bool | Sequence[bool] = False,
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov,
        )  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            bad = (group["nesterov"] > 0) & ((group["momentum"] <= 0) | (group["dampening"] != 0))
            if bool(bad.any()):
                raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _update(self, p, grad, state, group, active) -> None:  # noqa: ANN001
        lr_mult, wd_mult = self._multipliers(p)
        lr = _trial_view(group["lr"] * lr_mult, p)
        wd = group["weight_decay"] * wd_mult
        if bool((wd != 0).any()):
            grad = grad + _trial_view(wd, p) * p
        momentum = group["momentum"]
        if bool((momentum != 0).any()):
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.clone()  # torch: the first buffer is grad
            else:
                buf.mul_(_trial_view(momentum, p)).add_(
                    grad * _trial_view(1 - group["dampening"], p)
                )
            nesterov = _trial_view(group["nesterov"], p) > 0
            step = torch.where(nesterov, grad + _trial_view(momentum, p) * buf, buf)
            grad = torch.where(_trial_view(momentum, p) != 0, step, grad)
        p.add_(grad * -lr)


class Adam(FusedOptimizer):
    """Fused ``torch.optim.Adam`` (L2 weight decay added to the gradient), per-trial settings.

    Example:
        >>> import torch
        >>> from hydro.fusion import fuse
        >>> import hydro.optim
        >>> fused = fuse(torch.nn.Linear(4, 1), n=2)
        >>> opt = hydro.optim.Adam(fused.parameters(), lr=[1e-3, 1e-2], betas=(0.9, [0.99, 0.999]))
    """

    per_trial_keys = ("lr", "betas", "eps", "weight_decay", "amsgrad")
    decoupled = False

    def __init__(
        self,
        params: Iterable,
        lr: HyperParam = 1e-3,
        betas: tuple[HyperParam, HyperParam] = (0.9, 0.999),
        eps: HyperParam = 1e-8,
        weight_decay: HyperParam = 0.0,
        amsgrad: bool | Sequence[bool] = False,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        super().__init__(params, defaults)

    def _update(self, p, grad, state, group, active) -> None:  # noqa: ANN001
        lr_mult, wd_mult = self._multipliers(p)
        lr = group["lr"] * lr_mult
        wd = group["weight_decay"] * wd_mult
        beta1, beta2 = group["betas"]
        if not state:
            state["step"] = torch.zeros(self.n, dtype=torch.float64)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
            if bool(group["amsgrad"].any()):
                state["max_exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += active
        step = state["step"]
        if self.decoupled:
            p.mul_(_trial_view(1 - lr * wd, p))
        elif bool((wd != 0).any()):
            grad = grad + _trial_view(wd, p) * p
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, _trial_view(1 - beta1, p))
        exp_avg_sq.mul_(_trial_view(beta2, p)).addcmul_(grad, grad * _trial_view(1 - beta2, p))
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        second = exp_avg_sq
        if "max_exp_avg_sq" in state:
            torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
            ams = _trial_view(group["amsgrad"], p) > 0
            second = torch.where(ams, state["max_exp_avg_sq"], exp_avg_sq)
        denom = (second.sqrt() / _trial_view(bias_correction2_sqrt, p)).add_(
            _trial_view(group["eps"], p)
        )
        p.addcdiv_(exp_avg * _trial_view(-lr / bias_correction1, p), denom)


class AdamW(Adam):
    """Fused ``torch.optim.AdamW`` (decoupled weight decay), per-trial hyperparameters.

    Example:
        >>> import torch
        >>> from hydro.fusion import fuse
        >>> import hydro.optim
        >>> fused = fuse(torch.nn.Linear(4, 1), n=2)
        >>> opt = hydro.optim.AdamW(fused.parameters(), lr=1e-3, weight_decay=[0.0, 0.1])
    """

    decoupled = True

    def __init__(
        self,
        params: Iterable,
        lr: HyperParam = 1e-3,
        betas: tuple[HyperParam, HyperParam] = (0.9, 0.999),
        eps: HyperParam = 1e-8,
        weight_decay: HyperParam = 1e-2,
        amsgrad: bool | Sequence[bool] = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad)
