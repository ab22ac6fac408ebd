"""ALiBi slopes built in Python from the head count (BLOOM's ``build_alibi_tensor``) are
per-head constants: the head count is kept whole and the head dim is cut, so the surrogate's
slopes are the target's, value for value (a cut ``arange`` would keep only the first ones)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx
from torch import nn

import hydro

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::hydro.errors.HydroWarning")]  # fmt: skip


def build_alibi_tensor(mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """BLOOM's slopes ``2 ** (-8 i / H)`` times the positions, ``[B * H, 1, T]``."""
    batch, seq = mask.shape
    closest = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    powers = torch.arange(1, 1 + closest, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    positions = ((mask.cumsum(dim=-1) - 1) * mask)[:, None, :]
    return (slopes[..., None] * positions).reshape(batch * num_heads, 1, seq).to(dtype)


class AlibiLM(nn.Module):
    def __init__(self, d: int = 64, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(50, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.emb(ids)
        alibi = build_alibi_tensor(torch.ones_like(ids), self.heads, x.dtype)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(x).split(x.shape[-1], -1))  # fmt: skip
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + alibi.view(b, -1, 1, t)
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        return self.head(x + self.proj(y))


def _slopes(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The value of the graph's ``pow`` node (the slopes) when the captured model runs."""
    gm = model.graphs["eval"]
    seen = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):  # noqa: ANN001, ANN202
            out = super().run_node(n)
            if n.op == "call_function" and "pow" in str(n.target):
                seen["pow"] = out
            return out

    model.eval()
    Recorder(model, graph=gm.graph).run(ids)  # (get_attr reads the model's tensors)
    return seen["pow"]


@pytest.mark.parametrize("ratio", [8, 4, 2])
def test_alibi_keeps_its_heads_and_slopes(ratio):
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 6))
    model = AlibiLM()
    sur = hydro.scale(model, ratio, example_inputs=(ids,), seed=0)
    one = hydro.scale(model, 1, example_inputs=(ids,), seed=0)
    assert sur.get_parameter("qkv.weight").shape == (3 * 64 // ratio, 64 // ratio)
    assert torch.equal(_slopes(sur, ids), _slopes(one, ids))
    assert _slopes(sur, ids).shape == (8,)
    assert sur(ids).shape == (2, 6, 50)
