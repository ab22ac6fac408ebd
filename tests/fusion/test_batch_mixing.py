"""Models whose computation mixes the samples of a batch fuse per trial: the mixing stays inside
each trial's own batch, so fused training equals separate training (float64, step by step).
Patterns: an in-batch contrastive loss (a similarity of every sample with every other, labels
``arange(B)``, as CLIP computes it), batch statistics (``h - h.mean(0)``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydro.optim
from hydro.fusion import fuse
from tests.fusion.exactness import TOL, assert_close


class Contrastive(nn.Module):
    """Two towers, normalized embeddings, logits of every image against every text, the
    symmetric cross entropy against ``arange(B)``: the model returns its loss."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, width, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                   nn.Flatten(), nn.Linear(width, width))
        self.text = nn.Sequential(nn.Embedding(50, width), nn.Flatten(),
                                  nn.Linear(6 * width, width))
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        a = F.normalize(self.image(pixels), dim=-1)
        b = F.normalize(self.text(ids), dim=-1)
        logits = a @ b.t() * self.logit_scale.exp()
        labels = torch.arange(pixels.shape[0], device=pixels.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


class BatchStatistics(nn.Module):
    """A layer centred on its batch mean and scaled by its batch std, and a loss over the
    batch's second moments. (No bias before the centring: its exact gradient is 0, and Adam
    would turn the rounding noise on both sides into arbitrary steps.)"""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16, bias=False)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = (h - h.mean(0)) / (h.std(0) + 1.0)
        return self.out(h.relu()).pow(2).mean(0).sum()


def _inputs(kind: str, step: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "contrastive":
        return (torch.randn(5, 3, 8, 8, generator=g, dtype=torch.float64),
                torch.randint(0, 50, (5, 6), generator=g))
    return (torch.randn(6, 8, generator=g, dtype=torch.float64),)


@pytest.mark.parametrize("kind", ["contrastive", "batch_statistics"])
def test_mixing_the_batch_fuses_per_trial_exactly(kind):
    n = 3
    models = []
    for k in range(n):
        torch.manual_seed(k)
        models.append((Contrastive() if kind == "contrastive" else BatchStatistics()).double())
    fused = fuse([copy.deepcopy(m) for m in models])
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2 * (k + 1)) for k, m in enumerate(models)]
    fused_opt = hydro.optim.Adam(fused.parameters(), lr=[1e-2 * (k + 1) for k in range(n)])
    tol = TOL[torch.float64]
    for step in range(3):
        x = _inputs(kind, step)
        losses = []
        for m, opt in zip(models, opts):
            opt.zero_grad()
            loss = m(*x)
            loss.backward()
            losses.append(loss.detach())
        fused_opt.zero_grad()
        out = fused(*x)
        out.sum().backward()
        assert_close(out, torch.stack(losses), **tol, msg=f"step {step}: losses")
        params = dict(fused.named_parameters())
        for k, m in enumerate(models):
            for name, p in m.named_parameters():
                assert_close(params[name].grad[k], p.grad, **tol, msg=f"step {step}: grad {name}")
        for opt in opts:
            opt.step()
        fused_opt.step()
        for k, m in enumerate(models):
            for name, p in m.named_parameters():
                assert_close(params[name][k], p, **tol, msg=f"step {step}: param {name}")
