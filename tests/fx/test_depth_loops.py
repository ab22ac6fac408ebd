"""Depth cuts of stacks whose loop body lives in the parent's ``forward`` (parallel lists of
sub-layers, a ``ModuleDict`` of blocks), and the warning when ``depth_ratio > 1`` cuts nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydro
from examples.charlm.model import MLP, CausalSelfAttention
from hydro.errors import HydroWarning
from hydro.parametrize import optimizer_multipliers, param_groups

X = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))


class LoopGPT(nn.Module):
    """Sub-layers in parallel lists; the residual adds are the parent's, in one loop body."""

    def __init__(self, n_layer: int = 4, n_embd: int = 32, mult: float = 1.0) -> None:
        super().__init__()
        self.mult = mult  # the hand-made shallow model's residual-branch multiplier
        self.wte = nn.Embedding(50, n_embd)
        self.ln_1 = nn.ModuleList(nn.LayerNorm(n_embd) for _ in range(n_layer))
        self.attn = nn.ModuleList(CausalSelfAttention(n_embd, 4, 0.0) for _ in range(n_layer))
        self.ln_2 = nn.ModuleList(nn.LayerNorm(n_embd) for _ in range(n_layer))
        self.mlp = nn.ModuleList(MLP(n_embd, 0.0) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, 50, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for i in range(len(self.attn)):
            x = x + self.mult * self.attn[i](self.ln_1[i](x))
            x = x + self.mult * self.mlp[i](self.ln_2[i](x))
        return self.head(self.ln_f(x))


class UnevenLoopGPT(LoopGPT):
    """The loop body halves the stream after odd blocks only: the blocks are not alike."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for i in range(len(self.attn)):
            x = x + self.attn[i](self.ln_1[i](x))
            x = x + self.mlp[i](self.ln_2[i](x))
            if i % 2:
                x = x * 0.5
        return self.head(self.ln_f(x))


class Residual(nn.Module):
    """A block without its residual add: the parent adds it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.gelu(self.norm(x)))


class DictNet(nn.Module):
    """A ``ModuleDict`` of blocks, iterated in the parent with the residual add outside."""

    def __init__(self, blocks: int = 4, width: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleDict({f"b{i}": Residual(width) for i in range(blocks)})
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks.values():
            h = h + block(h)
        return self.out(h)


class DenseNet(nn.Module):
    """Every block reads the sum of all earlier outputs: no chain, nothing to cut."""

    def __init__(self, blocks: int = 4, width: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.layers = nn.ModuleList(Residual(width) for _ in range(blocks))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [self.inp(x)]
        for layer in self.layers:
            outs.append(layer(sum(outs)))
        return self.out(sum(outs))


def _loop_gpt(n_layer: int, mult: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    return LoopGPT(n_layer, mult=mult).double()


def test_parallel_lists_are_cut_as_one_loop_body() -> None:
    """(1, 2) of a 4-block LoopGPT at Depth-muP is the 2-block LoopGPT with branches x sqrt 2:
    the same numbers, and the kept items' Adam learning rates x sqrt 2."""
    sur = hydro.scale(_loop_gpt(4), 1, depth_ratio=2, depth_alpha=0.5, example_inputs=(X,))
    stacks = {st.path: st for st in sur.hydro.stacks}
    assert set(stacks) == {"ln_1", "attn", "ln_2", "mlp"}
    for path, st in stacks.items():
        assert st.cut and st.reason is None and st.kept == [f"{path}.0", f"{path}.2"]
        assert sorted(st.siblings) == sorted(set(stacks) - {path})
    assert sur.hydro.depth_multipliers == {"depth_residual.scale": pytest.approx(2**0.5)}
    report = hydro.inspect(_loop_gpt(4), 1, example_inputs=(X,), depth_ratio=2)
    assert ("depth: stack 'mlp' keeps 2 of 4 blocks (mlp.0, mlp.2) (one loop body with 'ln_1', "
            "'attn', 'ln_2'), residual branches x 2") in str(report)
    assert report.to_dict()["stacks"][0]["siblings"] == ["attn", "ln_2", "mlp"]
    ref = _loop_gpt(2, mult=2**0.5)
    state = {k.replace(".2.", ".1."): v for k, v in sur.state_dict().items()}
    ref.load_state_dict(state)  # strict: the same tensors, renumbered
    torch.testing.assert_close(sur(X), ref(X), rtol=1e-12, atol=1e-12)
    # CompleteP's Adam factor (L / L_s)^(1 - alpha) reaches every sibling's kept items
    for name in ("attn.2.c_attn.weight", "ln_1.0.weight", "mlp.2.c_proj.bias"):
        assert optimizer_multipliers(sur.get_parameter(name))[0] == pytest.approx(2**0.5), name
    assert optimizer_multipliers(sur.get_parameter("ln_f.weight"))[0] == 1.0


def test_loop_gpt_width_and_depth_surrogate_matches_the_shallow_one_and_trains() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HydroWarning)  # the width floor at ratio 4
        sur = hydro.scale(_loop_gpt(4).float(), 4, depth_ratio=2, example_inputs=(X,), seed=0)
        shallow = hydro.scale(_loop_gpt(2).float(), 4, example_inputs=(X,), seed=0)
    renumbered = {k.replace(".2.", ".1."): tuple(v.shape) for k, v in sur.state_dict().items()}
    assert renumbered == {k: tuple(v.shape) for k, v in shallow.state_dict().items()}
    opt = torch.optim.Adam(param_groups(sur, lr=3e-3))
    y = torch.roll(X, 1, dims=1)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = F.cross_entropy(sur(X).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_module_dict_with_the_add_in_the_parent_is_cut() -> None:
    torch.manual_seed(0)
    model = DictNet().double()
    x = torch.randn(5, 8, dtype=torch.double)
    sur = hydro.scale(model, 1, depth_ratio=2, example_inputs=(x,))
    (st,) = sur.hydro.stacks
    assert st.path == "blocks" and st.kept == ["blocks.b0", "blocks.b2"] and st.siblings == []
    # by hand, with the surrogate's tensors: the kept blocks, each branch doubled
    missing = model.load_state_dict(sur.state_dict(), strict=False).missing_keys
    assert {k.split(".")[1] for k in missing} == {"b1", "b3"}
    with torch.no_grad():
        h = model.inp(x)
        for key in ("b0", "b2"):
            h = h + 2.0 * model.blocks[key](h)
        want = model.out(h)
    torch.testing.assert_close(sur(x), want, rtol=1e-12, atol=1e-12)


def test_a_depth_ratio_that_cuts_nothing_warns_naming_the_containers() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    with pytest.warns(HydroWarning, match=r"depth_ratio 2 cut no block of DenseNet") as got:
        sur = hydro.scale(DenseNet(), 1, depth_ratio=2, example_inputs=(x,))
    (line,) = [str(w.message) for w in got if "cut no block" in str(w.message)]
    assert (
        "'layers' (4 blocks) left whole: the parent's code between blocks differs from block "
        "to block (train graph)"
    ) in line
    (st,) = sur.hydro.stacks
    assert st.reason is not None and not st.cut
    with pytest.warns(HydroWarning, match="cut no block"):
        report = hydro.inspect(DenseNet(), 1, example_inputs=(x,), depth_ratio=2)
    assert "depth: stack 'layers' (4 blocks) left whole: the parent's code" in str(report)
    with pytest.warns(HydroWarning, match="cut no block of UnevenLoopGPT") as got:
        hydro.scale(UnevenLoopGPT(), 1, depth_ratio=2, example_inputs=(X,))
    (line,) = [str(w.message) for w in got if "cut no block" in str(w.message)]
    assert (
        "cut no block of UnevenLoopGPT, so the surrogate keeps the target's depth: 'ln_1', "
        "'attn', 'ln_2', 'mlp' (4 blocks each) left whole as one loop body: the parent's code "
        "between blocks differs from block to block (train graph). A block is cut"
    ) in line
    with pytest.warns(HydroWarning, match=r"cut no block of Sequential.*no ModuleList"):
        hydro.scale(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), 1,
                    depth_ratio=2, example_inputs=(x,))
    with warnings.catch_warnings():  # a cut, or depth_ratio 1: no such warning
        warnings.simplefilter("error", HydroWarning)
        hydro.scale(DenseNet(), 1, example_inputs=(x,))
        hydro.scale(DictNet(), 1, depth_ratio=2, example_inputs=(x,))
