"""Depth-scaled surrogates: ``hydro.scale(..., depth_ratio=k)`` keeps every k-th block."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydro
import hydro.optim
from examples.charlm.model import Block, gpt
from hydro.errors import HydroWarning, ScaleError
from hydro.fusion import fuse, trial_loss
from hydro.fx import depth
from hydro.fx.capture import capture
from hydro.parametrize import optimizer_multipliers, param_groups
from tests.real_models import build, timm_available

X = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))


def _gpt(n_layer: int = 8, n_embd: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return gpt(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=16)


def test_depth_ratio_1_is_todays_surrogate_bit_for_bit() -> None:
    model = _gpt(4)
    a = hydro.scale(model, 4, example_inputs=(X,), seed=3)
    b = hydro.scale(model, 4, example_inputs=(X,), seed=3, depth_ratio=1, depth_alpha=0.5)
    assert a.graphs["train"].code == b.graphs["train"].code
    assert a.graphs["eval"].code == b.graphs["eval"].code
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert dict(a.named_buffers()).keys() == dict(b.named_buffers()).keys()
    assert torch.equal(a(X), b(X))
    assert b.hydro.depth_multipliers == {} and b.hydro.stacks == []
    assert all(optimizer_multipliers(p) == optimizer_multipliers(q)
               for p, q in zip(a.parameters(), b.parameters()))


def test_8_4_surrogate_keeps_two_blocks_with_multiplier_4() -> None:
    sur = hydro.scale(_gpt(8), 8, depth_ratio=4, example_inputs=(X,), seed=0)
    (stack,) = sur.hydro.stacks
    assert stack.path == "h" and stack.kept == ["h.0", "h.4"] and stack.reason is None
    assert {k.split(".")[1] for k in sur.state_dict() if k.startswith("h.")} == {"0", "4"}
    assert sur.hydro.depth_multipliers == {"depth_residual.scale": 4.0}
    assert sur.get_buffer("depth_residual.scale").item() == 4.0
    assert "depth_residual.scale" not in sur.state_dict()  # non-persistent, like mup_readout
    # as many parameters as the width-8 surrogate of the 2-block model
    shallow = hydro.scale(_gpt(2), 8, example_inputs=(X,), seed=0)
    assert [p.shape for p in sur.parameters()] == [p.shape for p in shallow.parameters()]
    assert sur(torch.randint(0, 50, (5, 16))).shape == (5, 16, shallow.get_parameter(
        "lm_head.weight").shape[0])
    # two residual adds per kept block, each branch multiplied by the buffer
    muls = [n for n in sur.graphs["train"].graph.nodes
            if n.target is torch.ops.aten.mul.Tensor and any(
                a.op == "get_attr" and a.target == "depth_residual.scale"
                for a in n.args if isinstance(a, torch.fx.Node))]
    assert len(muls) == 4


class _ScaledBlock(Block):
    mult = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mult * self.attn(self.ln_1(x))
        return x + self.mult * self.mlp(self.ln_2(x))


def test_cut_model_computes_the_shallow_model_with_scaled_branches() -> None:
    """At width ratio 1 the (1, 2) surrogate of a 4-block GPT is the 2-block GPT with branches
    x (4/2)^alpha, and with alpha = 1/2 the blocks' Adam learning rates x 2^(1/2)."""
    model = _gpt(4).double()
    x = torch.randint(0, 50, (3, 16))
    for alpha in (1.0, 0.5):
        sur = hydro.scale(model, 1, depth_ratio=2, depth_alpha=alpha, example_inputs=(X,))
        assert sur.hydro.stacks[0].kept == ["h.0", "h.2"]
        ref = _gpt(2).double()
        for b in ref.h:
            b.__class__ = _ScaledBlock
            b.mult = 2.0**alpha
        state = {k.replace("h.2.", "h.1."): v for k, v in sur.state_dict().items()}
        ref.load_state_dict(state)
        torch.testing.assert_close(sur.eval()(x), ref.eval()(x), rtol=1e-12, atol=1e-12)
        # CompleteP: Adam lr x (L / L_s)^(1 - alpha) inside the kept blocks, no depth factor
        # on the weight decay
        f = 2.0 ** (1 - alpha)
        assert optimizer_multipliers(sur.get_parameter("h.2.attn.c_attn.weight")) == (f, 1.0)
        assert optimizer_multipliers(sur.get_parameter("h.0.ln_1.weight")) == (f, 1.0)
        assert optimizer_multipliers(sur.get_parameter("ln_f.weight")) == (1.0, 1.0)
        assert optimizer_multipliers(sur.get_parameter("h.0.ln_1.weight"), "sgd") == (1.0, 1.0)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_adam_rules_are_completep_relative_to_the_target(alpha: float) -> None:
    """Every parameter's (lr, weight decay) multipliers at (8, 4), against CompleteP's rules
    written out with the target as the base (m_N = 1/8, m_L = 2/8): hidden weights lr
    m_N^-1 m_L^(alpha-1), weight decay m_N (no depth factor); the blocks' biases and norm
    gains lr m_L^(alpha-1); embeddings and the final norm untouched."""
    sur = hydro.scale(_gpt(8, 64), 8, depth_ratio=4, depth_alpha=alpha, example_inputs=(X,))
    assert sur.hydro.depth_multipliers == {"depth_residual.scale": 4.0**alpha}
    m_n, m_l = 1 / 8, 2 / 8
    for name, p in sur.named_parameters():
        in_block = name.startswith(("h.0.", "h.4."))
        hidden = in_block and p.dim() == 2
        lr = (1 / m_n if hidden else 1.0) * (m_l ** (alpha - 1) if in_block else 1.0)
        wd = m_n if hidden else 1.0
        got = optimizer_multipliers(p)
        assert got == pytest.approx((lr, wd), rel=1e-12), name
    # the per-step decay of a hidden weight: width-invariant, and only at alpha = 1 depth-invariant
    fc = sur.get_parameter("h.4.mlp.c_fc.weight")
    (group,) = [g for g in param_groups(sur, lr=1e-3, weight_decay=0.1)
                if any(p is fc for p in g["params"])]
    assert group["lr"] * group["weight_decay"] == pytest.approx(1e-4 * 4.0 ** (1 - alpha))


def _stacks(name: str, k: int = 2) -> tuple[list[depth.Stack], nn.Module, object]:
    model, make = build(name)
    args, kwargs = make(2, torch.Generator().manual_seed(0))
    cap = capture(model, args, kwargs, modes=("train",))
    cut, plan = depth.cut(cap, model, k)
    return plan.stacks, cut, (model, args, kwargs)


@pytest.mark.parametrize(
    ("name", "path"),
    [("nanogpt", "transformer.h"), ("hf_gpt2", "transformer.h"), ("hf_llama", "model.layers"),
     ("hf_bert", "bert.encoder.layer"), ("encoder_batch_first", "encoder.layers")],
)
def test_stack_detection_on_real_models(name: str, path: str) -> None:
    stacks, cut, (model, args, kwargs) = _stacks(name)
    (stack,) = stacks
    assert stack.path == path and stack.reason is None
    assert stack.kept == [f"{path}.0"] and stack.multiplier == 2.0
    assert not any(k.startswith(f"{path}.1.") for k in cut.state_dict())
    assert any(k.startswith(f"{path}.0.") for k in cut.state_dict())
    out = cut(*args, **kwargs)  # runs without the removed block
    if name == "nanogpt":  # and is the model without it (multipliers come with hydro.scale)
        model.transformer.h = nn.ModuleList(model.transformer.h[:1])
        ref = model.train()(*args, **kwargs)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.skipif(not timm_available(), reason="timm cannot import torchvision here")
def test_resnet18_cuts_the_uniform_stage_only() -> None:
    stacks, cut, (model, args, kwargs) = _stacks("timm_resnet18")
    by_path = {s.path: s for s in stacks}
    assert set(by_path) == {"layer1", "layer2", "layer3", "layer4"}
    assert by_path["layer1"].reason is None and by_path["layer1"].kept == ["layer1.0"]
    for p in ("layer2", "layer3", "layer4"):  # the first block of each downsamples
        assert by_path[p].reason == "blocks of different parameter shapes"
        assert by_path[p].kept == by_path[p].blocks
    assert cut(*args, **kwargs).shape == (2, 7)


class _Stages(nn.Module):
    """Two torchvision-style stages: each opens with a block that changes the shape (stride 2,
    twice the channels), then ``tail`` identical blocks."""

    def __init__(self, width: int = 8, tail: int = 4) -> None:
        super().__init__()
        from examples.cnn.model import ResidualBlock

        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.layer1 = nn.Sequential(
            ResidualBlock(width, 2 * width, stride=2),
            *(ResidualBlock(2 * width, 2 * width) for _ in range(tail)),
        )
        self.layer2 = nn.Sequential(
            ResidualBlock(2 * width, 4 * width, stride=2),
            *(ResidualBlock(4 * width, 4 * width) for _ in range(3)),
        )
        self.head = nn.Linear(4 * width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer2(self.layer1(self.stem(x))).mean((2, 3)))


def test_a_stage_whose_first_block_differs_cuts_its_identical_tail() -> None:
    torch.manual_seed(0)
    model = _Stages()
    x = torch.randn(2, 3, 16, 16)
    cut, plan = depth.cut(capture(model, (x,), modes=("train",)), model, 2)
    by_path = {s.path: s for s in plan.stacks}
    one, two = by_path["layer1"], by_path["layer2"]
    assert one.head == ["layer1.0"] and one.blocks == [f"layer1.{i}" for i in (1, 2, 3, 4)]
    assert one.reason is None and one.kept == ["layer1.1", "layer1.3"] and one.multiplier == 2.0
    assert two.head == ["layer2.0"] and two.kept == ["layer2.1", "layer2.3"]
    assert two.multiplier == 1.5  # 3 blocks, 2 kept
    assert any(k.startswith("layer1.0.shortcut.") for k in cut.state_dict())
    assert not any(k.startswith(("layer1.2.", "layer1.4.", "layer2.2.")) for k in cut.state_dict())
    # the cut graph is the model without those blocks (multipliers come with hydro.scale)
    model.layer1 = nn.Sequential(*(model.layer1[i] for i in (0, 1, 3)))
    model.layer2 = nn.Sequential(*(model.layer2[i] for i in (0, 1, 3)))
    assert torch.equal(cut(x), model.train()(x))


def test_scale_and_inspect_name_the_head_of_a_cut_stage() -> None:
    torch.manual_seed(0)
    model, x = _Stages(tail=2), torch.randn(2, 3, 16, 16)
    sur = hydro.scale(model, ratio=2, depth_ratio=2, example_inputs=(x,))
    assert sur(x).shape == (2, 5)
    report = str(hydro.inspect(model, ratio=2, depth_ratio=2, example_inputs=(x,)))
    assert ("depth: stack 'layer1' keeps 1 of 2 blocks (layer1.1) after layer1.0 (another "
            "shape, kept as is), residual branches x 2") in report
    stacks = hydro.inspect(model, ratio=2, depth_ratio=2, example_inputs=(x,)).to_dict()["stacks"]
    assert {s["path"]: s["head"] for s in stacks} == {"layer1": ["layer1.0"],
                                                      "layer2": ["layer2.0"]}


@pytest.mark.skipif(not timm_available(), reason="timm cannot import torchvision here")
def test_timm_resnet34_cuts_the_tail_of_every_stage() -> None:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("resnet34", num_classes=7)
    x = torch.randn(2, 3, 32, 32)
    cut, plan = depth.cut(capture(model, (x,), modes=("train",)), model, 2)
    tails = {s.path: (s.head, len(s.blocks), len(s.kept), s.reason) for s in plan.stacks}
    assert tails == {"layer1": ([], 3, 2, None), "layer2": (["layer2.0"], 3, 2, None),
                     "layer3": (["layer3.0"], 5, 3, None),
                     "layer4": (["layer4.0"], 2, 1, None)}
    assert cut(x).shape == (2, 7)


class _Res(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


class _Plain(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _Toy(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(8, d)
        self.blocks = nn.ModuleList(_Res(d) for _ in range(6))
        self.mlp = nn.Sequential(_Plain(d), _Plain(d))  # no residual add
        self.tail = nn.ModuleList([_Res(d)])  # one block
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        x = self.tail[0](self.mlp(x))
        return self.head(x)


def test_inspect_names_cut_and_left_whole_stacks() -> None:
    report = hydro.inspect(_Toy(), 4, depth_ratio=4, example_inputs=(torch.randn(2, 8),))
    text = str(report)
    assert "stack 'blocks' keeps 2 of 6 blocks (blocks.0, blocks.4), residual branches x 3" in text
    assert "stack 'mlp' (2 blocks) left whole: no residual add in mlp.0" in text
    assert "stack 'tail' (1 blocks) left whole: one block" in text
    assert "depth multiplier depth_residual.scale = 3" in text
    rows = {r.path: r for r in report.rows}
    assert rows["blocks.1.fc"].surrogate_params == 0 and rows["blocks.1.fc"].target_flops > 0
    assert rows["blocks.1.fc"].target_flops == rows["blocks.0.fc"].target_flops
    data = report.to_dict()
    assert [s["left_whole"] for s in data["stacks"]][1:] == [
        "no residual add in mlp.0 (an add of the block's input and a branch computed from it) "
        "(train graph)", "one block"]


def test_fused_depth_cut_surrogate_trains_like_separate_ones() -> None:
    torch.manual_seed(0)
    model = gpt(n_layer=4, n_head=2, n_embd=32, block_size=16).double()
    sur = hydro.scale(model, 2, depth_ratio=2, depth_alpha=0.5, example_inputs=(X,), seed=0)
    fused = fuse(sur, n=2, seed=1)
    members = [fused.trial(k) for k in range(2)]
    lrs = [1e-3, 4e-3]
    opts = [torch.optim.AdamW(param_groups(m, lr=lr, weight_decay=0.1)) for m, lr in
            zip(members, lrs)]
    fused_opt = hydro.optim.AdamW(fused.parameters(), lr=lrs, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 50, (3, 16), generator=g)
        y = torch.randint(0, 50, (3, 16), generator=g)
        losses = []
        for m, o in zip(members, opts):
            o.zero_grad()
            loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
            loss.backward()
            o.step()
            losses.append(loss.detach())
        fused_opt.zero_grad()
        out = fused(x)
        fl = trial_loss(F.cross_entropy, out.flatten(1, 2), y.flatten())
        fl.sum().backward()
        fused_opt.step()
        torch.testing.assert_close(fl.detach(), torch.stack(losses), rtol=1e-9, atol=0)
    fp = dict(fused.named_parameters())
    for k, m in enumerate(members):
        for name, p in m.named_parameters():
            torch.testing.assert_close(fp[name][k], p, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4", None])
def test_bad_depth_ratio_is_a_clear_error(bad: object) -> None:
    with pytest.raises(ScaleError, match="depth_ratio must be a positive integer"):
        hydro.scale(_gpt(2), 4, depth_ratio=bad, example_inputs=(X,))


@pytest.mark.parametrize("bad", [1.5, -0.5, "1", math.nan])
def test_bad_depth_alpha_is_a_clear_error(bad: object) -> None:
    with pytest.raises(ScaleError, match="depth_alpha must be a number in"):
        hydro.scale(_gpt(2), 4, depth_ratio=2, depth_alpha=bad, example_inputs=(X,))


def test_a_deep_completep_cut_warns_and_names_the_remedy() -> None:
    with pytest.warns(
        HydroWarning, match=r"depth_ratio 4 keeps 2 of 8 blocks of 'h'.*depth_alpha=0.5"
    ):
        hydro.scale(_gpt(8), 8, depth_ratio=4, example_inputs=(X,), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HydroWarning)
        warnings.filterwarnings("ignore", message="ratio .* below the width")  # the width floor
        hydro.scale(_gpt(8), 8, depth_ratio=4, depth_alpha=0.5, example_inputs=(X,), seed=0)
        hydro.scale(_gpt(8), 8, depth_ratio=2, example_inputs=(X,), seed=0)
