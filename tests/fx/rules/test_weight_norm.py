"""Weight normalization (``w = g * v / ||v||``): a width rule, muP roles, consistent gains, and
fused training equal to separate training."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

import hydro
from hydro.scaling import build as build_scaled
from tests.fusion.exactness import build, train_and_compare
from tests.zoo import ZOO, Case


def _old_weight_norm(module: nn.Module, dim: int = 0) -> nn.Module:
    with warnings.catch_warnings():  # the hook form is deprecated, and still common
        warnings.simplefilter("ignore", FutureWarning)
        return nn.utils.weight_norm(module, dim=dim)


class WNNet(nn.Module):
    """A conv with the newer parametrization (normalized per kernel position, as wav2vec2's
    positional conv) and a linear with the old hook (per output row)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Conv1d(3, width, 3, padding=1)
        self.conv = parametrizations.weight_norm(nn.Conv1d(width, width, 3, padding=1), dim=2)
        self.fc = _old_weight_norm(nn.Linear(width, width))
        self.out = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        h = F.gelu(self.conv(h)) + h
        return self.out(F.gelu(self.fc(h.mean(-1))))


def wn_case(width: int = 32, batch: int = 4, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed + 1000)
    torch.manual_seed(seed)
    x = torch.randn(batch, 3, 6, generator=g)
    return Case(WNNet(width), (x,), torch.randint(0, 5, (batch,), generator=g), F.cross_entropy)


def test_weight_norm_scales_with_mup_roles_and_gains_of_its_own_v():
    model = wn_case().model
    x = torch.randn(2, 3, 6)
    sur = hydro.scale(model, 4, example_inputs=(x,), seed=0)
    p = dict(sur.named_parameters())
    v_conv, g_conv = (
        p["conv.parametrizations.weight.original1"],
        p["conv.parametrizations.weight.original0"],
    )
    assert v_conv.shape == (8, 8, 3) and g_conv.shape == (1, 1, 3)  # g: per kernel position
    assert p["fc.weight_v"].shape == (8, 8) and p["fc.weight_g"].shape == (8, 1)
    roles = sur.hydro.roles
    assert roles["fc.weight_v"] == roles["conv.parametrizations.weight.original1"] == "hidden"
    assert (
        roles["fc.weight_g"] == "vector"
        and roles["conv.parametrizations.weight.original0"] == "fixed"
    )
    # the effective weight starts as the muP-drawn v, as weight normalization itself starts
    assert torch.allclose(g_conv, torch.norm_except_dim(v_conv, 2, 2))
    assert torch.allclose(p["fc.weight_g"], torch.norm_except_dim(p["fc.weight_v"], 2, 0))
    # v is drawn as a hidden weight of fan-in / 4: std x 2, so the effective weight is muP's
    target_v = model.fc.weight_v
    assert float(p["fc.weight_v"].std() / target_v.std()) == pytest.approx(2.0, rel=0.25)
    assert sur(torch.randn(5, 3, 6)).shape == (5, 5)
    again = build_scaled(model, 4, example_inputs=(x,), seed=0).sample(seed=3)
    q = dict(again.named_parameters())
    assert not torch.equal(q["fc.weight_v"], p["fc.weight_v"])
    assert torch.allclose(q["fc.weight_g"], torch.norm_except_dim(q["fc.weight_v"], 2, 0))


def test_weight_norm_surrogates_fuse_exactly(monkeypatch):
    monkeypatch.setitem(ZOO, "weight_norm", wn_case)

    def surrogate(case: Case) -> nn.Module:
        return hydro.scale(case.model, 2, example_inputs=case.inputs)

    run, cases = build("weight_norm", 3, "adam", make_model=surrogate)
    assert any(n.endswith("weight_v") for n, _ in run.fused.named_parameters())
    train_and_compare(run, cases, steps=3, shared=True)
