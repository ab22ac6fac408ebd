"""Trials in and out of a fused model, muP multipliers, dropout, schedulers, clipping, errors."""

from __future__ import annotations

import copy
import logging

import mup
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydro.optim
from hydro.errors import FuseError
from hydro.fusion import FusedModel, fuse, trial_loss
from tests.fusion.exactness import build, train_and_compare
from tests.zoo import MLP, ZOO


def test_trial_and_load_trial_round_trip() -> None:
    run, cases = build("resnet", 3, "sgd", width=8, batch=4)
    train_and_compare(run, cases, steps=2)
    original_keys = list(cases[0].model.state_dict())
    x = cases[0].inputs[0].double()
    run.fused.eval()
    out = run.fused(x)
    for k in range(3):
        module = run.fused.trial(k)
        assert type(module) is type(cases[0].model)
        assert list(module.state_dict()) == original_keys
        for name, value in module.state_dict().items():
            assert torch.equal(value, run.fused.state_dict()[name][k]), name
        assert torch.equal(module(x), run.models[k].eval()(x)) or torch.allclose(
            module(x), out[k], rtol=1e-12, atol=1e-12
        )
    # Write trial 2 into slot 0: slot 0 now behaves exactly like trial 2.
    run.fused.load_trial(0, run.fused.trial(2))
    for name, value in run.fused.state_dict().items():
        if name not in ("diverged", "trial_seed", "trial_step"):  # the slot's own stream
            assert torch.equal(value[0], value[2]), name


def test_select_keeps_training_in_step() -> None:
    sched = (
        lambda o, k: torch.optim.lr_scheduler.StepLR(o, step_size=1 + k, gamma=0.5),
        lambda o: hydro.optim.lr_scheduler.StepLR(o, step_size=[1, 2, 3, 4], gamma=0.5),
    )
    run, cases = build("resnet", 4, "adamw", width=8, batch=4, schedule=sched)
    train_and_compare(run, cases, steps=2, shared=False)
    keep = [3, 1]
    selected = run.fused.select(keep)
    assert selected is run.fused and run.fused.n == 2
    run.fused_opt.select(keep)
    run.models = [run.models[i] for i in keep]
    run.opts = [run.opts[i] for i in keep]
    run.scheds = [run.scheds[i] for i in keep]
    run.live = {}
    train_and_compare(run, [cases[i] for i in keep], steps=2, shared=False)


def test_fuse_n_initializations() -> None:
    torch.manual_seed(0)
    model = MLP(width=64)
    fused = fuse(model, n=4)
    w = fused.get_parameter("hidden.1.weight")
    assert torch.equal(w[0], model.hidden[1].weight)
    for k in range(1, 4):
        assert not torch.equal(w[k], w[0])
        # Same init scale as the original tensor.
        assert torch.allclose(w[k].std(), w[0].std(), rtol=1e-5)
    x = torch.randn(5, 16)
    assert fused(x).shape == (4, 5, 10)
    torch.testing.assert_close(fused(x)[0], model(x))


def surrogate_like(case) -> nn.Module:
    """An MLP carrying mup infshapes against a 8x wider base, as a Hydro surrogate does."""
    mup.set_base_shapes(case.model, MLP(width=256), rescale_params=False, do_assert=False)
    return case.model


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_mup_multipliers_match_torch_with_param_groups(opt: str) -> None:
    run, cases = build("mlp", 3, opt, make_model=surrogate_like, width=32, batch=8)
    from hydro.parametrize import optimizer_multipliers

    p = run.fused.get_parameter("hidden.1.weight")
    assert optimizer_multipliers(p, "adam") == (8.0, 0.125)  # the fused parameter kept infshape
    train_and_compare(run, cases, steps=3)
    t = run.fused.trial(1)
    assert t.hidden[1].weight.infshape.width_mult() == 0.125


def test_dropout_masks_independent_with_per_trial_rate() -> None:
    rates = [0.1, 0.5, 0.5, 0.9]
    models = [nn.Sequential(nn.Linear(4, 4), nn.Dropout(p)) for p in rates]
    fused = fuse(models)
    x = torch.randn(4000, 4)
    out = fused(x)
    clean = torch.stack([m[0](x) for m in models])
    dropped = (out == 0) & (clean != 0)
    for k, p in enumerate(rates):
        assert abs(dropped[k].float().mean().item() - p) < 0.03
        kept = ~dropped[k]
        torch.testing.assert_close(out[k][kept], clean[k][kept] / (1 - p))
    assert not torch.equal(dropped[1], dropped[2])  # same rate, independent masks
    assert fused.trial(3)[1].p == 0.9
    fused.load_trial(0, nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3)))
    assert fused.trial(0)[1].p == 0.3
    fused.load_trial(0, models[0])
    fused.eval()
    torch.testing.assert_close(fused(x), clean)
    # One rate for all trials: the plain path, still independent masks.
    same = fuse([nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)) for _ in range(2)])
    y = same(x)
    assert not torch.equal(y[0] == 0, y[1] == 0)


SCHEDULES = {
    "step": (
        lambda o, k: torch.optim.lr_scheduler.StepLR(
            o, step_size=[1, 2, 3][k], gamma=[0.5, 0.1, 0.9][k]
        ),
        lambda o: hydro.optim.lr_scheduler.StepLR(o, step_size=[1, 2, 3], gamma=[0.5, 0.1, 0.9]),
    ),
    "multistep": (
        lambda o, k: torch.optim.lr_scheduler.MultiStepLR(o, [[1, 3], [2], [1, 2]][k], gamma=0.3),
        lambda o: hydro.optim.lr_scheduler.MultiStepLR(o, [[1, 3], [2], [1, 2]], gamma=0.3),
    ),
    "exponential": (
        lambda o, k: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9 - 0.1 * k),
        lambda o: hydro.optim.lr_scheduler.ExponentialLR(o, gamma=[0.9, 0.8, 0.7]),
    ),
    "cosine": (
        lambda o, k: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=3 + k, eta_min=1e-4 * k),
        lambda o: hydro.optim.lr_scheduler.CosineAnnealingLR(o, [3, 4, 5], [0.0, 1e-4, 2e-4]),
    ),
    "warmup_then_cosine": (
        lambda o, k: torch.optim.lr_scheduler.SequentialLR(
            o,
            [
                torch.optim.lr_scheduler.LinearLR(
                    o, start_factor=[0.1, 0.2, 0.3][k], total_iters=2
                ),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
            ],
            milestones=[2],
        ),
        lambda o: hydro.optim.lr_scheduler.SequentialLR(
            o,
            [
                hydro.optim.lr_scheduler.LinearLR(o, start_factor=[0.1, 0.2, 0.3], total_iters=2),
                hydro.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
            ],
            milestones=[2],
        ),
    ),
    "onecycle": (
        lambda o, k: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.01 * (k + 1), total_steps=6),
        lambda o: hydro.optim.lr_scheduler.OneCycleLR(o, max_lr=[0.01, 0.02, 0.03], total_steps=6),
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_schedulers_match_torch(name: str, opt: str) -> None:
    run, cases = build("mlp", 3, opt, schedule=SCHEDULES[name], width=16, batch=4)
    train_and_compare(run, cases, steps=5)


def test_per_trial_gradient_clipping() -> None:
    run, cases = build("resnet", 3, "sgd", width=8, batch=4)
    train_and_compare(run, cases, steps=3, clip=[0.01, 0.5, 1e6])


def test_isolation_nan_trial_leaves_others_bit_identical() -> None:
    def training(inject: bool) -> tuple[FusedModel, torch.optim.Optimizer, list]:
        cases = [ZOO["resnet"](width=8, batch=4, seed=k) for k in range(3)]
        fused = fuse([c.model.double() for c in cases])
        opt = hydro.optim.AdamW(fused.parameters(), lr=[1e-3, 2e-3, 3e-3], weight_decay=0.1)
        history = []
        for step in range(4):
            if inject and step == 2:
                with torch.no_grad():
                    fused.get_parameter("stem.weight")[1, 0, 0, 0] = float("nan")
            opt.zero_grad()
            losses = trial_loss(
                F.cross_entropy, fused(cases[0].inputs[0].double()), cases[0].target
            )
            losses.sum().backward()
            opt.step()
            history.append(copy.deepcopy((fused.state_dict(), opt.state_dict()["state"])))
        return fused, opt, history

    clean, _, clean_hist = training(False)
    broken, _, broken_hist = training(True)
    assert clean.diverged.tolist() == [False, False, False]
    assert broken.diverged.tolist() == [False, True, False]
    for (sd_a, st_a), (sd_b, st_b) in zip(clean_hist, broken_hist):
        for name in sd_a:
            if name != "diverged":
                for k in (0, 2):
                    assert torch.equal(sd_a[name][k], sd_b[name][k]), name
        for i in st_a:
            for key in st_a[i]:
                for k in (0, 2):
                    assert torch.equal(st_a[i][key][k], st_b[i][key][k]), key
    # The diverged trial is frozen: nothing of it changes after the step it diverged.
    sd_2, sd_3 = broken_hist[2][0], broken_hist[3][0]
    for name in sd_2:
        a, b = sd_2[name][1], sd_3[name][1]
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), name


def test_per_trial_parameter_op_falls_back_to_vmap(caplog) -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 5))
            self.bil = nn.Bilinear(3, 3, 2)  # aten.bilinear has no fused form -> vmap

        def forward(self, x):
            h = x @ self.w.t()  # .t() of a per-trial weight, then a matmul: fused
            return self.bil(h, h)

    models = [Odd().double() for _ in range(3)]
    fused = fuse([copy.deepcopy(m) for m in models])
    x = torch.randn(7, 5, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="hydro.fusion"):
        out = fused(x)
    warned = [r.getMessage() for r in caplog.records if "vmap" in r.getMessage()]
    assert len(warned) == 1 and "node 'bilinear'" in warned[0]
    assert fused.fallbacks == ["bilinear (aten.bilinear.default)"]
    for k, m in enumerate(models):
        torch.testing.assert_close(out[k], m(x), rtol=1e-12, atol=1e-12)


def test_fuse_errors_name_the_node() -> None:
    # (a batch statistic, h - h.mean(0), was refused here; it now runs per trial:
    # tests/fusion/test_batch_mixing.py)
    class Pick(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)[1:]  # drops a sample: along the batch

    with pytest.raises(FuseError, match="slice"):
        fuse([Pick(), Pick()])(torch.randn(3, 4))
    with pytest.raises(FuseError):
        fuse([MLP(width=16), MLP(width=32)])


def test_dtype_conversion_after_fusing() -> None:
    cases = [ZOO["convnext"](dim=16, batch=2, seed=k) for k in range(2)]
    fused = fuse([c.model for c in cases])
    x = cases[0].inputs[0]
    fused(x)  # build the float32 graph first: .double() must invalidate it
    fused.double()
    out = fused(x.double())
    assert out.dtype == torch.float64
    for k, c in enumerate(cases):
        torch.testing.assert_close(out[k], c.model.double()(x.double()), rtol=1e-12, atol=1e-12)


class TiedHead(nn.Module):
    """An output head tied to the embedding through functional F.linear (a get_attr weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.lin = nn.Linear(16, 16)

    def forward(self, idx):
        h = torch.tanh(self.lin(self.emb(idx)))
        return F.linear(h, self.emb.weight).mean(dim=1)


def test_functional_linear_with_per_trial_weight(monkeypatch, caplog) -> None:
    from tests import zoo

    def tied(seed: int = 0, batch: int = 4) -> zoo.Case:
        g = torch.Generator().manual_seed(seed + 1000)
        torch.manual_seed(seed)
        idx = torch.randint(0, 20, (batch, 5), generator=g)
        target = torch.randint(0, 20, (batch,), generator=g)
        return zoo.Case(TiedHead(), (idx,), target, F.cross_entropy)

    monkeypatch.setitem(zoo.ZOO, "tied", tied)
    with caplog.at_level(logging.WARNING, logger="hydro.fusion"):
        run, cases = build("tied", 3, "adamw")
        train_and_compare(run, cases, steps=3)
        fused = fuse(nn.Linear(4, 3), n=2)  # traced through: a functional F.linear
        fused(torch.randn(5, 4))
    assert "vmap" not in caplog.text  # both went through the fused linear op
