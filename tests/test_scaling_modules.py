"""A surrogate is still a module: the user's submodule classes at the user's names, with the
surrogate's widths, and forward hooks that fire with the activations of each call.

:func:`hook_calls` / :func:`assert_hooks_as_model` are also run on every real model by
``tests/fx/test_capture.py`` (where those models are scaled anyway).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

import hydro
from examples.charlm.model import gpt
from hydro.fusion import fuse
from hydro.parametrize import param_groups

X = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))


def hook_calls(model: nn.Module, *args: Any, **kwargs: Any) -> dict[str, list[dict]]:
    """Run ``model`` once with a plain forward hook on every submodule: per name, one record
    per call (its tensor inputs and outputs, and whether it returned its input unchanged)."""
    calls: dict[str, list[dict]] = {}
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(mod: nn.Module, inputs: tuple, output: Any, name: str = name) -> None:
            outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
            ins = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
            same = len(ins) == 1 and len(outs) == 1 and outs[0] is ins[0]
            outs = [t.detach() for t in outs]
            calls.setdefault(name, []).append({"in": ins, "out": outs, "identity": same})

        handles.append(module.register_forward_hook(hook))
    try:
        model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls


def assert_hooks_as_model(
    model: nn.Module, sur: nn.Module, args: tuple, kwargs: dict, exact: bool
) -> None:
    """Every submodule the model calls is called as often in ``sur`` and its hooks fire there
    (with bit-identical outputs where ``exact``: a ratio-1 surrogate holding the model's
    weights). Pass-through calls (``nn.Identity``) compute nothing in a graph: exempt."""
    want, got = hook_calls(model, *args, **kwargs), hook_calls(sur, *args, **kwargs)
    assert set(got) <= set(want), sorted(set(got) - set(want))
    for name, calls in want.items():
        if all(c["identity"] for c in calls) and name not in got:
            continue
        kind = type(model.get_submodule(name)).__name__
        assert name in got, f"hooks of {name!r} ({kind}) never fired"
        assert len(got[name]) == len(calls), (name, len(got[name]), len(calls))
        assert type(sur.get_submodule(name)) is type(model.get_submodule(name)), name
        for mine, theirs in zip(got[name], calls):
            assert mine["in"] and mine["out"], name
            if exact:  # the call's outputs the model reads (BERT's pooled output, not its
                # unread last hidden state), each one of the module's outputs bit for bit
                assert all(any(torch.equal(a, b) for b in theirs["out"]) for a in mine["out"])


class _Net(nn.Module):
    """Embedding, a module called twice, a norm, an activation module, a conv."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.mix = nn.Linear(d, d)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.out = nn.Linear(d, 7)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = self.mix(self.act(self.mix(h)))  # one Linear, two calls
        h = self.norm(h)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.out(h.mean(1))


def test_surrogate_submodules_are_the_users_classes_at_the_surrogates_widths() -> None:
    torch.manual_seed(0)
    model = _Net()
    sur = hydro.scale(model, 4, example_inputs=(X,), seed=0)
    names = [n for n, _ in model.named_modules()]
    assert [n for n, _ in sur.named_modules() if n in names] == names
    for name, module in model.named_modules():
        if name:
            assert type(sur.get_submodule(name)) is type(module), name
    assert (sur.mix.in_features, sur.mix.out_features) == (16, 16)
    assert sur.mix.weight is sur.get_parameter("mix.weight") and sur.mix.weight.shape == (16, 16)
    assert (sur.out.in_features, sur.out.out_features) == (16, 7)
    assert (sur.emb.num_embeddings, sur.emb.embedding_dim) == (50, 16)
    assert (sur.conv.in_channels, sur.conv.out_channels, sur.conv.kernel_size) == (16, 16, (3,))
    assert sur.norm.normalized_shape == (16,)
    # keep_head_dim: 4 heads of 16 -> 1 head of 16
    assert (sur.attn.embed_dim, sur.attn.num_heads, sur.attn.head_dim) == (16, 1, 16)
    assert model.mix.in_features == 64 and model.attn.num_heads == 4  # the model is untouched
    assert not model.mix._forward_hooks and sur.state_dict().keys() == model.state_dict().keys()


def test_hooks_see_exactly_each_calls_activations() -> None:
    torch.manual_seed(0)
    model = _Net().double()
    one = hydro.scale(model, 1, example_inputs=(X,), seed=0)
    one.load_state_dict(model.state_dict())
    for mode in (False, True):
        model.train(mode), one.train(mode)
        assert_hooks_as_model(model, one, (X,), {}, exact=True)
    calls = hook_calls(one, X)
    assert len(calls["mix"]) == 2 and len(calls["act"]) == 1
    assert torch.equal(calls["act"][0]["out"][0], calls["mix"][1]["in"][0])  # GELU feeds mix
    # a hook that returns a value replaces the output, as on the model; pre-hooks see inputs
    seen = []
    for m in (model, one):
        m.mix.register_forward_hook(lambda mod, i, o: o * 2)
        m.norm.register_forward_pre_hook(lambda mod, i: seen.append(i[0].shape))
    torch.manual_seed(0)
    want = model(X)
    torch.manual_seed(0)
    assert torch.equal(one(X), want)
    assert seen == [(2, 16, 64)] * 2
    # the hooked run is only taken while a hook exists: the graph's own code otherwise
    for m in (model, one):
        m.mix._forward_hooks.clear(), m.norm._forward_pre_hooks.clear()
    assert torch.equal(one(X), model(X))


def test_fused_trials_are_module_trees_whose_hooks_fire() -> None:
    torch.manual_seed(0)
    model = gpt(n_layer=2, n_head=4, n_embd=32, block_size=16)
    sur = hydro.scale(model, 2, example_inputs=(X,), seed=0)
    fused = fuse(sur, n=2)
    trial = fused.trial(1)
    assert [n for n, _ in trial.named_modules()] == [n for n, _ in sur.named_modules()]
    assert all(type(trial.get_submodule(n)) is type(m) for n, m in sur.named_modules() if n)
    assert trial.h[0].attn.n_head == 2 and trial.lm_head.in_features == 16
    fused.eval(), trial.eval()
    calls = hook_calls(trial, X)
    want = {n for n, m in model.named_modules() if n and not isinstance(m, nn.ModuleList)}
    assert want <= set(calls), sorted(want - set(calls))
    assert torch.equal(calls["lm_head"][0]["out"][0], trial(X))
    torch.testing.assert_close(trial(X), fused(X)[1], rtol=0, atol=1e-6)


def _coord(model: nn.Module, x: torch.Tensor, y: torch.Tensor, ratio: int, kind: str) -> dict:
    """Mean |activation| of each Linear after 4 Adam steps, recorded by plain forward hooks."""
    sur = hydro.scale(model, ratio, example_inputs=(x,), seed=0, parametrization=kind)
    sizes: dict[str, float] = {}
    for name, module in sur.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(
                lambda m, i, o, name=name: sizes.__setitem__(name, o.detach().abs().mean().item())
            )
    opt = torch.optim.Adam(param_groups(sur, lr=0.02, kind="adam"))
    for _ in range(4):
        opt.zero_grad()
        F.cross_entropy(sur(x), y).backward()
        opt.step()
    sur(x)
    return sizes


def test_coordinate_check_with_plain_forward_hooks() -> None:
    torch.manual_seed(0)
    width = 512
    model = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 5)).double()
    x = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 5, (32,), generator=torch.Generator().manual_seed(2))
    ratios = (1, 8, 64)  # widths 512, 64, 8
    mup = {r: _coord(model, x, y, r, "mup") for r in ratios}
    sp = {r: _coord(model, x, y, r, "sp") for r in ratios}
    assert set(mup[1]) == {"0", "2", "4"}

    def spread(sizes: dict, layer: str) -> float:
        values = [sizes[r][layer] for r in ratios]
        return max(values) / min(values)

    for layer in ("0", "2", "4"):  # muP: every layer's coordinates stay O(1) across widths
        assert spread(mup, layer) < 2.0, (layer, [mup[r][layer] for r in ratios])
    # the naively narrowed model's output grows with width (its updates do not shrink with it)
    assert sp[1]["4"] > 3 * sp[64]["4"], [sp[r]["4"] for r in ratios]
    assert spread(sp, "4") > 3 * spread(mup, "4")
