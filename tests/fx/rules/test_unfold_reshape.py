"""MobileViT's unfold and fold-back: ``reshape(batch * channels * patches_h, ph, patches_w, pw)``
computes its first size as ``B * C * n`` from ``x.shape``; capture records it as a chain of two
multiplications, and the channels' literal (not the patch count's) is the one that shrinks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hydro

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::hydro.errors.HydroWarning")]


class UnfoldBlock(nn.Module):
    """A conv to ``C`` channels, patches of 2 x 2 unfolded into tokens, one transformer layer
    over the patches, folded back, a pooled head."""

    def __init__(self, channels: int = 48, patch: int = 2) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.patch = patch
        self.layer = nn.TransformerEncoderLayer(channels, 2, 2 * channels, 0.0, batch_first=True)
        self.out = nn.Conv2d(channels, channels, 1)
        self.head = nn.Linear(channels, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        batch, channels, height, width = x.shape
        ph = pw = self.patch
        nph, npw = int(math.ceil(height / ph)), int(math.ceil(width / pw))
        patches, area = nph * npw, ph * pw
        t = x.reshape(batch * channels * nph, ph, npw, pw).transpose(1, 2)
        t = t.reshape(batch, channels, patches, area).transpose(1, 3)
        t = self.layer(t.reshape(batch * area, patches, -1))
        t = t.contiguous().view(batch, area, patches, -1).transpose(1, 3)
        t = t.reshape(batch * channels * nph, npw, ph, pw).transpose(1, 2)
        x = t.reshape(batch, channels, nph * ph, npw * pw)
        return self.head(self.out(x).mean((2, 3)))


@pytest.mark.parametrize("ratio", [2])
def test_unfold_reshape_scales(ratio):
    torch.manual_seed(0)
    model, x = UnfoldBlock(), torch.randn(2, 3, 6, 6)
    sur = hydro.scale(model, ratio, example_inputs=(x,), seed=0)
    assert sur.get_parameter("conv.weight").shape == (48 // ratio, 3, 3, 3)
    assert sur(torch.randn(3, 3, 6, 6)).shape == (3, 5)
    one = hydro.scale(model, 1, example_inputs=(x,))
    one.load_state_dict(model.state_dict())
    assert torch.equal(one(x), model(x))
