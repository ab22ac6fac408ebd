"""hydro.scale over the model zoo: shapes, exactness at ratio 1, muP metadata, init, errors."""

from __future__ import annotations

import math

import mup
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydro
from hydro.fx.capture import capture
from hydro.parametrize import optimizer_multipliers
from tests.zoo import ZOO

NAMES = list(ZOO)
_CAPTURED: dict = {}


def zoo(name: str):
    """A zoo case and its capture, made once per test session (capturing is the slow part;
    scaling a ``Captured`` skips it)."""
    if name not in _CAPTURED:
        case = ZOO[name]()
        _CAPTURED[name] = (case, capture(case.model, case.inputs))
    return _CAPTURED[name]


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_ratio_one_is_the_target_bit_for_bit(name):
    case, cap = zoo(name)
    sur = hydro.scale(cap, 1, example_inputs=case.inputs, seed=1)
    assert set(sur.state_dict()) == set(case.model.state_dict())
    sur.load_state_dict(case.model.state_dict())
    # nn.TransformerEncoder's eval-mode fast path is a different kernel; the slow path is the
    # model's own definition, which the surrogate follows
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        for mode in (True, False):
            case.model.train(mode)
            sur.train(mode)
            with torch.no_grad():
                assert torch.equal(sur(*case.inputs), case.model(*case.inputs))
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert not any("mup_readout" in name for name, _ in sur.named_buffers())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ratio", [2, 8])
def test_shapes_and_parameter_count(name, ratio):
    case, cap = zoo(name)
    sur = hydro.scale(cap, ratio, example_inputs=case.inputs, seed=0)
    out_t, out_s = case.model(*case.inputs), sur(*case.inputs)
    assert out_s.shape == out_t.shape
    assert torch.isfinite(out_s).all()
    assert set(sur.state_dict()) == set(case.model.state_dict())
    # hidden matrices shrink by ratio^2, vectors and input/output layers by ratio
    assert n_params(case.model) / n_params(sur) > 0.8 * ratio
    loss = case.loss(out_s, case.target)
    loss.backward()
    assert all(p.grad is not None for p in sur.parameters() if p.requires_grad) or name == "gpt"


@pytest.mark.parametrize("name", NAMES)
def test_infshapes_roles_and_optimizer_multipliers(name):
    ratio = 4
    case, cap = zoo(name)
    sur = hydro.scale(cap, ratio, example_inputs=case.inputs, seed=0)
    roles = sur.hydro.roles
    expected_ninf = {"hidden": 2, "input": 1, "output": 1, "vector": 1, "fixed": 0}
    for pname, p in sur.named_parameters():
        assert hasattr(p, "infshape"), pname
        assert p.infshape.ninf() == expected_ninf[roles[pname]], (pname, roles[pname])
        if p.infshape.ninf():
            # 1/ratio, or between 1/ratio and 1 for a concatenation of width and fixed channels
            assert 1 / ratio - 1e-9 <= p.infshape.width_mult() < 1
        lr_adam, wd_adam = optimizer_multipliers(p, "adam")
        m = p.infshape.width_mult()
        assert (lr_adam, wd_adam) == ((1 / m, m) if roles[pname] == "hidden" else (1, 1))
    # exactly what the mup package's optimizers do
    for kind, cls in (("adam", mup.MuAdam), ("sgd", mup.MuSGD)):
        opt = cls(sur.parameters(), lr=1.0, weight_decay=1.0)
        for group in opt.param_groups:
            for p in group["params"]:
                lr_m, wd_m = optimizer_multipliers(p, kind)
                assert group["lr"] == pytest.approx(lr_m)
                assert group["weight_decay"] == pytest.approx(wd_m)
    # and MuAdam trains a surrogate
    opt = mup.MuAdam(sur.parameters(), lr=1e-3)
    case.loss(sur(*case.inputs), case.target).backward()
    opt.step()


def test_roles_and_readout_multiplier_of_gpt():
    case = ZOO["gpt"]()
    sur = hydro.scale(case.model, 8, example_inputs=case.inputs, seed=0)
    roles = sur.hydro.roles
    assert roles["h.0.attn.c_attn.weight"] == "hidden"
    assert roles["h.0.mlp.2.weight"] == "hidden"
    assert roles["wpe.weight"] == "input"
    assert roles["wte.weight"] == "output"  # tied: also the readout
    assert roles["h.0.ln_1.weight"] == "vector"
    assert sur.lm_head.weight is sur.wte.weight  # tied weights stay tied
    # the readout multiplier is a 0-dim buffer the graph multiplies by (one value per trial when
    # fused); not part of the state_dict, whose keys stay the target's
    assert sur.hydro.multipliers == {"mup_readout.scale": 8.0}
    assert sur.get_buffer("mup_readout.scale").item() == 8.0
    assert "mup_readout.scale" not in sur.state_dict()
    mult = hydro.scale(case.model, 8, example_inputs=case.inputs, output_mult=0.5)
    assert mult.hydro.multipliers == {"mup_readout.scale": 4.0}
    x = case.inputs[0]
    before = mult(x)
    mult.get_buffer("mup_readout.scale").fill_(8.0)  # the multiplier is read at run time
    assert not torch.equal(before, mult(x))


def test_initialization_follows_the_target_by_role():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    nn.init.normal_(model[2].weight, 0.0, 0.02)
    nn.init.zeros_(model[4].weight)
    nn.init.constant_(model[2].bias, 0.3)
    sur = hydro.scale(model, 8, seed=0)
    # hidden: std grows by sqrt(fan-in ratio) = sqrt(8)
    assert sur.get_parameter("2.weight").std().item() == pytest.approx(0.02 * math.sqrt(8), rel=0.1)
    # default Kaiming-uniform input layer: same bound, still uniform
    w0 = sur.get_parameter("0.weight")
    assert w0.abs().max().item() <= 1.02 / math.sqrt(32)  # bound from the sample std
    assert w0.std().item() == pytest.approx(model[0].weight.std().item(), rel=0.1)
    # constants stay constants: a zero readout, a constant bias
    assert torch.count_nonzero(sur.get_parameter("4.weight")) == 0
    assert torch.all(sur.get_parameter("2.bias") == 0.3)


def test_layer_scale_and_norms_keep_their_constants():
    case = ZOO["convnext"]()
    sur = hydro.scale(case.model, 8, example_inputs=case.inputs)
    assert torch.allclose(sur.get_parameter("blocks.0.gamma"), torch.tensor(0.1))
    assert torch.all(sur.get_parameter("blocks.0.norm.weight") == 1)
    assert sur.get_parameter("blocks.0.dwconv.weight").shape == (4, 1, 7, 7)
    convs = [
        n for n in sur.graphs["train"].graph.nodes if n.target is torch.ops.aten.conv2d.default
    ]
    assert convs[1].args[6] == 4  # the depthwise conv's groups follow its channels


class HardCodedAttention(nn.Module):
    """Width-valued literals baked into forward, as in much real code."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.proj = nn.Linear(64, 64)
        self.bias = nn.Parameter(torch.zeros(64))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(64, dim=-1)
        q = q.reshape(B, T, 4, 16).permute(0, 2, 1, 3)
        k = k.reshape(B, T, 4, 16).permute(0, 2, 1, 3)
        v = v.reshape(B, T, 4, 16).permute(0, 2, 1, 3)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, 64)
        return self.proj(y) + self.bias + torch.zeros(64)


@pytest.mark.parametrize("policy, heads, head_dim", [("keep_head_dim", 1, 16),
                                                     ("keep_head_count", 4, 4)])
def test_width_literals_and_head_policy(policy, heads, head_dim):
    model = nn.Sequential(nn.Linear(8, 64), HardCodedAttention(), nn.Linear(64, 3))
    x = torch.randn(2, 5, 8)
    sur = hydro.scale(model, 4, example_inputs=(x,), head_policy=policy)
    assert sur(x).shape == (2, 5, 3)
    assert f"-> {heads} heads x {head_dim}" in sur.hydro.head_decisions[0]
    sdpa = [n for n in sur.graphs["train"].graph.nodes if "scaled_dot_product" in str(n.target)][0]
    if policy == "keep_head_count":  # muP 1/d attention relative to the target's 1/sqrt(16)
        assert sdpa.kwargs["scale"] == pytest.approx(16**-0.5 * 16 / 4)
    else:
        assert "scale" not in sdpa.kwargs


def test_transformer_encoder_heads_scale():
    case = ZOO["encoder"]()
    sur = hydro.scale(case.model, 8, example_inputs=case.inputs)
    # nn.MultiheadAttention is captured as its ops: 8 heads of 8 become 1 head of 8
    assert sur.get_parameter("encoder.layers.0.self_attn.in_proj_weight").shape == (24, 8)
    assert "8 heads x 8 -> 1 heads x 8 (kept the head dim)" in sur.hydro.head_decisions[0]
    assert sur(*case.inputs).shape == (4, 5)


# --- errors ----------------------------------------------------------------------------------


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


class UsesItem(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        return self.fc(x) * float(x.mean())


def test_capture_errors_name_module_line_and_fix():
    model = nn.Sequential(nn.Linear(4, 4), Branchy())
    with pytest.raises(hydro.TraceError) as err:
        hydro.scale(model, 2, example_inputs=(torch.randn(2, 4),))
    msg = str(err.value)
    assert "module '1' (Branchy)" in msg and "test_scaling.py" in msg
    assert "if x.sum() > 0" in msg and "data-dependent control flow" in msg
    assert "torch.where" in msg
    assert isinstance(err.value, ValueError)
    with pytest.raises(hydro.TraceError, match=r"UsesItem.*float\(x.mean\(\)\).*data-dependent"):
        hydro.scale(UsesItem(), 2, example_inputs=(torch.randn(2, 4),))


def test_ratio_that_does_not_divide_suggests_ratios():
    model = nn.Sequential(nn.Linear(4, 48), nn.ReLU(), nn.Linear(48, 2))
    with pytest.raises(hydro.ScaleError, match=r"width 48 of '0.weight' .* not divisible by ratio "
                       r"5. Nearest ratios that divide every width: 4, 6"):
        hydro.scale(model, 5)
    with pytest.raises(hydro.ScaleError, match="positive integer"):
        hydro.scale(model, 0)
    with pytest.raises(hydro.ScaleError, match="positive integer"):
        hydro.scale(model, 2.5)


def test_head_split_that_cannot_scale():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 18)
            self.out = nn.Linear(18, 2)

        def forward(self, x):
            h = self.fc(x).view(-1, 3, 6).softmax(-1).flatten(1)
            return self.out(h)

    with pytest.raises(hydro.ScaleError, match=r"node 'view'.*3 x 6.*cannot shrink"):
        hydro.scale(Odd(), 9)


def test_unknown_module_with_parameters():
    class Bilinear(nn.Module):  # (a GRUCell was the example here until recurrent rules came)
        def __init__(self):
            super().__init__()
            self.mix = nn.Bilinear(4, 4, 8)

        def forward(self, x):
            return self.mix(x, x)

    with pytest.raises(
        hydro.ScaleError, match=r"module 'mix' \(Bilinear\).*'mix.weight'.*no width rule"
    ):
        hydro.scale(Bilinear(), 2, example_inputs=(torch.randn(2, 4),))


def test_head_count_kept_when_the_ratio_does_not_divide_it():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 48)
            self.attn = nn.MultiheadAttention(48, 3, batch_first=True)
            self.out = nn.Linear(48, 4)

        def forward(self, x):
            h = self.inp(x)
            return self.out(self.attn(h, h, h, need_weights=False)[0])

    x = torch.randn(2, 5, 4)
    # 3 heads of 16 at ratio 2: whole heads of 16 do not fit in 24, so 3 heads of 8 (muP 1/d)
    sur = hydro.scale(M(), 2, example_inputs=(x,))
    assert "3 heads x 16 -> 3 heads x 8 (kept the head count" in sur.hydro.head_decisions[0]
    assert sur(x).shape == (2, 5, 4)
    sdpa = next(n for n in sur.graphs["train"].graph.nodes if "scaled_dot" in str(n.target))
    assert sdpa.kwargs["scale"] == pytest.approx(16**-0.5 * 16 / 8)
    sur3 = hydro.scale(M(), 3, example_inputs=(x,))
    assert "3 heads x 16 -> 1 heads x 16 (kept the head dim)" in sur3.hydro.head_decisions[0]


def test_inputs_that_cannot_be_guessed():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 8)

        def forward(self, x, y):
            return self.fc(x * y)

    with pytest.raises(hydro.ScaleError, match="pass example_inputs"):
        hydro.scale(TwoInputs(), 2)


# --- inspect and coord check -----------------------------------------------------------------


def test_inspect_table_and_data():
    case = ZOO["gpt"]()
    report = hydro.inspect(case.model, 8, example_inputs=case.inputs)
    rows = {r.path: r for r in report.rows}
    assert rows["h.0.mlp.0"].role == "hidden"
    assert rows["h.0.mlp.0"].target_shape == (512, 128)
    assert rows["h.0.mlp.0"].surrogate_shape == (64, 16)
    assert rows["h.0.mlp.0"].target_flops == 64 * rows["h.0.mlp.0"].surrogate_flops
    totals = report.totals
    assert totals["target_params"] == sum(r.target_params for r in report.rows)
    assert totals["target_flops"] / totals["surrogate_flops"] > 40
    text = str(report)
    assert "h.0.attn.c_attn" in text and "fewer FLOPs" in text
    assert report.to_dict()["rows"][0]["path"] == report.rows[0].path


# Each zoo model, widened so that ratio 8 still leaves a few dozen channels. The naive model
# must fail the same check where its drift is large enough to tell apart at four steps.
COORD_CASES = [
    ("mlp", {"width": 256}, 1e-2, 1.5, 2.0),
    ("resnet", {"width": 32}, 3e-3, 2.0, None),
    ("gpt", {"n_embd": 256}, 3e-3, 3.0, 3.5),
    ("encoder", {"d_model": 128}, 3e-3, 2.0, None),
    ("convnext", {"dim": 128}, 3e-3, 2.0, 2.3),
    ("mixed", {"width": 64}, 1e-2, 2.5, None),
]


@pytest.mark.parametrize("name, kwargs, lr, mup_max, sp_min", COORD_CASES)
def test_coord_check_holds_with_mup_and_fails_without(name, kwargs, lr, mup_max, sp_min):
    case = ZOO[name](**kwargs)
    args = (case.model, case.inputs, case.target, case.loss)
    muP = hydro.coord_check(*args, ratios=(1, 2, 4, 8), steps=4, lr=lr)
    hidden = muP.hidden_layers()
    assert hidden
    for step in range(muP.steps):
        assert max(muP.spread(layer, step) for layer in hidden) < mup_max, step
    if sp_min is not None:
        naive = hydro.coord_check(*args, ratios=(1, 2, 4, 8), steps=4, lr=lr, parametrization="sp")
        assert max(naive.spread(layer, naive.steps - 1) for layer in hidden) > sp_min


def test_meta_target_costs_no_memory_and_reads_layer_defaults():
    from tests.zoo import GPT, ConvNeXt

    with torch.device("meta"):
        target = GPT()
    sur = hydro.scale(target, 8, example_inputs=(torch.zeros(2, 16, dtype=torch.long),))
    assert all(p.device.type == "cpu" for p in sur.parameters())
    # Linear's default init at the *target* fan-in (128), by the muP rules: hidden bias as is
    bias = sur.get_parameter("h.0.mlp.0.bias")
    # (redrawn from the layer's sample statistics, so the bound holds up to sampling error)
    assert 0.5 / math.sqrt(128) < bias.abs().max().item() <= 1.1 / math.sqrt(128)
    assert sur(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 65)
    with torch.device("meta"):
        convnext = ConvNeXt()
    with pytest.warns(UserWarning, match=r"raw parameters blocks.0.gamma, blocks.1.gamma"):
        hydro.scale(convnext, 8, example_inputs=(torch.zeros(2, 3, 8, 8),))
