"""A forward that edits its own weights in place (HuggingFace RWKV rescales its layers in eval
mode): refused with an error naming the line and what to do, not torch's "leaf Variable"."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hydro
from hydro.errors import ScaleError

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


class SelfRescaling(nn.Module):
    """RWKV's pattern: in eval mode, once, the output weights are divided in place."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.out = nn.Linear(32, 3)
        self.rescaled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rescaled == (not self.training):
            with torch.no_grad():
                self.out.weight.div_(2)
            self.rescaled = not self.rescaled
        return self.out(self.inp(x).relu())


def test_a_forward_that_writes_its_weights_is_refused_naming_the_line():
    with pytest.raises(ScaleError, match=r"self.out.weight.div_\(2\).*writes a parameter in place"):
        hydro.scale(SelfRescaling(), 4, example_inputs=(torch.randn(2, 8),))
