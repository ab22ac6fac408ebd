"""Faults that used to pass silently (issue 19, points 4 and 8): each now raises one clear line,
warns once, or (a diverged trial's BatchNorm statistics) stays frozen."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydro
import hydro.optim
from hydro.errors import ConfigError, DataError, FuseError, HydroWarning, ScaleError
from hydro.fusion import fuse, trial_loss


def _bn_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)
    ).double()


def _train_bn(models: list[nn.Module], lrs: list[float], steps: int) -> tuple:
    torch.manual_seed(1)
    x = torch.randn(6, 3, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    fused = fuse([copy.deepcopy(m) for m in models])
    opt = hydro.optim.SGD(fused.parameters(), lr=lrs, momentum=0.9)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        trial_loss(F.cross_entropy, fused(x), y).sum().backward()
        opt.step()
        history.append({k: v.clone() for k, v in fused.state_dict().items()})
    return fused, history


def test_diverged_trial_batchnorm_statistics_stay_frozen() -> None:
    # lr=1e6 blows trial 1's activations up by ~1e10 a step: its BatchNorm running variance
    # overflows in a forward whose (normalized) loss is still finite, so only the buffers tell
    torch.manual_seed(0)
    models = [_bn_net() for _ in range(3)]
    steps = 34
    broken, hist = _train_bn(models, [0.1, 1e6, 0.05], steps)
    alone, alone_hist = _train_bn([models[0], models[2]], [0.1, 0.05], steps)
    assert broken.diverged.tolist() == [False, True, False]
    # the healthy trials: bit for bit what they are trained without the diverged one
    for mine, theirs in zip(hist, alone_hist):
        for name, value in theirs.items():
            if name not in ("diverged", "trial_seed", "trial_step"):
                assert torch.equal(mine[name][[0, 2]], value), name
    # the diverged trial's buffers: finite, and from the step it diverged on never written again
    at = next(i for i, sd in enumerate(hist) if sd["diverged"][1])
    assert 0 < at < steps - 2
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        frozen = hist[at - 1][name][1]
        assert torch.isfinite(frozen.double()).all(), name
        for sd in hist[at:]:
            assert torch.equal(sd[name][1], frozen), name
    assert int(hist[-1]["1.num_batches_tracked"][1]) == at
