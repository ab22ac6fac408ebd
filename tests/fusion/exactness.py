"""Train n separate models with torch.optim and one fused model with hydro.optim, side by side.

After every step the fused model's trial k must match model k: loss, gradients, parameters,
buffers (BatchNorm statistics) and optimizer state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import hydro.optim
from hydro.fusion import FusedModel, fuse, trial_loss
from hydro.parametrize import param_groups
from tests.zoo import ZOO, Case

# Relative to the tensor's largest entry: entries whose exact value is 0 (the gradient of a key
# bias under softmax) are rounding noise on both sides, so elementwise ratios mean nothing there.
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-15), torch.float32: dict(rtol=1e-5, atol=1e-8)}
# Parameters and optimizer state are compared only where the gradient has ever been more than
# rounding noise: an entry whose exact gradient is zero (an attention key bias: softmax ignores
# it) gets ~1e-18 noise on both sides, which Adam normalizes into different, arbitrary steps.
NOISE = {torch.float64: 1e-13, torch.float32: 1e-5}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, msg: str):
    actual, expected = actual.detach(), expected.detach()
    assert actual.shape == expected.shape, f"{msg}: shape {actual.shape} != {expected.shape}"
    if expected.dtype == torch.bool or not expected.is_floating_point():
        assert torch.equal(actual, expected), msg
        return
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(actual)), f"{msg}: non-finite entries differ"
    err = (actual - expected)[finite].abs().max() if finite.any() else 0.0
    scale = expected[finite].abs().max() if finite.any() else 0.0
    assert err <= rtol * scale + atol, (
        f"{msg}: max error {float(err):.3g} at scale {float(scale):.3g}"
    )


# Hyperparameters that differ per trial (index k of n).
ADAM_HP = dict(
    lr=lambda k: 1e-3 * (k + 1),
    betas=lambda k: (0.9 - 0.05 * k, 0.999 - 0.002 * k),
    eps=lambda k: 1e-8 * (k + 1),
    weight_decay=lambda k: 0.02 * k,
    amsgrad=lambda k: k % 2 == 1,
)
SGD_HP = dict(
    lr=lambda k: 0.01 * (k + 1),
    momentum=lambda k: [0.0, 0.9, 0.5, 0.8][k % 4],
    dampening=lambda k: [0.0, 0.0, 0.1, 0.0][k % 4],
    nesterov=lambda k: k % 4 == 1,
    weight_decay=lambda k: [0.0, 1e-3, 1e-2, 0.0][k % 4],
)


def clone(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy that keeps mup's ``infshape`` (``deepcopy`` of a Parameter drops attributes)."""
    copied = copy.deepcopy(model)
    for (_, p), (_, q) in zip(model.named_parameters(), copied.named_parameters()):
        if hasattr(p, "infshape"):
            q.infshape = p.infshape
    return copied


@dataclass
class Run:
    """Everything a comparison needs, kept for tests that want to poke at it afterwards."""

    models: list[torch.nn.Module]
    fused: FusedModel
    opts: list[torch.optim.Optimizer]
    fused_opt: hydro.optim.FusedOptimizer
    scheds: list = field(default_factory=list)
    fused_sched: object = None
    live: dict = field(default_factory=dict)  # (k, name) -> entries with a real gradient so far


def build(
    name: str,
    n: int,
    opt: str,
    dtype: torch.dtype = torch.float64,
    make_model: Callable[[Case], torch.nn.Module] | None = None,
    schedule: tuple[Callable, Callable] | None = None,
    **case_kw: object,
) -> tuple[Run, list[Case]]:
    cases = [ZOO[name](seed=k, **case_kw) for k in range(n)]
    models = [(make_model(c) if make_model else c.model).to(dtype) for c in cases]
    fused = fuse([clone(m) for m in models])
    hp = ADAM_HP if opt in ("adam", "adamw") else SGD_HP
    per = {key: [f(k) for k in range(n)] for key, f in hp.items()}
    kind = "sgd" if opt == "sgd" else "adam"
    torch_cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[opt]
    opts = []
    for k, m in enumerate(models):
        extra = {key: per[key][k] for key in per if key not in ("lr", "weight_decay")}
        groups = param_groups(m, lr=per["lr"][k], weight_decay=per["weight_decay"][k], kind=kind)
        opts.append(torch_cls(groups, **extra))
    fused_cls = {"sgd": hydro.optim.SGD, "adam": hydro.optim.Adam, "adamw": hydro.optim.AdamW}[opt]
    if opt == "sgd":
        fused_opt = fused_cls(fused.parameters(), **per)
    else:
        betas = ([b[0] for b in per["betas"]], [b[1] for b in per["betas"]])
        fused_opt = fused_cls(fused.parameters(), **{**per, "betas": betas})
    run = Run(models, fused, opts, fused_opt)
    if schedule is not None:
        make_torch, make_fused = schedule
        run.scheds = [make_torch(o, k) for k, o in enumerate(opts)]
        run.fused_sched = make_fused(fused_opt)
    return run, cases


def batch(cases: list[Case], step: int, shared: bool, dtype: torch.dtype):
    """Step ``step``'s inputs and targets: case 0's for every trial, or each case's own."""

    def vary(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype) * (1 + 0.1 * step) if x.is_floating_point() else x

    if shared:
        return tuple(vary(x) for x in cases[0].inputs), cases[0].target, None
    per = [tuple(vary(x) for x in c.inputs) for c in cases]
    stacked = tuple(torch.stack(xs) for xs in zip(*per))
    return stacked, torch.stack([c.target for c in cases]), per


def assert_trial_equal(
    run: Run, k: int, *, grads: bool, state: bool, dtype: torch.dtype, where: str
) -> None:
    tol = TOL[dtype]
    model, fused = run.models[k], run.fused
    fused_params = dict(fused.named_parameters())
    for name, p in model.named_parameters():
        fp = fused_params[name]
        if grads:
            assert (p.grad is None) == (fp.grad is None), f"{where}: grad presence {name}"
            if p.grad is not None:
                assert_close(fp.grad[k], p.grad, **tol, msg=f"{where}: grad {name}")
                real = p.grad.abs() > NOISE[dtype] * max(float(p.grad.abs().max()), 1e-30)
                run.live[k, name] = run.live.get((k, name), real) | real
        live = run.live.get((k, name), torch.ones_like(p, dtype=torch.bool))
        assert_close(fp[k][live], p[live], **tol, msg=f"{where}: param {name}")
        if state and p in run.opts[k].state:
            mine = run.fused_opt.state[fp]
            for key, value in run.opts[k].state[p].items():
                if key == "momentum_buffer" and value is None:
                    continue
                got = mine[key][k].to(value.dtype)
                if value.shape == p.shape:
                    got, value = got[live], value[live]
                assert_close(got, value, **tol, msg=f"{where}: state {key} of {name}")
    fused_buffers = dict(fused.named_buffers())
    for name, b in model.named_buffers():
        assert_close(fused_buffers[name][k], b, **TOL[dtype], msg=f"{where}: buffer {name}")


def train_and_compare(
    run: Run,
    cases: list[Case],
    steps: int,
    *,
    shared: bool = True,
    dtype: torch.dtype = torch.float64,
    clip: list[float] | None = None,
) -> None:
    """Step both sides ``steps`` times, asserting equality after every backward and step."""
    n = len(run.models)
    loss_fn = cases[0].loss
    for step in range(steps):
        inputs, target, per = batch(cases, step, shared, dtype)
        losses = []
        for k, (model, opt) in enumerate(zip(run.models, run.opts)):
            opt.zero_grad()
            x = inputs if shared else per[k]
            y = target if shared else target[k]
            loss = loss_fn(model(*x), y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip[k], foreach=False)
            losses.append(loss.detach())
        run.fused_opt.zero_grad()
        out = run.fused(*inputs, shared=shared)
        fused_losses = trial_loss(loss_fn, out, target, shared=shared)
        fused_losses.sum().backward()
        if clip is not None:
            hydro.optim.clip_grad_norm_(run.fused, clip)
        assert_close(fused_losses, torch.stack(losses), **TOL[dtype], msg=f"step {step}: losses")
        for k in range(n):
            assert_trial_equal(run, k, grads=True, state=False, dtype=dtype, where=f"step {step}")
        for opt in run.opts:
            opt.step()
        run.fused_opt.step()
        for s in run.scheds:
            s.step()
        if run.fused_sched is not None:
            run.fused_sched.step()
            lrs = torch.tensor([s.get_last_lr()[0] for s in run.scheds], dtype=torch.float64)
            torch.testing.assert_close(run.fused_opt.param_groups[0]["lr"], lrs, rtol=0, atol=0)
        for k in range(n):
            assert_trial_equal(run, k, grads=False, state=True, dtype=dtype, where=f"step {step}")
