"""The two models the compiled-step tests train (:mod:`test_compiled`, :mod:`test_step`): a
small MLP with BatchNorm and dropout, and a one-layer charlm GPT, with their float64 batches and
per-trial losses; and how those tests record a step and compare two runs step by step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import hydro
from examples.charlm.model import GPT, VOCAB_SIZE

TOL = {"rtol": 1e-12, "atol": 1e-12}  # float64: inductor reorders some sums (~1e-16 seen)


def mlp(p: float) -> nn.Module:
    torch.manual_seed(0)
    # no bias before BatchNorm: its true gradient is 0, and Adam would amplify rounding noise
    return nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.Dropout(p), nn.ReLU(),
                         nn.Linear(16, 3))


def gpt(p: float) -> nn.Module:
    torch.manual_seed(0)
    return GPT(n_layer=1, n_head=2, n_embd=16, block_size=8, dropout=p)


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    return x, torch.randn(8, 3, generator=g, dtype=torch.float64)


def gpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB_SIZE, (2, 2, 8), generator=g).unbind()


def mlp_losses(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean(dim=(1, 2))


def gpt_losses(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return hydro.trial_loss(lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()), out, y)


def snapshot(fused: nn.Module, opt: torch.optim.Optimizer, losses: torch.Tensor) -> dict:
    """Copies of one step's losses, parameters, optimizer state and buffers, by kind and name."""
    state = {f"{k}.{s}": v.clone() for k, p in fused.named_parameters()
             for s, v in opt.state[p].items() if torch.is_tensor(v)}
    return {
        "loss": {"loss": losses.detach().clone()},
        "param": {k: p.detach().clone() for k, p in fused.named_parameters()},
        "state": state,
        "buffer": {k: b.clone() for k, b in fused.named_buffers()},
    }


def assert_same(a: list, b: list, trials: list[int] | None = None, exact: bool = False) -> None:
    """Two runs' step records equal, every kind and name (within :data:`TOL`, or bit for bit
    with ``exact``), on all trials or on ``trials`` only."""
    assert len(a) == len(b)
    for step, (ra, rb) in enumerate(zip(a, b)):
        for kind in ra:
            assert ra[kind].keys() == rb[kind].keys(), kind
            for name in ra[kind]:
                x, y = ra[kind][name], rb[kind][name]
                if trials is not None:
                    x, y = x[trials], y[trials]
                where = f"step {step} {kind} {name}"
                if exact:
                    assert torch.equal(x, y), where
                else:
                    torch.testing.assert_close(
                        x, y, **TOL, equal_nan=True, msg=lambda m, where=where: f"{where}: {m}"
                    )
