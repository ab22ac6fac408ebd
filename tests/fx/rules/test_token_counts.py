"""Token counts are fixed dimensions: register tokens (DINOv2-style ``reg_token [1, 4, D]``) and
class tokens concatenated with the patch tokens keep their count, while their width shrinks; a
learned vector concatenated along the channels, which a layer then contracts, is still a width."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hydro

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::hydro.errors.HydroWarning")]


class RegisterViT(nn.Module):
    """Patches, a class token, 4 register tokens inserted after the class token (as timm does
    for ``reg_tokens``), one encoder layer, a head on the class token."""

    def __init__(self, d: int = 64, registers: int = 4) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, 4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.reg_token = nn.Parameter(torch.randn(1, registers, d) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 16 + 1, d) * 0.02)
        self.block = nn.TransformerEncoderLayer(d, 4, 2 * d, 0.0, batch_first=True)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch(x).flatten(2).transpose(1, 2)
        b = p.shape[0]
        t = torch.cat([self.cls_token.expand(b, -1, -1), p], 1) + self.pos_embed
        t = torch.cat([t[:, :1], self.reg_token.expand(b, -1, -1), t[:, 1:]], 1)
        return self.head(self.block(t)[:, 0])


@pytest.mark.parametrize("ratio", [8, 4])
def test_register_tokens_keep_their_count(ratio):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    sur = hydro.scale(RegisterViT(), ratio, example_inputs=(x,), seed=0)
    assert sur.get_parameter("reg_token").shape == (1, 4, 64 // ratio)
    assert sur.get_parameter("cls_token").shape == (1, 1, 64 // ratio)
    assert sur.get_parameter("pos_embed").shape == (1, 17, 64 // ratio)
    assert sur(x).shape == (2, 10)


def test_ratio_one_is_the_model():
    torch.manual_seed(0)
    model, x = RegisterViT(), torch.randn(2, 3, 16, 16)
    one = hydro.scale(model, 1, example_inputs=(x,))
    one.load_state_dict(model.state_dict())
    assert torch.equal(one(x), model(x))


def test_a_learned_vector_concatenated_along_channels_is_still_a_width():
    class Extra(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 64)
            self.extra = nn.Parameter(torch.randn(16))
            self.out = nn.Linear(80, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.cat([self.inp(x), self.extra.expand(x.shape[0], -1)], -1)
            return self.out(h.relu())

    sur = hydro.scale(Extra(), 8, example_inputs=(torch.randn(2, 8),))
    assert sur.get_parameter("extra").shape == (2,)
    assert sur.get_parameter("out.weight").shape == (3, 10)
