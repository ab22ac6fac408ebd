"""A warm-up range the run cannot hold is one ConfigError before the first trial (config load
after --steps, ``hydro.tune``, ``optimize``), not a trial failing mid-run; the range's last
step still trains."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

import hydro
from hydro.cli import main
from hydro.integrations.optuna import optimize
from hydro.tuning import config
from hydro.tuning.space import check_space
from tests import toy

pytestmark = pytest.mark.usefixtures("one_thread")
optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def project(tmp_path, monkeypatch):
    return toy.project(tmp_path, monkeypatch, "warmmod", toy.source())


def _config(project, high: int) -> str:
    space = f"  warmup: {{type: int, low: 0, high: {high}}}\n"
    (project / "tune.yaml").write_text(toy.config("warmmod", steps=10, eval_every=5, space=space))
    return "tune.yaml"


def test_cli_refuses_a_warmup_range_at_or_past_the_steps(project, capsys):
    _config(project, 12)
    assert main(["tune", "tune.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("hydro tune: error: tune.yaml: space: space['warmup'] ranges 0 to "
                          "12, but each trial trains 10 steps"), err
    assert "upper end to at most 9, or raise task.steps above 12" in err
    assert not (project / "toy.db").exists()  # before the study was opened
    # a range the file's steps hold, cut short by --steps: the fix names the flag
    _config(project, 9)
    assert main(["tune", "tune.yaml", "--steps", "9"]) == 2
    err = capsys.readouterr().err
    assert "ranges 0 to 9, but each trial trains 9 steps" in err
    assert "at most 8, or raise --steps above 9" in err
    assert not (project / "toy.db").exists()


def test_cli_trains_the_range_when_steps_hold_it(project, capsys):
    _config(project, 12)
    cfg = config.load("tune.yaml", steps=13)  # --steps raises the run above the range
    assert cfg.task.steps == 13 and cfg.space["warmup"].high == 12
    _config(project, 9)  # the last warm-up the 10 steps hold
    assert main(["tune", "tune.yaml", "--no-progress"]) == 0
    study = optuna.load_study(study_name="toy", storage="sqlite:///toy.db")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2


def make_task(steps: int = 10) -> hydro.Task:
    return toy.task(n=96, n_train=64, width=64, steps=steps, eval_every=5)


LR = FloatDistribution(1e-3, 1e-1, log=True)


def test_api_refuses_before_any_trial(tmp_path):
    task = make_task(steps=10)
    space = {"lr": LR, "warmup": IntDistribution(0, 10)}
    fix = r"upper end to at most 9, or raise Task\(steps=\.\.\.\) above 10"
    db = tmp_path / "a.db"
    with pytest.raises(hydro.ConfigError, match=r"space\['warmup'\] ranges 0 to 10, but each "
                       r"trial trains 10 steps .*" + fix):
        hydro.tune(task, space, n_trials=2, ratio=2, fuse=2, storage=f"sqlite:///{db}")
    assert not db.exists()
    study = optuna.create_study()
    with pytest.raises(hydro.ConfigError, match=fix):
        optimize(study, task, space, n_trials=2, ratio=2, fuse=2)
    assert study.trials == []


@pytest.mark.parametrize(
    "dist, message",
    [
        (FloatDistribution(0.0, 10.5), r"ranges 0 to 10\.5, .* at most 9, "),
        (IntDistribution(0, 40, step=10), "ranges 0 to 40, .* above 40"),
        (CategoricalDistribution([0, 5, 10]), r"has choices \[0, 5, 10\], .* above 10"),
        (IntDistribution(-2, 5), r"ranges -2 to 5: a warm-up is a number of steps >= 0"),
        (CategoricalDistribution(["short", 3]), r"choices \['short', 3\] must be numbers"),
    ],
)
def test_each_kind_of_distribution(dist, message):
    with pytest.raises(hydro.ConfigError, match=message):
        check_space({"lr": LR, "warmup": dist}, set(), steps=10)


def test_ranges_the_steps_hold_pass_and_the_last_step_trains():
    # a float range trains int(warmup): 9.9 is a warm-up of 9 steps
    fits = [IntDistribution(0, 9), FloatDistribution(0.0, 9.9), CategoricalDistribution([0, 9])]
    for dist in fits:
        check_space({"lr": LR, "warmup": dist}, set(), steps=10)
    check_space({"lr": LR, "warmup": IntDistribution(0, 50)}, set())  # no steps: no check
    study = optuna.create_study()
    study.enqueue_trial({"lr": 1e-2, "warmup": 9})
    optimize(study, make_task(steps=10), {"lr": LR, "warmup": IntDistribution(0, 9)}, n_trials=1,
             ratio=2, fuse=1)
    assert study.trials[0].state == TrialState.COMPLETE and study.trials[0].params["warmup"] == 9
