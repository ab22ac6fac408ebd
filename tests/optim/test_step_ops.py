"""A fused optimizer step dispatches the same aten ops for 2 trials as for 64.

Parameters are built by stacking a model's parameters ``[n, *p.shape]`` (muP infshapes kept), on
the shapes of an MLP, a CNN with BatchNorm and the charlm GPT surrogate. Counted: per-trial
gradient clipping, the optimizer step and a per-trial scheduler step, after two warm-up steps.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hydro
import hydro.optim
from examples.charlm.model import GPT
from examples.models import ResNet


class CountOps(TorchDispatchMode):
    """Counts every aten op dispatched while active (foreach ops count once)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def gpt_surrogate() -> nn.Module:
    idx = torch.randint(0, 96, (2, 32))
    target = GPT(n_layer=2, n_head=8, n_embd=256, block_size=32, dropout=0.0)
    return hydro.scale(target, ratio=4, example_inputs=(idx,))


def mlp() -> nn.Module:
    """The benchmark's width-64 MLP."""
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )


MODELS = {"mlp": mlp, "cnn_bn": lambda: ResNet(width=8), "gpt_surrogate": gpt_surrogate}


def stacked_params(model: nn.Module, n: int) -> list[nn.Parameter]:
    params = []
    for p in model.parameters():
        t = nn.Parameter(p.detach().unsqueeze(0).repeat(n, *[1] * p.dim()).clone())
        if hasattr(p, "infshape"):
            t.infshape = p.infshape
        params.append(t)
    return params


def make(kind: str, params: list[nn.Parameter], n: int):
    per = [float(k + 1) / n for k in range(n)]
    if kind == "sgd":
        opt = hydro.optim.SGD(
            params,
            lr=[0.1 * x for x in per],
            momentum=[0.9 * x for x in per],
            weight_decay=[1e-3 * x for x in per],
            nesterov=[k % 2 == 0 for k in range(n)],
        )
    else:
        cls = hydro.optim.AdamW if kind == "adamw" else hydro.optim.Adam
        opt = cls(
            params,
            lr=[1e-3 * x for x in per],
            betas=[(0.9 - 0.1 * x, 0.999 - 0.01 * x) for x in per],
            eps=[1e-8 * x for x in per],
            weight_decay=[0.1 * x for x in per],
            amsgrad=[k % 2 == 1 for k in range(n)],
        )
    S = hydro.optim.lr_scheduler
    sched = S.SequentialLR(
        opt,
        [S.LinearLR(opt, start_factor=per, total_iters=2), S.CosineAnnealingLR(opt, T_max=10)],
        milestones=[2],
    )
    return opt, sched


def count_step(model_name: str, kind: str, n: int) -> Counter[str]:
    torch.manual_seed(0)
    params = stacked_params(MODELS[model_name](), n)
    opt, sched = make(kind, params, n)
    diverged = torch.zeros(n, dtype=torch.bool)
    for p in params:
        p.hydro_diverged = diverged
    limits = [1.0 + k for k in range(n)]

    def step() -> None:
        for p in params:
            p.grad = torch.randn_like(p)
        hydro.optim.clip_grad_norm_(params, limits)
        opt.step()
        sched.step()

    step()
    step()
    for p in params:
        p.grad = torch.randn_like(p)
    with CountOps() as counter:
        hydro.optim.clip_grad_norm_(params, limits)
        opt.step()
        sched.step()
    return counter.ops


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_op_count_independent_of_n(model_name: str, kind: str) -> None:
    small = count_step(model_name, kind, 2)
    large = count_step(model_name, kind, 64)
    assert sum(small.values()) == sum(large.values()), (small - large) + (large - small)
    assert small == large
    assert "_local_scalar_dense" not in small  # no .item(): nothing waits for the device
    assert "select" not in small  # no per-trial indexing


def test_count_grows_with_parameters_not_trials() -> None:
    # the counter sees the step: a model with more parameter tensors dispatches more ops
    assert sum(count_step("gpt_surrogate", "adam", 2).values()) > sum(
        count_step("mlp", "adam", 2).values()
    )
