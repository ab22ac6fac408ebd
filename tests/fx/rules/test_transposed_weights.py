"""A parameter reached through a transpose is the layer it is: ``x @ W.T`` (Falcon's linear),
``x @ W.mT``, ``torch.matmul(x, W.t())``, ``x @ W.transpose(0, 1)`` and ``F.linear`` of a
permuted copy all get ``F.linear``'s width rule and muP roles (input, hidden, output with its
readout multiplier), the same surrogate as ``nn.Linear``, and fuse exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydro
from tests.fusion.exactness import build, train_and_compare

pytestmark = pytest.mark.usefixtures("one_thread")

FORMS = ["T", "mT", "t", "transpose", "permuted_linear"]


class Weight(nn.Module):
    """A bare ``[out, in]`` weight applied by ``how``."""

    def __init__(self, d_in: int, d_out: int, how: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.bias = nn.Parameter(torch.zeros(d_out))
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.how == "T":
            y = x @ w.T
        elif self.how == "mT":
            y = x @ w.mT
        elif self.how == "t":
            y = torch.matmul(x, w.t())
        elif self.how == "transpose":
            y = x @ w.transpose(0, 1)
        elif self.how == "permuted_linear":
            y = F.linear(x, w.permute(1, 0).contiguous().permute(1, 0))
        else:
            y = F.linear(x, w)
        return y + self.bias


class Net(nn.Module):
    def __init__(self, how: str, d_in: int = 16, width: int = 64, d_out: int = 10) -> None:
        super().__init__()
        self.a = Weight(d_in, width, how)
        self.b = Weight(width, width, how)
        self.c = Weight(width, d_out, how)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x).relu()).relu())


def _copy(src: Net, how: str) -> Net:
    net = Net(how)
    net.load_state_dict(src.state_dict())
    return net.double()


@pytest.mark.parametrize("how", FORMS)
def test_a_transposed_weight_scales_as_a_linear_layer(how):
    torch.manual_seed(0)
    plain = Net("linear").double()
    x = torch.randn(4, 16, dtype=torch.float64)
    want = hydro.scale(plain, 8, example_inputs=(x,), seed=3)
    got = hydro.scale(_copy(plain, how), 8, example_inputs=(x,), seed=3)
    assert got.hydro.roles == want.hydro.roles == {
        "a.weight": "input", "a.bias": "vector", "b.weight": "hidden", "b.bias": "vector",
        "c.weight": "output", "c.bias": "fixed"}
    assert got.hydro.multipliers == want.hydro.multipliers == {"mup_readout.scale": 8.0}
    for (name, p), (_, q) in zip(got.named_parameters(), want.named_parameters()):
        assert torch.equal(p, q), name
    assert torch.allclose(got(x), want(x), rtol=1e-12, atol=1e-12)
    model = _copy(plain, how)
    one = hydro.scale(model, 1, example_inputs=(x,))
    one.load_state_dict(model.state_dict())
    assert torch.equal(one(x), model(x))  # ratio 1: the model itself


@pytest.mark.parametrize("how", ["T", "mT"])
def test_surrogates_with_transposed_weights_fuse_exactly(how):
    def surrogate(case):
        torch.manual_seed(len(case.inputs[0]))
        return hydro.scale(Net(how).double(), 8, example_inputs=case.inputs, seed=id(case) % 97)

    run, cases = build("mlp", 3, "adam", make_model=surrogate, batch=8)
    train_and_compare(run, cases, steps=3)
