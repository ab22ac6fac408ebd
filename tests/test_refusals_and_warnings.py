"""Faults that used to pass silently (issue 19, points 4 and 8): each now raises one clear line,
warns once, or (a diverged trial's BatchNorm statistics) stays frozen."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydro
import hydro.optim
from hydro.errors import ConfigError, DataError, FuseError, HydroWarning, ScaleError
from hydro.fusion import fuse, trial_loss


def _bn_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)
    ).double()


def _train_bn(models: list[nn.Module], lrs: list[float], steps: int) -> tuple:
    torch.manual_seed(1)
    x = torch.randn(6, 3, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    fused = fuse([copy.deepcopy(m) for m in models])
    opt = hydro.optim.SGD(fused.parameters(), lr=lrs, momentum=0.9)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        trial_loss(F.cross_entropy, fused(x), y).sum().backward()
        opt.step()
        history.append({k: v.clone() for k, v in fused.state_dict().items()})
    return fused, history


def test_diverged_trial_batchnorm_statistics_stay_frozen() -> None:
    # lr=1e6 blows trial 1's activations up by ~1e10 a step: its BatchNorm running variance
    # overflows in a forward whose (normalized) loss is still finite, so only the buffers tell
    torch.manual_seed(0)
    models = [_bn_net() for _ in range(3)]
    steps = 34
    broken, hist = _train_bn(models, [0.1, 1e6, 0.05], steps)
    alone, alone_hist = _train_bn([models[0], models[2]], [0.1, 0.05], steps)
    assert broken.diverged.tolist() == [False, True, False]
    # the healthy trials: bit for bit what they are trained without the diverged one
    for mine, theirs in zip(hist, alone_hist):
        for name, value in theirs.items():
            if name not in ("diverged", "trial_seed", "trial_step"):
                assert torch.equal(mine[name][[0, 2]], value), name
    # the diverged trial's buffers: finite, and from the step it diverged on never written again
    at = next(i for i, sd in enumerate(hist) if sd["diverged"][1])
    assert 0 < at < steps - 2
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        frozen = hist[at - 1][name][1]
        assert torch.isfinite(frozen.double()).all(), name
        for sd in hist[at:]:
            assert torch.equal(sd[name][1], frozen), name
    assert int(hist[-1]["1.num_batches_tracked"][1]) == at


# --- trial_loss: only vmap's own errors take the per-trial path; batch mismatches named ---------


def _item_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    scale = 2.0 if output.sum().item() > 1e9 else 1.0  # .item(): vmap cannot batch this
    return F.cross_entropy(output, target) * scale


def test_trial_loss_unbatchable_loss_warns_once_and_is_exact() -> None:
    torch.manual_seed(0)
    out, y = torch.randn(3, 8, 4, dtype=torch.float64), torch.randint(0, 4, (8,))
    with pytest.warns(HydroWarning, match=r"vmap cannot batch the loss _item_loss .*3 calls"):
        losses = trial_loss(_item_loss, out, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call: no second warning
        again = trial_loss(_item_loss, out, y)
    assert torch.equal(losses, again)
    assert torch.equal(losses, torch.stack([F.cross_entropy(o, y) for o in out]))


@pytest.mark.parametrize("error", [ValueError, RuntimeError])
def test_trial_loss_lets_the_loss_own_error_through(error: type) -> None:
    calls = []

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        raise error("the loss's own bug")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(error, match="the loss's own bug"):
            trial_loss(loss, torch.randn(3, 8, 4), torch.randint(0, 4, (8,)))
    assert len(calls) == 1  # raised once, not retried trial by trial


@pytest.mark.parametrize(
    "loss, output, target, shared, message",
    [
        (F.cross_entropy, (3, 8, 4), (5,), True, r"batch of 8 .* has 5 \(shape \(5,\)\)"),
        (F.mse_loss, (3, 8, 1), (5, 1), True, r"batch of 8 .* has 5 \(shape \(5, 1\)\)"),
        (F.mse_loss, (3, 8, 1), (3, 5, 1), False, r"expected a target \[3, 8, \.\.\.\]"),
        (F.mse_loss, (3, 8, 1), (2, 8, 1), False, r"shape \(2, 8, 1\) but there are 3 trials"),
    ],
)
def test_trial_loss_batch_mismatch_one_line(loss, output, target, shared, message) -> None:
    y = torch.randint(0, 4, target) if loss is F.cross_entropy else torch.randn(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mse_loss's own broadcasting warning
        with pytest.raises(DataError, match=message) as info:
            trial_loss(loss, torch.randn(output), y, shared=shared)
    assert "\n" not in str(info.value)


# --- FusedModel: trial and select indices -------------------------------------------------------


def test_trial_negative_index_and_select_empty_or_repeated_refused() -> None:
    fused = fuse(nn.Linear(3, 2), n=3)
    with pytest.raises(IndexError, match=r"trial -1 out of range: .* trials 0 to 2"):
        fused.trial(-1)
    with pytest.raises(IndexError, match="trial 3 out of range"):
        fused.select([0, 3])
    with pytest.raises(FuseError, match=r"select\(\[\]\) would leave a fused model of 0 trials"):
        fused.select([])
    with pytest.raises(FuseError, match=r"trials \[0\] are listed more than once"):
        fused.select([0, 0])
    assert fused.n == 3  # nothing changed by the refused calls
    weight = fused.weight.detach().clone()
    assert torch.equal(fused.select([2, 0]).weight, weight[[2, 0]])
    assert torch.equal(fused.select([1, 1], repeat=True).weight, weight[[0, 0]])


# --- optimizers: per-trial hyperparameters range-checked ----------------------------------------


@pytest.mark.parametrize(
    "opt, kwargs, message",
    [
        ("AdamW", dict(lr=-1), r"lr out of range \(trial 0: -1.0, trial 1: -1.0, trial 2: -1.0\)"),
        ("AdamW", dict(lr=[1e-3, float("nan"), 1e-3]), r"lr out of range \(trial 1: nan\)"),
        ("Adam", dict(eps=[1e-8, 1e-8, 0.0]), r"eps out of range \(trial 2: 0.0\): .* > 0"),
        ("Adam", dict(betas=(0.9, [0.99, 1.0, 0.9])), r"beta2 out of range \(trial 1: 1.0\)"),
        ("Adam", dict(betas=(-0.1, 0.99)), r"beta1 out of range \(trial 0: -0.1"),
        ("AdamW", dict(weight_decay=[0, -0.1, 0]), r"weight_decay out of range \(trial 1: -0.1\)"),
        ("SGD", dict(lr=0.1, momentum=[0.9, 0.9, float("inf")]), r"momentum .*trial 2: inf"),
    ],
)
def test_optimizer_rejects_hyperparameters_out_of_range(opt: str, kwargs: dict, message: str):
    fused = fuse(nn.Linear(3, 2), n=3)
    with pytest.raises(ConfigError, match=message) as info:
        getattr(hydro.optim, opt)(fused.parameters(), **kwargs)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def test_reset_trial_rejects_a_bad_value_and_keeps_the_old() -> None:
    fused = fuse(nn.Linear(3, 2), n=3)
    opt = hydro.optim.Adam(fused.parameters(), lr=[1e-3, 2e-3, 3e-3])
    with pytest.raises(ConfigError, match=r"lr out of range \(trial 1: inf\)"):
        opt.reset_trial(1, lr=float("inf"))
    assert opt.param_groups[0]["lr"].tolist() == [1e-3, 2e-3, 3e-3]
    hydro.optim.SGD(fused.parameters(), lr=0.0)  # a learning rate of 0 is valid, as in torch


# --- scale ---------------------------------------------------------------------------------------


class _NoParams(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.relu()


def test_scale_model_without_parameters_is_refused() -> None:
    with pytest.raises(ScaleError, match="_NoParams has no parameters: there is no width to cut"):
        hydro.scale(_NoParams(), 8, example_inputs=(torch.randn(2, 3),))


def test_scale_of_only_fixed_widths_warns_nothing_is_cut() -> None:
    with pytest.warns(HydroWarning, match=r"every width of Linear is fixed .* no width is cut"):
        sur = hydro.scale(nn.Linear(4, 3), 8, example_inputs=(torch.randn(2, 4),))
    assert [tuple(p.shape) for p in sur.parameters()] == [(3, 4), (3,)]


# --- Task: a training set smaller than one batch -------------------------------------------------


def test_training_set_smaller_than_the_batch_warns_once() -> None:
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    task = hydro.Task(model=nn.Linear(4, 3), train_data=(x, y), val_data=(x, y), batch_size=32)
    with pytest.warns(HydroWarning, match=r"holds 10 samples, fewer than a batch of 32") as rec:
        for seed in range(3):  # three trials of one task: one warning
            assert task.batch_len(next(task.train_batches(32, seed=seed))) == 32
    assert len([r for r in rec if issubclass(r.category, HydroWarning)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a batch the data fill: no warning
        next(task.train_batches(8, seed=0))


def test_dataset_smaller_than_the_batch_names_the_sizes() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.randint(0, 3, (10,)))
    task = hydro.Task(model=nn.Linear(4, 3), train_data=data, val_data=data, batch_size=32)
    with pytest.raises(DataError, match=r"holds 10 samples, fewer than one batch of 32"):
        next(task.train_batches(32, seed=0))


# --- hydro inspect: a wrong example shape prints Hydro's line only -------------------------------

WRONG_SHAPE = """
import torch
from torch import nn


def build():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, (torch.randn(4, 5),)
"""


def test_inspect_wrong_example_shape_prints_one_line(tmp_path, capfd, monkeypatch) -> None:
    from hydro.cli import main

    (tmp_path / "wrong_shape_model.py").write_text(WRONG_SHAPE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["inspect", "wrong_shape_model:build"]) == 2
    out, err = capfd.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[:2000]
    assert lines[0].startswith("hydro inspect: error: cannot capture Sequential")
