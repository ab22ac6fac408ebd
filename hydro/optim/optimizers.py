"""Fused SGD, Adam and AdamW: one step for ``n`` trials, each with its own hyperparameters.

Every parameter has a leading trial dimension ``[n, ...]``. Each hyperparameter may be a scalar
(the same for every trial) or a length-``n`` sequence/tensor; it is kept as a float64 tensor
``[n]`` in the parameter group (where the schedulers of ``lr_scheduler`` write it). The update of
trial ``k`` is torch's own fused kernel (``torch._fused_adam_``, ``_fused_adamw_``,
``_fused_sgd_``, what ``torch.optim.Adam(fused=True)`` runs) applied to trial ``k``'s slices of
all parameters at once, with trial ``k``'s hyperparameters: one pass over memory per step, and the
result ``torch.optim`` gives (checked step by step in ``tests/fusion``).

muP: a parameter carrying ``infshape`` (every parameter of a Hydro surrogate) gets the learning
rate and weight decay multipliers of :func:`hydro.parametrize.optimizer_multipliers`; a plain
parameter gets none.

Isolation: before each step, a trial with a non-finite gradient is marked in the fused model's
``diverged`` flags. Diverged trials are frozen: the kernels skip them, so their parameters and
optimizer state (step counts included) stop changing, and no other trial's update depends on them.
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


def _trial_slices(**tensors: list[torch.Tensor]) -> dict[str, list[list[torch.Tensor]]]:
    """For each named list of ``[n, ...]`` tensors, trial k's slices: ``out[name][k]``.

    (``unbind`` makes all of a tensor's trial views in one call.)
    """
    out = {}
    for name, ts in tensors.items():
        per_tensor = [t.unbind(0) for t in ts]
        n = len(per_tensor[0]) if per_tensor else 0  # empty: never indexed
        out[name] = [[views[k] for views in per_tensor] for k in range(n)]
    return out


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
        # One reduction per gradient: a trial's sum is finite iff all its entries are (barring an
        # overflow of the sum itself, which only an exploding trial reaches).
        sums = torch.stack([p.grad.flatten(1).sum(dim=1).float() for p in with_grad])
        frozen = ~torch.isfinite(sums).all(dim=0).cpu()
        flags = self._diverged()
        if flags is not None:
            flags |= frozen.to(flags.device)
            frozen = flags.cpu()
        active = [k for k, f in enumerate(frozen.tolist()) if not f]
        for group in self.param_groups:
            # Parameters sharing muP multipliers are updated together, one kernel call per trial.
            by_mults: dict[tuple[float, float], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_mults.setdefault(optimizer_multipliers(p, self.kind), []).append(p)
            for (lr_mult, wd_mult), params in by_mults.items():
                self._update(params, group, lr_mult, wd_mult, active, (~frozen).to(torch.float64))
        return loss

    def _update(self, params, group, lr_mult, wd_mult, active, stepping) -> None:  # noqa: ANN001
        """Update ``params`` (sharing muP multipliers) for the trials in ``active``."""
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

    def _update(self, params, group, lr_mult, wd_mult, active, stepping) -> None:  # noqa: ANN001
        hp = {k: group[k].tolist() for k in self.per_trial_keys}
        states = [self.state[p] for p in params]
        if any(m != 0 for m in hp["momentum"]) and not states[0]:
            for p, state in zip(params, states):
                state["momentum_buffer"] = torch.zeros_like(p)
                state["momentum_started"] = torch.zeros(self.n, dtype=torch.bool)
        # unbind: every trial's views in one call, not one indexing op per trial and tensor.
        slices = _trial_slices(
            params=params,
            grads=[p.grad for p in params],
            bufs=[s["momentum_buffer"] for s in states if "momentum_buffer" in s],
        )
        for k in active:
            momentum = hp["momentum"][k]
            started = bool(states[0]["momentum_started"][k]) if momentum != 0 else True
            # torch's own fused SGD kernel on trial k's slices, with trial k's hyperparameters.
            torch._fused_sgd_(
                slices["params"][k],
                slices["grads"][k],
                slices["bufs"][k] if momentum != 0 else [],
                weight_decay=hp["weight_decay"][k] * wd_mult,
                momentum=momentum,
                lr=hp["lr"][k] * lr_mult,
                dampening=hp["dampening"][k],
                nesterov=bool(hp["nesterov"][k]),
                maximize=False,
                is_first_step=not started,
            )
            if momentum != 0:
                for s in states:
                    s["momentum_started"][k] = True


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

    def _update(self, params, group, lr_mult, wd_mult, active, stepping) -> None:  # noqa: ANN001
        hp = {k: group[k].tolist() for k in self.per_trial_keys if k != "betas"}
        beta1, beta2 = (b.tolist() for b in group["betas"])
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:
                state["step"] = torch.zeros(self.n, dtype=torch.float64, device=p.device)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
                if any(hp["amsgrad"]):
                    state["max_exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += stepping.to(state["step"].device)
        kernel = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        slices = _trial_slices(
            params=params,
            grads=[p.grad for p in params],
            exp_avg=[s["exp_avg"] for s in states],
            exp_avg_sq=[s["exp_avg_sq"] for s in states],
            max_exp_avg_sq=[s["max_exp_avg_sq"] for s in states if "max_exp_avg_sq" in s],
            step=[s["step"] for s in states],
        )
        for k in active:
            amsgrad = bool(hp["amsgrad"][k])
            # torch's own fused Adam(W) kernel on trial k's slices, with trial k's settings.
            kernel(
                slices["params"][k],
                slices["grads"][k],
                slices["exp_avg"][k],
                slices["exp_avg_sq"][k],
                slices["max_exp_avg_sq"][k] if amsgrad else [],
                slices["step"][k],
                lr=hp["lr"][k] * lr_mult,
                beta1=beta1[k],
                beta2=beta2[k],
                weight_decay=hp["weight_decay"][k] * wd_mult,
                eps=hp["eps"][k],
                amsgrad=amsgrad,
                maximize=False,
            )


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
