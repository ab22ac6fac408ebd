"""Hydro's surrogate against the ``mup`` package's parametrization of the same narrow model.

The twin is the charlm GPT built at the narrow width by hand, as the package's README says:
``MuSharedReadout`` for the tied readout, the attention scale muP's ``1/d`` (``sqrt(d_base) / d``:
the target's own ``1/sqrt(d)`` at the base), ``set_base_shapes`` with the full model as base,
``mup.init`` for the weights and ``MuAdam`` for the learning rates. With the head count kept
(``head_policy="keep_head_count"``, the layout the twin has) the two must be the same model:
same rules per parameter, and, given the same weights, the same outputs before and after an
Adam step. ``benchmarks/mup_compare.py`` prints the same comparison at full size.
"""

from __future__ import annotations

import math

import mup
import pytest
import torch
import torch.nn.functional as F

import hydro
from examples.charlm.data import VOCAB_SIZE
from examples.charlm.model import GPT, CausalSelfAttention
from hydro.parametrize import optimizer_multipliers, param_groups

WIDTH, HEADS, BLOCK = 64, 2, 8
# a width-64 target at ratio 4 is below the measured width floor: the rules are what is compared
pytestmark = pytest.mark.filterwarnings("ignore:ratio 4 takes")


class MupAttention(CausalSelfAttention):
    """The example's attention with an explicit scale (muP's 1/d relative to the base)."""

    scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


def mup_twin(ratio: int) -> GPT:
    """The narrow GPT parametrized by the mup package, the full one as base."""
    width = WIDTH // ratio
    model = GPT(1, HEADS, width, BLOCK, 0.0)
    d, d_base = width // HEADS, WIDTH // HEADS
    for block in model.h:
        attn = MupAttention(width, HEADS, 0.0)
        attn.scale = math.sqrt(d_base) / d
        block.attn = attn
    model.lm_head = mup.MuSharedReadout(model.wte.weight, bias=False)
    with torch.device("meta"):
        base = GPT(1, HEADS, WIDTH, BLOCK, 0.0)
    mup.set_base_shapes(model, base, rescale_params=False)
    return model


def scaled(ratio: int):
    torch.manual_seed(0)
    target = GPT(1, HEADS, WIDTH, BLOCK, 0.0)
    x = torch.randint(0, VOCAB_SIZE, (2, BLOCK))
    sur = hydro.scale(target, ratio, example_inputs=(x,), seed=0,
                      head_policy="keep_head_count")
    return target, sur, x


@pytest.mark.parametrize("ratio", [2, 4])
def test_rules_per_parameter_are_the_packages(ratio):
    _, sur, _ = scaled(ratio)
    twin = mup_twin(ratio)
    twin_params = dict(twin.named_parameters())
    assert set(twin_params) == {n for n, _ in sur.named_parameters()}
    for kind, cls in (("adam", mup.MuAdam), ("sgd", mup.MuSGD)):
        groups = cls(twin.parameters(), lr=1.0, weight_decay=1.0).param_groups
        by_id = {id(p): (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}
        for name, p in sur.named_parameters():
            assert optimizer_multipliers(p, kind) == pytest.approx(by_id[id(twin_params[name])]), (
                kind, name)
    for name in twin_params:
        # mup.init's rule: the std of a matrix with two width dimensions x width_mult^-1/2
        scales: list[float] = []
        mup.init.constant_std_init_(twin_params[name],
                                    lambda t, scale=1.0, out=scales: out.append(scale))
        assert sur.hydro.init_mult[name] == pytest.approx(scales[0]), name
    readout = twin.lm_head
    assert list(sur.hydro.multipliers.values()) == [readout.output_mult / readout.width_mult()]
    assert sur.lm_head.weight is sur.wte.weight


@pytest.mark.parametrize("ratio", [2, 4])
def test_same_model_as_the_packages_before_and_after_a_step(ratio):
    target, sur, x = scaled(ratio)
    twin = mup_twin(ratio)
    twin.load_state_dict(sur.state_dict())
    torch.testing.assert_close(sur(x), twin(x), rtol=1e-5, atol=1e-5)
    y = torch.randint(0, VOCAB_SIZE, (2, BLOCK))
    opts = [torch.optim.Adam(param_groups(sur, lr=1e-2)), mup.MuAdam(twin.parameters(), lr=1e-2)]
    for model, opt in zip((sur, twin), opts):
        F.cross_entropy(model(x).reshape(-1, VOCAB_SIZE), y.reshape(-1)).backward()
        opt.step()
    torch.testing.assert_close(sur(x), twin(x), rtol=1e-4, atol=1e-4)
    # and the default layout at these ratios (fewer heads of the target's size) is another model
    default = hydro.scale(target, ratio, example_inputs=(x,), seed=0)
    assert default.hydro.head_decisions != sur.hydro.head_decisions
