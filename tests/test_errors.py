"""Bad input through the Python API: each gets a hydro error naming what is wrong."""

from __future__ import annotations

import math
import warnings

import optuna
import pytest
import torch
from optuna.distributions import FloatDistribution
from torch import nn

import hydro
from hydro.errors import ConfigError, DataError, FuseError, HydroWarning, ModelError, StudyError
from hydro.integrations.optuna import INTERRUPTED
from hydro.tuning.outputs import export
from hydro.tuning.progress import postfix
from hydro.tuning.report import trial_counts

SPACE = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}


def mlp(classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, classes))


def data(n: int = 64, classes: int = 3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randint(0, classes, (n,), generator=g)


def task(**kw):
    x, y = data()
    args = {"model": mlp(), "train_data": (x, y), "val_data": (x, y), "steps": 4, **kw}
    return hydro.Task(**args)


@pytest.mark.parametrize(
    "kw, error, message",
    [
        ({"eval_every": 0}, ConfigError, "eval_every must be a positive integer, got 0"),
        ({"batch_size": 0}, ConfigError, "batch_size must be a positive integer, got 0"),
        ({"steps": -3}, ConfigError, "steps must be a positive integer"),
        ({"loss": "hinge"}, ConfigError, "unknown loss 'hinge'"),
    ],
)
def test_bad_task_settings(kw, error, message):
    with pytest.raises(error, match=message):
        task(**kw)


def test_inputs_and_targets_of_different_lengths():
    x, y = data()
    with pytest.raises(DataError, match="train_data: inputs have 64 rows but targets 10"):
        hydro.Task(model=mlp(), train_data=(x, y[:10]), val_data=(x, y))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_inf_in_the_data_names_the_set_and_index(bad):
    x, y = data()
    x[17, 3] = bad
    with pytest.raises(
        DataError, match=r"val_data: inputs contain (NaN|infinity) \(first at index 17"
    ):
        hydro.Task(model=mlp(), train_data=data(), val_data=(x, y))


def test_float_targets_with_cross_entropy():
    x, _ = data()
    with pytest.raises(DataError, match="targets are float32 but loss 'cross_entropy' needs"):
        hydro.Task(model=mlp(), train_data=(x, torch.randn(64)), val_data=(x, torch.randn(64)))
    hydro.Task(model=mlp(1), train_data=(x, torch.randn(64, 1)), val_data=data(), loss="mse")


def test_labels_out_of_range_before_any_trial():
    x, y = data(classes=5)
    t = hydro.Task(model=mlp(3), train_data=(x, y), val_data=(x, y), steps=4)
    study = optuna.create_study()
    with pytest.raises(DataError, match=r"labels range over \[0, 4\] but the model outputs 3 "
                       r"classes.*labels in \[0, 2\]"):
        hydro.tune(t, SPACE, n_trials=2, ratio=2, fuse=2, study=study)
    assert study.trials == []  # refused before asking, so nothing is lost or failed


def broken_factory(width: int = 32, depth: int = 2) -> nn.Module:
    raise RuntimeError(f"no such depth {depth}")


def test_a_factory_that_raises_is_named_with_its_arguments():
    x, y = data()
    t = hydro.Task(model=broken_factory, train_data=(x, y), val_data=(x, y))
    with pytest.raises(ModelError, match=r"test_errors:broken_factory\(\) raised RuntimeError: no"):
        hydro.tune(t, SPACE, n_trials=2, ratio=2, fuse=2, storage="sqlite:///:memory:")
    with pytest.raises(ModelError, match=r"broken_factory\(depth=3\) raised"):
        t.build_model(depth=3)


def test_a_model_without_parameters():
    x, y = data()
    t = hydro.Task(model=nn.ReLU(), train_data=(x, y), val_data=(x, y))
    with pytest.raises(ModelError, match=r"the model \(ReLU\) has no parameters"):
        hydro.tune(t, SPACE, n_trials=2, ratio=2, fuse=2, storage="sqlite:///:memory:")


def test_fuse_needs_at_least_one_trial():
    with pytest.raises(FuseError, match="needs a whole number of trials >= 1, got 0"):
        hydro.fuse(mlp(), n=0)


@pytest.mark.parametrize("n", [-1, 0, 2.5])
def test_tune_needs_a_positive_trial_count(n):
    with pytest.raises(ConfigError, match="n_trials must be a positive integer"):
        hydro.tune(task(), SPACE, n_trials=n, storage="sqlite:///:memory:")


def test_a_model_with_no_hidden_width_warns_that_the_surrogate_is_the_model():
    x, y = data()
    t = hydro.Task(model=nn.Linear(8, 3), train_data=(x, y), val_data=(x, y), steps=2)
    with pytest.warns(HydroWarning, match="ratio-4 surrogate equals the full model"):
        hydro.tune(t, SPACE, n_trials=1, ratio=4, fuse=1, storage="sqlite:///:memory:")
    with warnings.catch_warnings():
        # a model with hidden widths: not this warning (width 8 is below the floor: that one)
        warnings.filterwarnings("error", "no width of", HydroWarning)
        hydro.tune(task(steps=2), SPACE, n_trials=1, ratio=4, fuse=1, storage="sqlite:///:memory:")


def _study_with(states: list[str]) -> optuna.Study:
    study = optuna.create_study()
    for s in states:
        trial = study.ask({"lr": FloatDistribution(1e-3, 1e-1, log=True)})
        if s == "complete":
            study.tell(trial, 1.0 + trial.number)
        elif s == "pruned":
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            trial.set_user_attr("fail_reason", INTERRUPTED if s == "interrupted" else "boom")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return study


def test_interrupted_trials_are_neither_finished_nor_failed(tmp_path, capsys):
    study = _study_with(["complete", "complete", "pruned", "interrupted", "interrupted", "failed"])
    counts = trial_counts(study)
    assert counts == {"complete": 2, "pruned": 1, "failed": 1, "interrupted": 2, "running": 0,
                      "finished": 4}
    data = export(study, tmp_path / "best.yaml")
    assert data["provenance"]["trials_finished"] == 4
    assert data["provenance"]["trials"] == {"complete": 2, "pruned": 1, "failed": 1,
                                            "interrupted": 2}
    line = postfix(study)
    assert "failed 1" in line and "interrupted 2" in line
    states = [r["state"] for r in hydro.TuneResult(study, 8).trials]
    assert states.count("INTERRUPTED") == 2 and states.count("FAIL") == 1


def test_no_complete_trial_is_a_study_error(tmp_path):
    study = _study_with(["failed", "interrupted"])
    result = hydro.TuneResult(study, 8)
    with pytest.raises(StudyError, match=r"no complete trial \(1 failed, 0 pruned, 1 "
                       r"interrupted\); first failure: boom"):
        _ = result.best_params
    with pytest.raises(StudyError):
        export(study, tmp_path / "best.yaml")
    assert not (tmp_path / "best.yaml").exists()


def test_an_unwritable_export_path(tmp_path):
    study = _study_with(["complete"])
    with pytest.raises(ConfigError, match="directory .* does not exist"):
        export(study, tmp_path / "missing" / "best.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        export(study, tmp_path)
