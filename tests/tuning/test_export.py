"""The export says what trained, and files written for the user are replaced whole or not at all."""

from __future__ import annotations

import os
import stat

import optuna
import pytest
import torch
import yaml
from optuna.distributions import FloatDistribution

import hydro
from hydro.cli import main
from hydro.errors import ConfigError
from hydro.files import replacing, write_text
from hydro.tuning.bookkeeping import trial_seed
from hydro.tuning.lockstep import train_group
from hydro.tuning.outputs import export

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _task() -> hydro.Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(192, 8, generator=g, dtype=torch.float64)
    y = (x @ torch.randn(8, 3, generator=g, dtype=torch.float64)).argmax(-1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 3)).double()
    return hydro.Task(model=model, train_data=(x[:128], y[:128]), val_data=(x[128:], y[128:]),
                      steps=24, eval_every=24, batch_size=32)


def _space(trial: optuna.Trial) -> dict:
    # lr drawn under another name, warmup fixed: neither is what trial.params say
    return {"lr": 10 ** trial.suggest_float("log_lr", -2.5, -1.0), "warmup": 20}


def test_export_writes_every_value_the_best_trial_trained_with(tmp_path, monkeypatch, capsys):
    task = _task()
    db = f"sqlite:///{tmp_path / 'fixed.db'}"
    result = hydro.tune(task, _space, n_trials=1, ratio=2, fuse=1, storage=db, seed=0)
    best = result.best_trial
    lr = 10 ** best.params["log_lr"]
    data = result.export(tmp_path / "best.yaml")
    assert data["hyperparameters"] == {"lr": lr, "warmup": 20} == result.best_params
    assert data["training"]["warmup"] == 20 and data["training"]["optimizer_args"]["lr"] == lr
    assert data["provenance"]["searched"] == {"log_lr": best.params["log_lr"]}
    assert yaml.safe_load((tmp_path / "best.yaml").read_text()) == data
    assert [r["warmup"] for r in result.trials] == [20]
    # the exported values are what trained: they reproduce the trial's value exactly (float64),
    # and the suggested parameters alone (warm-up 0, no lr) do not
    seeds = [trial_seed(best, 0)]
    again, _ = train_group(task, [data["hyperparameters"]], ratio=2, seeds=seeds)
    assert again[0].value == pytest.approx(best.value, rel=1e-12, abs=0)
    params_only, _ = train_group(task, [{"lr": lr}], ratio=2, seeds=seeds)
    assert params_only[0].value != pytest.approx(best.value, rel=1e-6)
    # `hydro export` reads the same record
    monkeypatch.chdir(tmp_path)
    assert main(["export", "-o", "cli.json"]) == 0
    assert yaml.safe_load((tmp_path / "cli.json").read_text())["hyperparameters"] == {
        "lr": lr, "warmup": 20
    }
    capsys.readouterr()


def test_a_space_function_value_the_study_cannot_store_is_named(tmp_path):
    def space(trial: optuna.Trial) -> dict:
        return {"lr": trial.suggest_float("lr", 1e-3, 1e-1), "dropout": torch.tensor(0.25),
                "init_scale": object()}

    with pytest.raises(ConfigError, match=r"returned init_scale=<object object at .*\(object\)"):
        hydro.tune(_task(), space, n_trials=1, ratio=2, fuse=1,
                   storage=f"sqlite:///{tmp_path / 's.db'}", seed=0)


def _study(tmp_path) -> optuna.Study:
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", study_name="s")
    study.add_trial(optuna.trial.create_trial(
        params={"lr": 0.01}, distributions={"lr": FloatDistribution(1e-4, 1e-1, log=True)},
        value=0.5))
    return study


def test_a_failing_export_leaves_the_old_file_whole(tmp_path, monkeypatch):
    study = _study(tmp_path)
    old = tmp_path / "best.yaml"
    old.write_text("hyperparameters: {lr: 0.003}\n")
    os.chmod(old, 0o640)

    def dies_midway(data, stream=None, **kwargs):  # writes a part, then fails (a full disk)
        if stream is not None:
            stream.write("hyperparameters:\n  lr: 0.")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(yaml, "safe_dump", dies_midway)
    with pytest.raises(OSError, match="No space left"):
        export(study, old)
    assert old.read_text() == "hyperparameters: {lr: 0.003}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.yaml", "s.db"]  # no temp file
    monkeypatch.undo()
    export(study, old)  # a good export replaces it, keeping its mode
    assert yaml.safe_load(old.read_text())["hyperparameters"] == {"lr": 0.01}
    assert stat.S_IMODE(old.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.yaml", "s.db"]


def test_a_failing_report_figure_leaves_the_old_file_whole(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from hydro.tuning.report import write_report

    study = _study(tmp_path)
    old = tmp_path / "r.png"
    old.write_bytes(b"old figure")

    def dies_midway(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise KeyboardInterrupt  # Ctrl-C while matplotlib writes

    monkeypatch.setattr(Figure, "savefig", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        write_report(study, str(old))
    assert old.read_bytes() == b"old figure"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.png", "s.db"]


def test_replacing_follows_a_link_and_gives_a_new_file_the_usual_mode(tmp_path):
    umask = os.umask(0o022)
    try:
        write_text(tmp_path / "new.txt", "a")
        assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o644  # not mkstemp's 0600
    finally:
        os.umask(umask)
    (tmp_path / "link.txt").symlink_to("new.txt")
    write_text(tmp_path / "link.txt", "b")
    assert (tmp_path / "link.txt").is_symlink() and (tmp_path / "new.txt").read_text() == "b"
    with pytest.raises(RuntimeError), replacing(tmp_path / "new.txt") as tmp:
        assert tmp.endswith(".txt") and os.path.dirname(tmp) == str(tmp_path)
        raise RuntimeError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "new.txt"]
