"""Fused SGD, Adam and AdamW: ``torch.optim``'s single-tensor arithmetic with each trial's values.

Each optimizer defines its state, its per-trial coefficients and its element-wise update; the
step itself, the per-trial hyperparameters, trial selection, reset and state export, the muP
multipliers and the isolation of diverged trials are :class:`FusedOptimizer`'s
(:mod:`hydro.optim.base`, whose names this module re-exports).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from hydro.errors import ConfigError
from hydro.optim.base import (  # noqa: F401 - re-exported
    BETAS_FORMS,
    Betas,
    FusedOptimizer,
    HyperParam,
    parse_betas,
    per_trial,
)

_ZEROS: dict[tuple, torch.Tensor] = {}


def _decayed_gradient(p: torch.Tensor, g: torch.Tensor, c: dict, out: torch.Tensor) -> torch.Tensor:
    """``g`` plus L2 weight decay where ``c`` has it, zeroed for frozen trials (their gradient may
    be non-finite); written to ``out`` when either applies, else ``g`` itself."""
    d = g
    if "wd" in c:
        d = torch.addcmul(g, p, c["wd"], out=out)
    if "active" in c:
        d = torch.where(c["active"], d, _zero(p), out=out)
    return d


def _zero(like: torch.Tensor) -> torch.Tensor:
    """A 0-d zero of ``like``'s dtype and device (``torch.where(..., out=)`` needs a tensor)."""
    key = (like.dtype, like.device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros((), dtype=like.dtype, device=like.device)
    return _ZEROS[key]


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
    cohort_key = "momentum_started"

    def __init__(
        self,
        params: Iterable,
        lr: HyperParam = 1e-3,
        momentum: HyperParam = 0.0,
        dampening: HyperParam = 0.0,
        weight_decay: HyperParam = 0.0,
        nesterov: bool | Sequence[bool] = False,
        *,
        compile: bool | str | Callable = "auto",
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(params, defaults, compile=compile)
        self._validate()

    def _validate(self) -> None:
        super()._validate()
        for group in self.param_groups:
            bad = (group["nesterov"] > 0) & ((group["momentum"] <= 0) | (group["dampening"] != 0))
            if bool(bad.any()):
                raise ConfigError(
                    f"nesterov: trials {bad.nonzero().flatten().tolist()} ask for Nesterov "
                    "momentum without a positive momentum and zero dampening"
                )

    def _state_keys(self) -> tuple[str, ...]:
        return ("momentum_buffer",)

    def _new_cohort(self, p: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.n, dtype=torch.bool, device=p.device)

    def _init_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        # Buffers exist for every trial once any trial has momentum (a scheduler may add some).
        if "momentum_buffer" not in state and self._any("momentum"):
            state["momentum_buffer"] = torch.zeros_like(p)

    def _advance_cohorts(self, per_group: list[list[torch.Tensor]], active: torch.Tensor) -> None:
        done = set()
        for group, ps in zip(self.param_groups, per_group):
            for p in ps:
                t = self.state[p]["momentum_started"]
                if id(t) not in done and "momentum_buffer" in self.state[p]:
                    done.add(id(t))
                    t |= active.to(t.device) & (self._on(group, "momentum", t) != 0)

    def _advance_traced(self, per_group, cohorts, keys, active, hypers) -> None:
        """:meth:`_advance_cohorts` on the traced tensors of :mod:`hydro.fusion.step`."""
        if "momentum_buffer" not in keys:
            return
        done, offset = set(), 0
        for ps, hyper in zip(per_group, hypers):
            for t in cohorts[offset : offset + len(ps)]:
                if id(t) not in done:
                    done.add(id(t))
                    t |= active & (hyper["momentum"] != 0)
            offset += len(ps)

    def _coefficients(self, group, state, lr_mult, wd_mult, active, like):
        f64 = torch.float64
        lr = self._on(group, "lr", like) * lr_mult
        out = {"active": active, "neg_lr": torch.where(active, -lr, 0.0)}
        if self._any("weight_decay"):
            out["wd"] = self._on(group, "weight_decay", like) * wd_mult
        if "momentum_buffer" in state:
            mom = self._on(group, "momentum", like)
            damp = self._on(group, "dampening", like)
            nesterov = self._on(group, "nesterov", like) != 0
            started = state["momentum_started"].to(like.device)
            has = mom != 0
            moving = active & has
            # buf <- buf * a + d * c: torch's buf*momentum + (1-dampening)*d once started, d on
            # its first step; unchanged for frozen trials and while a trial's momentum is 0.
            out["a"] = torch.where(moving, torch.where(started, mom, 0.0), 1.0)
            out["c"] = torch.where(moving, torch.where(started, 1 - damp, 1.0), 0.0)
            # direction <- buf * x + d * y: Nesterov's d + momentum*buf, else buf; d alone
            # without momentum.
            out["x"] = torch.where(has, torch.where(nesterov, mom, 1.0), 0.0)
            out["y"] = torch.where(has, nesterov.to(f64), 1.0)
        return out

    @staticmethod
    def _elementwise(params, grads, state, coeffs) -> None:
        d = torch._foreach_addcmul(grads, params, coeffs["wd"]) if "wd" in coeffs else grads
        if "active" in coeffs:  # a frozen trial's gradient may be non-finite: zero it
            d = [torch.where(a, g, 0.0) for a, g in zip(coeffs["active"], d)]
        if "momentum_buffer" in state:
            bufs = state["momentum_buffer"]
            torch._foreach_mul_(bufs, coeffs["a"])
            torch._foreach_addcmul_(bufs, d, coeffs["c"])
            d_scaled = torch._foreach_mul(d, coeffs["y"])
            d = torch._foreach_addcmul(d_scaled, bufs, coeffs["x"])
        torch._foreach_addcmul_(params, d, coeffs["neg_lr"])

    def _update(self, p, g, state, c, scratch) -> None:
        s1, s2 = scratch
        d = _decayed_gradient(p, g, c, out=s2)
        if "momentum_buffer" in state:
            buf = state["momentum_buffer"]
            buf.mul_(c["a"]).addcmul_(d, c["c"])
            d = torch.mul(d, c["y"], out=s1).addcmul_(buf, c["x"])
        p.addcmul_(d, c["neg_lr"])


class Adam(FusedOptimizer):
    """Fused ``torch.optim.Adam`` (L2 weight decay added to the gradient), per-trial settings.

    ``betas``: ``(beta1, beta2)`` with each a scalar or one value per trial, or a list of ``n``
    ``(beta1, beta2)`` pairs (see :func:`parse_betas`).

    Example:
        >>> import torch
        >>> from hydro.fusion import fuse
        >>> import hydro.optim
        >>> fused = fuse(torch.nn.Linear(4, 1), n=2)
        >>> opt = hydro.optim.Adam(fused.parameters(), lr=[1e-3, 1e-2], betas=(0.9, [0.99, 0.999]))
        >>> opt = hydro.optim.Adam(fused.parameters(), betas=[(0.9, 0.99), (0.8, 0.999)])
    """

    per_trial_keys = ("lr", "betas", "eps", "weight_decay", "amsgrad")
    decoupled = False

    def __init__(
        self,
        params: Iterable,
        lr: HyperParam = 1e-3,
        betas: Betas = (0.9, 0.999),
        eps: HyperParam = 1e-8,
        weight_decay: HyperParam = 0.0,
        amsgrad: bool | Sequence[bool] = False,
        *,
        compile: bool | str | Callable = "auto",
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        super().__init__(params, defaults, compile=compile)

    def _state_keys(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def _new_cohort(self, p: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.n, dtype=torch.float64, device=p.device)

    def _init_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        if "max_exp_avg_sq" not in state and self._any("amsgrad"):
            state["max_exp_avg_sq"] = torch.zeros_like(p)

    def _advance_cohorts(self, per_group: list[list[torch.Tensor]], active: torch.Tensor) -> None:
        steps = {id(self.state[p]["step"]): self.state[p]["step"] for ps in per_group for p in ps}
        torch._foreach_add_(list(steps.values()), [active.to(s.device) for s in steps.values()])

    def _advance_traced(self, per_group, cohorts, keys, active, hypers) -> None:
        """:meth:`_advance_cohorts` on the traced tensors of :mod:`hydro.fusion.step`."""
        done = set()
        for t in cohorts:
            if id(t) not in done:
                done.add(id(t))
                t.add_(active)

    def _coefficients(self, group, state, lr_mult, wd_mult, active, like):
        # torch computes these per trial in double precision; so do we, as [n] vectors.
        lr = self._on(group, "lr", like) * lr_mult
        wd = self._on(group, "weight_decay", like) * wd_mult
        beta1, beta2 = self._on(group, 0, like), self._on(group, 1, like)
        eps = self._on(group, "eps", like)
        step = state["step"].to(like.device) + active  # the step this update is
        bc1 = 1 - beta1.pow(step)
        bc2 = 1 - beta2.pow(step)
        out = {
            "active": active,
            "w1": torch.where(active, 1 - beta1, 0.0),
            "b1": torch.where(active, beta1, 1.0),
            "b2": torch.where(active, beta2, 1.0),
            "c2": torch.where(active, 1 - beta2, 0.0),
            "neg_step_size": torch.where(active, -(lr / bc1), 0.0),
            "bc2_sqrt": torch.where(step > 0, bc2.sqrt(), 1.0),
            "eps": eps,
        }
        out["eps_bc2"] = eps * out["bc2_sqrt"]
        out["neg_step_bc2"] = out["neg_step_size"] * out["bc2_sqrt"]
        if self.decoupled:
            out["decay"] = torch.where(active, 1 - lr * wd, 1.0)
        elif self._any("weight_decay"):
            out["wd"] = wd
        if "max_exp_avg_sq" in state:
            out["amsgrad"] = self._on(group, "amsgrad", like) != 0
        return out

    @staticmethod
    def _elementwise(params, grads, state, coeffs) -> None:
        d = grads
        if "decay" in coeffs:  # AdamW: decoupled weight decay
            torch._foreach_mul_(params, coeffs["decay"])
        elif "wd" in coeffs:
            d = torch._foreach_addcmul(grads, params, coeffs["wd"])
        if "active" in coeffs:  # a frozen trial's gradient may be non-finite: zero it
            d = [torch.where(a, g, 0.0) for a, g in zip(coeffs["active"], d)]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        # inductor leaves a lerp with tensor weights unfused: torch's mul + addcmul instead
        torch._foreach_mul_(exp_avg, coeffs["b1"])
        torch._foreach_addcmul_(exp_avg, d, coeffs["w1"])
        torch._foreach_mul_(exp_avg_sq, coeffs["b2"])
        torch._foreach_addcmul_(exp_avg_sq, torch._foreach_mul(d, coeffs["c2"]), d)
        if "max_exp_avg_sq" in state and "amsgrad" in coeffs:
            most = state["max_exp_avg_sq"]
            torch._foreach_maximum_(most, exp_avg_sq)
            second = [torch.where(a, m, v) for a, m, v in zip(coeffs["amsgrad"], most, exp_avg_sq)]
        else:
            second = exp_avg_sq
        denom = torch._foreach_sqrt(second)
        torch._foreach_div_(denom, coeffs["bc2_sqrt"])  # torch's order of operations
        torch._foreach_add_(denom, coeffs["eps"])
        step = torch._foreach_mul(exp_avg, coeffs["neg_step_size"])
        torch._foreach_addcdiv_(params, step, denom)

    def _update(self, p, g, state, c, scratch) -> None:
        # Seven ops over this parameter's memory (one more for weight decay, one for frozen
        # trials), intermediates in two scratch tensors: s2 holds the gradient used until v is
        # updated, then the step; s1 holds d * d, then the denominator.
        s1, s2 = scratch
        d = _decayed_gradient(p, g, c, out=s2)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(d, c["w1"])
        exp_avg_sq.lerp_(torch.mul(d, d, out=s1), c["c2"])  # v + (1 - beta2) * (d * d - v)
        second = exp_avg_sq
        if "max_exp_avg_sq" in state and "amsgrad" in c:
            most = torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
            second = torch.where(c["amsgrad"], most, exp_avg_sq, out=s1)
        # the same quotient as torch's with sqrt(bias correction 2) moved into the numerator
        denom = torch.sqrt(second, out=s1).add_(c["eps_bc2"])
        if "decay" in c:  # AdamW's decoupled decay, as torch's first; here while p is in cache
            p.mul_(c["decay"])
        p.addcdiv_(torch.mul(exp_avg, c["neg_step_bc2"], out=s2), denom)


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
        betas: Betas = (0.9, 0.999),
        eps: HyperParam = 1e-8,
        weight_decay: HyperParam = 1e-2,
        amsgrad: bool | Sequence[bool] = False,
        *,
        compile: bool | str | Callable = "auto",
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, compile=compile)
