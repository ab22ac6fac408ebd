"""Experiment trackers (hydro.tuning.trackers) on a real tune with fused groups and pruning:
MLflow runs read back with MLflow's client, TensorBoard files with TensorBoard's reader; the
config file's ``trackers`` key through ``hydro tune``."""

from __future__ import annotations

import importlib.util
import math

import optuna
import pytest
from mlflow import MlflowClient
from optuna.trial import TrialState
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

import hydro
from hydro.cli import main
from hydro.errors import ConfigError
from hydro.tuning import trackers
from hydro.tuning.trackers import MLflowTracker, TensorBoardTracker
from tests import toy


def space(trial: optuna.Trial) -> dict:
    """``lr`` trained from a sampled ``log_lr``, ``warmup`` fixed: what trains differs from
    ``trial.params``, and the trackers log both."""
    return {
        "lr": 10 ** trial.suggest_float("log_lr", -4, 0),
        "beta2": trial.suggest_categorical("beta2", [0.9, 0.99]),
        "warmup": 1,
    }


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """Six trials in fused groups of three, most pruned at their first report, logged to
    MLflow and TensorBoard, and what a plain callback saw."""
    folder = tmp_path_factory.mktemp("trackers")
    seen: list[optuna.trial.FrozenTrial] = []
    result = hydro.tune(
        toy.task(steps=20, eval_every=5),
        space,
        n_trials=8,
        ratio=2,
        fuse=4,
        seed=0,
        study="trk",
        storage=f"sqlite:///{folder / 'study.db'}",
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
        callbacks=[
            MLflowTracker(folder / "mlflow.db"),
            TensorBoardTracker(folder / "tb"),
            lambda study, trial: seen.append(trial),
        ],
    )
    return folder, result.study, seen


def test_every_finished_trial_reaches_the_callbacks_once_with_its_params(tuned):
    _, study, seen = tuned
    trials = {t.number: t for t in study.trials}
    assert sorted(t.number for t in seen) == sorted(trials)  # each once
    states = {t.state for t in seen}
    assert states == {TrialState.COMPLETE, TrialState.PRUNED}
    for t in seen:
        assert set(t.params) == {"log_lr", "beta2"} and set(t.distributions) == set(t.params)
        assert t.state == trials[t.number].state and t.intermediate_values
        if t.state == TrialState.COMPLETE:
            assert t.value == trials[t.number].value and math.isfinite(t.value)


def test_mlflow_holds_one_run_per_trial_with_params_value_and_curve(tuned):
    folder, study, _ = tuned
    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("trk")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == sorted(f"trial {t.number}" for t in study.trials)
    for t in study.trials:
        run = runs[f"trial {t.number}"]
        trained = t.user_attrs["hydro_params"]
        assert run.data.params == {
            "log_lr": str(t.params["log_lr"]),
            "lr": str(trained["lr"]),
            "beta2": str(t.params["beta2"]),
            "warmup": "1",
        }
        assert run.data.tags["hydro.state"] == t.state.name
        history = client.get_metric_history(run.info.run_id, "reported")
        assert [(m.step, m.value) for m in history] == sorted(t.intermediate_values.items())
        if t.state == TrialState.COMPLETE:
            assert run.info.status == "FINISHED" and run.data.metrics["value"] == t.value
        else:
            assert run.info.status == "KILLED" and "value" not in run.data.metrics


def test_tensorboard_holds_each_trials_curve_value_and_hparams(tuned):
    folder, study, _ = tuned
    for t in study.trials:
        events = EventAccumulator(str(folder / "tb" / "trk" / f"trial-{t.number:04d}")).Reload()
        reported = [(e.step, e.value) for e in events.Scalars("reported")]
        assert reported == pytest.approx(sorted(t.intermediate_values.items()), rel=1e-6)
        has_value = "value" in events.Tags()["scalars"]
        assert has_value == (t.state == TrialState.COMPLETE)
        if has_value:
            assert events.Scalars("value")[-1].value == pytest.approx(t.value, rel=1e-6)
        content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
        assert set(info.hparams) == {"log_lr", "lr", "beta2", "warmup", "state"}
        assert info.hparams["state"].string_value == t.state.name
        assert info.hparams["beta2"].number_value == t.params["beta2"]


def test_the_config_trackers_key_logs_a_cli_tune(tmp_path, monkeypatch):
    top = "trackers:\n  mlflow: runs.db\n  tensorboard: tb\n"
    toy.project(
        tmp_path, monkeypatch, "toymod", toy.source(), toy.config("toymod", trials=2, top=top)
    )
    assert main(["tune", "tune.yaml", "--no-progress"]) == 0
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs.db'}")
    runs = client.search_runs([client.get_experiment_by_name("toy").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["trial 0", "trial 1"]
    assert all("lr" in r.data.params for r in runs)
    assert sorted(p.name for p in (tmp_path / "tb" / "toy").iterdir()) == [
        "trial-0000",
        "trial-0001",
    ]


@pytest.mark.parametrize(
    "top, message",
    [
        ("trackers:\n  wandb: runs\n", "unknown tracker 'wandb'; known: mlflow, tensorboard"),
        ("trackers: mlflow.db\n", "trackers must be a mapping of tracker to where it logs"),
        ("trackers:\n  tensorboard: 3\n", "trackers.tensorboard must be a path or URI"),
    ],
)
def test_a_wrong_trackers_key_is_one_line_before_any_trial(
    tmp_path, monkeypatch, capsys, top, message
):
    toy.project(tmp_path, monkeypatch, "toymod", toy.source(), toy.config("toymod", top=top))
    assert main(["tune", "tune.yaml"]) == 2
    err = capsys.readouterr().err
    assert message in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not (tmp_path / "toy.db").exists()


def test_a_missing_tracker_package_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"trackers\.mlflow: .*hydro-surrogate\[trackers\]"):
        trackers.from_config({"mlflow": "runs.db"})
    assert trackers.MLflowTracker  # the other tracker still builds:
    assert isinstance(trackers.from_config({"tensorboard": "tb"})[0], TensorBoardTracker)
